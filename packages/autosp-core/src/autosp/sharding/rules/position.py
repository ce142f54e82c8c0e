"""Ops whose result depends on an element's position, not only its value: triangles of a matrix.

An elementwise rule would apply ``tril`` to each rank's block as if it started at
position 0.  Here every element is kept or zeroed by its *global* row and column,
which the placement's intervals give, so the result is exact with any layout.
"""

from __future__ import annotations

import torch

from autosp.sharding.context import SPContext, SPValue
from autosp.sharding.placement import Shard
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


__all__ = ["positions", "triangle_rule"]
