"""Ulysses at one attention site: all-to-all from sequence- to head-sharded and back.

q, k and v arrive sharded on the sequence; an all-to-all gives each rank H/P
whole-sequence heads, attention runs unchanged on them (causal flags and masks
keep their meaning, since every rank sees the whole sequence), and the inverse
all-to-all returns the output sharded on the sequence. A length the ranks do not split evenly
travels padded to equal pieces (``autosp_ulysses.uneven``).

With ``ulysses_chunks=n`` (a variant option, default 1) each rank's heads are processed in n
groups as a pipeline: group c+1's q/k/v exchange is in flight while group c's attention runs,
and group c's output exchange while group c+1's runs. Heads are independent, so the result is
the same; it costs n times the collectives (each 1/n of the bytes).

A head count H that P does not divide (GPT-2 XL's 25 heads, 4 heads at P=3) travels padded: q, k
and v get zero heads up to the next multiple of P (k and v first repeated to H heads where they
are grouped, GQA), each rank attends over its ceil(H/P) heads, and the padding heads are cut from
the output. A zero head's scores are all equal, so its rows are finite and its output, which
nothing reads, is zero; its gradient is cut with it, so the real heads' values and gradients are
those of the unpadded attention. It costs (ceil(H/P)*P - H)/H more attention compute, and the report
says so. SDPA and FlexAttention pad (Flex's mods see the last real head's index in the padding
heads, ``autosp_ulysses.flex``), and so does a plugin's op that declares ``AttentionSpec.pads_heads``;
any other plugin op may read the head index or carry per-head arguments in ways not known here, so it
still needs P to divide H.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from autosp.analysis.attention import AttentionSite
from autosp.errors import AutoSPError, ConfigError
from autosp.lowering import SDPA, sdpa_args
from autosp.sharding import collectives as C
from autosp.sharding.context import SPContext, SPValue, global_like
from autosp.sharding.padded import heads_multiple, heads_note, pad_heads, pad_mask_heads
from autosp.sharding.placement import Replicate, SeqAxis, Shard, is_even
from autosp.sharding.redistribute import gather
from autosp_ulysses import uneven


def check(site: AttentionSite, world: int) -> None:
    if site.heads % world and not site.spec.pads_heads:
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
        length = v.gval.shape[sdim]
        sent = uneven.pad_own(ctx, v.local, sdim, length).contiguous()
        return uneven.keep_real(ctx, C.all_to_all(sent, hdim, sdim, ctx.group_name), sdim, length)
    full = gather(ctx, v)
    lo, hi = _head_range(ctx, v.gval.shape[hdim])
    return full.narrow(hdim, lo, hi - lo)


def from_heads(ctx: SPContext, out: torch.Tensor, sdim: int, hdim: int, length: Any) -> torch.Tensor:
    """The inverse exchange: this rank's piece of the sequence for every head."""
    ctx.note("all_to_all")
    sent = uneven.pad_each(ctx, out, sdim, length).contiguous()
    return uneven.cut_own(ctx, C.all_to_all(sent, sdim, hdim, ctx.group_name), sdim, length)


def _same_layout(ctx: SPContext, values: list[SPValue], hdim: int, sdim: int) -> bool:
    first = values[0].local
    return all(
        _exchangeable(ctx, v, hdim, sdim)
        and v.gval.shape[sdim] == values[0].gval.shape[sdim]
        and v.local.dtype == first.dtype
        and v.local.device == first.device
        and [n for d, n in enumerate(v.local.shape) if d != hdim] == [n for d, n in enumerate(first.shape) if d != hdim]
        for v in values
    )


@dataclass
class _Exchange:
    """A fused head exchange in flight: which of the values it carries, and their head counts."""

    buf: torch.Tensor
    shape: list[Any]
    carried: list[bool]
    sizes: list[Any]
    length: Any  # of the sequence, which may travel padded


