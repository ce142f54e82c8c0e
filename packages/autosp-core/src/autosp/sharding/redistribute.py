"""Changes of placement: a free local slice, or a collective."""

from __future__ import annotations

from typing import Any

import torch

from autosp.sharding import collectives as C
from autosp.sharding.context import SPContext, SPValue
from autosp.sharding.placement import HeadShard, IntLike, Layout, Partial, Replicate, SeqAxis, Shard, in_rank_order


def _split_axis(x: torch.Tensor, dim: int, outer: IntLike, length: IntLike, inner: IntLike) -> tuple[torch.Tensor, int]:
    """View ``dim`` as (outer, length, inner) when needed; return the view and the sequence dim."""
    if inner == 1 and outer == 1:
        return x, dim
    shape = [*x.shape[:dim], outer, length, inner, *x.shape[dim + 1 :]]
    return x.reshape(shape), dim + 1


def _merge_axis(x: torch.Tensor, dim: int, folded: bool) -> torch.Tensor:
    if not folded:
        return x
    shape = [*x.shape[: dim - 1], -1, *x.shape[dim + 2 :]]
    return x.reshape(shape)


def slice_to(ctx: SPContext, full: torch.Tensor, dim: int, axis: SeqAxis, ranges: Layout) -> torch.Tensor:
    """This rank's intervals of a replicated tensor whose ``dim`` carries ``axis``."""
    view, sdim = _split_axis(full, dim, axis.outer(full.shape[dim]), axis.length, axis.inner)
    pieces = [view.narrow(sdim, lo, hi - lo) for lo, hi in ranges[ctx.rank]]
    part = pieces[0] if len(pieces) == 1 else torch.cat(pieces, sdim)
    if sdim != dim:
        return _merge_axis(part, sdim, True)
    return part


def gather(ctx: SPContext, v: SPValue, *, for_output: bool = False) -> torch.Tensor:
    """The whole value on every rank."""
    p = v.placement
    if isinstance(p, Replicate):
        return v.local
    if isinstance(p, Partial):
        ctx.note("all_reduce")
        return C.all_reduce(v.local, ctx.group_name, for_output)
    if isinstance(p, HeadShard):
        ctx.note("all_gather")
        sizes = [hi - lo for lo, hi in p.ranges]
        return C.all_gather(v.local.contiguous(), p.dim, sizes, ctx.group_name, for_output)
    assert isinstance(p, Shard)
    ctx.note("all_gather")
    outer = p.axis.outer(v.gval.shape[p.axis.dim])
    view, sdim = _split_axis(v.local, p.axis.dim, outer, p.local_length(ctx.rank), p.axis.inner)
    folded = sdim != p.axis.dim
    sizes = [p.local_length(r) for r in range(len(p.ranges))]
    full = C.all_gather(view.contiguous(), sdim, sizes, ctx.group_name, for_output)
    if not in_rank_order(p.ranges):
        full = _reorder(full, sdim, p.ranges)
    merged = _merge_axis(full, sdim, folded)
    # A program output must not alias what the program never returned: the merge of a folded axis is
    # a view of the gathered buffer, which AOT autograd hands back as a view made under no_grad, and an
    # in-place write on it in eager code after a graph break failed (HF DBRX's experts: index_add_).
    return merged.clone() if for_output and folded else merged


def _reorder(gathered: torch.Tensor, dim: int, ranges: Layout) -> torch.Tensor:
    """Pieces gathered in rank order, put back in sequence order."""
    spans = [span for pieces in ranges for span in pieces]
    parts = gathered.split([hi - lo for lo, hi in spans], dim)
    return torch.cat([part for _, part in sorted(zip(spans, parts), key=lambda sp: sp[0][0])], dim)


def to_replicate(ctx: SPContext, v: SPValue, why: str = "") -> SPValue:
    if isinstance(v.placement, Replicate):
        return v
    if why and not isinstance(v.placement, Partial):
        ctx.fallbacks.append(why)
    return SPValue(gather(ctx, v), Replicate(), v.gval)


def whole_local(ctx: SPContext, x: Any) -> Any:
    """``x`` whole on this rank as a plain tensor (gathered if distributed); a non-value as it is."""
    return to_replicate(ctx, x).local if isinstance(x, SPValue) else x


def to_shard(ctx: SPContext, v: SPValue, dim: int, target: Shard) -> torch.Tensor:
    """``v`` laid out like ``target`` along its own dimension ``dim``."""
    p = v.placement
    if isinstance(p, Shard) and p.axis.dim == dim and p.same_layout(target):
        return v.local
    full = gather(ctx, v) if not isinstance(p, Replicate) else v.local
    return slice_to(ctx, full, dim, target.axis, target.ranges)


__all__ = ["gather", "slice_to", "to_replicate", "to_shard", "whole_local"]
