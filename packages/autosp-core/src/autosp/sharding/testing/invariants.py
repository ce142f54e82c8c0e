"""What a later rule relies on about a value: its local tensor agrees with its placement."""

from __future__ import annotations

from autosp.sharding.context import SPValue
from autosp.sharding.placement import HeadShard, Replicate, Shard


def placement_problem(v: SPValue, rank: int, world: int) -> str | None:
    """Why ``v``'s local tensor, placement and global value disagree on ``rank``; None if they agree.

    Shard: the global dim holds ``outer x length x inner``, the intervals cover the sequence
    once, the local dim holds this rank's share.  HeadShard: the local dim holds this rank's
    block.  Replicate with a sequence axis: that dim can hold the claimed length.  Always:
    the local dtype is the global one.
    """
    p, shape, gshape = v.placement, list(v.local.shape), list(v.gval.shape)
    if v.local.dtype != v.gval.dtype:
        return f"local dtype {v.local.dtype} but global {v.gval.dtype}"
    want = list(gshape)
    if isinstance(p, Shard):
        axis = p.axis
        span = axis.length * axis.inner
        size = gshape[axis.dim] if axis.dim < len(gshape) else None
        if size is None or (size % span if span else size):
            return f"{p}: global shape {gshape} has no dim {axis.dim} holding length {axis.length} x inner {axis.inner}"
        covered = sorted(piece for pieces in p.ranges for piece in pieces if piece[1] > piece[0])
        if len(p.ranges) != world or [0] + [hi for _, hi in covered] != [lo for lo, _ in covered] + [axis.length]:
            return f"{p}: ranges {p.ranges} do not cover [0, {axis.length}) once over {world} ranks"
        outer = size // span if span else 1
        want[axis.dim] = outer * p.local_length(rank) * axis.inner
    elif isinstance(p, HeadShard):
        lo, hi = p.ranges[rank]
        want[p.dim] = hi - lo
    elif isinstance(p, Replicate) and p.axis is not None:
        span = p.axis.length * p.axis.inner
        if p.axis.dim >= len(gshape) or (gshape[p.axis.dim] % span if span else gshape[p.axis.dim]):
            return f"{p}: claims sequence length {p.axis.length} on dim {p.axis.dim} of a {gshape} value"
    if shape != want:
        return f"{p}: local shape {shape}, expected {want} on rank {rank}"
    return None


__all__ = ["placement_problem"]
