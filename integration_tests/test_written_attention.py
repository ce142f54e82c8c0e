"""Attention written out by hand, graph breaks and checkpointed layers: exact against single-device eager.

Cross-attention to a memory of another length keeps the memory whole and each rank's query rows local.
Hand-written attention that SDPA computes exactly becomes one SDPA call (every variant rewrites
it); what it cannot (soft-capping, kv heads that do not group the query heads) stays as written and is still
exact, k and v gathered.  A graph without attention shards by the length of the graph before it,
or runs whole when none came before.  Each case also pins what the report says it did.
"""

from __future__ import annotations

import pytest
import torch
from attention_workers import reference, run
from harness import run_spmd

REFS: dict[tuple, dict] = {}

# (attention, breaks, kv heads, padding mask) -> (attention sites over all graphs, phrase in the notes)
REWRITTEN = "computed as one SDPA call"
KEPT = "kept as written"
FINITE = "every key masked by a finite value"  # finfo.min masks: kept as written
CASES = {
    ("nano", "none", 4, False): (2, REWRITTEN),
    ("hf_eager", "none", 2, False): (0, FINITE),
    ("gpt2", "none", 4, True): (0, FINITE),
    ("alibi", "none", 4, False): (2, REWRITTEN),
    ("bloom", "none", 2, False): (2, REWRITTEN),
    ("einsum", "none", 4, False): (2, REWRITTEN),
    ("softcap", "none", 4, False): (0, "tanh"),
    ("flat", "none", 2, False): (0, "[batch * heads, S, d]"),
    ("sdpa", "between", 2, False): (2, None),
    ("sdpa", "before_head", 2, False): (2, "sharding inputs of sequence length"),
    ("hf_eager", "checkpoint", 2, False): (0, FINITE),
    ("none", "none", 4, False): (0, "runs whole on every rank"),
    ("cross", "none", 4, False): (4, "cross-attention"),
    ("mha", "none", 4, False): (2, "nn.MultiheadAttention"),
    ("cross_written", "none", 4, False): (2, "kept as written"),
}


def check(
    world: int, backend: str, variant: str, cases: list[tuple], seq: int = 16, expect: dict[tuple, tuple] | None = None
) -> None:
    expect = CASES if expect is None else expect
    for case in cases:
        if (case, seq) not in REFS:
            REFS[case, seq] = reference(case, seq)
    per_rank = run_spmd(run, world, cases, backend, variant, seq)
    for rank, results in enumerate(per_rank):
        for case in cases:
            got, ref = results[case], REFS[case, seq]
            where = f"{case} {variant} P={world} {backend} rank {rank}"
            torch.testing.assert_close(got["loss"], ref["loss"], rtol=1e-5, atol=1e-6, msg=f"{where}: loss")
            assert got["grads"].keys() == ref["grads"].keys(), f"{where}: other parameters got gradients"
            for name, g in ref["grads"].items():
                torch.testing.assert_close(got["grads"][name], g, rtol=1e-4, atol=1e-6, msg=f"{where}: grad {name}")
            sites, phrase = expect[case]
            assert got["sites"] == sites, f"{where}: {got['sites']} attention sites, expected {sites}"
            if phrase is not None:
                assert any(phrase in n for n in got["notes"]), f"{where}: no note with {phrase!r}: {got['notes']}"
            # Every program with attention, found or kept as written, is sequence-parallel in every graph.
            if case[0] != "none":
                assert all(s is not None for s in got["sharded"]), f"{where}: sharded {got['sharded']}"
            # A program of which no graph is sharded says so once, as a warning, not only in its report.
            warned = got["not_sp_warnings"]
            if all(s is None for s in got["sharded"]):
                assert len(warned) == 1 and "none of the 1 compiled graph(s)" in warned[0], f"{where}: {warned}"
                assert "scaled_dot_product_attention" in warned[0], warned
            else:
                assert not warned, f"{where}: {warned}"


# The forms the HF matrix's first-tier rows do not cover, with the graph breaks and cross-attention.
FIRST_TIER = [
    ("nano", "none", 4, False),
    # Once not found (baddbmm; einsum's permutes around its bmm): the whole program ran on every rank.
    ("bloom", "none", 2, False),
    ("einsum", "none", 4, False),
    ("softcap", "none", 4, False),
    ("sdpa", "between", 2, False),
    ("sdpa", "before_head", 2, False),
    ("none", "none", 4, False),
    ("cross", "none", 4, False),
]


