"""Ops whose result depends on an element's position, not only its value: triangles, running sums.

An elementwise rule would apply ``tril`` or ``cumsum`` to each rank's block as if it
started at position 0.  Here every element is treated by its *global* position, which
the placement's intervals give, so the result is exact with any layout (even, uneven,
zigzag).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from autosp.sharding import collectives as C
from autosp.sharding.context import SPContext, SPValue
from autosp.sharding.dims import normalize_dim
from autosp.sharding.placement import Replicate, Shard
from autosp.sharding.rules.base import call, fallback, linked_zeros, replicated, rule

aten = torch.ops.aten


def positions(ctx: SPContext, p: Shard, device: torch.device) -> torch.Tensor:
    """Global sequence positions of this rank's elements along ``p.axis.dim``, in local order."""
    pieces = [torch.arange(lo, hi, device=device) for lo, hi in p.ranges[ctx.rank]]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


@rule(aten.tril.default, aten.triu.default)
def triangle_rule(ctx, node, args, kwargs):
    v = args[0]
    diagonal = args[1] if len(args) > 1 else kwargs.get("diagonal", 0)
    p = v.placement
    rows, cols = v.ndim - 2, v.ndim - 1
    if not isinstance(p, Shard):
        axis = p.axis if hasattr(p, "axis") else None
        return replicated(ctx, node, args, kwargs, axis)
    if p.axis.dim not in (rows, cols):
        return SPValue(call(node, args, kwargs), p, node.meta["val"])
    if p.axis.inner != 1 or p.axis.outer(v.gval.shape[p.axis.dim]) != 1:
        return fallback(ctx, node, args, kwargs)
    x = v.local
    mine = positions(ctx, p, x.device)
    row = mine if p.axis.dim == rows else torch.arange(x.shape[rows], device=x.device)
    col = mine if p.axis.dim == cols else torch.arange(x.shape[cols], device=x.device)
    offset = col[None, :] - row[:, None]
    keep = offset <= diagonal if node.target == aten.tril.default else offset >= diagonal
    out = torch.where(keep, x, torch.zeros((), dtype=x.dtype, device=x.device))
    return SPValue(out, p, node.meta["val"])


@rule(aten.cumsum.default)
def cumsum_rule(ctx, node, args, kwargs):
    unsplit = _unsplit_scan(ctx, node, args, kwargs)
    if unsplit is not None:
        return unsplit
    v, dim = args[0], normalize_dim(args[1], args[0].ndim)
    p = v.placement
    dtype = kwargs.get("dtype") or (args[2] if len(args) > 2 else None)
    x = v.local if dtype is None else v.local.to(dtype)
    out = _scan(
        ctx,
        x,
        p,
        scan=lambda piece: piece.cumsum(dim),
        total=lambda t: t.sum(dim, keepdim=True),
        after=lambda offset, piece: piece.cumsum(dim) + offset,
    )
    return SPValue(out, p, node.meta["val"])


@rule(aten.logcumsumexp.default)
def logcumsumexp_rule(ctx, node, args, kwargs):
    """Log-space running sums (the gates of linear attention).

    ``-inf`` (a gate of 0) is where a split could differ from one device: torch's backward gives NaN
    at the positions whose result is ``-inf`` (a leading run of them) and 0 at other ``-inf`` inputs.
    So a piece is scanned *from* the ``logsumexp`` of everything before it (prepended, then dropped),
    its result ``-inf`` exactly where the whole scan's is; and a piece that is ``-inf`` throughout
    totals ``-inf`` with a zero gradient (``logsumexp``'s own would be NaN).
    """
    unsplit = _unsplit_scan(ctx, node, args, kwargs)
    if unsplit is not None:
        return unsplit
    v, dim = args[0], normalize_dim(args[1], args[0].ndim)
    p = v.placement

    def total(t: torch.Tensor) -> torch.Tensor:
        empty = (t == -math.inf).all(dim, keepdim=True)
        lse = torch.where(empty, 0.0, t).logsumexp(dim, keepdim=True)
        return torch.where(empty, -math.inf, lse)

    def after(offset: torch.Tensor, piece: torch.Tensor) -> torch.Tensor:
        return torch.logcumsumexp(torch.cat([offset, piece], dim), dim).narrow(dim, 1, piece.shape[dim])

    out = _scan(ctx, v.local, p, scan=lambda piece: piece.logcumsumexp(dim), total=total, after=after)
    return SPValue(out, p, node.meta["val"])


def _unsplit_scan(ctx: SPContext, node: torch.fx.Node, args: tuple, kwargs: dict) -> SPValue | None:
    """A scan's result where it does not run across the ranks' pieces (whole, along another dim, or
    pieces it cannot combine: symbolic bounds, a folded axis, counts that differ per rank); else None."""
    v, dim = args[0], normalize_dim(args[1], args[0].ndim)
    p = v.placement
    if isinstance(p, Replicate):
        return replicated(ctx, node, args, kwargs, p.axis)
    if p.axis.dim != dim:
        return SPValue(call(node, args, kwargs), p, node.meta["val"])
    counts = {len(pieces) for pieces in p.ranges}
    static = all(isinstance(n, int) for pieces in p.ranges for span in pieces for n in span)
    if not static or p.axis.inner != 1 or p.axis.outer(v.gval.shape[dim]) != 1 or len(counts) != 1:
        return fallback(ctx, node, args, kwargs)
    return None


Scan = Callable[[torch.Tensor], torch.Tensor]


def _scan(
    ctx: SPContext, x: torch.Tensor, p: Shard, *, scan: Scan, total: Scan, after: Callable[..., torch.Tensor]
) -> torch.Tensor:
    """An associative running scan of ``x`` along its sharded dim, by global position.

    ``scan(piece)`` for a piece with nothing before it, ``after(offset, piece)`` for one whose
    predecessors (on any rank) ``total`` to ``offset`` (``total`` of their totals). One all-gather
    of per-piece totals, whose backward (reduce-scatter) keeps gradients exact. Empty pieces count
    for nothing.
    """
    dim = p.axis.dim
    mine = p.ranges[ctx.rank]
    pieces = list(x.split([hi - lo for lo, hi in mine], dim))
    totals = torch.cat([total(piece) for piece in pieces], dim)
    ctx.note("all_gather")
    every = C.all_gather(totals.contiguous(), dim, [len(mine)] * ctx.world, ctx.group_name, False)
    spans = [span for pieces_r in p.ranges for span in pieces_r]
    out, linked = [], False
    for piece, (lo, _) in zip(pieces, mine):
        before = [i for i, (start, end) in enumerate(spans) if start < lo and end > start]
        if before:
            offset = total(every.index_select(dim, torch.tensor(before, device=x.device)))
            out.append(after(offset, piece))
            linked = True
        else:
            out.append(scan(piece))
    result = torch.cat(out, dim)
    if not linked:
        # Without it this rank would skip the all-gather's backward and its peers would wait for it.
        result = result + linked_zeros(every.sum())
    return result


__all__ = ["cumsum_rule", "logcumsumexp_rule", "positions", "triangle_rule"]
