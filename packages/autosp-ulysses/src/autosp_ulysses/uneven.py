"""A sequence the ranks do not split evenly, through Ulysses' equal-piece all-to-alls.

A length S that P does not divide leaves the ranks the balanced pieces ``even_ranges(S, P)``
(sizes s_r, which differ by at most one token). The all-to-all exchanges equal blocks, so each
piece travels padded to m = ceil(S / P) tokens at its end, and the padding is cut off where it
arrives: the exchange to heads receives P blocks of m rows, rank j's real rows first in block j,
and keeps those; the exchange back sends each rank its piece padded to m and keeps the first s_r
rows of what comes back. The padding is zeros that no real row reads (attention runs on the S real
rows only), and pad and cut are local ops, so autograd routes gradients through them exactly: a
padded row's gradient is dropped by the pad's backward. The cost is the padding's bytes, at most
P - 1 rows over the whole exchange.

With S divisible by P every function here returns its input, so those programs are unchanged.
"""

from __future__ import annotations

import torch

from autosp.sharding.context import SPContext
from autosp.sharding.placement import IntLike, piece_lengths


def sizes(ctx: SPContext, length: IntLike) -> list[int] | None:
    """Each rank's piece of a ``length`` split by ``even_ranges``; None when they are all alike."""
    if not isinstance(length, int) or length % ctx.world == 0:
        return None
    return [int(n) for n in piece_lengths(ctx.even_ranges(length))]


def _pad(t: torch.Tensor, dim: int, to: int) -> torch.Tensor:
    # Also where nothing is missing (zero rows): every rank's graph then has the same ops here, and
    # the passes that place ops by the graph's structure (the overlap pass, the partitioner) see the
    # same structure on every rank.
    shape = list(t.shape)
    shape[dim] = to - t.shape[dim]
    return torch.cat([t, t.new_zeros(shape)], dim)


def pad_own(ctx: SPContext, local: torch.Tensor, dim: int, length: IntLike) -> torch.Tensor:
    """This rank's piece padded to the longest piece, ready to send."""
    pieces = sizes(ctx, length)
    return local if pieces is None else _pad(local, dim, max(pieces))


def keep_real(ctx: SPContext, received: torch.Tensor, dim: int, length: IntLike) -> torch.Tensor:
    """The whole sequence out of P received blocks of padded pieces, rank order."""
    pieces = sizes(ctx, length)
    if pieces is None:
        return received
    m = max(pieces)
    return torch.cat([received.narrow(dim, j * m, n) for j, n in enumerate(pieces)], dim)


def pad_each(ctx: SPContext, whole: torch.Tensor, dim: int, length: IntLike) -> torch.Tensor:
    """The whole sequence as P blocks, each rank's piece padded to the longest, ready to send back."""
    pieces = sizes(ctx, length)
    if pieces is None:
        return whole
    m, at, blocks = max(pieces), 0, []
    for n in pieces:
        blocks.append(_pad(whole.narrow(dim, at, n), dim, m))
        at += n
    return torch.cat(blocks, dim)


def cut_own(ctx: SPContext, received: torch.Tensor, dim: int, length: IntLike) -> torch.Tensor:
    """This rank's piece out of the padded block it received."""
    pieces = sizes(ctx, length)
    return received if pieces is None else received.narrow(dim, 0, pieces[ctx.rank])


__all__ = ["cut_own", "keep_real", "pad_each", "pad_own", "sizes"]
