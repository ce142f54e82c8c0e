"""Workers for test_auto_variant: Llama-style models of several head counts compiled with variant="auto"."""

from __future__ import annotations

from typing import Any

import torch

import autosp
from autosp.testing.models import Config, LlamaLike

# name -> (heads, kv heads, dim): 4 heads split over 2 and 4 ranks; 2 and 3 heads do not split over 4.
SHAPES = {"h4": (4, 2, 64), "h2": (2, 1, 64), "h3": (3, 1, 48)}


class MHALM(torch.nn.Module):
    """``nn.MultiheadAttention`` (3 heads, causal): its SDPA call appears only once the graph is lowered."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(96, 48)
        self.mha = torch.nn.MultiheadAttention(48, 3, batch_first=True)
        self.head = torch.nn.Linear(48, 96)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        causal = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool).triu(1)
        x = x + self.mha(x, x, x, attn_mask=causal, need_weights=False)[0]
        return torch.nn.functional.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "mha3":
        return MHALM()
    heads, kv, dim = SHAPES[name]
    return LlamaLike(Config(heads=heads, kv_heads=kv, dim=dim, layers=1, hidden=64))


def step(model: Any, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    loss = model(batch["ids"], batch["labels"])
    loss.backward()
    params = model._orig_mod if hasattr(model, "_orig_mod") else model
    grads = {n: p.grad.detach().clone() for n, p in params.named_parameters() if p.grad is not None}
    return {"loss": loss.detach(), "grads": grads}


def batch(seq: int = 32) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 96, (2, seq), generator=torch.Generator().manual_seed(3))
    labels = ids.clone()
    labels[0, 2:9] = -100
    return {"ids": ids, "labels": labels}


def run_auto(rank: int, world: int, cases: list[tuple[str, str | None]], variant: str = "auto") -> dict[str, Any]:
    """Each (model, hardware) compiled with ``variant`` ("auto", or "hybrid" without a degree); loss,
    gradients and what was chosen."""
    out = {}
    for name, hardware in cases:
        compiled = autosp.compile(
            build(name),
            sp_size=world,
            variant=variant,
            hardware=hardware,
            backend="aot_eager",
            fullgraph=True,
            sac=False,
        )
        result = step(compiled, batch())
        report = compiled.autosp_reports[0]
        result["variant"] = report.variant
        result["notes"] = list(report.notes)
        out[f"{name}@{hardware}"] = result
    return out
