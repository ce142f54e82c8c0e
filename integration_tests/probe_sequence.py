"""The twelfth round of held-out probes: the sequence axis used as something other than positions.

Parameters whose size is the sequence length (MLP-Mixer's token-mixing linear, gMLP's spatial gate
as a ``Conv1d`` whose channels are the positions, Linformer's learned key projection); pair
representations with two sequence axes (AlphaFold-style outer sums, a triangle update, pooled back);
a CRF's loss (transition scores indexed by neighbouring labels, a forward recursion over positions);
reinforcement learning's returns-to-go (a discounted reverse cumsum) with ``linspace`` positions;
attention pooling (``softmax`` and ``log_softmax`` over the sequence); InfoNCE over positions (each
position's logits over every position); order statistics along the sequence (``kthvalue``,
``quantile``, ``mode``); the sequence tiled (``repeat``) and pooled into segments by ``scatter_reduce``'s
``amax``; ``unbind`` over positions summed in Python.

``probe_models.build`` and ``probe_models.inputs`` find these by name.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from probe_models import CLASSES, DIM, VOCAB, Attn, LMBase


class TokenMixer(LMBase):
    """MLP-Mixer: a linear over the positions (its weight [S, S]), on the transposed sequence."""

    def __init__(self, seq: int) -> None:
        super().__init__()
        self.mix = nn.Linear(seq, seq)

    def forward(self, ids):
        x = self.embed(ids)
        x = x + self.attn(self.ln(x))
        x = x + self.mix(self.ln(x).transpose(1, 2)).transpose(1, 2)
        return self.lm_loss(x, ids)


class SpatialGate(LMBase):
    """gMLP's spatial gating unit: a ``Conv1d`` whose channels are the positions, gating half the features."""

    def __init__(self, seq: int) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, 2 * DIM)
        self.spatial = nn.Conv1d(seq, seq, 1)
        self.back = nn.Linear(DIM, DIM)

    def forward(self, ids):
        x = self.embed(ids)
        x = x + self.attn(self.ln(x))
        u, v = F.gelu(self.proj(self.ln(x))).chunk(2, dim=-1)
        return self.lm_loss(x + self.back(u * self.spatial(v)), ids)


class Linformer(nn.Module):
    """Linformer: keys and values projected along the sequence by learned [S, k] matrices (einsum)."""

    def __init__(self, seq: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.e = nn.Parameter(torch.randn(seq, 4) / seq**0.5)
        self.f = nn.Parameter(torch.randn(seq, 4) / seq**0.5)
        self.attn = Attn(causal=False)
        self.cls = nn.Linear(DIM, CLASSES)

    def forward(self, ids, y):
        x = self.embed(ids)
        x = x + self.attn(x)
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        k, v = torch.einsum("bsd,sk->bkd", k, self.e), torch.einsum("bsd,sk->bkd", v, self.f)
        x = x + torch.softmax(q @ k.transpose(1, 2) / DIM**0.5, dim=-1) @ v
        return F.cross_entropy(self.cls(x.mean(1)), y)


class PairRepresentation(LMBase):
    """A pair representation [B, S, S, c] from an outer sum, a triangle update over the shared
    position (``einsum('bikc,bjkc->bijc')``), pooled back over one axis into the sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.left, self.right = nn.Linear(DIM, 8), nn.Linear(DIM, 8)
        self.gate = nn.Linear(8, 8)
        self.back = nn.Linear(8, DIM)

    def forward(self, ids):
        x = self.embed(ids)
        x = x + self.attn(self.ln(x))
        pair = self.left(x)[:, :, None] + self.right(x)[:, None, :]
        pair = pair + torch.einsum("bikc,bjkc->bijc", pair, torch.sigmoid(self.gate(pair))) / x.shape[1]
        return self.lm_loss(x + self.back(pair.mean(2)), ids)


class CRF(nn.Module):
    """A linear-chain CRF's negative log-likelihood: the gold path's emissions and transitions
    (``trans[y[:, :-1], y[:, 1:]]``, neighbours across any split) against a forward recursion."""

    TAGS = 5

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.attn = Attn(causal=False)
        self.emit = nn.Linear(DIM, self.TAGS)
        self.trans = nn.Parameter(torch.randn(self.TAGS, self.TAGS) * 0.1)

    def forward(self, ids, tags):
        x = self.embed(ids)
        e = self.emit(x + self.attn(x))  # [B, S, T]
        gold = e.gather(2, tags[..., None]).squeeze(-1).sum(1) + self.trans[tags[:, :-1], tags[:, 1:]].sum(1)
        alpha = e[:, 0]
        for t in range(1, ids.shape[1]):
            alpha = torch.logsumexp(alpha[:, :, None] + self.trans[None] + e[:, t, None, :], dim=1)
        return (torch.logsumexp(alpha, dim=1) - gold).mean()


class ReturnsToGo(nn.Module):
    """A decision-transformer-style value loss: discounted returns-to-go by a flipped cumsum over the
    rewards (shaped by the model), scaled back by ``gamma ** t``, a loss weighted along ``linspace`` positions."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.attn = Attn()
        self.value, self.shaping = nn.Linear(DIM, 1), nn.Linear(DIM, 1)

    def forward(self, ids, rewards):
        S = ids.shape[1]
        x = self.embed(ids)
        x = x + self.attn(x)
        v = self.value(x).squeeze(-1)
        rewards = rewards + 0.1 * torch.tanh(self.shaping(x).squeeze(-1))  # shaped by the model: sharded
        disc = 0.9 ** torch.arange(S, dtype=torch.float32)
        rtg = torch.flip(torch.cumsum(torch.flip(rewards * disc, [1]), 1), [1]) / disc
        weight = torch.linspace(1.0, 2.0, S)
        return (weight * (v - rtg) ** 2).mean()


class AttentionPool(nn.Module):
    """Attention pooling: a score per position, ``softmax`` over the sequence (dim 1), a weighted sum;
    and an entropy bonus from ``log_softmax`` over it."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.attn = Attn(causal=False)
        self.score = nn.Linear(DIM, 1)
        self.cls = nn.Linear(DIM, CLASSES)

    def forward(self, ids, y):
        x = self.embed(ids)
        x = x + self.attn(x)
        s = self.score(x).squeeze(-1)
        w = torch.softmax(s, dim=1)
        pooled = (w[..., None] * x).sum(1)
        entropy = -(w * F.log_softmax(s, dim=1)).sum(1).mean()
        return F.cross_entropy(self.cls(pooled), y) - 0.1 * entropy


class PositionalInfoNCE(nn.Module):
    """Contrastive predictive coding: each position's logits over every position ([B, S, S]), its own
    the positive, by ``cross_entropy`` against ``arange(S)``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.attn = Attn()
        self.z, self.c = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)

    def forward(self, ids):
        x = self.embed(ids)
        h = x + self.attn(x)
        logits = self.c(h) @ self.z(x).transpose(1, 2) / DIM**0.5
        B, S = ids.shape
        return F.cross_entropy(logits.reshape(B * S, S), torch.arange(S).repeat(B))


