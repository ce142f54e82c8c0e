"""Ring and hybrid against the single-device eager reference: loss and every gradient, on 2 and 4 ranks.

Two launches (2 ranks, 4 ranks) run every case; the tests read their shared results.
"""

from __future__ import annotations

import _ring_cases as rc
import pytest
import torch
from harness import run_spmd

SEQ = 32
# The last: float64, whose blocks compute and merge in float64 (once fp32: half the digits, silently).
# Lengths the ranks do not split evenly (31, 30, 33): contiguous pieces one token apart.
OPS_2 = [
    (2, 4, 2, SEQ, 8, True, 0),
    (2, 3, 3, SEQ, 8, False, 0),
    (2, 4, 2, SEQ, 8, True, 0, torch.float64),
    (2, 4, 2, 31, 8, True, 0),
    (1, 3, 3, 31, 8, False, 0),
]
OPS_4 = [
    (1, 6, 1, SEQ, 8, True, 0),
    (1, 4, 2, SEQ, 8, True, 5),
    (1, 4, 2, SEQ, 8, True, 12),
    (1, 3, 3, SEQ, 8, False, 0),
    (1, 4, 2, 30, 8, True, 5),  # pieces 7, 8, 7, 8: a window shorter than the shortest, fewer steps
    (1, 4, 2, 33, 8, True, 10),  # 8, 8, 8, 9: a window over two pieces
    (1, 3, 3, 33, 8, False, 0),
]
HYB = {"ulysses_degree": 2}
JOBS_2 = [
    ("llama", "ring", None),
    ("gpt2", "ring", None),
    ("encoder-h6", "ring", None),
    ("llama-h3", "ring", None),
    ("window-op", "ring", None),
    ("llama-mask", "ring", None),
    ("llama-h3", "hybrid", HYB),
    ("alibi-h3", "hybrid", HYB),
    # A plugin op over 3 heads that declares AttentionSpec.pads_heads: padded as SDPA's (once refused).
    ("window-op-h3", "hybrid", HYB),
    ("window-op-h3", "ulysses", None),
]
JOBS_4 = [
    ("llama", "ring", None),
    ("llama-h3", "ring", None),
    ("encoder-h6", "ring", None),
    ("llama", "hybrid", HYB),
    ("llama-mqa", "hybrid", HYB),
    ("window-op", "hybrid", HYB),
    ("llama-h3", "hybrid", HYB),  # 3 heads padded to 4 in each ulysses group of 2, ring of 2
]
# Left to other suites, for time (four processes on two cores): a non-causal encoder under hybrid,
# and a model-built mask under hybrid (integration_tests: test_fuzz's hybrid P=4 draws from every mask
# kind, test_packed_documents runs hybrid at P=4).


@pytest.fixture(scope="module")
def batch():
    return rc.batch(SEQ)


@pytest.fixture(scope="module")
def refs(batch):
    names = {n for n, _, _ in JOBS_2 + JOBS_4}
    return {n: rc.reference(n, batch) for n in names}


@pytest.fixture(scope="module")
def two(batch):
    return run_spmd(rc.run, 2, JOBS_2, batch, ["llama"], OPS_2)


@pytest.fixture(scope="module")
def four(batch):
    return run_spmd(rc.run, 4, JOBS_4, batch, ["llama"], OPS_4)


def _extended(covered_by: str) -> pytest.MarkDecorator:
    return pytest.mark.extended(covered_by=covered_by)


def _per_world(name: str) -> pytest.MarkDecorator:
    """``world`` 2 and 4 for a test that reads both launches; the 4-rank launch runs in test-all only."""
    return pytest.mark.parametrize("world", [2, pytest.param(4, marks=_extended(name))])


@pytest.fixture
def launch(request, world):
    return request.getfixturevalue("two" if world == 2 else "four")


def _assert_matches(result: dict, ref: dict, what: str) -> None:
    assert "error" not in result, f"{what}: {result.get('error')}"
    torch.testing.assert_close(result["loss"], ref["loss"], rtol=1e-5, atol=1e-6, msg=f"{what}: loss")
    assert result["grads"].keys() == ref["grads"].keys(), what
    for name, g in ref["grads"].items():
        torch.testing.assert_close(result["grads"][name], g, rtol=1e-4, atol=1e-6, msg=f"{what}: grad of {name}")


def _check_jobs(per_rank: list[dict], jobs: list[tuple], refs: dict) -> None:
    for rank, results in enumerate(per_rank):
        for name, variant, _ in jobs:
            r = results[f"{name}/{variant}"]
            _assert_matches(r, refs[name], f"{name}/{variant} rank {rank}")
            assert not r["fallbacks"], (name, variant, r["fallbacks"])
            if variant == "ulysses":
                continue
            assert r["collectives"]["ring_attention"] == r["sites"], r["collectives"]
            # SAC keeps the ring op's output: no ring trip is recomputed in the backward.
            assert r["sac"].get("attention forwards in backward", 0) == 0, r["sac"]


@_per_world("test_op_matches_sdpa")
def test_op_matches_sdpa(launch, world):
    # Causal / not, GQA and MQA, 3 heads, windows shorter and longer than a chunk (fewer ring steps).
    for rank, results in enumerate(launch):
        for cfg, errs in zip(OPS_2 if world == 2 else OPS_4, results["ops"], strict=True):
            assert max(errs) < (1e-12 if torch.float64 in cfg else 1e-5), (rank, cfg, errs)


