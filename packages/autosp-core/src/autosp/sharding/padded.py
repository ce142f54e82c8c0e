"""Uneven pieces through collectives that move equal blocks: padded to the longest, cut where they arrive.

A sequence split over n ranks in contiguous pieces of ``pieces[j]`` positions (rank order; lengths
that n does not divide leave pieces one token apart) crosses an all-to-all, which moves equal
blocks, padded: each piece travels padded to m = max(pieces) at its end, and the padding is cut off
where it arrives. To heads, a rank receives n blocks of m rows, piece j's real rows first in block j,
and keeps those (``keep_real``); back, it sends the whole sequence as n blocks, each piece padded
(``pad_each``), and keeps the first ``pieces[index]`` rows of the block it receives (``cut_own``). The
padding is zeros no real row reads, and pad and cut are local ops, so autograd routes gradients
exactly: a padded row's gradient is dropped by the pad's backward. The cost is the padding's bytes.

``pieces=None`` means equal pieces: every function returns its input. Pieces may be symbolic sizes
(a length marked dynamic); taking the longest then guards on their order. Where pieces are given, the
ops are the same whatever the sizes (a pad of zero rows is still a concatenation), so every rank's
graph has the same structure for the passes that place ops by it (overlap, the partitioner).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from autosp.sharding.placement import IntLike


def pad_to(t: torch.Tensor, dim: int, to: IntLike) -> torch.Tensor:
    """``t`` with zero rows appended along ``dim`` up to ``to`` (a concatenation even of none)."""
    shape: list[IntLike] = list(t.shape)
    shape[dim] = to - t.shape[dim]
    return torch.cat([t, t.new_zeros(shape)], dim)


def pad_own(local: torch.Tensor, dim: int, pieces: Sequence[IntLike] | None) -> torch.Tensor:
    """This rank's piece padded to the longest, ready to send."""
    return local if pieces is None else pad_to(local, dim, max(pieces))


def keep_real(received: torch.Tensor, dim: int, pieces: Sequence[IntLike] | None) -> torch.Tensor:
    """The whole sequence out of the received blocks of padded pieces, in rank order."""
    if pieces is None:
        return received
    m = max(pieces)
    return torch.cat([received.narrow(dim, j * m, n) for j, n in enumerate(pieces)], dim)


def pad_each(whole: torch.Tensor, dim: int, pieces: Sequence[IntLike] | None) -> torch.Tensor:
    """The whole sequence as blocks, each rank's piece padded to the longest, ready to send back."""
    if pieces is None:
        return whole
    m, blocks = max(pieces), []
    at: IntLike = 0
    for n in pieces:
        blocks.append(pad_to(whole.narrow(dim, at, n), dim, m))
        at += n
    return torch.cat(blocks, dim)


def cut_own(received: torch.Tensor, dim: int, pieces: Sequence[IntLike] | None, index: int) -> torch.Tensor:
    """Piece ``index`` out of the padded block it received."""
    return received if pieces is None else received.narrow(dim, 0, pieces[index])


__all__ = ["cut_own", "keep_real", "pad_each", "pad_own", "pad_to"]
