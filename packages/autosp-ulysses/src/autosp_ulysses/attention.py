"""Ulysses at one attention site: all-to-all from sequence- to head-sharded and back.

q, k and v arrive sharded on the sequence; an all-to-all gives each rank H/P
whole-sequence heads, attention runs unchanged on them (causal flags and masks
keep their meaning, since every rank sees the whole sequence), and the inverse
all-to-all returns the output sharded on the sequence.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from autosp.analysis.attention import AttentionSite
from autosp.errors import AutoSPError
from autosp.lowering import sdpa_args
from autosp.sharding import collectives as C
from autosp.sharding.context import SPContext, SPValue
from autosp.sharding.placement import Replicate, SeqAxis, Shard, is_even
from autosp.sharding.redistribute import gather


def check(site: AttentionSite, world: int) -> None:
    if site.heads % world:
        raise AutoSPError(
            f"attention {site.name} has {site.heads} query heads, not divisible by sp_size={world}; Ulysses splits "
            f"heads over ranks: use an sp_size that divides {site.heads}, or variant='ring'"
        )


def _head_range(ctx: SPContext, heads: int) -> tuple[int, int]:
    per = heads // ctx.world
    return ctx.rank * per, (ctx.rank + 1) * per


def _exchangeable(ctx: SPContext, v: SPValue, hdim: int, sdim: int) -> bool:
    """Evenly sharded on the sequence, with heads that split over the ranks: one all-to-all away."""
    p = v.placement
    return (
        isinstance(p, Shard)
        and p.axis.dim == sdim
        and p.axis.inner == 1
        and p.axis.length == v.gval.shape[sdim]
        and is_even(p.ranges, p.axis.length)
        and v.gval.shape[hdim] % ctx.world == 0
    )


def to_heads(ctx: SPContext, v: SPValue, hdim: int, sdim: int) -> torch.Tensor:
    """This rank's heads over the whole sequence."""
    if _exchangeable(ctx, v, hdim, sdim):
        ctx.note("all_to_all")
        return C.all_to_all(v.local.contiguous(), hdim, sdim, ctx.group_name)
    full = gather(ctx, v)
    lo, hi = _head_range(ctx, v.gval.shape[hdim])
    return full.narrow(hdim, lo, hi - lo)


def to_heads_fused(ctx: SPContext, values: list[SPValue], hdim: int, sdim: int) -> list[torch.Tensor] | None:
    """Several tensors' heads in one all-to-all, or None when they cannot share one.

    Each tensor's heads are split into P per-rank blocks and the blocks of all tensors are
    laid side by side per rank, so the all-to-all's r-th slice holds exactly rank r's heads
    of every tensor. One collective instead of three per layer, forward and backward (and
    in SAC's recompute), with the same bytes.
    """
    first = values[0].local
    same = all(
        _exchangeable(ctx, v, hdim, sdim)
        and v.local.dtype == first.dtype
        and v.local.device == first.device
        and [n for d, n in enumerate(v.local.shape) if d != hdim] == [n for d, n in enumerate(first.shape) if d != hdim]
        for v in values
    )
    if not same:
        return None
    P = ctx.world
    heads = [v.local.shape[hdim] for v in values]
    blocks = [v.local.unflatten(hdim, (P, h // P)) for v, h in zip(values, heads)]
    packed = torch.cat(blocks, hdim + 1).flatten(hdim, hdim + 1)
    ctx.note("all_to_all")
    mine = C.all_to_all(packed.contiguous(), hdim, sdim, ctx.group_name)
    return list(mine.split([h // P for h in heads], hdim))


def _repeat_heads(v: SPValue, hdim: int, r: int) -> SPValue:
    """Each head ``r`` times in a row, as ``repeat_kv`` does; a local op, so the placement is unchanged."""
    x = v.local.unsqueeze(hdim + 1)
    shape = list(x.shape)
    shape[hdim + 1] = r
    merged = list(v.local.shape)
    merged[hdim] *= r
    gshape = list(v.gval.shape)
    gshape[hdim] *= r
    return SPValue(x.expand(shape).reshape(merged), v.placement, v.gval.new_empty(gshape))


def kv_heads(ctx: SPContext, v: SPValue, q_heads: int, hdim: int, sdim: int) -> tuple[SPValue, bool]:
    """k or v with a head count that splits over the ranks (repeated as little as possible), and needs_gqa."""
    kv = v.gval.shape[hdim]
    if kv % ctx.world == 0:
        return v, kv != q_heads
    # Fewer kv heads than ranks (or not a multiple): repeat each head the fewest times that makes
    # the count divisible by the ranks, then exchange as usual. r = P / gcd(kv, P) divides q/kv
    # because P divides q, so rank r's repeated heads are exactly those its query heads use.
    # Gathering the whole k/v instead would move twice the bytes and reduce-scatter in backward.
    r = ctx.world // math.gcd(kv, ctx.world)
    return _repeat_heads(v, hdim, r), kv * r != q_heads


def _mask_heads(ctx: SPContext, mask: Any, heads: int, hdim: int) -> Any:
    if not isinstance(mask, SPValue):
        return mask
    full = gather(ctx, mask) if not isinstance(mask.placement, Replicate) else mask.local
    offset = mask.ndim - 4
    d = hdim + offset
    if d >= 0 and mask.gval.shape[d] == heads and heads > 1:
        lo, hi = _head_range(ctx, heads)
        return full.narrow(d, lo, hi - lo)
    return full


def ulysses_attention(ctx: SPContext, node: torch.fx.Node, site: AttentionSite, args: tuple, kwargs: dict) -> SPValue:
    spec = site.spec
    hdim, sdim = site.axis("H"), site.axis("S")
    if spec.leaf is not None and node.target == spec.leaf:
        a = sdpa_args(args, kwargs)
        q, k, v = a["query"], a["key"], a["value"]
    else:
        q, k, v = (args[i] for i in spec.qkv)
        a = None
    k, gqa_k = kv_heads(ctx, k, site.heads, hdim, sdim)
    v, gqa_v = kv_heads(ctx, v, site.heads, hdim, sdim)
    fused = to_heads_fused(ctx, [q, k, v], hdim, sdim)
    ql, kl, vl = fused if fused is not None else (to_heads(ctx, x, hdim, sdim) for x in (q, k, v))
    if a is not None:
        mask = _mask_heads(ctx, a["attn_mask"], site.heads, hdim)
        out = F.scaled_dot_product_attention(
            ql,
            kl,
            vl,
            attn_mask=mask,
            dropout_p=a["dropout_p"],
            is_causal=a["is_causal"],
            scale=a["scale"],
            enable_gqa=a["enable_gqa"] or gqa_k or gqa_v,
        )
    else:
        local = list(args)
        for i, t in zip(spec.qkv, (ql, kl, vl)):
            local[i] = t
        local = [x.local if isinstance(x, SPValue) else x for x in local]
        if isinstance(spec.mask, int) and isinstance(args[spec.mask], SPValue):
            local[spec.mask] = _mask_heads(ctx, args[spec.mask], site.heads, hdim)
        out = node.target(*local, **{k_: (x.local if isinstance(x, SPValue) else x) for k_, x in kwargs.items()})
    ctx.note("all_to_all")
    back = C.all_to_all(out.contiguous(), sdim, hdim, ctx.group_name)
    length = site.seq_len
    return SPValue(back, Shard(SeqAxis(sdim, length), ctx.even_ranges(length)), node.meta["val"])


__all__ = ["check", "kv_heads", "to_heads", "ulysses_attention"]
