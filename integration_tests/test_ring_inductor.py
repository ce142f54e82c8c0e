"""Ring and hybrid compiled by Inductor, exact against single-device eager: loss and every gradient.

SDPA with an additive padding mask (finfo.min, broadcast over queries) and GQA on 2 ranks (ring)
and on 4 (hybrid 2x2, q/k/v crossing each ulysses group in one all-to-all); causal SDPA with GQA
(enable_gqa) on 4 (ring); on 2 and 4, packed documents whose query rows ring balances by the mask. (Written-out attention with finfo.min fills stays as written, so HF's
eager and GPT-2's forms are not ring sites: test_written_attention.py.)  The ring
blocks run on the CPU flash kernel (its forward and backward), which the block counters show.
"""

from __future__ import annotations

import pytest
import torch
from attention_workers import reference
from harness import run_spmd
from ring_inductor_workers import run

SEQ = 16
SDPA_GQA = ("sdpa", "none", 2, False)
PADDED = ("sdpa_padded", "none", 2, True)
SKEWED = ("packed-skewed", "none", 4, False)
HYBRID = {"ulysses_degree": 2}


@pytest.fixture(scope="module")
def refs():
    return {case: reference(case, SEQ) for case in (SDPA_GQA, PADDED, SKEWED)}


def _check(per_rank: list[dict], refs: dict, world: int) -> None:
    for rank, results in enumerate(per_rank):
        for (case, variant), got in results.items():
            where = f"{case} {variant} P={world} inductor rank {rank}"
            ref = refs[case]
            torch.testing.assert_close(got["loss"], ref["loss"], rtol=1e-5, atol=1e-6, msg=f"{where}: loss")
            assert got["grads"].keys() == ref["grads"].keys(), f"{where}: other parameters got gradients"
            for name, g in ref["grads"].items():
                torch.testing.assert_close(got["grads"][name], g, rtol=1e-4, atol=1e-6, msg=f"{where}: grad {name}")
            assert got["sites"] == 2 and not got["fallbacks"], (where, got["sites"], got["fallbacks"])
            assert got["collectives"]["ring_attention"] == 2, (where, got["collectives"])
            blocks = got["blocks"]
            # Every computed block, forward and backward, ran on the fused kernel: none on fp32 math.
            for way in ("forward", "backward"):
                assert blocks[way, "computed"] > 0 and blocks[way, "cpu flash"] == blocks[way, "computed"], (
                    where,
                    blocks,
                )


@pytest.mark.extended(covered_by="integration_tests/test_written_attention.py::test_two_ranks_inductor")
def test_two_ranks_ring(refs):
    # Packed documents of 3/4 and 1/4 of the row: query rows balanced by the mask (chunks of any size).
    per_rank = run_spmd(run, 2, [(PADDED, "ring", None), (SKEWED, "ring", {"balance_chunk": 1})], SEQ)
    _check(per_rank, refs, 2)
    for results in per_rank:
        blocks = results[SKEWED, "ring"]["blocks"]
        assert blocks.get(("forward", "balanced"), 0) == blocks.get(("backward", "balanced"), 0) == 2, blocks


@pytest.mark.extended(covered_by="integration_tests/test_written_attention.py::test_two_ranks_inductor")
def test_four_ranks_ring_and_hybrid(refs):
    jobs = [(SDPA_GQA, "ring", None), (PADDED, "hybrid", HYBRID), (SKEWED, "ring", {"balance_chunk": 1})]
    per_rank = run_spmd(run, 4, jobs, SEQ)
    _check(per_rank, refs, 4)
    for results in per_rank:
        blocks = results[SKEWED, "ring"]["blocks"]
        assert blocks.get(("forward", "balanced"), 0) == blocks.get(("backward", "balanced"), 0) == 2, blocks
        # Per layer: q, k and v in one all-to-all over the ulysses group, the output back in another.
        got = results[PADDED, "hybrid"]
        assert got["collectives"]["all_to_all"] == 2 * got["sites"], got["collectives"]
