"""Ulysses at a FlexAttention call: whole sequences for H/P heads, the block mask kept whole.

After the all-to-all every rank holds the whole sequence for its heads, so the block mask, the
query and key indices that ``score_mod``/``mask_mod`` see and their captured buffers keep their
meaning. Only the head index changes: rank r computes heads ``[r*H/P, (r+1)*H/P)`` as local
heads ``0 .. H/P-1``, so both mods get ``h`` shifted back to the global head, and per-head block
tensors are sliced to this rank's heads. Kv heads that do not split over the ranks (GQA, 2 kv heads
over 4 ranks) are repeated the fewest times that makes them split, as for SDPA: each rank's
repeated kv heads are those its query heads read, so Flex's own GQA grouping pairs them rightly.
Heads the ranks do not split (4 over 3 ranks) travel padded, as for SDPA (``autosp_ulysses.attention``),
k and v first repeated to the query heads: a padding head takes the last real head's blocks and, in
both mods, its index (``flex_blocks.heads_of``), so a mod reading a per-head table stays in range;
the padding heads' outputs and log-sum-exps are cut, so neither they nor their gradients are seen.
Whatever this cannot place exactly (block-mask fields it does not know) runs whole, inputs gathered.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

from autosp import flex_blocks
from autosp.analysis.attention import AttentionSite
from autosp.sharding.context import SPContext, SPValue
from autosp.sharding.padded import heads_multiple, heads_note
from autosp.sharding.placement import HeadShard, SeqAxis, Shard
from autosp.sharding.redistribute import whole_local
from autosp.sharding.rules.base import fallback
from autosp_ulysses.attention import from_heads, pad_values, to_heads, to_heads_fused
from autosp_ulysses.attention import kv_heads as split_kv_heads


def flex_rule(ctx: SPContext, node: torch.fx.Node, site: AttentionSite, args: tuple, kwargs: dict) -> Any:
    q, k, v, score_mod, block, scale, options, score_bufs, mask_bufs = args
    heads = site.heads
    count = heads_multiple(heads, ctx.world)  # padded where the ranks do not split the heads
    per = count // ctx.world
    lo, hi = ctx.rank * per, (ctx.rank + 1) * per
    local_block = flex_blocks.heads_of(tuple(whole_local(ctx, x) for x in block), heads, lo, hi)
    padded = count != heads
    if local_block is None or kwargs:
        ctx.fallbacks.append(f"{node.name} (FlexAttention): its block mask does not split over heads; run whole")
        return fallback(ctx, node, args, kwargs)
    if padded and not all(isinstance(x, SPValue) for x in (q, k, v)):
        ctx.fallbacks.append(
            f"{node.name} (FlexAttention): q, k or v is a constant, whose heads are not padded; run whole"
        )
        return fallback(ctx, node, args, kwargs)
    hdim, sdim = site.axis("H"), site.axis("S")
    if padded:
        q, k, v = pad_values(ctx, [q, k, v], heads, hdim)
        cut = "; the mods see the last real head's index in the padding heads, whose results are cut"
        ctx.notes.append(heads_note(f"{site.name} (FlexAttention)", heads, count, f"{ctx.world} ranks", cut))
    k, v = (split_kv_heads(ctx, x, count, hdim, sdim)[0] if isinstance(x, SPValue) else x for x in (k, v))
    fused = to_heads_fused(ctx, [q, k, v], hdim, sdim)
    ql, kl, vl = fused if fused is not None else (to_heads(ctx, x, hdim, sdim) for x in (q, k, v))
    # Captured buffers (document ids, biases) index global positions and heads: whole on every rank.
    score_bufs, mask_bufs = pytree.tree_map(lambda x: whole_local(ctx, x), (score_bufs, mask_bufs))
    shift = flex_blocks.offset(lo, heads if padded else None)
    score_mod = flex_blocks.shift_arg(score_mod, flex_blocks.SCORE_HEAD, shift)
    out, lse, *rest = node.target(
        ql, kl, vl, score_mod, local_block, scale, options, tuple(score_bufs), tuple(mask_bufs)
    )
    length = site.seq_len
    back = from_heads(ctx, out, sdim, hdim, length)
    vals = node.meta["val"]
    shard = Shard(SeqAxis(sdim, length), ctx.even_ranges(length))
    # The log-sum-exp (and the row max) stay head-sharded over the whole sequence; a use gathers them.
    # A rank's padding heads are cut: its range is its real heads (none, where all are padding).
    ranges = tuple((min(r * per, heads), min((r + 1) * per, heads)) for r in range(ctx.world))
    real = ranges[ctx.rank][1] - ranges[ctx.rank][0]
    heads_of = HeadShard(1, ranges)
    return (
        SPValue(back.narrow(hdim, 0, heads) if padded else back, shard, vals[0]),
        *(SPValue(t.narrow(1, 0, real) if padded else t, heads_of, g) for t, g in zip([lse, *rest], vals[1:])),
    )


__all__ = ["flex_rule"]
