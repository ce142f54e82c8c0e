"""Sequence layouts and placement builders for rule tests: even, uneven, zigzag, a rank with nothing."""

from __future__ import annotations

from collections.abc import Callable

import torch

from autosp.sharding.placement import (
    HeadShard,
    Layout,
    Partial,
    Placement,
    Replicate,
    SeqAxis,
    Shard,
    even_ranges,
    zigzag_ranges,
)

LayoutFn = Callable[[int, int], Layout]
# A placement, or how to build one from the whole input tensor and the world size; None is Replicate().
PlacementSpec = Placement | Callable[[torch.Tensor, int], Placement] | None


def sliced_layout(layout: Layout, start: int, end: int) -> Layout:
    """The layout of ``x[start:end]`` along the sequence when ``x`` has ``layout`` (as ``slice`` keeps it)."""
    return tuple(
        tuple((min(max(lo, start), end) - start, min(max(hi, start), end) - start) for lo, hi in pieces)
        for pieces in layout
    )


def uneven_layout(length: int, world: int) -> Layout:
    """Contiguous pieces of different sizes: an even split of ``length + 1`` with the last token dropped."""
    return sliced_layout(even_ranges(length + 1, world), 0, length)


def first_rank_empty_layout(length: int, world: int) -> Layout:
    """Rank 0 holds nothing and the others split the sequence (``x[:, k:]`` with k past rank 0's piece)."""
    if world == 1:
        return even_ranges(length, 1)
    return (((0, 0),), *even_ranges(length, world - 1))


def zigzag_sliced_layout(length: int, world: int) -> Layout:
    """A zigzag layout with its first tokens sliced off: uneven pieces, two per rank, out of rank order."""
    chunk = -(-(length + 1) // (2 * world))
    full = 2 * world * chunk
    return sliced_layout(zigzag_ranges(full, world), full - length, full)


def zigzag_layout(length: int, world: int) -> Layout:
    """``zigzag_ranges``, refusing a length it would not cover."""
    if length % (2 * world):
        raise ValueError(f"a zigzag layout needs a length divisible by 2 * world = {2 * world}, got {length}")
    return zigzag_ranges(length, world)


LAYOUTS: dict[str, LayoutFn] = {
    "even": even_ranges,
    "uneven": uneven_layout,
    "zigzag": zigzag_layout,
    "zigzag_sliced": zigzag_sliced_layout,
    "first_empty": first_rank_empty_layout,
}


def layout_fn(layout: str | LayoutFn) -> LayoutFn:
    if isinstance(layout, str):
        if layout not in LAYOUTS:
            raise ValueError(f"unknown layout {layout!r}; one of {sorted(LAYOUTS)} or a function (length, world)")
        return LAYOUTS[layout]
    return layout


def shard(dim: int, layout: str | LayoutFn = "even", *, length: int | None = None, inner: int = 1) -> PlacementSpec:
    """A ``Shard`` of the input's ``dim``, built for each world size.

    ``length`` is the sequence length when ``dim`` folds more than the sequence
    (``[B * S, D]``: ``length=S``); by default ``dim`` holds ``length * inner`` elements.
    ``layout`` names one of ``LAYOUTS`` or maps ``(length, world)`` to per-rank intervals.
    """
    make = layout_fn(layout)

    def build(x: torch.Tensor, world: int) -> Placement:
        n = length if length is not None else x.shape[dim] // inner
        return Shard(SeqAxis(dim, n, inner), make(n, world))

    return build


def head_shard(dim: int) -> PlacementSpec:
    """A ``HeadShard`` of ``dim`` in balanced blocks."""

    def build(x: torch.Tensor, world: int) -> Placement:
        n = x.shape[dim]
        return HeadShard(dim, tuple((r * n // world, (r + 1) * n // world) for r in range(world)))

    return build


def resolve(spec: PlacementSpec, x: torch.Tensor, world: int) -> Placement:
    if spec is None:
        return Replicate()
    if isinstance(spec, (Replicate, Shard, HeadShard, Partial)):
        return spec
    return spec(x, world)


__all__ = [
    "LAYOUTS",
    "LayoutFn",
    "PlacementSpec",
    "first_rank_empty_layout",
    "head_shard",
    "layout_fn",
    "resolve",
    "shard",
    "sliced_layout",
    "uneven_layout",
    "zigzag_layout",
    "zigzag_sliced_layout",
]
