"""The document-aware plan of ring attention (autosp_ring.balance), without processes.

The all-to-alls are played out in one process: every rank's plan is built, the rows each sends
are handed to the receivers, and what each receiver places must be the global rows of its plan.
"""

from __future__ import annotations

import random

import pytest
import torch

from autosp_ring import balance as B
from autosp_ring.op import segments
from autosp_ring.work import document_mask as doc_mask
from autosp_ring.work import random_documents as random_docs


def layout(seq: int, world: int, zigzag: bool) -> list[list[tuple[int, int, int]]]:
    return [segments(r, seq // world, world, zigzag) for r in range(world)]


def spread(work: list[int]) -> float:
    return max(work) / (sum(work) / len(work))


def test_tile_grid_is_any_pair_in_the_tile():
    gen = torch.Generator().manual_seed(0)
    mask = torch.rand(2, 3, 24, 24, generator=gen) < 0.05
    for causal, window in ((False, 0), (True, 0), (True, 5)):
        grid = B.tile_grid(mask, causal, window, 4)
        pos = torch.arange(24)
        keep = mask.clone()
        if causal:
            keep &= pos[None, :] <= pos[:, None]
        if window:
            keep &= pos[:, None] - pos[None, :] < window
        brute = keep.view(2, 3, 6, 4, 6, 4).any(dim=(0, 1, 3, 5))
        assert torch.equal(grid, brute), (causal, window)
    # An additive mask drops only -inf.
    bias = torch.zeros(1, 1, 8, 8).masked_fill(~doc_mask([3, 5]), float("-inf"))
    bias[0, 0, 7, 0] = torch.finfo(torch.float32).min  # finite: still a pair the kernel computes
    grid = B.tile_grid(bias, False, 0, 2)
    assert grid[3, 0] and not grid[2, 0] and not grid[0, 2]  # [3, 0]: only the finfo.min pair


def test_chunk_size_cuts_pieces_into_equal_chunks_of_at_least_the_smallest():
    pieces = [p for ps in layout(256, 2, True) for p in ps]  # pieces of 64
    assert B.chunk_size(pieces, 1) == 8  # at most MAX_SPLIT chunks per piece
    assert B.chunk_size(pieces, 10) == 16 and B.chunk_size(pieces, 64) == 64
    assert B.chunk_size(pieces, 65) == 0 and B.chunk_size(pieces, 0) == 0
    assert B.chunk_size([(0, 6, 0), (6, 4, 0)], 1) == 0  # uneven pieces: no plan


def test_deal_gives_every_rank_its_count_and_is_deterministic():
    rng = random.Random(1)
    for world in (2, 3, 4, 8):
        work = [rng.randrange(0, 50) for _ in range(world * 6)]
        dealt = B.deal(work, world)
        assert sorted(i for o in dealt for i in o) == list(range(len(work)))
        assert all(len(o) == 6 for o in dealt)
        assert dealt == B.deal(list(work), world)
        loads = [sum(work[i] for i in o) for o in dealt]
        assert max(loads) - min(loads) <= max(work), (world, loads)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_any_document_lengths_balance_within_ten_percent(world):
    # Zigzag's work spreads up to 2x the mean on such rows; the plan keeps every rank within 10%
    # (at most 2% seen here) of the mean, counting the tile area the kernels compute.
    rng = random.Random(world)
    seq, worst_zigzag = 1024, 1.0
    for mean in (16, 64, 256, 512):
        for _ in range(5):
            mask = doc_mask(random_docs(seq, mean, rng))
            lay = layout(seq, world, True)
            chunk = B.chunk_size([p for ps in lay for p in ps], 1)
            grid = B.tile_grid(mask, True, 0, chunk)
            keys = [p for ps in lay for p in ps]
            worst_zigzag = max(worst_zigzag, spread([B.piece_work(grid, chunk, ps, keys) for ps in lay]))
            work = (grid.sum(dim=1) * chunk * chunk).tolist()
            loads = [sum(work[i] for i in owned) for owned in B.deal(work, world)]
            assert spread(loads) <= 1.10, (world, mean, loads)
    assert worst_zigzag > 1.2, worst_zigzag  # the rows were worth balancing


def _play_out(plans: list[B.Plan], local: list[torch.Tensor]) -> list[torch.Tensor]:
    """What ``Plan.to_plan`` gives on every rank, the all-to-all played out in this process."""
    world = len(plans)
    sent = [list(x.index_select(0, p.send_rows).split(p.send_counts)) for p, x in zip(plans, local, strict=True)]
    out = []
    for r, p in enumerate(plans):
        arrived = torch.cat([sent[src][r] for src in range(world)])
        assert arrived.shape[0] == sum(p.recv_counts)
        placed = torch.empty_like(arrived)
        placed[p.recv_order] = arrived
        out.append(placed)
    return out


@pytest.mark.parametrize(("world", "zigzag"), [(2, True), (3, True), (4, True), (4, False)])
def test_rows_arrive_where_the_plan_puts_them(world, zigzag):
    seq = 48 * world
    lay = layout(seq, world, zigzag)
    mask = doc_mask([seq * 3 // 4, seq - seq * 3 // 4])
    plans = [B.plan(mask, True, 0, lay, r, 1) for r in range(world)]
    assert all(p is not None and p.moves for p in plans)
    plans_: list[B.Plan] = [p for p in plans if p is not None]
    rows = torch.arange(seq)  # row t of the sequence holds t
    local = [torch.cat([rows[g : g + n] for g, n, _ in pieces]) for pieces in lay]
    for r, (p, got) in enumerate(zip(plans_, _play_out(plans_, local), strict=True)):
        want = torch.cat([rows[g : g + n] for g, n, _ in sorted(p.q_pieces, key=lambda q: q[2])])
        assert torch.equal(got, want), r
        assert [q[2] for q in p.q_pieces] == list(range(0, len(got), p.chunk))
    before, after = plans_[0].work
    assert spread(after) <= 1.10 < spread(before)


def test_finer_tiles_alone_when_moving_rows_buys_nothing():
    # One causal document as a mask: zigzag already balances it; finer tiles skip more area.
    world, seq = 2, 128
    lay = layout(seq, world, True)
    p = B.plan(doc_mask([seq]), True, 0, lay, 0, 1)
    assert p is not None and not p.moves
    assert p.q_pieces == B.split(lay[0], p.chunk)
    x = torch.randn(1, 1, seq // world, 2)
    assert p.to_plan(None, x)[0] is x  # type: ignore[arg-type]
    before, after = p.work
    assert max(after) < max(before)


def test_no_plan_without_a_gain():
    # Full attention (every tile needed): nothing to balance, nothing to skip.
    lay = layout(64, 2, True)
    assert B.plan(torch.ones(1, 1, 64, 64, dtype=torch.bool), False, 0, lay, 0, 1) is None


def test_key_runs_skip_empty_tiles_and_merge_neighbours():
    world, seq = 2, 64
    lay = layout(seq, world, True)
    p = B.plan(doc_mask([40, 24]), True, 0, lay, 0, 1)
    assert p is not None
    for q in p.q_pieces:
        row = p.grid[q[0] // p.chunk]
        for pieces in lay:
            runs = p.k_runs(q, pieces)
            covered = {g // p.chunk + i for g, n, _ in runs for i in range(n // p.chunk)}
            wanted = {g // p.chunk for g, _, _ in B.split(pieces, p.chunk) if row[g // p.chunk]}
            assert covered == wanted
            local = {pg + i: pl + i for pg, pn, pl in pieces for i in range(pn)}
            for g, n, s in runs:  # each run is contiguous in the sender's local rows too
                assert all(local[g + i] == s + i for i in range(n)), (g, n, s, pieces)


def test_a_grid_is_planned_once():
    # Every layer passes the model's one mask (a copy per site): the deal runs once per distinct grid.
    lay = layout(64, 2, True)
    first = B.plan(doc_mask([48, 16]), True, 0, lay, 0, 1)
    assert first is not None
    assert B.plan(doc_mask([48, 16]).clone(), True, 0, lay, 0, 1) is first
    assert B.plan(doc_mask([40, 24]), True, 0, lay, 0, 1) is not first
    assert B.plan(doc_mask([48, 16]), True, 0, lay, 1, 1) is not first  # another rank's rows


def test_balance_chunk_option():
    from autosp.errors import ConfigError
    from autosp_ring.attention import BALANCE_CHUNK, balance_chunk

    assert balance_chunk({}) == BALANCE_CHUNK == 512
    assert balance_chunk({"balance_chunk": 0}) == 0 and balance_chunk({"balance_chunk": 64}) == 64
    for bad in (-1, True, 1.5, "512"):
        with pytest.raises(ConfigError, match="balance_chunk"):
            balance_chunk({"balance_chunk": bad})
