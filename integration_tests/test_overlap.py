"""Ulysses with pipelined head groups and the overlap pass, against single-device eager.

Two head groups per layer: four all-to-alls per attention layer (q/k/v in and the output back,
per group). The overlap report says that group 1's q/k/v exchange is in flight over group 0's
attention and group 0's output exchange over group 1's, forward and backward.
"""

from __future__ import annotations

import cases
import overlap_workers
import pytest
import torch
from harness import run_spmd

pytest.importorskip("transformers")


def _check(results: list[dict], runs: list[tuple[str, object]]) -> None:
    batch = overlap_workers.make_batch()
    refs = {name: cases.reference(name, batch) for name in {n for n, _ in runs}}
    for name, sac in runs:
        ref, key = refs[name], f"{name} sac={sac}"
        for rank, per_rank in enumerate(results):
            got = per_rank[key]
            torch.testing.assert_close(got["loss"], ref["loss"], rtol=1e-5, atol=1e-6, msg=f"{key} rank {rank}")
            assert got["grads"].keys() == ref["grads"].keys()
            for p, g in ref["grads"].items():
                torch.testing.assert_close(got["grads"][p], g, rtol=1e-4, atol=1e-6, msg=f"{key} rank {rank}: {p}")
        _assert_overlapped(results[0][key], key)


def _assert_overlapped(r: dict, key: str) -> None:
    layers = r["layers"]  # attention sites of the program, each run as two head groups
    assert r["collectives"]["all_to_all"] == 4 * layers, (key, r["collectives"])
    lines = r["overlap"]
    for stage in ("forward", "backward"):
        # Per layer, group 1's q/k/v exchange and group 0's output exchange each overlap one attention call
        # (in the backward, with SAC, the recomputed exchanges overlap too: at least as many).
        busy = [ln for ln in lines if ln.startswith(f"overlap {stage}: all_to_all") and "attention x1" in ln]
        assert len(busy) >= 2 * layers, (key, stage, lines)
        if stage == "forward" or "recompute" not in r["sac"].get("mode", ""):
            assert len(busy) == 2 * layers, (key, stage, lines)
            assert f"overlap {stage}: {2 * layers} of " in "\n".join(lines), (key, stage, lines)


def test_pipelined_heads_aot_eager():
    # gpt2: k/v split with q; llama (GQA, one kv head per rank: k/v travel whole with group 0) with
    # SAC recomputing the exchanges in the backward.
    runs = [("gpt2", "auto"), ("llama", True)]
    _check(run_spmd(overlap_workers.pipelined, 2, runs, "aot_eager", 2), runs)


@pytest.mark.extended(covered_by="test_pipelined_heads_aot_eager")
def test_pipelined_heads_aot_eager_more_forms():
    # llama without SAC; llama-mqa: one kv head on two ranks (repeated, then whole with group 0).
    runs = [("llama", "auto"), ("llama-mqa", "auto")]
    _check(run_spmd(overlap_workers.pipelined, 2, runs, "aot_eager", 2), runs)


# Inductor compiles C++ kernels: in CI, with nothing cached, this run costs more than those above.
@pytest.mark.extended(covered_by="test_pipelined_heads_aot_eager")
def test_pipelined_heads_inductor():
    runs = [("llama", "auto")]
    _check(run_spmd(overlap_workers.pipelined, 2, runs, "inductor", 2), runs)
