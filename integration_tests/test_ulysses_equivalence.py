"""Ulysses against the single-device eager reference: loss, sequence outputs and every gradient."""

from __future__ import annotations

import re

import cases
import pytest
import torch
from harness import run_spmd

pytest.importorskip("transformers")


def make_batches(names: list[str], seq: int = 32, batch: int = 2) -> dict:
    gen = torch.Generator().manual_seed(1)
    batches = {}
    for name in names:
        ids = torch.randint(0, 96, (batch, seq), generator=gen)
        labels = ids.clone()
        labels[0, 3:11] = -100  # ignored tokens, all on rank 0's side of the sequence
        b = {"ids": ids, "labels": labels, "y": torch.tensor([0, 2])[:batch]}
        if name in ("llama-window", "hf-qwen2"):
            mask = torch.ones(batch, seq, dtype=torch.long)
            mask[1, :5] = 0  # left padding on one row
            labels[1, :5] = -100
            b["mask"] = mask
        batches[name] = b
    return batches


def assert_matches(result: dict, ref: dict, name: str) -> None:
    torch.testing.assert_close(result["loss"], ref["loss"], rtol=1e-5, atol=1e-6, msg=f"{name}: loss")
    if ref["seq_out"] is not None:
        torch.testing.assert_close(result["seq_out"], ref["seq_out"], rtol=1e-4, atol=1e-5, msg=f"{name}: output")
    assert result["grads"].keys() == ref["grads"].keys(), name
    for pname, g in ref["grads"].items():
        torch.testing.assert_close(result["grads"][pname], g, rtol=1e-4, atol=1e-6, msg=f"{name}: grad of {pname}")


def check(world: int, names: list[str], backend: str, options: dict | None = None) -> dict:
    batches = make_batches(names)
    refs = {n: cases.reference(n, batches[n]) for n in names}
    per_rank = run_spmd(cases.run_compiled, world, names, batches, backend, options)
    for rank, results in enumerate(per_rank):
        for name in names:
            assert_matches(results[name], refs[name], f"{name} rank {rank}")
    return per_rank[0]


MODELS_2 = ["llama", "llama-window", "hf-llama", "hf-qwen2"]


def _exchanges_only(results: dict, names: tuple[str, ...]) -> None:
    for name in names:
        r = results[name]
        # The sequence the compile agreement compared between the ranks: the forward's exchanges and the
        # backward's, and the one gradient all-reduce.
        ops = r["group_ops"]
        assert ops is not None and sum(op.startswith("autosp::all_to_all@") for op in ops) == 4 * r["layers"], ops
        assert sum(op.startswith("_c10d_functional::all_reduce[") for op in ops) == 1, ops
        # q, k, v in (fused into one) and the output back: two all-to-alls per attention layer, nothing gathered.
        assert r["collectives"]["all_to_all"] == 2 * r["layers"], (name, r["collectives"])
        assert not r["fallbacks"], (name, r["fallbacks"])
        # Every parameter gradient fits the default 25 MiB bucket: one all-reduce for all of them.
        assert r["collectives"]["grad_all_reduce"] == 1, (name, r["collectives"])


def test_two_ranks_aot_eager():
    _exchanges_only(check(2, MODELS_2, "aot_eager"), ("llama", "hf-llama", "hf-qwen2"))


@pytest.mark.extended(covered_by="test_two_ranks_aot_eager")
def test_two_ranks_aot_eager_more_models():
    # Learned positions (gpt2) and a classifier pooling over the sequence (also in test_sequence_reductions.py).
    _exchanges_only(check(2, ["gpt2", "pool"], "aot_eager"), ("gpt2",))


@pytest.mark.extended(covered_by="test_two_ranks_aot_eager")
def test_four_ranks_fewer_kv_heads_than_ranks():
    # 2 kv heads on 4 ranks, and multi-query attention: each kv head is repeated the fewest times that
    # splits over the ranks (2x, 4x), then exchanged with q: still two all-to-alls and nothing gathered.
    results = check(4, ["llama", "llama-mqa", "hf-llama"], "aot_eager")
    for name, r in results.items():
        assert r["collectives"]["all_to_all"] == 2 * r["layers"], (name, r["collectives"])
        # HF models return logits, gathered whole by the contract: that is their one all-gather.
        assert r["collectives"].get("all_gather", 0) == (1 if name.startswith("hf-") else 0), (name, r["collectives"])


def test_three_ranks_pad_heads_they_do_not_split():
    # 4 query heads over 3 ranks, padded to 6 (k/v's 2 heads repeated to 4 first); the 32 tokens
    # split 11, 11, 10. Once refused ("not divisible by sp_size=3"). Still two all-to-alls per layer.
    results = check(3, ["llama", "hf-llama"], "aot_eager")
    for name, r in results.items():
        assert r["collectives"]["all_to_all"] == 2 * r["layers"], (name, r["collectives"])
        assert not r["fallbacks"], (name, r["fallbacks"])
        padded = [n for n in r["notes"] if "4 heads padded to 6 to split over 3 ranks" in n]
        assert len(padded) == r["layers"], (name, r["notes"])


