"""autosp.tile_loss in one process: which LM heads + losses it tiles, and that results do not change."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autosp
from autosp.testing.models import Config, LlamaLike

V, D = 96, 16


class SoftcapHead(nn.Module):
    """An embedding, a biased LM head, an upcast and a Gemma-style soft-cap before the loss."""

    def __init__(self, smoothing: float = 0.0, return_logits: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.proj = nn.Linear(D, D)
        self.head = nn.Linear(D, V)
        self.smoothing, self.return_logits = smoothing, return_logits

    def forward(self, ids: torch.Tensor, labels: torch.Tensor):
        logits = self.head(torch.tanh(self.proj(self.embed(ids)))).float()
        logits = torch.tanh(logits / 5.0) * 5.0
        loss = F.cross_entropy(logits.view(-1, V), labels.view(-1), label_smoothing=self.smoothing, reduction="sum")
        return (loss, logits) if self.return_logits else loss


class MatmulHead(nn.Module):
    """``hidden @ weight.T`` on [B, S, D] (a permute, not ``t``), mean loss over the shifted tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.weight = nn.Parameter(torch.randn(V, D) / D**0.5)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.embed(ids).sin() @ self.weight.T
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


class TokenBiasHead(nn.Module):
    """An LM head as ``addmm`` with a bias row per token (looked up from the token): once a crash."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.bias = nn.Embedding(V, D), nn.Embedding(V, V)
        self.weight = nn.Parameter(torch.randn(V, D) / D**0.5)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = torch.addmm(self.bias(ids).flatten(0, 1), self.embed(ids).flatten(0, 1), self.weight.t())
        return F.cross_entropy(logits, labels.flatten())


def _batch(seq: int = 48) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (2, seq), generator=g)
    labels = ids.roll(-1, 1)
    labels[:, -1] = -100
    labels[1, :9] = -100
    return ids, labels


def _step(model: nn.Module, compiled, ids, labels) -> tuple[torch.Tensor, dict]:
    out = compiled(ids, labels)
    loss = out[0] if isinstance(out, tuple) else out
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _compare(make, backend: str, tile, **kw) -> list[str]:
    ids, labels = _batch()
    torch.manual_seed(0)
    model = make()
    ref_model = copy.deepcopy(model)
    ref_loss, ref_grads = _step(ref_model, ref_model, ids, labels)
    torch._dynamo.reset()
    compiled = autosp.compile(model, backend=backend, tile_loss=tile, **kw)
    loss, grads = _step(model, compiled, ids, labels)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6, msg=name)
    return [n for n in compiled.autosp_reports[0].notes if n.startswith("tile_loss")]


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_llama_head_is_tiled_and_exact(backend: str) -> None:
    notes = _compare(lambda: LlamaLike(Config(layers=1)), backend, 16)
    assert len(notes) == 1 and notes[0].startswith("tile_loss: tiled") and "chunks of 16 rows" in notes[0], notes


@pytest.mark.parametrize("make", [SoftcapHead, MatmulHead], ids=["bias-upcast-softcap", "matmul-weight-T"])
def test_other_heads_are_tiled(make) -> None:
    notes = _compare(make, "aot_eager", 10)
    assert len(notes) == 1 and notes[0].startswith("tile_loss: tiled"), notes


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (lambda: SoftcapHead(smoothing=0.1), "used beyond the loss"),
        (lambda: SoftcapHead(return_logits=True), "used elsewhere"),
        (TokenBiasHead, "a bias row per token"),
    ],
)
def test_left_as_is_when_not_provably_exact_or_logits_live(make, why: str) -> None:
    notes = _compare(make, "aot_eager", 10)
    assert len(notes) == 1 and "not tiled" in notes[0] and why in notes[0], notes


def test_default_tiles_only_when_it_saves_memory_and_off_means_off() -> None:
    # 94 tokens x 96 classes fit one default chunk: nothing to save, the graph is left as is.
    notes = _compare(lambda: LlamaLike(Config(layers=1)), "aot_eager", True)
    assert len(notes) == 1 and "fit in one chunk" in notes[0], notes
    assert _compare(lambda: LlamaLike(Config(layers=1)), "aot_eager", False) == []


@pytest.mark.parametrize("bad", [0, -3, 2.5, "yes"])
def test_bad_tile_loss_is_refused(bad) -> None:
    with pytest.raises(autosp.ConfigError, match="tile_loss="):
        autosp.compile(nn.Linear(2, 2), tile_loss=bad)
