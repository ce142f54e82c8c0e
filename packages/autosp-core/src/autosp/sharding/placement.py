"""Placements of values in the sequence-parallel program.

DTensor's vocabulary, specialised to one mesh axis (the SP group) and to the
sequence axis:

* ``Replicate`` -- every rank holds the whole value.  It may carry the
  position of the sequence axis (``axis``), which tells the propagation where
  it could be split for free.
* ``Shard`` -- every rank holds a contiguous interval of the sequence axis.
  The intervals are explicit per rank, so slicing (``logits[:, :-1]``) keeps
  values sharded with uneven intervals instead of gathering them.
* ``HeadShard`` -- every rank holds a slice of a non-sequence dimension
  (attention heads); it only exists between the all-to-alls of an attention site.
* ``Partial`` -- every rank holds a summand; the true value is the sum.

The sequence axis may be folded into a larger dimension (``view(B * S, D)``):
``SeqAxis`` records that dimension as ``outer x length x inner`` factors.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

IntLike = int | torch.SymInt


@dataclass(frozen=True)
class SeqAxis:
    """Where the sequence lives in a tensor.

    Attributes:
        dim: the tensor dimension that contains the sequence factor.
        length: global number of sequence positions along this axis.
        inner: product of the factors of ``dim`` that vary faster than the sequence.
    """

    dim: int
    length: IntLike
    inner: IntLike = 1

    def at(self, dim: int) -> SeqAxis:
        return replace(self, dim=dim)

    def outer(self, dim_size: IntLike) -> IntLike:
        return dim_size // (self.length * self.inner)


Interval = tuple[IntLike, IntLike]
Ranges = tuple[Interval, ...]  # one interval per rank (heads of a HeadShard)
Layout = tuple[tuple[Interval, ...], ...]  # per rank, the intervals of the sequence it holds, in order


def even_ranges(length: IntLike, world: int) -> Layout:
    """Balanced contiguous intervals; equal when ``world`` divides ``length``."""
    return tuple(((r * length // world, (r + 1) * length // world),) for r in range(world))


def piece_lengths(layout: Layout) -> list[IntLike]:
    """How many positions each rank holds."""
    return [sum(hi - lo for lo, hi in pieces) for pieces in layout]


def chunk_ranges(length: int, world: int) -> Layout:
    """``torch.chunk``'s pieces, the layout of a DTensor ``Shard``: ceil(length / world) tokens a rank
    while they last (the last ranks shorter or empty). ``even_ranges`` where ``world`` divides ``length``."""
    size = -(-length // world)
    return tuple(((min(r * size, length), min((r + 1) * size, length)),) for r in range(world))


def zigzag_ranges(length: IntLike, world: int) -> Layout:
    """Rank r holds chunks r and 2P-1-r of 2P: under a causal mask every rank does the same work."""
    chunk = length // (2 * world)
    return tuple(
        ((r * chunk, (r + 1) * chunk), ((2 * world - 1 - r) * chunk, (2 * world - r) * chunk)) for r in range(world)
    )


def is_even(ranges: Layout, length: IntLike) -> bool:
    return ranges == even_ranges(length, len(ranges))


def in_rank_order(ranges: Layout) -> bool:
    """Whether concatenating the ranks' pieces in rank order gives the sequence in order."""
    at = 0
    for pieces in ranges:
        for lo, hi in pieces:
            if lo != at:
                return False
            at = hi
    return True


@dataclass(frozen=True)
class Replicate:
    axis: SeqAxis | None = None

    def __str__(self) -> str:
        return "R" if self.axis is None else f"R(seq@{self.axis.dim})"


@dataclass(frozen=True)
class Shard:
    axis: SeqAxis
    ranges: Layout

    def local_length(self, rank: int) -> IntLike:
        return piece_lengths(self.ranges)[rank]

    def same_layout(self, other: Shard) -> bool:
        return (
            self.axis.length == other.axis.length
            and self.axis.inner == other.axis.inner
            and self.ranges == other.ranges
        )

    def __str__(self) -> str:
        return f"S(seq@{self.axis.dim})"


@dataclass(frozen=True)
class HeadShard:
    dim: int
    ranges: Ranges

    def __str__(self) -> str:
        return f"H@{self.dim}"


@dataclass(frozen=True)
class Partial:
    def __str__(self) -> str:
        return "P(sum)"


Placement = Replicate | Shard | HeadShard | Partial

__all__ = [
    "HeadShard",
    "IntLike",
    "Interval",
    "Layout",
    "Partial",
    "Placement",
    "Ranges",
    "Replicate",
    "SeqAxis",
    "Shard",
    "chunk_ranges",
    "even_ranges",
    "in_rank_order",
    "is_even",
    "piece_lengths",
    "zigzag_ranges",
]
