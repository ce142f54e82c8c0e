"""FlexAttention under SP, against single-device eager: values and every parameter's gradient.

Ulysses gives each rank its heads over the whole sequence, the block mask whole (sliced to its
heads when the mask is per head), the mods seeing global head indices; kv heads that do not split
over the ranks (2 over 4) are repeated so they do. Ring gives each rank its query rows (zigzag, or
contiguous when zigzag chunks would cut the mask's blocks) against k and v gathered whole, the block
mask cut to those rows; hybrid does both. A layout that would cut the mask's blocks runs whole.

Gradients are compared under ``aot_eager`` (``flex_workers`` lifts torch's CPU device check: Flex's
reference math has a backward on any device). That math reads ``mask_mod`` only, never the block
lists; Inductor's CPU kernel reads the lists, so a forward under Inductor checks the cut lists end to
end (``test_flex_blocks`` checks them element by element).
"""

from __future__ import annotations

import functools

import pytest
import torch
from flex_workers import run, run_captures
from harness import run_spmd

CASES = [("documents", 4), ("per_head", 2)]


def _check(world: int, variant: str, cases: list, seq: int = 128, **kw) -> list[dict]:
    grads = kw.setdefault("backend", "aot_eager") == "aot_eager"
    per_rank = run_spmd(functools.partial(run, grads=grads, **kw), world, variant, cases, seq)
    for rank, results in enumerate(per_rank):
        for case in cases:
            got = results[case]
            where = f"{case} {variant} P={world} rank {rank}"
            _matches_eager(got, where)
            assert got["collectives"]["shard_start"] >= 1, f"{where}: nothing was sequence-parallel"
    return per_rank


def _matches_eager(got: dict, where: str) -> None:
    """The loss and every parameter's gradient (where the run took them) equal single-device eager's."""
    torch.testing.assert_close(got["loss"], got["reference"], rtol=1e-5, atol=1e-5, msg=where)
    assert got["grads"].keys() == got["expected"].keys()
    for name, grad in got["grads"].items():
        torch.testing.assert_close(grad, got["expected"][name], rtol=1e-4, atol=1e-6, msg=f"{where} {name}")


def _flex_notes(results: dict) -> list[str]:
    return [n for n in results["notes"] if "(FlexAttention)" in n]


def _rewritten_by_ulysses(per_rank: list[dict]) -> None:
    for results in per_rank:
        for case, got in results.items():
            assert got["sites"].count("flex_attention") == 1 and not got["fallbacks"], (case, got["fallbacks"])
            # q/k/v in one exchange and the output in one more, for SDPA and for Flex alike.
            assert got["collectives"]["all_to_all"] == 4 and not got["collectives"]["all_gather"], got["collectives"]


def _cut_to_rows(per_rank: list[dict], gathers: int = 2) -> None:
    for results in per_rank:
        for case, got in results.items():
            assert got["sites"].count("flex_attention") == 1 and not got["fallbacks"], (case, got["fallbacks"])
            assert len(_flex_notes(got)) == 1 and "query rows" in _flex_notes(got)[0], got["notes"]
            # k and v gathered whole, once each (and nothing else: q stays this rank's rows).
            assert got["collectives"]["all_gather"] == gathers, got["collectives"]


def test_ulysses_rewrites_flex_attention():
    _rewritten_by_ulysses(_check(2, "ulysses", CASES))


def test_ring_cuts_flex_attention_to_query_rows():
    # The log-sum-exp feeds the residual stream too: its rows and gradient must come out right.
    cases = [*CASES, ("window", 4)]
    per_rank = _check(2, "ring", cases, lse=True, sac=True)
    _cut_to_rows(per_rank)
    for results in per_rank:
        for got in results.values():
            # SAC saves Flex's results like SDPA's (ring's op): no attention forward runs again.
            (report,) = got["sac"]
            assert report["attention sites kept"] == 2 and report["attention forwards in backward"] == 0, report


def test_hybrid_cuts_flex_attention_to_heads_and_rows():
    per_rank = _check(4, "hybrid", CASES, lse=True, options={"ulysses_degree": 2})
    _cut_to_rows(per_rank)
    for results in per_rank:
        for got in results.values():
            # SDPA's layer: q/k/v and out; Flex's: q/k/v, out and the log-sum-exp.
            assert got["collectives"]["all_to_all"] == 5, got["collectives"]


@pytest.mark.extended(covered_by="test_hybrid_cuts_flex_attention_to_heads_and_rows")
def test_hybrid_runs_flex_attention_whole_at_a_length_the_ranks_split_unevenly():
    # 130 tokens over 4 ranks: SDPA's layer runs sharded (padded exchanges, uneven ring spans), Flex
    # whole on every rank, exact, and the report says why.
    per_rank = _check(4, "hybrid", CASES, seq=130, lse=True, options={"ulysses_degree": 2})
    for results in per_rank:
        for got in results.values():
            assert any("its 130 tokens do not split evenly over 4 ranks" in f for f in got["fallbacks"]), got
            assert got["collectives"]["ring_attention"] == 1, got["collectives"]