def start_heads(
    ctx: SPContext,
    values: list[SPValue],
    hdim: int,
    sdim: int,
    chunk: int = 0,
    chunks: int = 1,
    whole: list[bool] | None = None,
) -> _Exchange:
    """Start exchanging head group ``chunk`` of ``chunks`` of several tensors in one all-to-all.

    Each tensor's heads are split into P per-rank blocks (and each block into ``chunks``
    groups, of which group ``chunk`` is sent); the blocks of all tensors are laid side by side
    per rank, so the all-to-all's r-th slice holds exactly rank r's heads of every tensor. One
    collective instead of three per layer, forward and backward (and in SAC's recompute), with
    the same bytes. A value marked ``whole`` travels with group 0 only, all its heads at once.
    """
    P = ctx.world
    length = values[0].gval.shape[sdim]
    whole = whole or [False] * len(values)
    carried, sizes, blocks = [], [], []
    for v, w in zip(values, whole):
        heads = v.local.shape[hdim]
        if w and chunk:
            carried.append(False)
            continue
        groups = 1 if w else chunks
        n = heads // (P * groups)
        local = uneven.pad_own(ctx, v.local, sdim, length)
        blocks.append(local.unflatten(hdim, (P, groups, n)).select(hdim + 1, 0 if w else chunk))
        carried.append(True)
        sizes.append(n)
    packed = torch.cat(blocks, hdim + 1).flatten(hdim, hdim + 1).contiguous()
    ctx.note("all_to_all")
    buf = C.all_to_all_start(packed, hdim, sdim, ctx.group_name)
    return _Exchange(buf, list(packed.shape), carried, sizes, length)


def finish_heads(ctx: SPContext, ex: _Exchange, hdim: int, sdim: int) -> list[torch.Tensor | None]:
    """This rank's heads of each value started by ``start_heads`` (None where not carried), over the whole sequence."""
    got = C.all_to_all_wait(ex.buf, ex.shape, hdim, sdim, ctx.group_name)
    mine = iter(uneven.keep_real(ctx, t, sdim, ex.length) for t in got.split(ex.sizes, hdim))
    return [next(mine) if c else None for c in ex.carried]


def to_heads_fused(ctx: SPContext, values: list[SPValue], hdim: int, sdim: int) -> list[torch.Tensor] | None:
    """Several tensors' heads in one all-to-all, or None when they cannot share one."""
    if not _same_layout(ctx, values, hdim, sdim):
        return None
    return [t for t in finish_heads(ctx, start_heads(ctx, values, hdim, sdim), hdim, sdim) if t is not None]


def _repeat_heads(v: SPValue, hdim: int, r: int) -> SPValue:
    """Each head ``r`` times in a row, as ``repeat_kv`` does; a local op, so the placement is unchanged."""
    x = v.local.unsqueeze(hdim + 1)
    shape = list(x.shape)
    shape[hdim + 1] = r
    merged = list(v.local.shape)
    merged[hdim] *= r
    gshape = list(v.gval.shape)
    gshape[hdim] *= r
    return SPValue(x.expand(shape).reshape(merged), v.placement, global_like(v.gval, gshape))


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


def _mask_heads(ctx: SPContext, mask: Any, heads: int, hdim: int, padded: int | None = None) -> tuple[Any, int | None]:
    """This rank's part of the mask, and its head dim when it has one (else None); a per-head mask
    gets the padding heads (``padded`` heads in all)."""
    if not isinstance(mask, SPValue):
        return mask, None
    full = gather(ctx, mask) if not isinstance(mask.placement, Replicate) else mask.local
    offset = mask.ndim - 4
    d = hdim + offset
    if d >= 0 and mask.gval.shape[d] == heads and heads > 1:
        if padded is not None and padded != heads:
            full, heads = pad_mask_heads(full, d, padded), padded
        lo, hi = _head_range(ctx, heads)
        return full.narrow(d, lo, hi - lo), d
    return full, None


def pad_values(ctx: SPContext, values: list[SPValue], heads: int, hdim: int) -> list[SPValue]:
    """q, k and v with ``heads_multiple(heads, P)`` heads each (``autosp.sharding.padded.pad_heads``).

    Padding is local (the heads axis is not the sharded one), so placements are unchanged.
    """
    count = heads_multiple(heads, ctx.world)
    q, k, v = (x.local for x in values)
    out = []
    for value, local in zip(values, pad_heads(q, k, v, count, hdim)):
        gshape = list(value.gval.shape)
        gshape[hdim] = count
        out.append(SPValue(local, value.placement, global_like(value.gval, gshape)))
    return out


