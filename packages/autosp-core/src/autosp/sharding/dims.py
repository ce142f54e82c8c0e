"""How the sequence axis moves through shape changes."""

from __future__ import annotations

import math
from collections.abc import Sequence

from autosp.sharding.placement import IntLike, SeqAxis


def map_view(axis: SeqAxis, in_shape: Sequence[IntLike], out_shape: Sequence[IntLike]) -> SeqAxis | None:
    """The sequence axis after a row-major reshape, or None if the reshape splits it.

    The sequence occupies the flat index range ``stride * [0, length)`` of the input;
    it survives the reshape when that range falls whole, and aligned, into one output dim.
    """
    stride = axis.inner * math.prod(in_shape[axis.dim + 1 :])
    span = stride * axis.length
    trailing = 1
    for dim in reversed(range(len(out_shape))):
        size = out_shape[dim]
        if trailing <= stride < trailing * size:
            if stride % trailing or (trailing * size) % span:
                return None
            return SeqAxis(dim, axis.length, stride // trailing)
        trailing *= size
    return None


def broadcast_dim(out_ndim: int, in_ndim: int, in_dim: int) -> int:
    """Output dim that a broadcast operand's dim lines up with."""
    return in_dim + out_ndim - in_ndim


def normalize_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def guess_seq_dim(shape: Sequence[IntLike], seq_len: IntLike) -> int | None:
    """The dim of an input that holds the sequence: the one of size ``seq_len``, after the batch."""
    hits = [d for d, s in enumerate(shape) if s == seq_len]
    if not hits:
        return None
    return 1 if 1 in hits and len(shape) > 1 else hits[0]


__all__ = ["broadcast_dim", "guess_seq_dim", "map_view", "normalize_dim"]
