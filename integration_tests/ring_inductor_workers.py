"""Spawned workers for test_ring_inductor: ring and hybrid compiled by Inductor, with what the report and
the ring op's block counters say they did."""

from __future__ import annotations

from typing import Any

import torch
import torch._inductor.config as inductor_config
from attention_workers import Case, build, step
from cases import caches_off

import autosp

Job = tuple[Case, str, dict | None]  # (model case, variant, variant_options)


def run(rank: int, world: int, jobs: list[Job], seq: int) -> dict[tuple, Any]:
    from autosp_ring import BLOCK_COUNTS

    results: dict[tuple, Any] = {}
    for case, variant, options in jobs:
        torch._dynamo.reset()
        BLOCK_COUNTS.clear()
        compiled = autosp.compile(build(case), backend="inductor", variant=variant, variant_options=options)
        # A hit in Inductor's on-disk caches skips the passes, and the report with them; compiling in
        # this process spares each rank a pool of compile workers.
        with caches_off(), inductor_config.patch(compile_threads=1):
            out = step(compiled, case, seq)
        reports = compiled.autosp_reports
        out["sites"] = sum(len(r.sites) for r in reports)
        out["collectives"] = _collectives(reports)
        out["fallbacks"] = [f for r in reports for f in r.fallbacks]
        out["blocks"] = dict(BLOCK_COUNTS)
        results[case, variant] = out
    return results


def _collectives(reports: list) -> dict[str, int]:
    total: dict[str, int] = {}
    for r in reports:
        for name, n in r.collectives.items():
            total[name] = total.get(name, 0) + n
    return total
