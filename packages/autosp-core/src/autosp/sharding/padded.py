"""Uneven pieces through collectives that move equal blocks: padded to the longest, cut where they arrive.

A sequence split over n ranks in contiguous pieces of ``pieces[j]`` positions (rank order; lengths
that n does not divide leave pieces one token apart) crosses an all-to-all, which moves equal
blocks, padded: each piece travels padded to m = max(pieces) at its end, and the padding is cut off
where it arrives. To heads, a rank receives n blocks of m rows, piece j's real rows first in block j,
and keeps those (``keep_real``); back, it sends the whole sequence as n blocks, each piece padded
(``pad_each``), and keeps the first ``pieces[index]`` rows of the block it receives (``cut_own``). The
padding is zeros no real row reads, and pad and cut are local ops, so autograd routes gradients
exactly: a padded row's gradient is dropped by the pad's backward. The cost is the padding's bytes.

Heads work the same way (``pad_heads``): a head count that the ranks of an all-to-all do not divide
travels padded with zero heads, k/v repeated to the query heads first, and the padding is cut from
the output where the variant gets it back.

``pieces=None`` means equal pieces: every function returns its input. Pieces may be symbolic sizes
(a length marked dynamic); taking the longest then guards on their order. Where pieces are given, the
ops are the same whatever the sizes (a pad of zero rows is still a concatenation), so every rank's
graph has the same structure for the passes that place ops by it (overlap, the partitioner).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from autosp.sharding.placement import IntLike


def pad_to(t: torch.Tensor, dim: int, to: IntLike, fill: bool | float = 0) -> torch.Tensor:
    """``t`` with rows of ``fill`` (zeros) appended along ``dim`` up to ``to`` (a concatenation even of none)."""
    shape: list[IntLike] = list(t.shape)
    shape[dim] = to - t.shape[dim]
    return torch.cat([t, t.new_full(shape, fill) if fill else t.new_zeros(shape)], dim)


def heads_multiple(heads: int, ranks: int) -> int:
    """``heads`` rounded up to a multiple of ``ranks``: the count ``pad_heads`` sends."""
    return -(-heads // ranks) * ranks


def pad_heads(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, count: int, dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v with ``count`` heads along ``dim``: k/v repeated to q's heads (GQA), then zero heads.

    k and v are repeated first: after padding, one rank's query heads would read kv heads that no
    whole number of kv heads per rank holds. A zero head attends uniformly to zero values; nothing
    reads its output, and its gradient is dropped with the padding.
    """
    heads = q.shape[dim]
    k, v = (x if x.shape[dim] == heads else x.repeat_interleave(heads // x.shape[dim], dim) for x in (k, v))
    return pad_to(q, dim, count), pad_to(k, dim, count), pad_to(v, dim, count)


def heads_note(site: str, heads: int, count: int, over: str, detail: str = "") -> str:
    """The report's note for an attention site whose ``heads`` travel as ``count`` to split ``over``."""
    return (
        f"attention {site}: {heads} heads padded to {count} to split over {over} "
        f"({100 * (count - heads) / heads:.0f}% more attention compute{detail})"
    )


def pad_mask_heads(mask: torch.Tensor, dim: int, count: int) -> torch.Tensor:
    """A per-head mask with padding heads that mask nothing (``True``, or ``0`` added): kernels
    disagree on a fully masked row (CPU's gives zeros, the math path NaN)."""
    return pad_to(mask, dim, count, mask.dtype == torch.bool)


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


__all__ = [
    "cut_own",
    "heads_multiple",
    "heads_note",
    "keep_real",
    "pad_each",
    "pad_heads",
    "pad_mask_heads",
    "pad_own",
    "pad_to",
]
