"""Workers for test_overlap: pipelined Ulysses head groups against single-device eager."""

from __future__ import annotations

from typing import Any

import torch
from cases import build, caches_off, step

import autosp


def make_batch(seq: int = 32, batch: int = 2) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 96, (batch, seq), generator=gen)
    labels = ids.clone()
    labels[0, 2:7] = -100
    return {"ids": ids, "labels": labels}


def pipelined(rank: int, world: int, runs: list[tuple[str, Any]], backend: str, chunks: int) -> dict[str, Any]:
    """Per (model, sac) run: loss, gradients, collective counts and overlap lines, compiled with ``ulysses_chunks``."""
    batch = make_batch()
    results = {}
    for name, sac in runs:
        compiled = autosp.compile(
            build(name), backend=backend, fullgraph=True, sac=sac, variant_options={"ulysses_chunks": chunks}
        )
        with caches_off():  # a cache hit would skip the passes and their report lines
            out = step(compiled, name, batch)
        report = compiled.autosp_reports[0]
        out["collectives"] = dict(report.collectives)
        out["overlap"] = [n for n in report.notes if n.startswith("overlap ")]
        out["sac"] = dict(report.sac)
        out["layers"] = len(report.sites)
        results[f"{name} sac={sac}"] = out
    return results
