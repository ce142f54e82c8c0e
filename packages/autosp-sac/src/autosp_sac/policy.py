"""The SAC policy as recompute tags on the joint graph, honoured by the min-cut partitioner.

Always saved: attention (its outputs and log-sum-exp), random ops (recomputing them
would draw new numbers), each attention block's input from the residual stream, and what
reads an input the step updates in place (a buffer's running statistics: the backward would
read the updated buffer, which autograd refuses).
Recomputed when SAC is on: everything else of the forward, matmuls and the
all-to-alls that feed attention included. ``sac="auto"`` decides by memory when the device's
memory (the hardware profile's ``memory_bytes``) or ``memory_budget=`` is known: the cheapest
layers that make the program fit are recomputed, none when it fits (``autosp_sac.budget``);
otherwise by the estimated time overhead (``autosp_sac.cost``).
"""

from __future__ import annotations

import operator

import torch
from torch import fx
from torch._functorch._aot_autograd.descriptors import InputMutationAOTOutput
from torch.utils.checkpoint import CheckpointPolicy

from autosp.context import CompileContext
from autosp_sac.budget import budget_bytes, plan
from autosp_sac.cost import OVERHEAD_THRESHOLD, estimate
from autosp_sac.graph import ATTENTION_KERNELS, JointInfo, analyse, aten, is_random, nbytes

_WRITE_BACK = frozenset({aten.copy.default, aten.copy_.default})


def _is_view(node: fx.Node) -> bool:
    """An op whose result aliases its input, by its schema (so a reader through it reads the input)."""
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and any(
        r.alias_info is not None and not r.alias_info.is_write for r in target._schema.returns
    )


def attention_ops(ctx: CompileContext) -> frozenset:
    plugin_ops = {t for spec in ctx.registry.attention.values() for t in spec.targets}
    return ATTENTION_KERNELS | frozenset(plugin_ops)


def _is_output_of(node: fx.Node, producers: set[fx.Node]) -> bool:
    return node.target is operator.getitem and node.args[0] in producers


def _kept(info: JointInfo) -> tuple[set[fx.Node], set[fx.Node], set[fx.Node]]:
    """What is always saved: attention and its outputs, layer inputs, random ops and their outputs."""
    attention = set(info.attention)
    random = {n for n in info.forward if is_random(n) and n not in attention}
    keep = attention | set(info.layer_inputs)
    kept = {n for n in info.forward if n in keep or n in random or _is_output_of(n, attention | random)}
    return attention, random, kept


def _reads_mutated_input(gm: fx.GraphModule, forward: list[fx.Node]) -> set[fx.Node]:
    """Forward nodes that read, directly or through views, an input the graph writes back.

    AOT writes an updated input back after the forward (``aten.copy``/``aten.copy_`` in the joint
    graph where the mutation stays in it, as under Inductor, else after the compiled forward);
    recomputing one of its readers in the backward would read the updated value (autograd
    refuses that; Inductor's code would not notice).
    """
    mutated = {
        n.args[0]
        for n in gm.graph.nodes
        if n.target in _WRITE_BACK and isinstance(n.args[0], fx.Node) and n.args[0].op == "placeholder"
    }
    # Where the mutation is not kept in the graph (aot_eager), the new value is a forward output
    # whose AOT descriptor names the input it updates.
    output = gm.graph.output_node()
    updated = {d.mutated_input for d in output.meta.get("desc") or () if isinstance(d, InputMutationAOTOutput)}
    mutated |= {n for n in gm.graph.find_nodes(op="placeholder") if n.meta.get("desc") in updated}
    in_forward, out, stack = set(forward), set(), [u for m in mutated for u in m.users]
    while stack:
        node = stack.pop()
        if node not in in_forward or node in out or node.target in _WRITE_BACK:
            continue
        if _is_view(node):
            stack.extend(node.users)
        else:
            out.add(node)
    # A reader returning several tensors is saved through its getitems.
    return out | {u for n in out for u in n.users if _is_output_of(u, out)}


def tag(gm: fx.GraphModule, ctx: CompileContext) -> None:
    info = analyse(gm, attention_ops(ctx), ctx.num_fwd_outputs)
    costs = estimate(info)
    overhead = costs.overhead(ctx.hardware)
    sac = ctx.options.sac
    attention, random, kept = _kept(info)
    kept |= _reads_mutated_input(gm, info.forward)
    budget = budget_bytes(ctx) if sac == "auto" else None
    memory = plan(gm, ctx, info, kept, budget) if budget is not None else None
    if memory is not None:
        # By memory: only the chosen layers' cheap values are recomputed, none when the program fits.
        chosen = {n for i in memory.chosen for n in memory.layers[i].nodes}
        recompute_node = chosen.__contains__
        recompute = bool(chosen)
    else:
        recompute = sac is True or (sac == "auto" and overhead <= OVERHEAD_THRESHOLD)
        recompute_node = lambda _n: recompute  # noqa: E731
    saved_bytes = recomputed = 0
    for node in info.forward:
        if node in random or _is_output_of(node, random):
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
        elif node in kept:
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
            saved_bytes += nbytes(node) if node not in attention else 0
        elif recompute_node(node):
            node.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
            recomputed += 1
    # A program that fits recomputes nothing: the default partition, as with sac=False (Inductor
    # partitions by min-cut whatever is asked, and may still recompute cheap pointwise ops).
    ctx.min_cut = memory is None or recompute
    ctx.report.sac = {
        "mode": f"{sac} -> {'recompute' if recompute else 'default partitioner choices'}"
        + (" (by memory)" if memory is not None else ""),
        "attention sites kept": len(attention),
        "layer inputs kept": f"{len(info.layer_inputs)} ({saved_bytes / 2**20:.2f} MiB with attention outputs)",
        "forward nodes tagged for recompute": recomputed,
        "random ops saved": len(random),
        "recompute FLOPs": f"{costs.matmul_flops:.3g} (step ~{3 * (costs.matmul_flops + costs.attention_flops):.3g})",
        "extra all-to-all bytes": f"{costs.comm_bytes:.3g}",
        "estimated overhead": f"{overhead:.1%} on {ctx.hardware.name} (threshold {OVERHEAD_THRESHOLD:.0%})",
    }
    if memory is not None:
        ctx.report.sac.update(memory.describe())


__all__ = ["attention_ops", "tag"]