def chunk_option(options: dict[str, Any]) -> int:
    """The ``ulysses_chunks`` variant option, checked."""
    asked = options.get("ulysses_chunks", 1)
    if isinstance(asked, bool) or not isinstance(asked, int) or asked < 1:
        raise ConfigError(
            f"ulysses_chunks={asked!r}; use an int >= 1: the head groups each rank pipelines per attention "
            "(1: one exchange each way per layer)"
        )
    return asked


def _plan_chunks(ctx: SPContext, a: dict | None, values: list[SPValue], hdim: int, sdim: int) -> tuple[int, list[bool]]:
    """How many head groups to pipeline, and which of k/v travel whole with the first group.

    Query heads split into the groups; k and v split with them when their heads per rank do,
    else (GQA with fewer kv heads per rank than groups) they travel whole with group 0 and each
    group takes the kv head its query heads share. Fewer groups than asked when the heads do
    not split so; 1 for plugin attention ops (they may carry per-head arguments) and dropout.
    """
    asked = chunk_option(ctx.variant_options)
    none = [False] * len(values)
    if asked == 1 or a is None or a["dropout_p"] or not _same_layout(ctx, values, hdim, sdim):
        return 1, none
    q_heads = int(values[0].gval.shape[hdim])
    per_rank = q_heads // ctx.world
    for n in range(min(asked, per_rank), 1, -1):
        if per_rank % n:
            continue
        whole = [(int(v.gval.shape[hdim]) // ctx.world) % n != 0 for v in values]
        group = q_heads // int(values[1].gval.shape[hdim])  # query heads per kv head
        if not any(whole) or group % (per_rank // n) == 0:
            return n, whole
    return 1, none


def _sdpa(a: dict, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, gqa: bool) -> torch.Tensor:
    return F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        dropout_p=a["dropout_p"],
        is_causal=a["is_causal"],
        scale=a["scale"],
        enable_gqa=a["enable_gqa"] or gqa,
    )


def _kv_for(kv: torch.Tensor, chunk: int, q_per_chunk: int, group: int, hdim: int) -> torch.Tensor:
    """The one kv head (of this rank's, received whole) that query group ``chunk`` attends with."""
    return kv.narrow(hdim, chunk * q_per_chunk // group, 1)


def _pipelined(
    ctx: SPContext,
    a: dict,
    values: list[SPValue],
    mask: tuple[Any, int | None],
    gqa: bool,
    plan: tuple[int, list[bool]],
    hdim: int,
    sdim: int,
) -> torch.Tensor:
    """Attention over head groups, each group's exchanges in flight during another group's attention."""
    chunks, whole = plan
    length = values[0].gval.shape[sdim]
    q_heads = int(values[0].gval.shape[hdim])
    q_per_chunk = q_heads // (ctx.world * chunks)
    group = q_heads // int(values[1].gval.shape[hdim])
    pending = start_heads(ctx, values, hdim, sdim, 0, chunks, whole)
    kept: list[torch.Tensor | None] = [None] * len(values)
    backs = []
    for c in range(chunks):
        current = pending
        if c + 1 < chunks:
            pending = start_heads(ctx, values, hdim, sdim, c + 1, chunks, whole)
        got = finish_heads(ctx, current, hdim, sdim)
        kept = [g if g is not None and w else k for g, w, k in zip(got, whole, kept)]
        qkv: list[torch.Tensor] = []
        for g, w, k in zip(got, whole, kept):
            t = _kv_for(k, c, q_per_chunk, group, hdim) if w and k is not None else g
            if t is None:  # every value is carried by each group or kept from group 0
                raise AssertionError("ulysses: a head group lost one of q, k, v")
            qkv.append(t)
        ql, kl, vl = qkv
        m, d = mask
        if d is not None:
            per = m.shape[d] // chunks
            m = m.narrow(d, c * per, per)
        out = uneven.pad_each(ctx, _sdpa(a, ql, kl, vl, m, gqa or any(whole)), sdim, length).contiguous()
        ctx.note("all_to_all")
        backs.append((C.all_to_all_start(out, sdim, hdim, ctx.group_name), list(out.shape)))
    # Group c of every rank comes back as [P, heads/(P*chunks)]; rank r's heads are its groups in order.
    parts = [C.all_to_all_wait(buf, shape, sdim, hdim, ctx.group_name) for buf, shape in backs]
    per = parts[0].shape[hdim] // ctx.world
    stacked = torch.stack([p.unflatten(hdim, (ctx.world, per)) for p in parts], hdim + 1)
    return uneven.cut_own(ctx, stacked.flatten(hdim, hdim + 2), sdim, length)


def ulysses_attention(ctx: SPContext, node: torch.fx.Node, site: AttentionSite, args: tuple, kwargs: dict) -> SPValue:
    spec = site.spec
    hdim, sdim = site.axis("H"), site.axis("S")
    # SDPA's leaf, or aten's SDPA itself (the rule harness calls it: the leaf has no eager backward).
    if spec is SDPA and node.target in (spec.leaf, torch.ops.aten.scaled_dot_product_attention.default):
        a = sdpa_args(args, kwargs)
        q, k, v = a["query"], a["key"], a["value"]
    else:
        q, k, v = (args[i] for i in spec.qkv)
        a = None
    heads = heads_multiple(site.heads, ctx.world)
    if heads != site.heads:
        if not spec.pads_heads:  # check() refuses it: a plugin op may read its head index
            raise AssertionError(f"ulysses: {site.name}'s {site.heads} heads do not split over {ctx.world} ranks")
        q, k, v = pad_values(ctx, [q, k, v], site.heads, hdim)
        repeated = ", k/v repeated to the query heads" if site.kv_heads != site.heads else ""
        ctx.notes.append(heads_note(site.name, site.heads, heads, f"{ctx.world} ranks", repeated))
    k, gqa_k = kv_heads(ctx, k, heads, hdim, sdim)
    v, gqa_v = kv_heads(ctx, v, heads, hdim, sdim)
    length = site.seq_len
    placement = Shard(SeqAxis(sdim, length), ctx.even_ranges(length))
    plan = _plan_chunks(ctx, a, [q, k, v], hdim, sdim)
    if a is not None and plan[0] > 1:
        mask = _mask_heads(ctx, a["attn_mask"], site.heads, hdim, heads)
        out = _pipelined(ctx, a, [q, k, v], mask, gqa_k or gqa_v, plan, hdim, sdim)
        return SPValue(out.narrow(hdim, 0, site.heads), placement, node.meta["val"])
    fused = to_heads_fused(ctx, [q, k, v], hdim, sdim)
    ql, kl, vl = fused if fused is not None else (to_heads(ctx, x, hdim, sdim) for x in (q, k, v))
    if a is not None:
        mask, _ = _mask_heads(ctx, a["attn_mask"], site.heads, hdim, heads)
        out = _sdpa(a, ql, kl, vl, mask, gqa_k or gqa_v)
    else:
        local = list(args)
        for i, t in zip(spec.qkv, (ql, kl, vl)):
            local[i] = t
        local = [x.local if isinstance(x, SPValue) else x for x in local]
        if isinstance(spec.mask, int) and isinstance(args[spec.mask], SPValue):
            local[spec.mask] = _mask_heads(ctx, args[spec.mask], site.heads, hdim, heads)[0]
        out = node.target(*local, **{k_: (x.local if isinstance(x, SPValue) else x) for k_, x in kwargs.items()})
    back = from_heads(ctx, out, sdim, hdim, length)
    return SPValue(back.narrow(hdim, 0, site.heads) if heads != site.heads else back, placement, node.meta["val"])


__all__ = [
    "check",
    "chunk_option",
    "finish_heads",
    "from_heads",
    "kv_heads",
    "pad_values",
    "start_heads",
    "to_heads",
    "to_heads_fused",
    "ulysses_attention",
]