class OrderStatistics(nn.Module):
    """Order statistics along the sequence: ``kthvalue``, ``quantile`` and ``mode`` of the token ids."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.attn = Attn(causal=False)
        self.cls = nn.Linear(3 * DIM + 1, CLASSES)

    def forward(self, ids, y):
        x = self.embed(ids)
        x = x + self.attn(x)
        k = x.kthvalue(3, dim=1).values
        q = torch.quantile(x, 0.75, dim=1)
        m = (ids % 4).mode(dim=1).values.float()[:, None]
        return F.cross_entropy(self.cls(torch.cat([k, q, x.mean(1), m], -1)), y)


class TiledSegments(LMBase):
    """The sequence tiled twice (``repeat``) through attention, halves added back; then a max per
    segment by ``scatter_reduce(..., 'amax')`` pooled into a classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.cls = nn.Linear(DIM, CLASSES)

    def forward(self, ids, segments, y):
        x = self.embed(ids)
        S = x.shape[1]
        t = self.attn(self.ln(x.repeat(1, 2, 1)))
        x = x + t[:, :S] + t[:, S:]
        index = segments[..., None].expand(-1, -1, DIM)
        pooled = torch.zeros(x.shape[0], 4, DIM).scatter_reduce(1, index, x, "amax", include_self=False)
        return self.lm_loss(x, ids) + F.cross_entropy(self.cls(pooled.mean(1)), y)


class UnbindPositions(LMBase):
    """``unbind`` over the positions, every third summed in Python, added to the last token."""

    def forward(self, ids):
        x = self.embed(ids)
        x = x + self.attn(self.ln(x))
        tokens = x.unbind(1)
        summary = sum(tokens[::3]) / len(tokens[::3])
        return self.lm_loss(torch.cat([x[:, :-1], (x[:, -1] + summary)[:, None]], 1), ids)


PROGRAMS: dict[str, Callable[[int], nn.Module]] = {
    "token-mixer": TokenMixer,
    "spatial-gate": SpatialGate,
    "linformer": Linformer,
    "pair-representation": lambda s: PairRepresentation(),
    "crf": lambda s: CRF(),
    "returns-to-go": lambda s: ReturnsToGo(),
    "attention-pool": lambda s: AttentionPool(),
    "positional-infonce": lambda s: PositionalInfoNCE(),
    "order-statistics": lambda s: OrderStatistics(),
    "tiled-segments": lambda s: TiledSegments(),
    "unbind-positions": lambda s: UnbindPositions(),
}


def program_inputs(name: str, seq: int, batch: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
    y = torch.randint(0, CLASSES, (batch,), generator=g)
    if name == "crf":
        return ids, torch.randint(0, CRF.TAGS, (batch, seq), generator=g)
    if name == "returns-to-go":
        return ids, torch.rand(batch, seq, generator=g)
    if name == "tiled-segments":
        return ids, torch.sort(torch.randint(0, 4, (batch, seq), generator=g), dim=1).values, y
    if name in ("linformer", "attention-pool", "order-statistics"):
        return ids, y
    return (ids,)


__all__ = ["PROGRAMS", "program_inputs"]
