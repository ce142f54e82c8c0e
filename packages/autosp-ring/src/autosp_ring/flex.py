"""Ring at a FlexAttention call: this rank's query rows against the whole keys and values.

Each rank keeps its query rows (the variant's layout: zigzag, so causal and document masks give
every rank about the same work) and gathers k and v whole, as PyTorch's context parallelism does
for Flex. The call is Flex itself on fewer rows: the block mask cut to those rows' query blocks
(its per-block counts and indices, and their transpose for the backward), ``score_mod`` and
``mask_mod`` seeing global query indices, captured buffers whole. So Flex's own kernel skips the
blocks the mask leaves empty, forward and backward, and no rank holds more than its rows of q,
out, the log-sum-exp and their gradients; k and v (and their gradients, reduce-scattered in the
backward) are whole, which GQA keeps small.

The rows must be whole query blocks of the block mask: a layout that cuts a block (chunks shorter
than ``BLOCK_SIZE``) would mix two ranks' rows in one block. Then the contiguous layout is tried,
and failing that the call runs whole on every rank (exact), and the report says why.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

from autosp import flex_blocks
from autosp.analysis.attention import AttentionSite
from autosp.sharding.context import SPContext, SPValue
from autosp.sharding.placement import Layout, Replicate, SeqAxis, Shard
from autosp.sharding.redistribute import to_shard, whole_local
from autosp.sharding.rules.base import fallback

# What the report says of each call cut to query rows (ring and hybrid).
CUT = "this rank's query rows against k and v gathered whole, the block mask cut to those rows"


def row_layout(ctx: SPContext, length: Any, block: tuple) -> Layout | None:
    """The variant's layout, else the contiguous one, if its pieces are whole query blocks."""
    size = block[flex_blocks.Q_BLOCK]
    if not isinstance(length, int) or block[0] != length or not isinstance(size, int):
        return None
    for layout in (ctx.layout(length), ctx.even_ranges(length)):
        if all(flex_blocks.row_blocks(pieces, length, size) is not None for pieces in layout):
            return layout
    return None


def _run_whole(ctx: SPContext, node: torch.fx.Node, args: tuple, kwargs: dict, why: str) -> Any:
    ctx.fallbacks.append(f"{node.name} (FlexAttention): {why}; run whole on every rank, q, k and v gathered")
    return fallback(ctx, node, args, kwargs)


def ring_flex_rule(ctx: SPContext, node: torch.fx.Node, site: AttentionSite, args: tuple, kwargs: dict) -> Any:
    q, k, v, score_mod, block, scale, options, score_bufs, mask_bufs = args
    length, sdim = site.seq_len, site.axis("S")
    if kwargs:
        return _run_whole(ctx, node, args, kwargs, f"keyword arguments this rule does not know ({sorted(kwargs)})")
    if site.kv_seq_len != length:
        return _run_whole(ctx, node, args, kwargs, "keys of another length than the queries")
    block = tuple(whole_local(ctx, x) for x in block)
    layout = row_layout(ctx, length, block)
    if layout is None:
        return _run_whole(
            ctx, node, args, kwargs, f"no layout of {length} tokens over {ctx.world} ranks keeps whole query blocks"
        )
    pieces = layout[ctx.rank]
    local_block = flex_blocks.rows_of(block, pieces)
    if local_block is None:
        return _run_whole(ctx, node, args, kwargs, "its block mask has fields this rule does not know")
    target = Shard(SeqAxis(sdim, length), layout)
    q = q if isinstance(q, SPValue) else SPValue(q, Replicate(), q)
    ql = to_shard(ctx, q, sdim, target)
    if isinstance(q.placement, Shard) and not q.placement.same_layout(target):
        ctx.note("relayout")
    # Captured buffers (document ids, biases) index global positions: whole on every rank.
    score_bufs, mask_bufs = pytree.tree_map(lambda x: whole_local(ctx, x), (score_bufs, mask_bufs))
    score_mod = flex_blocks.shift_arg(score_mod, flex_blocks.SCORE_QUERY, flex_blocks.global_rows(pieces))
    results = node.target(
        ql,
        whole_local(ctx, k),
        whole_local(ctx, v),
        score_mod,
        local_block,
        scale,
        options,
        tuple(score_bufs),
        tuple(mask_bufs),
    )
    ctx.notes.append(f"{node.name} (FlexAttention): {CUT}")
    # out [B, H, S, D], the log-sum-exp and the row max [B, H, S]: all this rank's rows.
    return tuple(SPValue(t, target, g) for t, g in zip(results, node.meta["val"]))


__all__ = ["CUT", "ring_flex_rule", "row_layout"]
