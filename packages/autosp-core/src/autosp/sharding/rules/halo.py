"""Ops whose output position reads nearby input positions: padding and 1-D convolution along the sequence.

RWKV's token shift (``F.pad(x, (0, 0, 1, -1))``), Mamba's and Hyena's causal short convolutions
(``F.pad`` then ``conv1d``, or ``conv1d(padding=K-1)`` then a crop) and Conformer's depthwise
convolution each read a few positions past the edges of a rank's pieces. Each rank keeps its own
output positions; the input positions they read that other ranks hold (the halo) cross in one
all-gather of exactly those positions (``_fetch``), every rank's plan being computed from the static
layout, so all ranks call the same collective. Positions outside the input are the op's fill value.

Gradients follow by construction: each window is slices of this rank's piece, of the gathered
halo and of a fill value, concatenated, whose backward puts each position's gradient back where it
came from; the all-gather's backward (a reduce-scatter) returns the halo's gradients to their owners.

The output keeps the input's pieces, cut to the output's length, the piece that ends the input also
taking the positions past its end (``out_layout``), unless that leaves a rank reading no input
position (``held_layout``: the output is then cut evenly, or runs whole). Strided or transposed
convolutions, and a sequence folded with other dims, run whole as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from autosp.sharding import collectives as C
from autosp.sharding.context import SPContext, SPValue
from autosp.sharding.placement import IntLike, Layout, Replicate, SeqAxis, Shard, even_ranges
from autosp.sharding.redistribute import to_replicate
from autosp.sharding.rules.base import call, fallback, replicated, rule, seq_dim, wrap

aten = torch.ops.aten


def out_layout(ranges: Layout, length_in: IntLike, length_out: IntLike) -> Layout:
    """Each piece cut to ``[0, length_out)``; the first piece that ends the input takes the positions past it."""
    extended = False
    layout = []
    for pieces in ranges:
        mine = []
        for lo, hi in pieces:
            lo, new_hi = min(lo, length_out), min(hi, length_out)
            if hi == length_in and length_out > length_in and not extended:
                new_hi, extended = length_out, True
            mine.append((lo, new_hi))
        layout.append(tuple(mine))
    return tuple(layout)


Reads = Callable[[Layout], Layout]  # an output layout -> the input interval each of its pieces reads


def held_layout(ranges: Layout, length_in: IntLike, length_out: IntLike, reads: Reads) -> tuple[Layout, Layout] | None:
    """``(layout, reads(layout))``: ``out_layout``, or ``[0, length_out)`` cut evenly where that leaves
    a rank reading no input position (all its output in the padding, or none); None when neither
    gives every rank one (the op then runs whole).

    A rank reading no input position would use the halo's all-gather (and a convolution's weight)
    only through an empty slice, which a compiler may drop: that rank would then skip the collective,
    or its backward, that the others wait in. Reading one, it reads them for real
    (``_route_one_own_position``). Any layout is exact: the reads are planned from it.
    """
    for layout in (out_layout(ranges, length_in, length_out), even_ranges(int(length_out), len(ranges))):
        wanted = reads(layout)
        if all(any(min(hi, length_in) > max(lo, 0) for lo, hi in pieces) for pieces in wanted):
            return layout, wanted
    return None


Segment = tuple[int, int, int, int]  # (rank holding it or -1 for the fill value, global lo, global hi, row of lo there)


StaticLayout = tuple[tuple[tuple[int, int], ...], ...]


def _static(ranges: Layout) -> StaticLayout | None:
    """The layout with plain ints, or None where a bound is symbolic (a dynamic length)."""
    if not all(isinstance(n, int) for pieces in ranges for span in pieces for n in span):
        return None
    return tuple(tuple((int(lo), int(hi)) for lo, hi in pieces) for pieces in ranges)


Held = list[tuple[int, int, int, int]]  # (global lo, global hi, rank, row of lo there), by position


def _held(ranges: StaticLayout) -> Held:
    """Every rank's pieces in position order, with where each starts in its rank's local tensor."""
    held = []
    for rank, pieces in enumerate(ranges):
        row = 0
        for a, b in pieces:
            held.append((a, b, rank, row))
            row += b - a
    return sorted(held)


def _segments(held: Held, length: int, lo: int, hi: int) -> list[Segment]:
    """``[lo, hi)`` cut where the pieces of the layout start and end; outside ``[0, length)`` it is fill."""
    out: list[Segment] = []
    if lo < min(hi, 0):
        out.append((-1, lo, min(hi, 0), 0))
    for a, b, rank, row in held:
        s, e = max(lo, a), min(hi, b)
        if s < e:
            out.append((rank, s, e, row + s - a))
    if max(lo, length) < hi:
        out.append((-1, max(lo, length), hi, 0))
    return out


def _route_one_own_position(plan: list[list[Segment]], rank: int) -> tuple[list[list[Segment]], Segment | None]:
    """``plan`` with the first position this rank reads from its own piece split off (returned too),
    to be read back through the all-gather: every rank then uses its result for real, so no compiler
    drops the collective (or its backward) on a rank that needs no halo, leaving the others waiting in it."""
    for i, segs in enumerate(plan):
        for j, (owner, s, e, row) in enumerate(segs):
            if owner == rank:
                routed = (owner, s, s + 1, row)
                split = [routed, *([(owner, s + 1, e, row + 1)] if e > s + 1 else [])]
                return [*plan[:i], [*segs[:j], *split, *segs[j + 1 :]], *plan[i + 1 :]], routed
    return plan, None


def _fetch(ctx: SPContext, v: SPValue, wanted: Layout, fill: Any) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """Per piece of this rank, the input positions ``wanted[rank][i]`` (a global interval) along the sequence dim.

    Positions outside ``[0, length)`` are ``fill``. Those another rank holds cross in one all-gather,
    with one position of each rank's own (``_route_one_own_position``); none when no rank needs
    another's positions. The all-gather's result is returned too, for ``_tied``.
    """
    p = v.placement
    assert isinstance(p, Shard)
    dim, length, local = p.axis.dim, int(p.axis.length), v.local
    ranges = _static(p.ranges)
    assert ranges is not None  # _plain_shard checked
    held = _held(ranges)
    plans = [[_segments(held, length, int(lo), int(hi)) for lo, hi in intervals] for intervals in wanted]
    if not any(seg[0] not in (-1, r) for r, plan in enumerate(plans) for segs in plan for seg in segs):
        return [_assemble(ctx, local, dim, segs, fill, None, {}) for segs in plans[ctx.rank]], None
    split = [_route_one_own_position(plan, r) for r, plan in enumerate(plans)]
    plans = [plan for plan, _ in split]
    # Segments read through the all-gather, in one order on every rank: rank-major, then position.
    routed = {seg for _, seg in split if seg is not None}
    others = {seg for r, plan in enumerate(plans) for segs in plan for seg in segs if seg[0] not in (-1, r)}
    halo = sorted(others | routed)
    sizes = [sum(e - s for owner, s, e, _ in halo if owner == r) for r in range(ctx.world)]
    mine = [local.narrow(dim, row, e - s) for owner, s, e, row in halo if owner == ctx.rank]
    send = torch.cat(mine, dim) if len(mine) > 1 else mine[0] if mine else local.narrow(dim, 0, 0)
    ctx.note("all_gather")
    buffer = C.all_gather(send.contiguous(), dim, sizes, ctx.group_name, False)
    at: dict[Segment, int] = {}
    offset = 0
    for seg in halo:  # rank-major, as the all-gather lays them out
        at[seg] = offset
        offset += seg[2] - seg[1]
    return [_assemble(ctx, local, dim, segs, fill, buffer, at) for segs in plans[ctx.rank]], buffer


def _tied(out: torch.Tensor, buffer: torch.Tensor | None, dim: int) -> torch.Tensor:
    """``out`` made to read ``buffer`` through an empty slice (no value changes). Every rank reads the
    buffer for real (``held_layout``); this keeps the dependency where the op's value does not need
    it. (A compiler may drop such a read; the ranks' collectives are compared after compiling, and a
    mismatch is refused, never run.)"""
    if buffer is None:
        return out
    shape = list(out.shape)
    shape[dim] = 0
    return torch.cat([out, buffer.reshape(-1)[:0].reshape(shape).to(out.dtype)], dim)


def _assemble(
    ctx: SPContext,
    local: torch.Tensor,
    dim: int,
    segs: list[Segment],
    fill: Any,
    buffer: torch.Tensor | None,
    at: dict[Segment, int],
) -> torch.Tensor:
    parts = []
    for seg in segs:
        owner, s, e, row = seg
        if seg in at:
            assert buffer is not None
            parts.append(buffer.narrow(dim, at[seg], e - s))
        elif owner == ctx.rank:
            parts.append(local.narrow(dim, row, e - s))
        else:
            shape = list(local.shape)
            shape[dim] = e - s
            parts.append(local.new_full(shape, fill))
    if not parts:
        return local.narrow(dim, 0, 0)
    return torch.cat(parts, dim) if len(parts) > 1 else parts[0]


def _plain_shard(v: Any, dim: int | None = None) -> bool:
    """A sequence sharded on one whole dim (not folded with others), where the static plan applies."""
    p = getattr(v, "placement", None)
    if not isinstance(p, Shard) or (dim is not None and p.axis.dim != dim):
        return False
    return (
        p.axis.inner == 1
        and isinstance(p.axis.length, int)
        and v.gval.shape[p.axis.dim] == p.axis.length
        and _static(p.ranges) is not None
    )


@rule(aten.constant_pad_nd.default)
def constant_pad_rule(ctx, node, args, kwargs):
    v, pad = args[0], list(args[1])
    value = args[2] if len(args) > 2 else kwargs.get("value", 0)
    p = v.placement
    seq = seq_dim(p)
    if seq is None:
        return replicated(ctx, node, args, kwargs)
    at = 2 * (v.ndim - 1 - seq)  # F.pad's pairs run from the last dim backwards
    before, after = (pad[at], pad[at + 1]) if at + 1 < len(pad) else (0, 0)
    if before == 0 and after == 0:  # other dims only: token-wise
        return wrap(call(node, args, kwargs), node.meta["val"], lambda _i, _g: p)
    if isinstance(p, Replicate):
        return replicated(ctx, node, args, kwargs)
    if not _plain_shard(v):
        return fallback(ctx, node, args, kwargs)
    length = p.axis.length
    held = held_layout(
        p.ranges,
        length,
        length + before + after,
        lambda layout: tuple(tuple((lo - before, hi - before) for lo, hi in pieces) for pieces in layout),
    )
    if held is None:
        return fallback(ctx, node, args, kwargs)
    layout, wanted = held
    windows, buffer = _fetch(ctx, v, wanted, value)
    local = torch.cat(windows, seq) if len(windows) > 1 else windows[0]
    if any(pad[i] for i in range(len(pad)) if i not in (at, at + 1)):
        rest = list(pad)
        rest[at] = rest[at + 1] = 0
        local = aten.constant_pad_nd(local, rest, value)
    return SPValue(_tied(local, buffer, seq), Shard(SeqAxis(seq, length + before + after), layout), node.meta["val"])


@rule(aten.convolution.default)
def convolution_rule(ctx, node, args, kwargs):
    """``conv1d`` along a sharded sequence: stride 1, any padding, dilation and groups."""
    x, weight, bias, stride, padding, dilation, transposed, _output_padding, groups = args
    if not (x.ndim == 3 and _plain_shard(x, 2) and list(stride) == [1] and not transposed):
        return fallback(ctx, node, args, kwargs)
    weight = to_replicate(ctx, weight, f"{node.name}: convolution weight gathered")
    bias = to_replicate(ctx, bias, f"{node.name}: convolution bias gathered") if bias is not None else None
    p = x.placement
    pad, dil, k = padding[0], dilation[0], weight.gval.shape[-1]
    reach = dil * (k - 1)
    length = p.axis.length
    # An empty output piece reads nothing (its window would be shorter than the kernel).
    held = held_layout(
        p.ranges,
        length,
        length + 2 * pad - reach,
        lambda layout: tuple(
            tuple((lo - pad, hi - pad + reach) if hi > lo else (lo, lo) for lo, hi in pieces) for pieces in layout
        ),
    )
    if held is None:
        return fallback(ctx, node, args, kwargs)
    layout, wanted = held
    windows, buffer = _fetch(ctx, x, wanted, 0)
    outs = []
    for window, (lo, hi) in zip(windows, layout[ctx.rank]):
        if hi == lo:  # nothing to compute; another piece of this rank reads the weights (held_layout)
            outs.append(window.new_zeros((window.shape[0], weight.gval.shape[0], 0)))
            continue
        outs.append(
            aten.convolution(
                window, weight.local, bias.local if bias is not None else None, [1], [0], [dil], False, [0], groups
            )
        )
    local = torch.cat(outs, 2) if len(outs) > 1 else outs[0]
    return SPValue(_tied(local, buffer, 2), Shard(SeqAxis(2, length + 2 * pad - reach), layout), node.meta["val"])


__all__ = ["constant_pad_rule", "convolution_rule", "held_layout", "out_layout"]
