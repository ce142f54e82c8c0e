"""Spawned workers for test_sequence_reductions: compile each program, return loss and gradients."""

from __future__ import annotations

from typing import Any

import torch
from cases import caches_off
from reduction_models import build, inputs

import autosp


def step(model: Any, name: str, seq: int) -> dict[str, Any]:
    loss = model(*inputs(name, seq=seq))
    loss.backward()
    params = model._orig_mod if hasattr(model, "_orig_mod") else model
    return {"loss": loss.detach(), "grads": {n: p.grad.clone() for n, p in params.named_parameters()}}


def reference(name: str, seq: int) -> dict[str, Any]:
    return step(build(name), name, seq)


def run(rank: int, world: int, names: list[str], backend: str, variant: str, options: dict, seq: int) -> dict[str, Any]:
    results = {}
    for name in names:
        torch._dynamo.reset()
        compiled = autosp.compile(
            build(name), backend=backend, fullgraph=True, variant=variant, variant_options=options
        )
        with caches_off():
            results[name] = step(compiled, name, seq)
        results[name]["fallbacks"] = list(compiled.autosp_reports[0].fallbacks)
    return results
