"""Registers the ring and hybrid variants, their passes, and the ring op as attention for SAC."""

from __future__ import annotations

import torch

import autosp_ring.op  # noqa: F401 - defines torch.ops.autosp_ring.*
from autosp import AttentionSpec, Pass, SPVariant, Stage, hookimpl
from autosp_ring.attention import check, ring_attention_rule, ring_layout
from autosp_ring.hybrid import hybrid_attention_rule, make_groups

RING = SPVariant(
    name="ring",
    attention_rule=ring_attention_rule,
    check=check,
    layout=ring_layout,
    uneven=True,
    doc="ring attention: q stays, k/v travel around the SP group; log-sum-exp merge; any head count; zigzag layout",
)

HYBRID = SPVariant(
    name="hybrid",
    attention_rule=hybrid_attention_rule,
    check=check,
    prepare=make_groups,
    uneven=True,
    doc="USP: Ulysses inside groups of ulysses_degree ranks, ring attention across them",
)

# The ring op as an attention kernel: sequence-aware checkpointing then saves its output and
# log-sum-exp instead of recomputing a whole ring trip in the backward. It never appears in a
# user's Dynamo graph, so no site is ever found for it.
RING_OP_SPEC = AttentionSpec(
    name="autosp_ring.ring_attention",
    targets=(torch.ops.autosp_ring.ring_attention.default,),
    layout="BHSD",
    causal="is_causal",
    signature=("q", "k", "v", "is_causal", "scale", "window", "group_name"),
)


def _count_ring_ops(gm: torch.fx.GraphModule, ctx) -> None:
    # The ring op is not a core collective, so the core does not count it; reports should.
    op = torch.ops.autosp_ring.ring_attention.default
    calls = [n for n in gm.graph.nodes if n.target is op]
    ctx.report.collectives["ring_attention"] += len(calls)
    balanced = [n for n in calls if len(n.args) > 9 and n.args[8] is not None and n.args[9]]
    if balanced:
        ctx.report.notes.append(
            f"ring: {len(balanced)} attention call(s) with a model-built mask place their query rows by the mask "
            f"at run time when that evens the ranks' work (chunks of >= {balanced[0].args[9]} tokens; "
            "variant_options={'balance_chunk': 0} turns it off)"
        )


COUNT_PASS = Pass(
    "ring.count",
    Stage.GRAPH,
    _count_ring_ops,
    requires=("autosp.shard",),
    applies=lambda ctx: ctx.sp and ctx.options.variant in ("ring", "hybrid"),
    doc="report ring attention ops per graph",
)


@hookimpl
def autosp_register_variants(register):
    register(RING)
    register(HYBRID)


@hookimpl
def autosp_register_passes(register):
    register(COUNT_PASS)


@hookimpl
def autosp_register_attention(register):
    register(RING_OP_SPEC)


__all__ = ["HYBRID", "RING", "RING_OP_SPEC"]
