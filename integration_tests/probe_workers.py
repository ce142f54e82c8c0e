"""Pool task for test_probe_programs: each probe compiled at sp=P and run on one device, compared on every rank."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch
from cases import caches_off
from probe_models import build, inputs

import autosp


def _scalar(out: Any) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The loss to differentiate: the first output plus every other output against fixed weights."""
    if isinstance(out, torch.Tensor):
        return out, [out]
    g = torch.Generator().manual_seed(7)
    total = out[0]
    for o in out[1:]:
        real = torch.view_as_real(o) if o.is_complex() else o  # both parts of a complex output carry gradients
        total = total + (real * torch.randn(real.shape, generator=g, dtype=real.dtype)).sum()
    return total, list(out)


def step(model: Any, args: tuple) -> dict[str, Any]:
    # The same generator state for the reference and the SP run: programs that draw dropout
    # masks must draw the same ones (the ranks are seeded alike too).
    torch.manual_seed(11)
    params = model._orig_mod if hasattr(model, "_orig_mod") else model
    before = dict(params.named_buffers())
    # The caller's tensors, its own copy per run: a program that writes into them (or reads their
    # gradient) is compared on what it left there.
    args = tuple(a.detach().clone().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a for a in args)
    loss, outs = _scalar(model(*args))
    loss.backward()
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    after = dict(params.named_buffers())
    state = {id(t): n for n, t in [*params.named_parameters(), *after.items()]}
    return {
        # Which buffers are still the same objects, and which outputs are the model's own tensors:
        # what code after the call (or after a graph break) can tell apart, as `value.persistent` does.
        "identity": {
            "kept": sorted(n for n, b in before.items() if after.get(n) is b),
            "outputs": [state.get(id(o)) for o in outs],
        },
        "outs": [o.detach().clone() for o in outs],
        "inputs": [a.detach().clone() for a in tensors],
        "input_grads": [a.grad.clone() for a in tensors if a.grad is not None],
        "grads": {n: p.grad.clone() for n, p in params.named_parameters() if p.grad is not None},
        "buffers": {n: b.detach().clone() for n, b in params.named_buffers()},
        # What the call left in the parameters (a forward that writes one through .data).
        "params": {n: p.detach().clone() for n, p in params.named_parameters()},
    }


def differences(got: dict[str, Any], ref: dict[str, Any]) -> list[str]:
    """What differs, with a tolerance relative to the largest reference value of each kind."""
    problems = []
    if got.get("identity") != ref.get("identity"):
        problems.append(
            f"buffers kept and outputs that are the model's tensors: {got.get('identity')} vs {ref.get('identity')}"
        )
    pairs = [(f"output {i}", g, r) for i, (g, r) in enumerate(zip(got["outs"], ref["outs"]))]
    for kind in ("inputs", "input_grads"):
        if len(got.get(kind, [])) != len(ref.get(kind, [])):
            problems.append(f"{kind}: {len(got.get(kind, []))} vs {len(ref.get(kind, []))}")
        pairs += [(f"{kind} {i}", g, r) for i, (g, r) in enumerate(zip(got.get(kind, []), ref.get(kind, [])))]
    if got["grads"].keys() != ref["grads"].keys():
        problems.append(f"gradients of {sorted(got['grads'])} vs {sorted(ref['grads'])}")
    scale = max((g.abs().max().item() for g in ref["grads"].values()), default=1.0)
    pairs += [(f"grad {n}", got["grads"][n], g) for n, g in ref["grads"].items() if n in got["grads"]]
    pairs += [(f"buffer {n}", got["buffers"][n], b) for n, b in ref["buffers"].items()]
    pairs += [(f"parameter {n}", got["params"][n], p) for n, p in ref.get("params", {}).items()]
    for what, g, r in pairs:
        if g.is_complex() and r.is_complex():
            g, r = torch.view_as_real(g), torch.view_as_real(r)
        if g.shape != r.shape:
            problems.append(f"{what}: shape {tuple(g.shape)} vs {tuple(r.shape)}")
            continue
        if not r.is_floating_point():
            if not torch.equal(g, r):
                problems.append(f"{what}: differs")
            continue
        atol = 1e-5 * (scale if what.startswith("grad") else max(r.abs().max().item(), 1.0))
        if not torch.allclose(g.double(), r.double(), rtol=1e-4, atol=atol):
            err = (g.double() - r.double()).abs().max().item()
            problems.append(f"{what}: max error {err:.3g} (largest {r.abs().max().item():.3g})")
    return problems


