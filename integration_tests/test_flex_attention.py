"""FlexAttention under SP, against single-device eager.

Ulysses rewrites it: each rank attends for its heads over the whole sequence, with the block mask
whole (sliced to its heads when the mask is per head) and the mods seeing global head indices.
Kv heads that do not split over the ranks (2 over 4) are repeated so they do. Under ring it runs
whole, exactly, and the report says so. Forward only: torch 2.13 has no FlexAttention backward on CPU (one device
raises the same error), so gradients are checked on a GPU.
"""

from __future__ import annotations

import pytest
import torch
from flex_workers import run
from harness import run_spmd

CASES = [("documents", 4), ("per_head", 2)]


def _check(world: int, variant: str, cases: list[tuple[str, int]]) -> list[dict]:
    per_rank = run_spmd(run, world, variant, cases, 96)
    for rank, results in enumerate(per_rank):
        for case in cases:
            got = results[case]
            where = f"{case} {variant} P={world} rank {rank}"
            torch.testing.assert_close(got["loss"], got["reference"], rtol=1e-5, atol=1e-6, msg=where)
            assert got["collectives"]["shard_start"] >= 1, f"{where}: nothing was sequence-parallel"
    return per_rank


def _rewritten(per_rank: list[dict]) -> None:
    for results in per_rank:
        for case, got in results.items():
            assert got["sites"].count("flex_attention") == 1 and not got["fallbacks"], (case, got["fallbacks"])
            # q/k/v in one exchange and the output in one more, for SDPA and for Flex alike.
            assert got["collectives"]["all_to_all"] == 4 and not got["collectives"]["all_gather"], got["collectives"]


def test_ulysses_rewrites_flex_attention():
    _rewritten(_check(2, "ulysses", CASES))


@pytest.mark.extended(covered_by="test_ulysses_rewrites_flex_attention")
def test_ulysses_rewrites_flex_attention_with_fewer_kv_heads_than_ranks():
    # 2 kv heads over 4 ranks: each repeated once so they split (once run whole, gathered).
    _rewritten(_check(4, "ulysses", [("per_head", 2), ("documents", 2)]))


def test_flex_attention_runs_whole_under_ring():
    # Ring does not rewrite Flex: it runs whole, exactly.
    cases = [("per_head", 2)]
    for results in _check(2, "ring", cases):
        said = results[cases[0]]["notes"]
        assert any("flex_attention" in n.lower() and "whole" in n for n in said), said
