"""Ops whose result depends on an element's position, not only its value: triangles, running sums.

An elementwise rule would apply ``tril`` or ``cumsum`` to each rank's block as if it
started at position 0.  Here every element is treated by its *global* position, which
the placement's intervals give, so the result is exact with any layout (even, uneven,
zigzag).
"""

from __future__ import annotations

import torch

from autosp.sharding import collectives as C
from autosp.sharding.context import SPContext, SPValue
from autosp.sharding.dims import normalize_dim
from autosp.sharding.placement import Replicate, Shard
from autosp.sharding.rules.base import call, fallback, replicated, rule

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
    # Each piece's running sum, plus the total of every position before it on any rank:
    # one all-gather of per-piece totals, whose backward (reduce-scatter) keeps gradients exact.
    dtype = kwargs.get("dtype") or (args[2] if len(args) > 2 else None)
    x = v.local if dtype is None else v.local.to(dtype)
    mine = p.ranges[ctx.rank]
    pieces = list(x.split([hi - lo for lo, hi in mine], dim))
    totals = torch.cat([piece.sum(dim, keepdim=True) for piece in pieces], dim)
    ctx.note("all_gather")
    every = C.all_gather(totals.contiguous(), dim, [len(mine)] * ctx.world, ctx.group_name, False)
    starts = [lo for pieces_r in p.ranges for lo, _ in pieces_r]
    out = []
    for piece, (lo, _) in zip(pieces, mine):
        before = torch.tensor([s < lo for s in starts], dtype=x.dtype, device=x.device)
        shape = [1] * x.dim()
        shape[dim] = len(starts)
        offset = (every * before.view(shape)).sum(dim, keepdim=True)
        out.append(piece.cumsum(dim) + offset)
    return SPValue(torch.cat(out, dim), p, node.meta["val"])


__all__ = ["cumsum_rule", "positions", "triangle_rule"]
