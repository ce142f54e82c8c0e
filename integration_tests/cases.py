"""Workers for the multi-process equivalence suite: each builds models, runs them compiled, returns numbers.

Module-level functions, since spawned processes import them by name.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

import autosp
from autosp.testing.models import Config, GPT2Like, LlamaLike, MeanPoolClassifier, hf_causal_lm


def hf_model(kind: str, heads: int = 4, kv_heads: int = 2) -> torch.nn.Module:
    return hf_causal_lm("llama" if kind == "hf-llama" else "qwen2", heads=heads, kv_heads=kv_heads)


def build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "llama":
        return LlamaLike(Config())
    if name == "llama-window":
        return LlamaLike(Config(window=9))
    if name == "llama-mqa":
        return LlamaLike(Config(heads=4, kv_heads=1))
    if name == "llama-h6":  # 6 heads, 3 kv heads: padded to 8 at P=4
        return LlamaLike(Config(dim=48, heads=6, kv_heads=3, hidden=96))
    if name == "gpt2":
        return GPT2Like(Config(heads=4))
    if name == "pool":
        return MeanPoolClassifier(Config())
    return hf_model(name)


def call(model: Any, name: str, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The scalar loss of one step, plus any sequence-shaped output folded in."""
    if name.startswith("hf-"):
        out = model(input_ids=batch["ids"], labels=batch["labels"], attention_mask=batch.get("mask"))
        return out.loss, out.logits
    if name == "pool":
        return model(batch["ids"], batch["y"]), None
    if name == "gpt2":
        return model(batch["ids"], batch["labels"])
    return model(batch["ids"], batch["labels"], batch.get("mask")), None


def step(model: Any, name: str, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    loss, seq_out = call(model, name, batch)
    total = loss if seq_out is None else loss + seq_out.float().pow(2).mean() * 1e-3
    total.backward()
    params = model._orig_mod if hasattr(model, "_orig_mod") else model
    return {
        "loss": loss.detach(),
        "seq_out": None if seq_out is None else seq_out.detach(),
        "grads": {n: p.grad.detach().clone() for n, p in params.named_parameters() if p.grad is not None},
    }


def reference(name: str, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    return step(build(name), name, batch)


@contextlib.contextmanager
def caches_off() -> Iterator[None]:
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        yield


def run_compiled(
    rank: int, world: int, names: list[str], batches: dict, backend: str, options: dict[str, Any] | None = None
) -> dict[str, Any]:
    results = {}
    for name in names:
        model = build(name)
        compiled = autosp.compile(model, backend=backend, fullgraph=True, **(options or {}))
        with caches_off():  # a hit in Inductor's on-disk caches skips the passes, and the report with them
            out = step(compiled, name, batches[name])
        report = compiled.autosp_reports[0]
        out["collectives"] = dict(report.collectives)
        out["group_ops"] = report.group_ops
        out["fallbacks"] = list(report.fallbacks)
        out["notes"] = list(report.notes)
        out["layers"] = len(report.sites)
        out["params"] = sum(1 for p in model.parameters() if p.requires_grad)
        results[name] = out
    return results


def matmul_shapes(rank: int, world: int, batch: dict[str, torch.Tensor], backend: str) -> list[list[int]]:
    """Input shapes of every matmul the compiled forward and backward run (after a warm-up step)."""
    model = build("llama")
    compiled = autosp.compile(model, backend=backend, fullgraph=True)
    step(compiled, "llama", batch)
    model.zero_grad()
    with torch.profiler.profile(record_shapes=True) as prof:
        step(compiled, "llama", batch)
    shapes = []
    for evt in prof.events():
        if evt.name in ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear"):
            shapes.extend(list(s) for s in evt.input_shapes if s)
    return shapes


def dynamic_lengths(
    rank: int, world: int, batches: list[torch.Tensor], variant: str = "ulysses", backend: str = "aot_eager"
) -> dict[str, Any]:
    """One compiled graph for several sequence lengths, marked dynamic by the user (a refusal's message
    in place of the steps where the variant refuses)."""
    model = build("llama")
    compiled = autosp.compile(model, backend=backend, fullgraph=True, variant=variant)
    steps: list[Any] = []
    for ids in batches:
        torch._dynamo.mark_dynamic(ids, 1)
        model.zero_grad(set_to_none=True)
        try:
            steps.append(step(compiled, "llama", {"ids": ids, "labels": ids}))
        except autosp.AutoSPError as e:
            steps.append(str(e))
    reports = compiled.autosp_reports
    return {
        "steps": steps,
        "graphs": len(reports),
        "report": str(reports[0]),
        "notes": [r.notes for r in reports],
        "collectives": [dict(r.collectives) for r in reports],
    }
