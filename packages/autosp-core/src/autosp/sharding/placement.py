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
from typing import Union

import torch

IntLike = Union[int, torch.SymInt]


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


Ranges = tuple[tuple[IntLike, IntLike], ...]


def even_ranges(length: IntLike, world: int) -> Ranges:
    """Balanced intervals; equal when ``world`` divides ``length``."""
    return tuple((r * length // world, (r + 1) * length // world) for r in range(world))


def is_even(ranges: Ranges, length: IntLike) -> bool:
    return ranges == even_ranges(length, len(ranges))


@dataclass(frozen=True)
class Replicate:
    axis: SeqAxis | None = None

    def __str__(self) -> str:
        return "R" if self.axis is None else f"R(seq@{self.axis.dim})"


@dataclass(frozen=True)
class Shard:
    axis: SeqAxis
    ranges: Ranges

    def local_length(self, rank: int) -> IntLike:
        lo, hi = self.ranges[rank]
        return hi - lo

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


Placement = Union[Replicate, Shard, HeadShard, Partial]

__all__ = [
    "HeadShard",
    "IntLike",
    "Partial",
    "Placement",
    "Ranges",
    "Replicate",
    "SeqAxis",
    "Shard",
    "even_ranges",
    "is_even",
]
