"""Ulysses at one attention site: all-to-all from sequence- to head-sharded and back.

q, k and v arrive sharded on the sequence; an all-to-all gives each rank H/P
whole-sequence heads, attention runs unchanged on them (causal flags and masks
keep their meaning, since every rank sees the whole sequence), and the inverse
all-to-all returns the output sharded on the sequence.
"""

from __future__ import annotations

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


def to_heads(ctx: SPContext, v: SPValue, hdim: int, sdim: int) -> torch.Tensor:
    """This rank's heads over the whole sequence."""
    p = v.placement
    heads = v.gval.shape[hdim]
    if (
        isinstance(p, Shard)
        and p.axis.dim == sdim
        and p.axis.inner == 1
        and p.axis.length == v.gval.shape[sdim]
        and is_even(p.ranges, p.axis.length)
        and heads % ctx.world == 0
    ):
        ctx.note("all_to_all")
        return C.all_to_all(v.local.contiguous(), hdim, sdim, ctx.group_name)
    full = gather(ctx, v)
    lo, hi = _head_range(ctx, heads)
    return full.narrow(hdim, lo, hi - lo)


def kv_heads(ctx: SPContext, v: SPValue, q_heads: int, hdim: int, sdim: int) -> tuple[torch.Tensor, bool]:
    """k or v for this rank's query heads, exchanged before any repeat; returns (tensor, needs_gqa)."""
    kv = v.gval.shape[hdim]
    if kv == q_heads:
        return to_heads(ctx, v, hdim, sdim), False
    if kv % ctx.world == 0:
        return to_heads(ctx, v, hdim, sdim), True
    # Fewer kv heads than ranks: every rank takes the whole kv heads its query heads use.
    full = gather(ctx, v)
    group = q_heads // kv
    lo, hi = _head_range(ctx, q_heads)
    first, last = lo // group, (hi - 1) // group
    return full.narrow(hdim, first, last - first + 1), (last - first + 1) != (hi - lo)


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
    ql = to_heads(ctx, q, hdim, sdim)
    kl, gqa_k = kv_heads(ctx, k, site.heads, hdim, sdim)
    vl, gqa_v = kv_heads(ctx, v, site.heads, hdim, sdim)
    if a is not None:
        mask = _mask_heads(ctx, a["attn_mask"], site.heads, hdim)
        out = F.scaled_dot_product_attention(
            ql, kl, vl, attn_mask=mask, dropout_p=a["dropout_p"], is_causal=a["is_causal"], scale=a["scale"],
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