@_per_world("test_op_takes_model_masks")
def test_op_takes_model_masks(launch, world):
    # Boolean padding, a learned additive bias (and its gradient), block-diagonal documents; zigzag or
    # not; and with query rows balanced by the mask (skewed documents, a learned bias on them).
    for rank, results in enumerate(launch):
        for (kind, zigzag, balance), errs in results["mask_ops"].items():
            assert max(errs) < 1e-5, (kind, zigzag, balance, rank, errs)
        for kind, errs in results["mask_ops_uneven"].items():
            assert max(errs) < 1e-5, (kind, "15 tokens", rank, errs)
        for (kind, zigzag, balance), moved in results["mask_balanced"].items():
            # Skewed documents move rows, forward and backward, in either layout; nothing moves
            # without balancing (padding with it may or may not: exact either way, above).
            if kind.startswith("skewed"):
                assert moved == (1, 1), (kind, zigzag, rank, moved)
            elif not balance:
                assert moved == (0, 0), (kind, zigzag, rank, moved)


def test_ring_two_ranks(two, refs):
    _check_jobs(two, JOBS_2, refs)


@_extended("test_ring_two_ranks")
def test_ring_and_hybrid_four_ranks(four, refs):
    _check_jobs(four, JOBS_4, refs)


@_per_world("test_heads_not_divisible_by_sp_size")
def test_heads_not_divisible_by_sp_size(launch, world):
    # 3 heads on 2 and 4 ranks, 6 heads on 4: ring never splits heads (checked against the reference above).
    assert "error" not in launch[0]["llama-h3/ring"]
    assert world == 2 or "error" not in launch[0]["encoder-h6/ring"]


@_extended("integration_tests/test_packed_documents.py::test_four_ranks")  # hybrid at P=4 in CI
def test_hybrid_exchanges_heads_and_rings_across(four):
    r = four[0]["llama/hybrid"]
    # Per layer: q, k and v in one all-to-all over the ulysses group (k/v carry the 2 kv heads), the
    # output back in another.
    assert r["collectives"]["all_to_all"] == 2 * r["sites"], r["collectives"]
    assert any("ulysses_degree=2 x ring_degree=2" in n for n in r["notes"]), r["notes"]
    # One kv head for two ranks cannot split: q crosses alone, k and v are gathered.
    r = four[0]["llama-mqa/hybrid"]
    assert r["collectives"]["all_to_all"] == 2 * r["sites"], r["collectives"]
    assert r["collectives"]["all_gather"] == 2 * r["sites"], r["collectives"]


@_extended("integration_tests/test_packed_documents.py::test_four_ranks")  # hybrid at P=4 in CI
def test_hybrid_subgroups_keep_the_sp_groups_timeout(four):
    timeouts = four[0]["group_timeouts"]
    assert timeouts["hybrid"] and all(t == timeouts["world"] for t in timeouts["hybrid"]), timeouts


def test_gqa_sends_kv_heads_only(two):
    # The model repeats kv heads; the k/v the ring carries are the un-repeated ones.
    assert any("exchange k/v before repeat" in n for n in two[0]["llama/ring"]["notes"])


def test_a_plugin_op_that_declares_it_pads_its_heads(two):
    # autosp-window's op declares AttentionSpec.pads_heads: its 3 heads padded to 4 under hybrid and
    # Ulysses (exact: test_ring_two_ranks); a plugin op that does not declare it is refused (autosp-core's
    # test_errors, autosp-ulysses' test_variant).
    for rank in range(2):
        for variant, over in (("hybrid", "ulysses_degree=2"), ("ulysses", "2 ranks")):
            notes = two[rank][f"window-op-h3/{variant}"]["notes"]
            assert any(f"3 heads padded to 4 to split over {over}" in n for n in notes), notes


def test_hybrid_pads_heads_its_ulysses_degree_does_not_split(two, refs):
    # 3 heads over ulysses_degree=2 (once refused): padded to 4, k/v's 3 heads too; exact (test_ring_two_ranks).
    # With a per-head bias (ALiBi's), its padding heads mask nothing.
    for rank in range(2):
        for name in ("llama-h3", "alibi-h3"):
            r = two[rank][f"{name}/hybrid"]
            assert "error" not in r, r.get("error")
            padded = [n for n in r["notes"] if "3 heads padded to 4 to split over ulysses_degree=2" in n]
            assert len(padded) == r["sites"], (name, r["notes"])


@_per_world("test_causal_work_is_balanced_by_the_zigzag_layout")
def test_causal_work_is_balanced_by_the_zigzag_layout(launch, world):
    # Rank r holds chunks r and 2P-1-r: every rank computes the same number of causal blocks.
    counts = [
        (r["llama/ring"]["blocks"][("forward", "computed")], r["llama/ring"]["blocks"][("backward", "computed")])
        for r in launch
    ]
    assert len(set(counts)) == 1, counts
    layers = launch[0]["llama/ring"]["sites"]
    assert counts[0][0] == layers * (2 * world + 1)  # (2P+1) of the 4P^2/2 half-chunk pairs


@_per_world("test_saved_bytes_shrink_with_ranks")
def test_saved_bytes_shrink_with_ranks(launch, world, batch):
    model = rc.compile_model("llama", "ring", 1, None, sac=False)
    rc.step(model, "llama", batch)
    single = rc.saved_bytes(model, "llama", batch)
    for results in launch:
        ratio = results["saved:llama"] / single
        assert ratio < 1.1 / world, (world, ratio, results["saved:llama"], single)