# Heads the ranks do not split travel padded, as SDPA's do (once refused): 3 heads over 2 ranks attend
# as 4, 4 over 3 as 6. A padding head takes the last real head's blocks and index in both mods (a slope
# per head, a per-head block mask, a learned bias table indexed by head, out of range without it), and
# its results (output and log-sum-exp) are cut.
def _padded(per_rank: list[dict], heads: int, count: int) -> None:
    for results in per_rank:
        for case, got in results.items():
            # Under Ulysses the log-sum-exp stays head-sharded, its real heads only; its use gathers it.
            assert all("head-sharded input gathered" in f for f in got["fallbacks"]), (case, got["fallbacks"])
            assert any(f"{heads} heads padded to {count}" in n for n in _flex_notes(got)), (case, got["notes"])


def test_ulysses_pads_flex_heads_the_ranks_do_not_split():
    _padded(_check(2, "ulysses", [("per_head", 3), ("documents", 1)], lse=True, heads=3, dim=24), 3, 4)
    for rank, got in enumerate(run_spmd(run_captures, 2, "ulysses", 128, 3, 24)):
        _matches_eager(got, f"captures rank {rank}")
        _padded([{"captures": got}], 3, 4)


@pytest.mark.extended(covered_by="test_ulysses_pads_flex_heads_the_ranks_do_not_split")
def test_flex_heads_padded_on_three_and_four_ranks():
    # Ulysses: 4 heads over 3 ranks, the third rank's heads all padding. Hybrid: 3 heads over ulysses
    # groups of 2, k and v of 3 (or 1) heads repeated to the query heads first.
    _padded(_check(3, "ulysses", CASES, seq=96, lse=True), 4, 6)
    hybrid = {"ulysses_degree": 2}
    _padded(_check(4, "hybrid", [("per_head", 3), ("documents", 1)], lse=True, heads=3, dim=24, options=hybrid), 3, 4)
    for rank, got in enumerate(run_spmd(run_captures, 4, "hybrid", 128, 3, 24, hybrid)):
        _matches_eager(got, f"captures hybrid rank {rank}")
        _padded([{"captures": got}], 3, 4)


def test_mods_reading_captured_tensors():
    # A learned bias table (its gradient flows through Flex's backward into the parameter) and
    # document ids made from the input. Lowering crashed on both ("NYI: Functionalize rule for
    # custom_function_call"), and once past that the bias's gradient did ("can not return a
    # BatchedTensor"); plain torch.compile runs them.
    for variant in ("ulysses", "ring"):
        for rank, got in enumerate(run_spmd(run_captures, 2, variant, 128)):
            _matches_eager(got, f"{variant} rank {rank}")


@pytest.mark.extended(covered_by="test_ring_cuts_flex_attention_to_query_rows")
def test_ring_flex_attention_on_four_ranks_with_gradients():
    _cut_to_rows(_check(4, "ring", [*CASES, ("window", 4)], lse=True))


@pytest.mark.extended(covered_by="test_ulysses_rewrites_flex_attention")
def test_ulysses_flex_attention_under_inductor():
    _rewritten_by_ulysses(_check(2, "ulysses", CASES, backend="inductor"))


@pytest.mark.extended(covered_by="test_hybrid_cuts_flex_attention_to_heads_and_rows")
def test_hybrid_flex_attention_under_inductor_reads_the_cut_block_lists():
    # Forward only. The second ring span's rows, cut in the graph: Inductor's kernel once read them from
    # the first block (a silently wrong loss on ranks 2 and 3; test_flex_blocks pins the cause). With 3
    # heads padded to 4 too.
    hybrid = {"ulysses_degree": 2}
    _cut_to_rows(_check(4, "hybrid", CASES, backend="inductor", options=hybrid))
    _padded(_check(3, "ulysses", CASES, seq=96, backend="inductor"), 4, 6)  # Ulysses' padded heads too
    _padded(_check(4, "hybrid", [("per_head", 3)], backend="inductor", heads=3, dim=24, options=hybrid), 3, 4)


@pytest.mark.extended(covered_by="test_ring_cuts_flex_attention_to_query_rows")
def test_ring_flex_attention_under_inductor_reads_the_cut_block_lists():
    # Forward only (Inductor has no CPU Flex backward); its CPU kernel skips the blocks the lists leave out.
    _cut_to_rows(_check(4, "ring", [*CASES, ("window", 4)], backend="inductor"))


@pytest.mark.extended(covered_by="test_ring_cuts_flex_attention_to_query_rows")
def test_ring_flex_attention_on_three_ranks_and_on_blocks_it_cannot_cut():
    # 96 tokens over 3 ranks: zigzag chunks of 16, whole blocks of 16.
    _cut_to_rows(_check(3, "ring", CASES, seq=96))
    # Blocks of 64 over 4 ranks: chunks of 16 (zigzag) or 32 (contiguous) cut them, so it runs whole.
    for results in _check(4, "ring", [("documents", 4)], block=64):
        got = results["documents", 4]
        assert not _flex_notes(got) and any("whole query blocks" in f for f in got["fallbacks"]), got["fallbacks"]


@pytest.mark.extended(covered_by="test_ulysses_rewrites_flex_attention")
def test_ulysses_rewrites_flex_attention_with_fewer_kv_heads_than_ranks():
    # 2 kv heads over 4 ranks: each repeated once so they split (once run whole, gathered).
    _rewritten_by_ulysses(_check(4, "ulysses", [("per_head", 2), ("documents", 2)]))
