"""Ops that move positions along the sequence without mixing them: ``flip`` and ``roll``.

Each rank keeps the values it holds; only the positions they stand at change, so the output is a
``Shard`` whose pieces are the input's, mapped (a reversed piece is the mirrored piece; a rolled
one is shifted, split in two where it wraps past the end). A rank's pieces must be listed in
increasing order and its local tensor must hold them in that order: a rolled rank's local tensor
is cut at the pieces' edges and put back together sorted by output position. No collective.
"""

from __future__ import annotations

import torch

from autosp.sharding.context import SPValue
from autosp.sharding.dims import normalize_dim
from autosp.sharding.placement import Layout, Partial, Shard
from autosp.sharding.rules.base import call, fallback, rule

aten = torch.ops.aten

# (output interval, offset of its values in the rank's local tensor)
Segment = tuple[tuple[int, int], int]


def _sorted(segments: list[Segment]) -> list[Segment]:
    return sorted((s for s in segments if s[0][1] > s[0][0]), key=lambda s: s[0][0])


def _intervals(segments: list[Segment]) -> tuple:
    """The rank's pieces in increasing order, adjacent ones merged (a rank with none: one empty piece)."""
    merged: list[tuple[int, int]] = []
    for (lo, hi), _ in _sorted(segments):
        if merged and merged[-1][1] == lo:
            merged[-1] = (merged[-1][0], hi)
        else:
            merged.append((lo, hi))
    return tuple(merged) or ((0, 0),)


def _moved(ctx, node, local: torch.Tensor, p: Shard, segments_of) -> SPValue:
    """The rank's values with each rank's pieces mapped by ``segments_of(pieces) -> [Segment]``."""
    ranges: Layout = tuple(_intervals(segments_of(pieces)) for pieces in p.ranges)
    dim = p.axis.dim
    parts = [local.narrow(dim, at, hi - lo) for (lo, hi), at in _sorted(segments_of(p.ranges[ctx.rank]))]
    out = torch.cat(parts, dim) if len(parts) > 1 else parts[0] if parts else local.narrow(dim, 0, 0)
    return SPValue(out, Shard(p.axis, ranges), node.meta["val"])


def _offsets(pieces) -> list[int]:
    out, at = [], 0
    for lo, hi in pieces:
        out.append(at)
        at += hi - lo
    return out


@rule(aten.flip.default, accepts=(Partial,))
def flip_rule(ctx, node, args, kwargs):
    """``x.flip(dims)``: along the sequence, piece ``[lo, hi)`` reversed is piece ``[L - hi, L - lo)``.

    The local flip reverses each piece and their order, so the rank's mirrored pieces come out in
    increasing order. A sequence folded with other factors (``[B * S]``) reverses them too, as the
    global flip does. Other dims flip locally, and a flipped summand is a summand of the flipped value."""
    v = args[0]
    dims = {normalize_dim(d, v.ndim) for d in args[1]}
    p = v.placement
    if not isinstance(p, Shard) or p.axis.dim not in dims:
        return _local(node, args, kwargs, p)
    length = p.axis.length
    ranges = tuple(tuple((length - hi, length - lo) for lo, hi in reversed(pieces)) for pieces in p.ranges)
    return SPValue(call(node, args, kwargs), Shard(p.axis, ranges), node.meta["val"])


@rule(aten.roll.default, accepts=(Partial,))
def roll_rule(ctx, node, args, kwargs):
    """``x.roll(shifts, dims)``: along the sequence, position ``q`` moves to ``(q + k) mod L``.

    A piece that wraps past the end becomes two pieces, ``[lo + k, L)`` and ``[0, hi + k - L)``,
    whose parts the rank puts back in increasing order. Rolling a folded dim (``[B * S]``) or the
    flattened tensor (no ``dims``) moves positions across the other factors: gathered."""
    v = args[0]
    shifts = list(args[1]) if isinstance(args[1], (list, tuple)) else [args[1]]
    dims = list(args[2]) if len(args) > 2 else list(kwargs.get("dims", []))
    p = v.placement
    if not dims:
        return fallback(ctx, node, args, kwargs) if isinstance(p, Shard) else _local(node, args, kwargs, p)
    dims = [normalize_dim(d, v.ndim) for d in dims]
    if not isinstance(p, Shard) or p.axis.dim not in dims:
        return _local(node, args, kwargs, p)
    folded = p.axis.outer(v.gval.shape[p.axis.dim]) != 1 or p.axis.inner != 1
    if folded or not all(isinstance(n, int) for n in (p.axis.length, *shifts)):
        return fallback(ctx, node, args, kwargs)  # a symbolic length: the pieces' order is not known here
    others = [(s, d) for s, d in zip(shifts, dims) if d != p.axis.dim]
    local = v.local.roll([s for s, _ in others], [d for _, d in others]) if others else v.local
    length = p.axis.length
    k = sum(s for s, d in zip(shifts, dims) if d == p.axis.dim) % length

    def segments_of(pieces) -> list[Segment]:
        out: list[Segment] = []
        for (lo, hi), at in zip(pieces, _offsets(pieces)):
            a, b = lo + k, hi + k
            if b <= length:
                out.append(((a, b), at))
            elif a >= length:
                out.append(((a - length, b - length), at))
            else:
                out += [((a, length), at), ((0, b - length), at + length - a)]
        return out

    return _moved(ctx, node, local, p, segments_of)


def _local(node, args, kwargs, placement) -> SPValue:
    """Whole values, summands and pieces moved along other dims than the sequence: the op as it is."""
    return SPValue(call(node, args, kwargs), placement, node.meta["val"])


__all__ = ["flip_rule", "roll_rule"]
