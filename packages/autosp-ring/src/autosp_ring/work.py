"""Per-rank work of the ring layout, to measure causal load balance without running anything."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from autosp_ring.blocks import allowed_pairs
from autosp_ring.op import num_steps, segments


@dataclass(frozen=True)
class RankWork:
    """What one rank computes in one ring attention forward (per batch row and head)."""

    blocks: int  # blocks with at least one allowed (q, k) pair
    skipped: int  # blocks fully masked: their k/v only pass through
    pairs: int  # unmasked score entries


def ring_work(seq: int, world: int, causal: bool, window: int = 0, zigzag: bool = False) -> list[RankWork]:
    """Work per rank, contiguous (rank r holds chunk r) or zigzag (chunks r and 2P-1-r of 2P).

    A block is one (query piece, key piece) pair; the max/mean ratio of pairs is the imbalance.
    """
    chunk = seq // world
    steps = world if zigzag else num_steps(world, chunk, window)
    result = []
    for c in range(world):
        pairs = [
            allowed_pairs(qo, ql, ko, kl, causal, window)
            for s in range(steps)
            for qo, ql, _ in segments(c, chunk, world, zigzag)
            for ko, kl, _ in segments((c - s) % world, chunk, world, zigzag)
        ]
        result.append(RankWork(sum(p > 0 for p in pairs), sum(p == 0 for p in pairs), sum(pairs)))
    return result


def imbalance(work: list[RankWork]) -> float:
    """max / mean of unmasked pairs over ranks: 1.0 is perfectly balanced."""
    total = [w.pairs for w in work]
    return max(total) / (sum(total) / len(total))


def document_mask(lengths: list[int]) -> torch.Tensor:
    """``[1, 1, S, S]`` bool: documents of ``lengths`` packed in a row, each attending within itself
    (bidirectional; pass ``is_causal`` or ``causal=True`` for causal documents)."""
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    return (doc[None, :] == doc[:, None])[None, None]


def random_documents(seq: int, mean: int, rng: random.Random) -> list[int]:
    """Lengths of documents filling ``seq`` tokens, exponentially distributed around ``mean``."""
    lengths: list[int] = []
    while sum(lengths) < seq:
        lengths.append(max(1, int(rng.expovariate(1 / mean))))
    lengths[-1] -= sum(lengths) - seq
    return lengths


__all__ = ["RankWork", "document_mask", "imbalance", "random_documents", "ring_work"]
