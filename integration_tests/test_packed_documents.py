"""Documents packed into rows, the model building a block-diagonal causal mask from restarting positions.

The most common long-context training setup: exact against single-device eager under Ulysses
(the mask reaches SDPA whole), ring (each block tiles it; tiles no document covers are skipped)
and hybrid, at P = 2 and 4, whether the model calls SDPA with the mask or writes attention out.
"""

from __future__ import annotations

import pytest
import torch
from attention_models import doc_mask, packed_positions
from attention_workers import reference, run
from harness import run_spmd

SEQ = 16
SDPA_CASE = ("packed", "none", 4, False)
WRITTEN_CASE = ("packed-written", "none", 4, False)
SKEWED = ("packed-skewed", "none", 4, False)  # documents of 3/4 and 1/4 of the row (5/8, 3/8)


def check(world: int, variant: str, cases: list[tuple], options: dict | None = None, seq: int = SEQ) -> list[dict]:
    refs = {case: reference(case, seq) for case in cases}
    per_rank = run_spmd(run, world, cases, "aot_eager", variant, seq, options)
    for rank, results in enumerate(per_rank):
        for case in cases:
            got, ref = results[case], refs[case]
            where = f"{case[0]} {variant} P={world} rank {rank}"
            torch.testing.assert_close(got["loss"], ref["loss"], rtol=1e-5, atol=1e-6, msg=f"{where}: loss")
            assert got["grads"].keys() == ref["grads"].keys(), where
            for name, g in ref["grads"].items():
                torch.testing.assert_close(got["grads"][name], g, rtol=1e-4, atol=1e-6, msg=f"{where}: grad {name}")
            assert got["sites"] == 2, f"{where}: {got['sites']} attention sites"
    return per_rank


def test_documents_cross_rank_boundaries():
    # The fixture is only worth its name if documents straddle the chunks of 2 and 4 ranks.
    pos = packed_positions(SEQ)
    starts = {i for i in range(SEQ) if pos[0, i] == 0}
    assert any(c not in starts for c in (SEQ // 2, SEQ // 4, 3 * SEQ // 4))
    mask = doc_mask(pos)
    assert mask.shape == (2, 1, SEQ, SEQ) and not mask[0, 0, 5, 4] and mask[0, 0, 4, 0]


def test_two_ranks():
    check(2, "ulysses", [SDPA_CASE, WRITTEN_CASE])
    check(2, "ring", [SDPA_CASE, WRITTEN_CASE])


@pytest.mark.parametrize(
    ("variant", "options"),
    [
        pytest.param("ulysses", None, marks=pytest.mark.extended(covered_by="test_two_ranks")),
        pytest.param("ring", None, marks=pytest.mark.extended(covered_by="test_two_ranks")),
        ("hybrid", {"ulysses_degree": 2}),
    ],
)
def test_four_ranks(variant, options):
    check(4, variant, [SDPA_CASE], options)


def _spread(per_rank: list[dict], phase: str) -> float:
    """max / mean over ranks of the tile area ring computed (its causal work)."""
    area = [r[SKEWED]["blocks"][phase, "area"] for r in per_rank]
    return max(area) / (sum(area) / len(area))


# CI: the plan's balance and where rows arrive, per rank (test_balance.py), and ring exact on packed rows.
@pytest.mark.extended(
    covered_by="packages/autosp-ring/tests/test_balance.py::test_any_document_lengths_balance_within_ten_percent"
)
@pytest.mark.parametrize("world", [2, 4])
def test_ring_balances_documents_by_the_mask(world):
    # In the zigzag layout the ranks holding the long document's late rows do 1.25x (P=2) and 1.4x
    # (P=4) the mean work. Balanced in chunks of any size (the row is 32 tokens), every rank within
    # 10% of the mean, forward and backward; exact either way.
    off = check(world, "ring", [SKEWED], {"balance_chunk": 0}, seq=32)
    on = check(world, "ring", [SKEWED], {"balance_chunk": 1}, seq=32)
    assert _spread(off, "forward") >= 1.25, [r[SKEWED]["blocks"] for r in off]
    for phase in ("forward", "backward"):
        assert _spread(on, phase) <= 1.10, [r[SKEWED]["blocks"] for r in on]
        assert all(r[SKEWED]["blocks"][phase, "balanced"] == 2 for r in on), "one plan per layer"
    assert any("place their query rows by the mask" in n for n in on[0][SKEWED]["notes"]), on[0][SKEWED]["notes"]
    if world == 4:
        # Hybrid's ring (2 ranks per ring, contiguous pieces) plans inside each ring group.
        hybrid = check(4, "hybrid", [SKEWED], {"ulysses_degree": 2, "balance_chunk": 1}, seq=32)
        assert all(r[SKEWED]["blocks"]["forward", "balanced"] == 2 for r in hybrid)