def test_two_ranks_ulysses():
    check(2, "aot_eager", "ulysses", FIRST_TIER)


@pytest.mark.extended(covered_by="test_two_ranks_ulysses")
def test_two_ranks_ulysses_more_forms():
    # ALiBi, a flattened [batch * heads] layout, nn.MultiheadAttention, written cross-attention, and
    # HF eager attention (Llama's, also under gradient checkpointing, and GPT-2's with a padding mask:
    # CI has both models' rows of test_hf_matrix.py, Llama's with checkpointing under Ulysses).
    check(2, "aot_eager", "ulysses", [c for c in CASES if c not in FIRST_TIER])


@pytest.mark.extended(covered_by="test_two_ranks_ulysses")
def test_two_ranks_ring():
    # Ring tiles the mask the model builds (nanoGPT's tril buffer, a padding mask) block by block;
    # GPT-2's finfo.min fill stays as written (a fully masked row would get n times its gradient as SDPA).
    expect = {
        ("nano", "none", 4, False): (2, REWRITTEN),
        ("gpt2", "none", 4, True): (0, FINITE),
        ("bloom", "none", 2, False): (2, REWRITTEN),  # a per-head [B, H, S, S] bias, tiled
        ("einsum", "none", 4, False): (2, REWRITTEN),
        ("sdpa", "between", 2, False): (2, None),
        ("cross", "none", 4, False): (4, "cross-attention"),
        ("sdpa_padded", "none", 2, True): (2, None),  # a [B, 1, 1, S] mask, spelled out for the tiles
    }
    check(2, "aot_eager", "ring", list(expect), expect=expect)


@pytest.mark.extended(
    covered_by="integration_tests/test_ulysses_equivalence.py::test_three_ranks_pad_heads_they_do_not_split"
)
def test_three_ranks_heads_not_divisible():
    # 4 heads over 3 ranks: written-out attention becomes SDPA, its heads padded to 6; BLOOM's
    # per-head [B, H, S, S] bias gets the padding heads too (once kept as written, k and v gathered).
    expect = {
        ("nano", "none", 4, False): (2, REWRITTEN),
        ("bloom", "none", 2, False): (2, "4 heads padded to 6"),
        ("alibi", "none", 4, False): (2, "4 heads padded to 6"),
    }
    check(3, "aot_eager", "ulysses", list(expect), seq=24, expect=expect)


@pytest.mark.extended(covered_by="test_two_ranks_ulysses")
def test_four_ranks_ulysses():
    # The rewritten and the kept-as-written forms; graph breaks and cross-attention run at P=2 above
    # (cross-attention's query rows at P=2, 3 and 4 in the rule harness, test_sharding_rules.py).
    # BLOOM's baddbmm and einsum's layouts (P=2 in the first tier) too.
    cases = [
        ("nano", "none", 4, False),
        ("gpt2", "none", 4, True),
        ("bloom", "none", 2, False),
        ("einsum", "none", 4, False),
    ]
    check(4, "aot_eager", "ulysses", cases)


@pytest.mark.parametrize(
    ("variant", "cases"),
    [
        pytest.param(
            "ulysses",
            [("hf_eager", "checkpoint", 2, False), ("cross", "none", 4, False), ("flat", "none", 2, False)],
            marks=pytest.mark.extended(covered_by="test_two_ranks_inductor"),
        ),
        pytest.param(
            "ulysses",
            [("bloom", "none", 2, False), ("einsum", "none", 4, False)],
            marks=pytest.mark.extended(covered_by="test_two_ranks_inductor"),
        ),
        # Ring's tiles of a model-built mask (nanoGPT's tril buffer, as SDPA's attn_mask) under Inductor:
        # CI's one ring under Inductor. A graph break before the head under ring and Inductor: test-all.
        ("ring", [("nano", "none", 4, False)]),
        pytest.param(
            "ring",
            [("sdpa", "before_head", 2, False)],
            marks=pytest.mark.extended(covered_by="test_two_ranks_inductor"),
        ),
    ],
)
def test_two_ranks_inductor(variant, cases):
    # At P=4 under Inductor, GPT-2's written attention with its padding mask runs under hybrid (Ulysses
    # inside pairs of ranks) in test_ring_inductor.py.
    check(2, "inductor", variant, cases)