@pytest.mark.extended(covered_by="test_three_ranks_pad_heads_they_do_not_split")
def test_four_ranks_inductor_pads_heads():
    # 6 heads (3 kv heads, repeated to 6 first) over 4 ranks attend as 8, under Inductor.
    results = check(4, ["llama-h6"], "inductor")
    r = results["llama-h6"]
    assert r["collectives"]["all_to_all"] == 2 * r["layers"], r["collectives"]
    assert sum("6 heads padded to 8 to split over 4 ranks" in n for n in r["notes"]) == r["layers"], r["notes"]


@pytest.mark.extended(
    covered_by="packages/autosp-core/tests/test_grad_sync.py::test_buckets_follow_descending_slots_and_close_at_the_cap"
)
def test_two_ranks_inductor_many_gradient_buckets():
    # 2 KiB buckets: the 64x64 weights go alone, LayerNorm weights and biases share buckets. (One
    # model: the buckets are laid out the same way for any; Llama under Inductor runs in test_tile_mlp.)
    results = check(2, ["gpt2"], "inductor", {"grad_bucket_mb": 2 / 1024})
    for name, r in results.items():
        assert 1 < r["collectives"]["grad_all_reduce"] < r["params"], (name, r["collectives"], r["params"])


def test_matmuls_see_only_local_tokens():
    seq, batch, world = 128, 2, 2
    b = make_batches(["llama"], seq=seq, batch=batch)["llama"]
    shapes = run_spmd(cases.matmul_shapes, world, b, "aot_eager")[0]
    assert shapes, "profiler recorded no matmul"
    local_tokens = batch * seq // world
    # Model dims (64, 128, 96) are at most the local token count; a full-sequence matmul would show 256.
    assert max(max(s) for s in shapes) <= local_tokens, sorted({tuple(s) for s in shapes})


_DYNAMIC_MORE = pytest.mark.extended(
    covered_by="test_a_dynamic_length_the_ranks_split_unevenly_compiles_once_per_remainder"
)


@pytest.mark.parametrize(
    ("world", "backend"),
    [
        (2, "aot_eager"),
        pytest.param(4, "aot_eager", marks=_DYNAMIC_MORE),
        pytest.param(2, "inductor", marks=_DYNAMIC_MORE),
    ],
)
def test_a_dynamic_length_the_ranks_split_unevenly_compiles_once_per_remainder(world: int, backend: str) -> None:
    # Once refused ("uneven pieces need concrete lengths"): a length marked dynamic that the ranks split
    # unevenly gets symbolic pieces, the graph guarded on the length's remainder modulo P.
    gen = torch.Generator().manual_seed(5)
    lengths = (32, 33, 47, 48, 35) if world == 2 else (32, 33, 34, 35, 37, 42)
    batches = [torch.randint(0, 96, (2, s), generator=gen) for s in lengths]
    per_rank = run_spmd(cases.dynamic_lengths, world, batches, "ulysses", backend)
    for result in per_rank:
        assert result["graphs"] == world, result["notes"]
        for ids, got in zip(batches, result["steps"]):
            assert not isinstance(got, str), got
            assert_matches(got, cases.reference("llama", {"ids": ids, "labels": ids}), f"llama S={ids.shape[1]}")
        # Exchanged padded, nothing gathered; the report says which lengths each graph serves.
        for notes, counts in zip(result["notes"][1:], result["collectives"][1:]):
            assert any(f"modulo {world})" in n and "marked dynamic" in n for n in notes), notes
            assert counts.get("all_to_all") and not counts.get("all_gather"), counts


def test_ring_refuses_a_dynamic_length_the_ranks_split_unevenly_and_names_ulysses():
    gen = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, 96, (2, s), generator=gen) for s in (32, 33)]
    (result, _) = run_spmd(cases.dynamic_lengths, 2, batches, "ring")
    assert not isinstance(result["steps"][0], str)
    message = result["steps"][1]
    assert isinstance(message, str) and "sequence length 33 is not divisible by sp_size=2" in message, message
    assert "compile without marking the length dynamic; or use variant='ulysses'" in message, message


def test_dynamic_sequence_length_reuses_one_graph():
    gen = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, 96, (2, s), generator=gen) for s in (32, 48, 64)]
    per_rank = run_spmd(cases.dynamic_lengths, 2, batches)
    for result in per_rank:
        assert result["graphs"] == 1
        # The one graph serves every length: its report says so, not "sequence length 32" as if static.
        assert re.search(r"sequence length dynamic \(s\d+; 32 when compiled", result["report"]), result["report"]
        for ids, got in zip(batches, result["steps"]):
            assert_matches(got, cases.reference("llama", {"ids": ids, "labels": ids}), f"llama S={ids.shape[1]}")
