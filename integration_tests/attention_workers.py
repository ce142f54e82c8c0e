"""Spawned workers for test_written_attention: compile each program, return loss, gradients and notes."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from attention_models import LM, PackedLM, inputs, packed_positions, padding
from cases import caches_off

import autosp

Case = tuple[str, str, int, bool]  # attention, breaks, kv heads, with a padding mask


def _args(case: Case, seq: int) -> tuple:
    if case[0].startswith("packed"):
        return (*inputs(seq), packed_positions(seq, skewed=case[0].endswith("skewed")))
    return (*inputs(seq), padding(seq)) if case[3] else inputs(seq)


def build(case: Case) -> Any:
    """``("packed" | "packed-written", ...)``: documents packed in rows; else an ``LM``."""
    if case[0].startswith("packed"):
        return PackedLM(written=case[0].startswith("packed-written"))
    return LM(case[0], case[1], case[2])


def step(model: Any, case: Case, seq: int) -> dict[str, Any]:
    loss = model(*_args(case, seq))
    loss.backward()
    params = model._orig_mod if hasattr(model, "_orig_mod") else model
    return {
        "loss": loss.detach(),
        "grads": {n: p.grad.clone() for n, p in params.named_parameters() if p.grad is not None},
    }


def reference(case: Case, seq: int) -> dict[str, Any]:
    return step(build(case), case, seq)


def run(
    rank: int, world: int, cases: list[Case], backend: str, variant: str, seq: int, options: dict | None = None
) -> dict[Case, Any]:
    from autosp_ring import BLOCK_COUNTS

    results = {}
    for case in cases:
        torch._dynamo.reset()
        compiled = autosp.compile(build(case), backend=backend, variant=variant, variant_options=options)
        BLOCK_COUNTS.clear()
        with caches_off(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", autosp.NotSequenceParallel)
            results[case] = step(compiled, case, seq)
        results[case]["blocks"] = dict(BLOCK_COUNTS)  # ring's blocks computed on this rank
        results[case]["not_sp_warnings"] = [str(w.message) for w in caught if w.category is autosp.NotSequenceParallel]
        reports = compiled.autosp_reports
        results[case]["graphs"] = len(reports)
        results[case]["sites"] = sum(len(r.sites) for r in reports)
        results[case]["sharded"] = [r.seq_len for r in reports]
        results[case]["notes"] = [n for r in reports for n in r.notes]
    return results
