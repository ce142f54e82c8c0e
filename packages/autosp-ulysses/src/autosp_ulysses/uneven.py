"""A sequence the ranks do not split evenly, through Ulysses' equal-piece all-to-alls.

A length S that P does not divide leaves the ranks the balanced pieces ``even_ranges(S, P)``
(sizes s_r, which differ by at most one token). Each piece crosses the all-to-all padded to
m = ceil(S / P) tokens and is cut where it arrives (``autosp.sharding.padded``): to heads, each rank
keeps the P real pieces of what it receives; back, each rank's piece is padded, and each keeps the
first s_r rows of what comes back. The cost is at most P - 1 padded rows over the whole exchange.

With S divisible by P every function here returns its input, so those programs are unchanged. A
length marked dynamic gets symbolic pieces (``r*S//P`` ... ``(r+1)*S//P``); deciding that P does not
divide it, and which piece is the longest, guards the graph on S's remainder modulo P.
"""

from __future__ import annotations

import torch

from autosp.sharding import padded
from autosp.sharding.context import SPContext
from autosp.sharding.placement import IntLike, piece_lengths


def sizes(ctx: SPContext, length: IntLike) -> list[IntLike] | None:
    """Each rank's piece of a ``length`` split by ``even_ranges`` (symbolic for a symbolic length);
    None when they are all alike."""
    if length % ctx.world == 0:
        return None
    return piece_lengths(ctx.even_ranges(length))


def pad_own(ctx: SPContext, local: torch.Tensor, dim: int, length: IntLike) -> torch.Tensor:
    """This rank's piece padded to the longest piece, ready to send."""
    return padded.pad_own(local, dim, sizes(ctx, length))


def keep_real(ctx: SPContext, received: torch.Tensor, dim: int, length: IntLike) -> torch.Tensor:
    """The whole sequence out of P received blocks of padded pieces, rank order."""
    return padded.keep_real(received, dim, sizes(ctx, length))


def pad_each(ctx: SPContext, whole: torch.Tensor, dim: int, length: IntLike) -> torch.Tensor:
    """The whole sequence as P blocks, each rank's piece padded to the longest, ready to send back."""
    return padded.pad_each(whole, dim, sizes(ctx, length))


def cut_own(ctx: SPContext, received: torch.Tensor, dim: int, length: IntLike) -> torch.Tensor:
    """This rank's piece out of the padded block it received."""
    return padded.cut_own(received, dim, sizes(ctx, length), ctx.rank)


__all__ = ["cut_own", "keep_real", "pad_each", "pad_own", "sizes"]