def run_probes(
    rank: int,
    world: int,
    probes: list[tuple[str, int, int]],
    variant: str,
    backend: str = "aot_eager",
    options: dict[str, Any] | None = None,
) -> dict[tuple[str, int, int], dict[str, Any]]:
    """Per ``(name, seq, batch)``: ``{"problems": [...], "fallbacks": [...]}`` or ``{"error": ...}``.

    ``options`` go to ``autosp.compile`` (``sac=True``, ...).
    """
    results: dict[tuple[str, int, int], dict[str, Any]] = {}
    for name, seq, batch in probes:
        torch._dynamo.reset()
        model = build(name, seq)
        args = inputs(name, seq, batch)
        ref = step(copy.deepcopy(model), args)
        try:
            compiled = autosp.compile(model, backend=backend, variant=variant, **{"fullgraph": True, **(options or {})})
            with caches_off(), warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", autosp.AttentionNotSharded)
                warnings.simplefilter("always", autosp.RanInEager)
                got = step(compiled, args)
        except Exception as e:  # noqa: BLE001 - a probe's refusal is a verdict, not a crash of the task
            kind = "refused" if type(e).__module__.startswith("autosp") or "AutoSP" in type(e).__name__ else "error"
            results[name, seq, batch] = {"error": f"{kind}: {type(e).__name__}: {str(e)[:1500]}"}
            continue
        reports = compiled.autosp_reports
        results[name, seq, batch] = {
            "problems": differences(got, ref),
            "fallbacks": [f for r in reports for f in r.fallbacks],
            "sharded": [r.seq_len for r in reports],
            "whole_attention": [str(w.message) for w in caught if issubclass(w.category, autosp.AttentionNotSharded)],
            "ran_in_eager": [str(w.message) for w in caught if issubclass(w.category, autosp.RanInEager)],
        }
    return results


def run_inference(
    rank: int, world: int, probes: list[tuple[str, int, int]], variant: str
) -> dict[tuple[str, int, int], dict[str, Any]]:
    """Per probe, in eval under ``torch.no_grad()``: ``{"problems": [...], "sharded": [...]}``."""
    results: dict[tuple[str, int, int], dict[str, Any]] = {}
    for name, seq, batch in probes:
        torch._dynamo.reset()
        model = build(name, seq).eval()
        args = inputs(name, seq, batch)
        with torch.no_grad():
            ref = model(*args)
            compiled = autosp.compile(copy.deepcopy(model), variant=variant, backend="aot_eager")
            with caches_off():
                got = compiled(*args)
        ref, got = ([out] if isinstance(out, torch.Tensor) else list(out) for out in (ref, got))
        empty = {"grads": {}, "buffers": {}}
        results[name, seq, batch] = {
            "problems": differences({"outs": got, **empty}, {"outs": ref, **empty}),
            "sharded": [r.seq_len for r in compiled.autosp_reports],
        }
    return results


__all__ = ["differences", "run_inference", "run_probes", "step"]


def run_lengths(
    rank: int, world: int, name: str, lengths: list[int], batch: int, variant: str, backend: str = "aot_eager"
) -> dict[int, Any]:
    """One compiled model called at several sequence lengths (Dynamo's second shape makes it dynamic)."""
    torch._dynamo.reset()
    model = build(name, lengths[0])
    compiled = autosp.compile(copy.deepcopy(model), backend=backend, fullgraph=True, variant=variant)
    out: dict[int, Any] = {}
    for seq in lengths:
        args = inputs(name, seq, batch)
        ref_model = copy.deepcopy(model)
        ref = step(ref_model, args)
        compiled._orig_mod.zero_grad(set_to_none=True)
        try:
            with caches_off():
                got = step(compiled, args)
        except Exception as e:  # noqa: BLE001 - a refusal is a verdict
            out[seq] = {"error": f"{type(e).__name__}: {str(e)[:600]}"}
            continue
        out[seq] = {"problems": differences(got, ref), "sharded": [r.seq_len for r in compiled.autosp_reports]}
    return out
