"""How the sequence axis moves through reshapes, and the per-rank intervals."""

from __future__ import annotations

import torch

from autosp.sharding.dims import guess_seq_dim, map_view
from autosp.sharding.placement import SeqAxis, chunk_ranges, even_ranges, in_rank_order, is_even, zigzag_ranges


def test_flatten_batch_and_sequence_keeps_the_axis_with_an_outer_factor():
    axis = map_view(SeqAxis(1, 16), (2, 16, 64), (32, 64))
    assert axis == SeqAxis(0, 16, 1)
    assert axis.outer(32) == 2


def test_split_heads_and_unflatten_back():
    assert map_view(SeqAxis(1, 16), (2, 16, 64), (2, 16, 4, 16)) == SeqAxis(1, 16, 1)
    assert map_view(SeqAxis(0, 16), (32, 64), (2, 16, 64)) == SeqAxis(1, 16, 1)


def test_sequence_folded_with_an_inner_factor():
    # [B, S, H, D] -> [B, S * H, D]: the sequence is the outer part of dim 1, heads vary faster.
    assert map_view(SeqAxis(1, 16), (2, 16, 4, 8), (2, 64, 8)) == SeqAxis(1, 16, 4)


def test_reshape_that_splits_the_sequence_is_refused():
    assert map_view(SeqAxis(1, 16), (2, 16, 64), (2, 4, 4, 64)) is None
    assert map_view(SeqAxis(1, 16), (2, 16, 64), (2, 8, 128)) is None


def test_even_ranges_cover_the_sequence_without_gaps():
    assert even_ranges(16, 4) == (((0, 4),), ((4, 8),), ((8, 12),), ((12, 16),))
    uneven = [pieces[0] for pieces in even_ranges(10, 4)]
    assert uneven[0][0] == 0 and uneven[-1][1] == 10
    assert all(a[1] == b[0] for a, b in zip(uneven, uneven[1:]))
    assert is_even(even_ranges(16, 4), 16) and not is_even((((0, 3),), ((3, 16),)), 16)
    assert in_rank_order(even_ranges(16, 4))


def test_chunk_ranges_are_torch_chunks_pieces():
    # A DTensor Shard's layout: torch.chunk's pieces, the last ranks shorter or empty.
    for length, world in [(16, 4), (15, 2), (5, 4), (13, 4), (3, 4), (7, 3)]:
        pieces = [hi - lo for ((lo, hi),) in chunk_ranges(length, world)]
        chunks = [len(c) for c in torch.arange(length).chunk(world)]
        assert pieces == chunks + [0] * (world - len(chunks)), (length, world)
        assert in_rank_order(chunk_ranges(length, world))
    assert chunk_ranges(16, 4) == even_ranges(16, 4)


def test_zigzag_gives_each_rank_a_head_and_a_tail_chunk():
    layout = zigzag_ranges(16, 2)
    assert layout == (((0, 4), (12, 16)), ((4, 8), (8, 12)))
    assert not in_rank_order(layout)
    covered = sorted(span for pieces in layout for span in pieces)
    assert covered == [(0, 4), (4, 8), (8, 12), (12, 16)]


def test_input_sequence_dim_prefers_the_dim_after_batch():
    assert guess_seq_dim((2, 16), 16) == 1
    assert guess_seq_dim((16, 16), 16) == 1
    assert guess_seq_dim((16, 64), 16) == 0
    assert guess_seq_dim((2, 8), 16) is None
