"""The sharding engine: placements, the per-op rules that propagate them, and the collectives.

This module is the public face for SP-variant, rule and plugin authors; the invariants every rule
and pass keeps are written down in ``README.md`` beside it.  Rules for new ops come in through the
``autosp_register_sharding_rules`` hook, never by editing a table.
"""

from autosp.sharding.collectives import COLLECTIVE_OPS, all_gather, all_reduce, all_to_all, reduce_scatter, scale_grad
from autosp.sharding.context import AttentionRule, SPContext, SPValue
from autosp.sharding.placement import (
    HeadShard,
    IntLike,
    Layout,
    Partial,
    Placement,
    Replicate,
    SeqAxis,
    Shard,
    even_ranges,
    in_rank_order,
    is_even,
    zigzag_ranges,
)
from autosp.sharding.propagate import evaluate, finish, normalize_inputs, shard_graph
from autosp.sharding.redistribute import gather, slice_to, to_replicate, to_shard
from autosp.sharding.rules.base import (
    Rule,
    accepted,
    call,
    declare,
    fallback,
    reduce_partials,
    replicated,
    seq_dim,
    values,
    wrap,
)
from autosp.sharding.rules.position import positions

__all__ = [
    "COLLECTIVE_OPS",
    "AttentionRule",
    "HeadShard",
    "IntLike",
    "Layout",
    "Partial",
    "Placement",
    "Replicate",
    "Rule",
    "SPContext",
    "SPValue",
    "SeqAxis",
    "Shard",
    "accepted",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "call",
    "declare",
    "evaluate",
    "even_ranges",
    "fallback",
    "finish",
    "gather",
    "in_rank_order",
    "is_even",
    "normalize_inputs",
    "positions",
    "reduce_partials",
    "reduce_scatter",
    "replicated",
    "scale_grad",
    "seq_dim",
    "shard_graph",
    "slice_to",
    "to_replicate",
    "to_shard",
    "values",
    "wrap",
    "zigzag_ranges",
]
