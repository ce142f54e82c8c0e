"""Spawned workers for test_sharded_outputs: a model returning (loss, logits), outputs='sharded'."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from cases import caches_off

import autosp

VOCAB, DIM, SEQ = 48, 32, 16


class LogitsLM(nn.Module):
    """An HF-style causal LM: returns the loss and the logits."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.emb(ids)
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, 4, DIM // 4).permute(2, 0, 3, 1, 4)
        x = x + F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, DIM)
        logits = self.head(x)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        return loss, logits


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))


def _objective(loss: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    # The logits' own gradient path: a z-loss-like term computed from the whole logits.
    return loss + 1e-2 * logits.float().logsumexp(-1).pow(2).mean()


def reference() -> dict[str, Any]:
    model = LogitsLM()
    loss, logits = model(_ids())
    _objective(loss, logits).backward()
    return {
        "loss": loss.detach(),
        "logits": logits.detach(),
        "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
    }


def run(rank: int, world: int, variant: str, backend: str) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    torch._dynamo.reset()
    model = LogitsLM()
    compiled = autosp.compile(model, backend=backend, variant=variant, outputs="sharded")
    with caches_off():
        loss, logits = compiled(_ids())
        is_dtensor = isinstance(logits, DTensor)
        placements = [str(p) for p in logits.placements] if is_dtensor else []
        local_shape = tuple(logits.to_local().shape) if is_dtensor else None
        whole = logits.full_tensor() if is_dtensor else logits
        _objective(loss, whole).backward()
    out = {
        "loss": loss.detach(),
        "logits": whole.detach(),
        "dtensor": is_dtensor,
        "placements": placements,
        "local_shape": local_shape,
        "loss_is_dtensor": isinstance(loss, DTensor),
        "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
        "outputs": [o for r in compiled.autosp_reports for o in r.outputs],
    }
    # The default gathers the logits whole; past the threshold the report says so and what to do.
    import autosp.passes.core as core

    core.LARGE_OUTPUT_BYTES = 1
    torch._dynamo.reset()
    compiled = autosp.compile(LogitsLM(), backend=backend, variant=variant)
    with caches_off():
        compiled(_ids())
    out["whole_notes"] = [n for r in compiled.autosp_reports for n in r.notes]
    return out


class CutLM(nn.Module):
    """Logits with the first ``cut`` positions dropped: a sequence output of another length than the input's."""

    def __init__(self, cut: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.cut = cut
        self.emb = nn.Embedding(VOCAB, DIM)
        self.q, self.k, self.v = (nn.Linear(DIM, DIM, bias=False) for _ in range(3))
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        q, k, v = (p(x).unflatten(-1, (4, DIM // 4)).transpose(1, 2) for p in (self.q, self.k, self.v))
        x = x + F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2)
        return self.head(x)[:, self.cut :]


def run_uneven(
    rank: int, world: int, cases: list[tuple[int, int, bool]], variant: str, backend: str = "aot_eager"
) -> dict[tuple, Any]:
    """Per (length, cut, marked dynamic): the logits whole, their type and local length, gradients' error."""
    from torch.distributed.tensor import DTensor

    out: dict[tuple, Any] = {}
    for seq, cut, dynamic in cases:
        torch._dynamo.reset()
        ids = torch.randint(0, VOCAB, (2, seq), generator=torch.Generator().manual_seed(seq))
        ref_model, model = CutLM(cut), CutLM(cut)
        ref = ref_model(ids)
        ref.logsumexp(-1).pow(2).mean().backward()
        compiled = autosp.compile(model, backend=backend, variant=variant, outputs="sharded")
        if dynamic:
            torch._dynamo.mark_dynamic(ids, 1)
        with caches_off():
            logits = compiled(ids)
            local = logits.to_local().shape[1] if isinstance(logits, DTensor) else None
            whole = logits.full_tensor() if isinstance(logits, DTensor) else logits
            whole.logsumexp(-1).pow(2).mean().backward()
        out[seq, cut, dynamic] = {
            "dtensor": isinstance(logits, DTensor),
            "local": local,
            "error": (whole - ref).abs().max().item(),
            "grad_error": max(
                (p.grad - r.grad).abs().max().item() for p, r in zip(model.parameters(), ref_model.parameters())
            ),
            "notes": [n for r in compiled.autosp_reports for n in r.notes],
        }
    return out
