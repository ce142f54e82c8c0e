"""The per-rank work model of the ring layouts (no processes)."""

from autosp_ring import imbalance, num_steps, ring_work


def test_causal_contiguous_layout_is_imbalanced():
    work = ring_work(64, 4, causal=True)
    assert [w.blocks for w in work] == [1, 2, 3, 4]
    assert [w.skipped for w in work] == [3, 2, 1, 0]
    assert sum(w.pairs for w in work) == 64 * 65 // 2
    assert 1.7 < imbalance(work) < 1.8  # the last rank does ~7/4 of the mean


def test_full_attention_is_balanced():
    work = ring_work(64, 4, causal=False)
    assert all(w.pairs == 16 * 64 for w in work) and imbalance(work) == 1.0


def test_window_needs_fewer_steps():
    assert num_steps(4, 8, 0) == 4
    assert num_steps(4, 8, 5) == 2 and num_steps(4, 8, 9) == 2 and num_steps(4, 8, 10) == 3
    work = ring_work(32, 4, causal=True, window=5)
    assert sum(w.pairs for w in work) == sum(min(i + 1, 5) for i in range(32))


def test_zigzag_balances_causal_work_within_ten_percent():
    for world in (2, 4, 8):
        work = ring_work(64 * world, world, causal=True, zigzag=True)
        assert sum(w.pairs for w in work) == 64 * world * (64 * world + 1) // 2
        assert imbalance(work) <= 1.10, (world, [w.pairs for w in work])
    assert imbalance(ring_work(256, 4, causal=True)) > 1.7  # contiguous, for contrast
