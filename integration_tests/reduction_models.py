"""Programs that reduce or select along the sequence before batch-level math, written as users write them.

Classifiers pooling an encoder's tokens, a reward model scoring the last token with
a margin loss, a DPO-style preference loss over per-sequence log-probability sums,
an encoder that prepends a learned [CLS] token inside ``forward``, HF-style
``position_ids`` from ``cumsum``.  None of them knows about sequence parallelism.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, DIM, HEADS = 64, 32, 4


class EncoderLayer(nn.Module):
    def __init__(self, causal: bool = False) -> None:
        super().__init__()
        self.causal = causal
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.ff = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))

    def forward(self, x, mask=None):
        B, S, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, S, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.causal and mask is None)
        x = x + self.proj(a.transpose(1, 2).reshape(B, S, DIM))
        return x + self.ff(self.ln2(x))


class PoolClassifier(nn.Module):
    """Bidirectional encoder -> pool over the sequence -> classifier with bias -> CE against [B] targets."""

    def __init__(self, pool: str) -> None:
        super().__init__()
        self.pool = pool
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layer = EncoderLayer()
        self.cls = nn.Linear(DIM, 3)

    def forward(self, ids, y):
        x = self.layer(self.embed(ids))
        if self.pool == "mean":
            h = x.mean(dim=1)
        elif self.pool == "sum":
            h = x.sum(1) / 10.0 + 1.0  # a constant added after a sequence sum
        elif self.pool == "max":
            h = x.max(dim=1).values
        elif self.pool == "first":
            h = x[:, 0]
        elif self.pool == "last":
            h = x[:, -1]
        elif self.pool == "logsumexp":
            h = torch.logsumexp(x, dim=1)
        elif self.pool == "norm":
            h = x / x.norm(dim=1, keepdim=True)
            h = h[:, 3]
        else:  # weighted: per-example weights on the loss
            h = x.mean(1)
            w = torch.linspace(0.5, 1.5, ids.shape[0])
            return (F.cross_entropy(self.cls(h), y, reduction="none") * w).sum() / w.sum()
        return F.cross_entropy(self.cls(h), y)


class RewardModel(nn.Module):
    """Causal decoder scoring the last token; Bradley-Terry margin loss over (chosen, rejected) pairs."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layer = EncoderLayer(causal=True)
        self.score = nn.Linear(DIM, 1)

    def forward(self, chosen, rejected):
        ids = torch.cat([chosen, rejected], dim=0)
        rewards = self.score(self.layer(self.embed(ids))[:, -1]).squeeze(-1)
        r_c, r_r = rewards.chunk(2)
        return -F.logsigmoid(r_c - r_r - 0.5).mean()


class PreferenceModel(nn.Module):
    """DPO: per-sequence sums of token log-probabilities (labels shifted inside), sigmoid loss over pairs."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layer = EncoderLayer(causal=True)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def logps(self, ids, loss_mask):
        logits = self.head(self.layer(self.embed(ids)))[:, :-1]
        labels = ids[:, 1:]
        per_token = torch.gather(logits.log_softmax(-1), 2, labels.unsqueeze(-1)).squeeze(-1)
        return (per_token * loss_mask[:, 1:]).sum(-1)

    def forward(self, chosen, rejected, loss_mask, ref_chosen, ref_rejected):
        pc = self.logps(chosen, loss_mask)
        pr = self.logps(rejected, loss_mask)
        margin = 0.1 * ((pc - ref_chosen) - (pr - ref_rejected))
        return -F.logsigmoid(margin).mean()


class ClsTokenEncoder(nn.Module):
    """Prepends a learned [CLS] embedding inside forward and classifies from it."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.cls_token = nn.Parameter(torch.randn(1, 1, DIM) * 0.02)
        self.pos = nn.Parameter(torch.randn(1, 64, DIM) * 0.02)
        self.layer = EncoderLayer()
        self.head = nn.Linear(DIM, 3)

    def forward(self, ids, y):
        x = self.embed(ids)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = x + self.pos[:, : x.shape[1]]
        return F.cross_entropy(self.head(self.layer(x)[:, 0]), y)


class PaddedCumsumLM(nn.Module):
    """HF-style: position_ids from attention_mask.cumsum, padding mask, running-mean feature, token loss."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Embedding(64, DIM)
        self.layer = EncoderLayer(causal=True)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids, attention_mask, labels):
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        x = self.embed(ids) + self.pos(position_ids)
        S = ids.shape[1]
        causal = torch.ones(S, S, dtype=torch.bool).tril()
        mask = causal[None, None] & attention_mask[:, None, None, :].bool()
        mask = mask | torch.eye(S, dtype=torch.bool)
        x = self.layer(x, mask)
        steps = torch.arange(1, S + 1, dtype=x.dtype)[None, :, None]
        x = x + 0.1 * x.cumsum(1) / steps
        logits = self.head(x)
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1), ignore_index=-100)


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name.startswith("pool-"):
        return PoolClassifier(name.removeprefix("pool-"))
    return {"reward": RewardModel, "dpo": PreferenceModel, "cls-token": ClsTokenEncoder, "cumsum": PaddedCumsumLM}[
        name
    ]()


def inputs(name: str, batch: int = 2, seq: int = 16) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=gen)
    y = torch.randint(0, 3, (batch,), generator=gen)
    if name == "reward":
        return ids, torch.randint(0, VOCAB, (batch, seq), generator=gen)
    if name == "dpo":
        mask = torch.ones(batch, seq)
        mask[:, : seq // 4] = 0  # the prompt: no loss on it
        return (
            ids,
            torch.randint(0, VOCAB, (batch, seq), generator=gen),
            mask,
            torch.randn(batch, generator=gen),
            torch.randn(batch, generator=gen),
        )
    if name == "cls-token":
        return ids[:, 1:], y  # one token fewer: [CLS] makes it whole again
    if name == "cumsum":
        mask = torch.ones(batch, seq, dtype=torch.long)
        mask[0, :5] = 0  # left padding
        labels = ids.clone()
        labels[0, :5] = -100
        return ids, mask, labels
    return ids, y


NAMES = [
    "pool-mean",
    "pool-sum",
    "pool-max",
    "pool-first",
    "pool-last",
    "pool-logsumexp",
    "pool-norm",
    "pool-weighted",
    "reward",
    "dpo",
    "cls-token",
    "cumsum",
]

__all__ = ["NAMES", "build", "inputs"]
