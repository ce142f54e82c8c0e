"""USP hybrid (``variant="hybrid"``): Ulysses inside groups of ``ulysses_degree`` ranks, ring across them.

SP rank ``p = i * U + u`` (ring index i, ulysses index u) holds sequence chunk p.
An all-to-all in ulysses group i (ranks ``i*U .. i*U+U-1``) gives each member
H/U heads over the group's contiguous span ``[i*S/R, (i+1)*S/R)``; the ring op
then runs over ring group u (ranks ``u, U+u, ...``), whose members hold the same
heads on consecutive spans, and the inverse all-to-all restores chunk p. A length P does not
divide leaves chunks one token apart: they cross the ulysses group padded to the longest and the
ring carries spans of different lengths (``uneven_pieces``).
Subgroups are made once per (SP group, U) by a compile-time pass, on every rank.
SDPA heads that U does not divide travel padded with zero heads, as under Ulysses
(``autosp_ulysses.attention``): k/v repeated to the query heads first, the padding cut from the
output. FlexAttention pads the same way, its mods seeing the last real head's index in the padding
heads (``autosp.flex_blocks.heads_of``), and so does a plugin's op that declares
``AttentionSpec.pads_heads``; any other plugin op needs U to divide the heads.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from autosp import flex_blocks
from autosp.analysis.attention import AttentionSite
from autosp.context import CompileContext
from autosp.errors import AutoSPError, ConfigError
from autosp.lowering import FLEX
from autosp.options import group_timeout
from autosp.passes.core import leave_to_engine
from autosp.sharding import collectives as C
from autosp.sharding import padded
from autosp.sharding.context import SPContext, SPValue
from autosp.sharding.placement import IntLike, Replicate, SeqAxis, Shard, even_ranges, piece_lengths
from autosp.sharding.redistribute import to_shard, whole_local
from autosp.sharding.rules.base import fallback
from autosp_ring.attention import balance_chunk, from_bhsd, parse, seq_chunks, whole_mask
from autosp_ring.flex import CUT


@dataclass(frozen=True)
class Groups:
    ulysses: str  # group name of this rank's ulysses group
    ring: str  # group name of this rank's ring group
    degree: int  # ulysses degree U


# A cache of process groups, not state: the rule gets its groups from ``SPContext.variant_state``.
_GROUPS: dict[tuple[str, int], Groups] = {}


def ulysses_degree(options: dict, world: int) -> int:
    u = options.get("ulysses_degree")
    r = options.get("ring_degree")
    if u is None and r is None:
        raise ConfigError(
            "variant='hybrid' needs variant_options={'ulysses_degree': U} (or 'ring_degree'), "
            f"with ulysses_degree * ring_degree == sp_size={world}"
        )
    if u is None:
        u = world // r if isinstance(r, int) and r > 0 else 0
    if not isinstance(u, int) or u < 1 or world % u or (r is not None and u * r != world):
        raise ConfigError(f"hybrid: ulysses_degree={u}, ring_degree={r} do not multiply to sp_size={world}")
    return u


def _check_heads(site: AttentionSite, u: int) -> None:
    if site.heads % u:
        raise AutoSPError(
            f"attention {site.name} has {site.heads} query heads, not divisible by ulysses_degree={u}; "
            "hybrid splits heads over each ulysses group: pick a ulysses_degree that divides the head count, "
            "or variant='ring'"
        )


def make_groups(ctx: CompileContext) -> Groups:
    """Validate the degrees and make the subgroups, before the rewrite and any collective of the program.

    ``SPVariant.prepare`` of the hybrid variant: the attention rule reads the result as
    ``SPContext.variant_state``. Process groups are made once per (SP group, degree) and reused
    by later compiles, since creating one is itself a collective.
    """
    u = ulysses_degree(ctx.options.variant_options, ctx.world)
    for site in list(ctx.sites):
        if site.spec.pads_heads:
            continue  # heads U does not divide travel padded (``_padded``, ``hybrid_flex_rule``)
        try:
            _check_heads(site, u)
        except AutoSPError as e:
            leave_to_engine(ctx, site, e)  # raises for attention over the sequence
    key = (ctx.group_name, u)
    if key not in _GROUPS:
        ranks = dist.get_process_group_ranks(ctx.group)
        i, j = divmod(ctx.rank, u)
        # Only members join each group (local synchronization), so other SP groups may differ.
        # Every rank creates its ulysses group first, then its ring group: no waiting cycle.
        # new_group would give them torch's 30-minute default, not the SP group's timeout.
        timeout = group_timeout(ctx.group)
        ug = dist.new_group(ranks[i * u : (i + 1) * u], use_local_synchronization=True, timeout=timeout)
        rg = dist.new_group(ranks[j::u], use_local_synchronization=True, timeout=timeout)
        _GROUPS[key] = Groups(ug.group_name, rg.group_name, u)
    ctx.report.notes.append(f"hybrid: ulysses_degree={u} x ring_degree={ctx.world // u}")
    return _GROUPS[key]


def _kv_for_heads(x: torch.Tensor, heads: int, g: Groups, rank_u: int) -> torch.Tensor:
    """k or v ([B, Hkv, S/P, D]) for this rank's H/U query heads over the ulysses span."""
    kv, u = x.shape[1], g.degree
    if kv % u == 0:
        return C.all_to_all(x.contiguous(), 1, 2, g.ulysses)
    # Fewer kv heads than the group splits: gather the span whole, keep the kv heads my query heads use.
    sizes = [x.shape[2]] * u
    full = C.all_gather(x.contiguous(), 2, sizes, g.ulysses, False)
    per, group = heads // u, heads // kv
    lo = rank_u * per
    idx = [(lo + h) // group for h in range(per)]
    first, last = idx[0], idx[-1]
    if per % (last - first + 1) == 0 and all(idx[h] - first == h // (per // (last - first + 1)) for h in range(per)):
        return full.narrow(1, first, last - first + 1)  # a uniform GQA ratio remains: expand per block
    return full[:, idx]  # uneven: repeat exactly the heads needed


def _fusable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, u: int) -> bool:
    """Whether q, k and v can cross the ulysses group in one all-to-all: all but the head axis alike."""
    rest = q.shape[:1] + q.shape[2:]
    return (
        q.dtype == k.dtype == v.dtype
        and q.device == k.device == v.device
        and k.shape[1] % u == 0
        and all(x.shape[:1] + x.shape[2:] == rest for x in (k, v))
    )


def qkv_to_heads(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, g: Groups, rank_u: int
) -> tuple[torch.Tensor, ...]:
    """q, k, v ([B, H*, S/P, D]) as this rank's heads over the ulysses span, in one all-to-all when they can.

    Each tensor's heads split into U per-rank blocks, laid side by side per rank, so the r-th slice of
    the exchange holds rank r's heads of all three (Ulysses' ``to_heads_fused``): one collective for
    three, forward and backward, with the same bytes.  Else separate exchanges (kv heads fewer than
    U gather instead).
    """
    u = g.degree
    if not _fusable(q, k, v, u):
        return C.all_to_all(q, 1, 2, g.ulysses), _kv_for_heads(k, heads, g, rank_u), _kv_for_heads(v, heads, g, rank_u)
    sizes = [x.shape[1] // u for x in (q, k, v)]
    packed = torch.cat([x.unflatten(1, (u, n)) for x, n in zip((q, k, v), sizes)], 2).flatten(1, 2)
    return tuple(C.all_to_all(packed.contiguous(), 1, 2, g.ulysses).split(sizes, 1))


def _padded(
    ctx: SPContext,
    site: AttentionSite,
    qkv: tuple[torch.Tensor, ...],
    mask: torch.Tensor | None,
    u: int,
    label: str | None = None,
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor | None, int]:
    """q, k, v ([B, H*, S/P, D]) and a per-head mask with heads a multiple of ``u``
    (``autosp.sharding.padded.pad_heads``), and that count; ``label`` names the site in the note."""
    heads = site.heads
    count = padded.heads_multiple(heads, u)
    if count == heads:
        return qkv, mask, heads
    ctx.notes.append(padded.heads_note(label or site.name, heads, count, f"ulysses_degree={u}"))
    if mask is not None and mask.shape[1] == heads and heads > 1:
        mask = padded.pad_mask_heads(mask, 1, count)
    q, k, v = qkv
    return padded.pad_heads(q, k, v, count, 1), mask, count


def hybrid_flex_rule(ctx: SPContext, node: torch.fx.Node, site: AttentionSite, args: tuple, kwargs: dict) -> Any:
    """FlexAttention: H/U heads over the ulysses group's span of query rows, k and v of those heads
    gathered whole over the ring group, the block mask cut to both (``autosp.flex_blocks``); out and
    the log-sum-exp cross back as SDPA's output does."""
    g: Groups = ctx.variant_state
    q, k, v, score_mod, block, scale, options, score_bufs, mask_bufs = args
    length, heads, rings = site.seq_len, site.heads, ctx.world // g.degree
    i, rank_u = divmod(ctx.rank, g.degree)
    count = padded.heads_multiple(heads, g.degree)  # padded where the group does not split the heads
    per = count // g.degree
    block = tuple(whole_local(ctx, x) for x in block)
    local = None
    uneven = isinstance(length, int) and length % ctx.world != 0
    if isinstance(length, int) and not uneven and not kwargs and site.kv_seq_len == length and block[0] == length:
        span = length // rings
        pieces = ((i * span, (i + 1) * span),)
        local = flex_blocks.heads_of(block, heads, rank_u * per, (rank_u + 1) * per)
        local = flex_blocks.rows_of(local, pieces) if local is not None else None
    if local is None:
        why = (
            f"its {length} tokens do not split evenly over {ctx.world} ranks"
            if uneven
            else f"its block mask does not cut into whole query blocks of {rings} spans and its heads"
        )
        ctx.fallbacks.append(f"{node.name} (FlexAttention): {why}; run whole on every rank, q, k and v gathered")
        return fallback(ctx, node, args, kwargs)
    even = Shard(SeqAxis(2, length), ctx.even_ranges(length))
    ql, kl, vl = (
        to_shard(ctx, x if isinstance(x, SPValue) else SPValue(x, Replicate(), x), 2, even) for x in (q, k, v)
    )
    # As Ulysses pads (``autosp_ulysses.flex``): the padding heads read the last real head's index
    # and blocks, and their results are cut below.
    (ql, kl, vl), _, _ = _padded(ctx, site, (ql, kl, vl), None, g.degree, f"{site.name} (FlexAttention)")
    ctx.note("all_to_all")
    qh, kh, vh = qkv_to_heads(ql, kl, vl, count, g, rank_u)
    kw, vw = (C.all_gather(x.contiguous(), 2, [span] * rings, g.ring, False) for x in (kh, vh))
    shift = flex_blocks.offset(rank_u * per, heads if count != heads else None)
    score_mod = flex_blocks.shift_arg(score_mod, flex_blocks.SCORE_HEAD, shift)
    score_mod = flex_blocks.shift_arg(score_mod, flex_blocks.SCORE_QUERY, flex_blocks.global_rows(pieces))
    score_bufs, mask_bufs = pytree.tree_map(lambda x: whole_local(ctx, x), (score_bufs, mask_bufs))
    ctx.notes.append(f"{node.name} (FlexAttention): H/{g.degree} heads per rank, {CUT}")
    results = node.target(qh, kw, vw, score_mod, local, scale, options, tuple(score_bufs), tuple(mask_bufs))
    # out [B, H/U, S/R, D] and the log-sum-exp [B, H/U, S/R] go back to all heads of this rank's chunk;
    # only the results some node reads cross (the log-sum-exp rarely is).
    users = list(node.users)
    if all(user.target is operator.getitem for user in users):
        read = {user.args[1] for user in users}
    else:
        read = set(range(len(results)))  # the tuple itself is used
    return tuple(
        SPValue(C.all_to_all(t.contiguous(), 2, 1, g.ulysses).narrow(1, 0, heads), even, gval) if n in read else None
        for n, (t, gval) in enumerate(zip(results, node.meta["val"]))
    )


def uneven_pieces(length: IntLike, world: int, degree: int, ring_index: int) -> tuple[list[int], list[int]] | None:
    """For a length ``world`` does not divide: the pieces of this rank's ulysses group's members and
    the spans of the ring (each group's pieces together), in rank order; None for equal pieces.

    Lists even where this group's own pieces happen to be alike, so that every rank runs the same ops.
    """
    if not isinstance(length, int) or length % world == 0:
        return None
    pieces = [int(n) for n in piece_lengths(even_ranges(length, world))]
    spans = [sum(pieces[i * degree : (i + 1) * degree]) for i in range(world // degree)]
    return pieces[ring_index * degree : (ring_index + 1) * degree], spans


def hybrid_attention_rule(ctx: SPContext, node: torch.fx.Node, site: AttentionSite, args: tuple, kwargs: dict) -> Any:
    if site.spec is FLEX:
        return hybrid_flex_rule(ctx, node, site, args, kwargs)
    g: Groups = ctx.variant_state
    call = parse(node, site, args, kwargs)
    q, k, v = seq_chunks(ctx, site, call)
    ring_index, rank_u = divmod(ctx.rank, g.degree)
    sdim, length = site.axis("S"), site.seq_len
    # Uneven pieces cross the ulysses group padded to the longest (``autosp.sharding.padded``); the
    # ring then carries spans of different lengths, which its op reads by ``sizes``.
    members, spans = uneven_pieces(length, ctx.world, g.degree, ring_index) or (None, None)
    mask = whole_mask(ctx, site, call)
    (q, k, v), mask, heads = _padded(ctx, site, (q, k, v), mask, g.degree)
    ctx.note("all_to_all")
    qs, ks, vs = (padded.pad_own(x, 2, members) for x in (q, k, v))
    qh, kh, vh = (padded.keep_real(x, 2, members) for x in qkv_to_heads(qs, ks, vs, heads, g, rank_u))
    if mask is not None and mask.shape[1] > 1:
        per = heads // g.degree
        mask = mask.narrow(1, rank_u * per, per).contiguous()  # the heads this rank attends for
    # Every rank of a ring group holds the same heads (ranks[j::U]), so the same mask and plan.
    balance = balance_chunk(ctx.variant_options)
    out, _ = torch.ops.autosp_ring.ring_attention(
        qh, kh, vh, call.causal, call.scale, call.window, False, g.ring, mask, balance, spans
    )
    back = C.all_to_all(padded.pad_each(out, 2, members).contiguous(), 2, 1, g.ulysses)
    back = padded.cut_own(back, 2, members, rank_u).narrow(1, 0, site.heads)
    return SPValue(from_bhsd(site, back), Shard(SeqAxis(sdim, length), ctx.even_ranges(length)), node.meta["val"])


__all__ = [
    "Groups",
    "hybrid_attention_rule",
    "hybrid_flex_rule",
    "make_groups",
    "qkv_to_heads",
    "ulysses_degree",
    "uneven_pieces",
]
