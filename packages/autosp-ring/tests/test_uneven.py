"""The ring op's bookkeeping for a length the ranks do not split evenly (values: test_ring's op cases)."""

from __future__ import annotations

import torch

from autosp_ring import RING
from autosp_ring.op import _pack, _unpack, segments


def test_uneven_segments_follow_the_pieces() -> None:
    sizes = [3, 3, 4]
    assert [segments(r, 3, 3, False, sizes) for r in range(3)] == [[(0, 3, 0)], [(3, 3, 0)], [(6, 4, 0)]]
    assert RING.uneven  # core refuses such a length for a variant without it (autosp.variants.refuses_length)


def test_kv_buffers_are_sized_for_the_longest_piece() -> None:
    # Every hop moves one buffer size, so a short piece travels padded and unpacks by its own length.
    k, v = torch.randn(2, 3, 4, 5), torch.randn(2, 3, 4, 6)
    buf = _pack(k, v, 5)
    assert buf.numel() == 2 * 3 * 5 * (5 + 6)
    kj, vj = _unpack(buf, (k, v), 4)
    assert torch.equal(kj, k) and torch.equal(vj, v)
    assert _pack(k, v, 4).numel() == k.numel() + v.numel()


def test_hybrid_groups_carry_their_members_pieces_and_the_ring_its_spans() -> None:
    from autosp_ring import hybrid

    # 13 over 4 ranks, ulysses_degree 2: pieces 3, 3, 3, 4; spans 6 and 7 around the ring.
    assert hybrid.uneven_pieces(13, 4, 2, 0) == ([3, 3], [6, 7])
    assert hybrid.uneven_pieces(13, 4, 2, 1) == ([3, 4], [6, 7])
    # 18: equal spans of unequal pieces; lists still, so every rank runs the same ops.
    assert hybrid.uneven_pieces(18, 4, 2, 1) == ([4, 5], [9, 9])
    assert hybrid.uneven_pieces(16, 4, 2, 0) is None
    assert hybrid.uneven_pieces(17, 6, 3, 0) == ([2, 3, 3], [8, 9])
