"""Workers for test_tile_loss (module level: spawned ranks import them by name)."""

from __future__ import annotations

from typing import Any

import cases
import torch

import autosp


def run(rank: int, world: int, runs: list[tuple[str, str, Any]], batch: dict[str, torch.Tensor]) -> list[dict]:
    """One step per (model, backend, tile_loss): loss, gradients, what the report says."""
    out = []
    for name, backend, tile in runs:
        torch._dynamo.reset()  # the same code compiled per setting: stay under Dynamo's recompile limit
        model = cases.build(name)
        compiled = autosp.compile(
            model, backend=backend, fullgraph=True, tile_loss=tile, sp_size=world if world > 1 else None
        )
        with cases.caches_off():  # a cache hit would skip the passes, and the report with them
            res = cases.step(compiled, name, batch)
        report = compiled.autosp_reports[0]
        res["notes"] = [n for n in report.notes if n.startswith("tile_loss")]
        res["collectives"] = dict(report.collectives)
        out.append(res)
    return out


def run_tile_mlp(rank: int, world: int, runs: list[tuple[str, str, str, dict]], batch: dict[str, torch.Tensor]) -> list:
    """One step per (model, backend, variant, options) with tiled MLPs: loss, gradients, the report's notes."""
    out = []
    for name, backend, variant, options in runs:
        torch._dynamo.reset()
        model = cases.build(name)
        compiled = autosp.compile(model, backend=backend, fullgraph=True, variant=variant, **options)
        with cases.caches_off():
            res = cases.step(compiled, name, batch)
        res["notes"] = [n for r in compiled.autosp_reports for n in r.notes if n.startswith("tile_mlp")]
        res["fallbacks"] = [f for r in compiled.autosp_reports for f in r.fallbacks]
        out.append(res)
    return out
