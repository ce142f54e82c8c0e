"""The SAC policy as recompute tags on the joint graph, honoured by the min-cut partitioner.

Always saved: attention (its outputs and log-sum-exp), random ops (recomputing them
would draw new numbers), and each attention block's input from the residual stream.
Recomputed when SAC is on: everything else of the forward, matmuls and the
all-to-alls that feed attention included.
"""

from __future__ import annotations

import operator

from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from autosp.context import CompileContext
from autosp_sac.cost import OVERHEAD_THRESHOLD, estimate
from autosp_sac.graph import ATTENTION_KERNELS, analyse, is_random, nbytes


def attention_ops(ctx: CompileContext) -> frozenset:
    plugin_ops = {t for spec in ctx.registry.attention.values() for t in spec.targets}
    return ATTENTION_KERNELS | frozenset(plugin_ops)


def _is_output_of(node: fx.Node, producers: set[fx.Node]) -> bool:
    return node.target is operator.getitem and node.args[0] in producers


def tag(gm: fx.GraphModule, ctx: CompileContext) -> None:
    info = analyse(gm, attention_ops(ctx), ctx.num_fwd_outputs)
    costs = estimate(info)
    overhead = costs.overhead(ctx.hardware)
    sac = ctx.options.sac
    recompute = sac is True or (sac == "auto" and overhead <= OVERHEAD_THRESHOLD)
    attention = set(info.attention)
    keep = attention | set(info.layer_inputs)
    random = {n for n in info.forward if is_random(n) and n not in attention}
    saved_bytes = recomputed = 0
    for node in info.forward:
        if node in random or _is_output_of(node, random):
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
        elif node in keep or _is_output_of(node, attention):
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
            saved_bytes += nbytes(node) if node not in attention else 0
        elif recompute:
            node.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
            recomputed += 1
    ctx.min_cut = True
    ctx.report.sac = {
        "mode": f"{sac} -> {'recompute' if recompute else 'default partitioner choices'}",
        "attention sites kept": len(attention),
        "layer inputs kept": f"{len(info.layer_inputs)} ({saved_bytes / 2**20:.2f} MiB with attention outputs)",
        "forward nodes tagged for recompute": recomputed,
        "random ops saved": len(random),
        "recompute FLOPs": f"{costs.matmul_flops:.3g} (step ~{3 * (costs.matmul_flops + costs.attention_flops):.3g})",
        "extra all-to-all bytes": f"{costs.comm_bytes:.3g}",
        "estimated overhead": f"{overhead:.1%} on {ctx.hardware.name} (threshold {OVERHEAD_THRESHOLD:.0%})",
    }


__all__ = ["attention_ops", "tag"]
