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


def _check(results: list[dict], names: list[str]) -> None:
    batch = overlap_workers.make_batch()
    for name in names:
        ref = cases.reference(name, batch)
        for rank, per_rank in enumerate(results):
            got = per_rank[name]
            torch.testing.assert_close(got["loss"], ref["loss"], rtol=1e-5, atol=1e-6, msg=f"{name} rank {rank}")
            assert got["grads"].keys() == ref["grads"].keys()
            for p, g in ref["grads"].items():
                torch.testing.assert_close(got["grads"][p], g, rtol=1e-4, atol=1e-6, msg=f"{name} rank {rank}: {p}")


def _assert_overlapped(r: dict, name: str) -> None:
    layers = r["layers"]  # attention sites of the program, each run as two head groups
    assert r["collectives"]["all_to_all"] == 4 * layers, (name, r["collectives"])
    lines = r["overlap"]
    for stage in ("forward", "backward"):
        # Per layer, group 1's q/k/v exchange and group 0's output exchange each overlap one attention call.
        busy = [ln for ln in lines if ln.startswith(f"overlap {stage}: all_to_all") and "attention x1" in ln]
        assert len(busy) == 2 * layers, (name, stage, lines)
        assert f"overlap {stage}: {2 * layers} of " in "\n".join(lines), (name, stage, lines)


def test_pipelined_heads_aot_eager():
    # llama: GQA with one kv head per rank (k/v travel whole with group 0); gpt2: k/v split with q;
    # llama-mqa: one kv head on two ranks (repeated, then whole with group 0).
    names = ["llama", "gpt2", "llama-mqa"]
    results = run_spmd(overlap_workers.pipelined, 2, names, "aot_eager", 2)
    _check(results, names)
    for name in names:
        _assert_overlapped(results[0][name], name)


def test_pipelined_heads_inductor():
    results = run_spmd(overlap_workers.pipelined, 2, ["llama"], "inductor", 2)
    _check(results, ["llama"])
    _assert_overlapped(results[0]["llama"], "llama")
