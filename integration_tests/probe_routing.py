"""The thirteenth round of held-out probes: tokens routed, sampled, merged and recurred over.

Token merging (ToMe's bipartite matching of even against odd tokens, merged by ``scatter_reduce``'s
mean); a Gumbel-softmax router over experts and REINFORCE over tokens drawn by ``multinomial``
(random draws shaped by the sequence); an STFT frontend (a waveform whose frames are the sequence,
complex values); a bidirectional ``nn.LSTM`` over the attention's output; point-cloud neighbourhoods
(``cdist`` over positions, ``topk`` nearest, their features gathered); a relative-position bias whose
buckets come from ``bucketize``; tokens merged in pairs by a ``reshape`` after ``F.pad``; local
attention over ``unfold``ed windows; mixture-of-depths (``topk`` over the sequence, the chosen tokens
processed and ``scatter``ed back); neighbouring tokens compared by ``cosine_similarity`` against a
``roll``ed negative; gated linear attention through ``logcumsumexp``; stick-breaking weights by
``cumprod``; distillation from a frozen teacher by ``kl_div``.

``probe_models.build`` and ``probe_models.inputs`` find these by name.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from probe_models import CLASSES, DIM, HEADS, VOCAB, Attn, LMBase


class TokenMerge(LMBase):
    """ToMe: even tokens matched to their most similar odd token, the best-matched half of them
    merged into it by ``scatter_reduce(..., 'mean')``; the merged sequence pooled into a classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.cls = nn.Linear(DIM, CLASSES)

    def forward(self, ids, y):
        x = self.embed(ids)
        x = x + self.attn(self.ln(x))
        a, b = x[:, ::2], x[:, 1::2]
        scores = F.normalize(a, dim=-1) @ F.normalize(b, dim=-1).transpose(1, 2)
        best, match = scores.max(-1)
        order = best.argsort(dim=-1, descending=True)
        r = a.shape[1] // 2
        merged_from, kept = order[:, :r], order[:, r:]
        src = a.gather(1, merged_from[..., None].expand(-1, -1, DIM))
        dst = match.gather(1, merged_from)[..., None].expand(-1, -1, DIM)
        b = b.scatter_reduce(1, dst, src, reduce="mean")
        a = a.gather(1, kept[..., None].expand(-1, -1, DIM))
        return self.lm_loss(x, ids) + F.cross_entropy(self.cls(torch.cat([a, b], 1).mean(1)), y)


class GumbelRouter(LMBase):
    """Each token routed to one of four experts by a hard ``gumbel_softmax`` (straight-through)."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, 4)
        self.experts = nn.Parameter(torch.randn(4, DIM, DIM) / DIM**0.5)

    def forward(self, ids):
        x = self.embed(ids)
        x = x + self.attn(self.ln(x))
        gate = F.gumbel_softmax(self.router(x), tau=0.7, hard=True)  # [B, S, 4]
        out = torch.einsum("bse,edf,bsd->bsf", gate, self.experts, x)
        return self.lm_loss(x + out, ids)


class MultinomialReinforce(LMBase):
    """REINFORCE: a token drawn per position by ``multinomial`` from the model's distribution, its
    log-probability weighted by a reward (it matching the next token), with the LM loss."""

    def forward(self, ids):
        x = self.embed(ids)
        x = x + self.attn(self.ln(x))
        logits = self.head(x)
        B, S, V = logits.shape
        probs = logits.softmax(-1)
        drawn = torch.multinomial(probs.detach().reshape(B * S, V), 1).reshape(B, S)
        logp = logits.log_softmax(-1).gather(2, drawn[..., None]).squeeze(-1)
        reward = (drawn[:, :-1] == ids[:, 1:]).float()
        return self.lm_loss(x, ids) - (reward * logp[:, :-1]).mean()


class StftFrontend(nn.Module):
    """Audio: a waveform's STFT magnitudes (``torch.stft``, complex) are the sequence of frames."""

    N_FFT, HOP = 16, 4

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(self.N_FFT // 2 + 1, DIM)
        self.attn = Attn(causal=False)
        self.cls = nn.Linear(DIM, CLASSES)
        self.register_buffer("window", torch.hann_window(self.N_FFT))

    def forward(self, wave, y):
        spec = torch.stft(wave, self.N_FFT, self.HOP, window=self.window, return_complex=True)
        x = self.proj(torch.log1p(spec.abs()).transpose(1, 2))  # [B, frames, DIM]
        x = x + self.attn(x)
        return F.cross_entropy(self.cls(x.mean(1)), y)


class LstmHead(LMBase):
    """A bidirectional ``nn.LSTM`` over the attention's output, the LM head on its states."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(DIM, DIM // 2, batch_first=True, bidirectional=True)

    def forward(self, ids):
        x = self.embed(ids)
        x = x + self.attn(self.ln(x))
        h, _ = self.rnn(x)
        return self.lm_loss(x + h, ids)


class KnnPoints(nn.Module):
    """Point-cloud neighbourhoods: ``cdist`` between the points (the sequence), the four nearest
    by ``topk``, their features gathered and max-pooled (as Point Transformer and DGCNN do)."""

    K = 4

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(3, DIM)
        self.attn = Attn(causal=False)
        self.edge = nn.Linear(2 * DIM, DIM)
        self.cls = nn.Linear(DIM, CLASSES)

    def forward(self, points, y):
        x = self.inp(points)
        x = x + self.attn(x)
        near = torch.cdist(points, points).topk(self.K, dim=-1, largest=False).indices  # [B, S, K]
        B, S, _ = x.shape
        nbr = x.gather(1, near.reshape(B, S * self.K, 1).expand(-1, -1, DIM)).reshape(B, S, self.K, DIM)
        e = self.edge(torch.cat([x[:, :, None].expand_as(nbr), nbr - x[:, :, None]], -1)).amax(2)
        return F.cross_entropy(self.cls(e.mean(1)), y)


class BucketizedBias(LMBase):
    """A learned relative-position bias per head whose buckets ``bucketize`` picks from log-spaced
    boundaries on ``j - i``, added to the scores of SDPA."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Embedding(9, HEADS)
        self.register_buffer("edges", torch.tensor([-8.0, -4.0, -2.0, -1.0, 0.0, 1.0, 2.0, 4.0]))

    def forward(self, ids):
        x = self.embed(ids)
        S = ids.shape[1]
        pos = torch.arange(S, dtype=torch.float32)
        buckets = torch.bucketize(pos[None, :] - pos[:, None], self.edges)  # [S, S]
        bias = self.bias(buckets).permute(2, 0, 1)[None]  # [1, H, S, S]
        return self.lm_loss(x + self.attn(self.ln(x), bias), ids)


class PairMerge(LMBase):
    """Neighbouring tokens merged in pairs by a ``reshape`` (``F.pad`` to an even length first), a
    linear on the pairs, unmerged and cropped back."""

    def __init__(self) -> None:
        super().__init__()
        self.pair = nn.Linear(2 * DIM, 2 * DIM)

    def forward(self, ids):
        x = self.embed(ids)
        x = x + self.attn(self.ln(x))
        B, S, _ = x.shape
        p = F.pad(x, (0, 0, 0, S % 2))
        merged = self.pair(p.reshape(B, -1, 2 * DIM))
        return self.lm_loss(x + merged.reshape(B, -1, DIM)[:, :S], ids)


class UnfoldLocal(LMBase):
    """Local attention over non-overlapping windows of four taken by ``unfold`` (padded to a
    multiple), each window's queries against its keys, folded back by a reshape."""

    W = 4

    def forward(self, ids):
        x = self.embed(ids)
        x = x + self.attn(self.ln(x))
        B, S, D = x.shape
        p = F.pad(x, (0, 0, 0, -S % self.W))
        win = p.unfold(1, self.W, self.W).transpose(2, 3)  # [B, n, W, D]
        a = torch.softmax(win @ win.transpose(2, 3) / D**0.5, dim=-1) @ win
        return self.lm_loss(x + a.reshape(B, -1, D)[:, :S], ids)


class MixtureOfDepths(LMBase):
    """Mixture-of-depths: a router picks half the tokens by ``topk`` over the sequence; only they
    pass an MLP, weighted by their router score, and are ``scatter``ed back in place."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, 1)
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))

    def forward(self, ids):
        x = self.embed(ids)
        x = x + self.attn(self.ln(x))
        score = self.router(x).squeeze(-1)  # [B, S]
        top = score.topk(x.shape[1] // 2, dim=1).indices.sort(dim=1).values
        idx = top[..., None].expand(-1, -1, DIM)
        chosen = torch.take_along_dim(x, idx, dim=1)
        w = torch.sigmoid(torch.take_along_dim(score, top, dim=1))[..., None]
        x = x.scatter(1, idx, chosen + w * self.mlp(chosen))
        return self.lm_loss(x, ids)


class CosineNeighbours(LMBase):
    """Neighbouring tokens pulled together by ``cosine_similarity`` against a ``roll``ed negative
    (a triplet margin), with the LM loss."""

    def forward(self, ids):
        x = self.embed(ids)
        x = x + self.attn(self.ln(x))
        anchor, pos = x[:, 1:], x[:, :-1]
        neg = torch.roll(x, shifts=3, dims=1)[:, 1:]
        margin = F.cosine_similarity(anchor, neg, dim=-1) - F.cosine_similarity(anchor, pos, dim=-1)
        return self.lm_loss(x, ids) + F.relu(margin + 0.2).mean()


class GatedLinearAttention(LMBase):
    """Gated linear attention in log space: decays accumulated by ``logcumsumexp`` over the
    sequence, a causal [S, S] decay matrix from their differences."""

    def __init__(self) -> None:
        super().__init__()
        self.qkvg = nn.Linear(DIM, 4 * DIM)

    def forward(self, ids):
        x = self.embed(ids)
        x = x + self.attn(self.ln(x))
        q, k, v, g = self.qkvg(self.ln(x)).chunk(4, -1)
        logg = F.logsigmoid(g.mean(-1))  # [B, S]
        cum = torch.logcumsumexp(logg, dim=1)
        S = ids.shape[1]
        decay = torch.exp(cum[:, :, None] - cum[:, None, :]).masked_fill(~torch.ones(S, S, dtype=torch.bool).tril(), 0)
        return self.lm_loss(x + (decay * (q @ k.transpose(1, 2)) / DIM) @ v, ids)


class StickBreaking(nn.Module):
    """Stick-breaking pooling: break fractions by ``sigmoid``, the stick left by an exclusive
    ``cumprod`` along the sequence, tokens weighted by what they break off."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.attn = Attn(causal=False)
        self.brk = nn.Linear(DIM, 1)
        self.cls = nn.Linear(DIM, CLASSES)

    def forward(self, ids, y):
        x = self.embed(ids)
        x = x + self.attn(x)
        beta = torch.sigmoid(self.brk(x).squeeze(-1))
        left = torch.cumprod(F.pad(1 - beta, (1, 0), value=1.0)[:, :-1], dim=1)
        w = beta * left
        return F.cross_entropy(self.cls((w[..., None] * x).sum(1)), y)


class KlDistill(LMBase):
    """Distillation: a frozen teacher (``requires_grad_(False)``, run under ``no_grad``) inside the
    forward; the student's ``log_softmax`` against it by ``kl_div``, plus the LM loss."""

    def __init__(self) -> None:
        super().__init__()
        self.teacher = LMBase().requires_grad_(False)

    def forward(self, ids):
        x = self.embed(ids)
        x = x + self.attn(self.ln(x))
        with torch.no_grad():
            t = self.teacher.embed(ids)
            t = self.teacher.head(t + self.teacher.attn(self.teacher.ln(t)))
        kl = F.kl_div(self.head(x).log_softmax(-1), t.log_softmax(-1), log_target=True, reduction="batchmean")
        return self.lm_loss(x, ids) + kl


PROGRAMS: dict[str, Callable[[int], nn.Module]] = {
    "token-merge": lambda s: TokenMerge(),
    "gumbel-router": lambda s: GumbelRouter(),
    "multinomial-reinforce": lambda s: MultinomialReinforce(),
    "stft-frontend": lambda s: StftFrontend(),
    "lstm-head": lambda s: LstmHead(),
    "knn-points": lambda s: KnnPoints(),
    "bucketized-bias": lambda s: BucketizedBias(),
    "pair-merge": lambda s: PairMerge(),
    "unfold-local": lambda s: UnfoldLocal(),
    "mixture-of-depths": lambda s: MixtureOfDepths(),
    "cosine-neighbours": lambda s: CosineNeighbours(),
    "gated-linear-attention": lambda s: GatedLinearAttention(),
    "stick-breaking": lambda s: StickBreaking(),
    "kl-distill": lambda s: KlDistill(),
}


def program_inputs(name: str, seq: int, batch: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
    y = torch.randint(0, CLASSES, (batch,), generator=g)
    if name == "stft-frontend":
        # ``seq`` frames: a centred STFT of hop h over T samples gives T // h + 1 frames.
        return torch.randn(batch, (seq - 1) * StftFrontend.HOP, generator=g), y
    if name == "knn-points":
        return torch.randn(batch, seq, 3, generator=g), y
    if name in ("token-merge", "stick-breaking"):
        return ids, y
    return (ids,)


__all__ = ["PROGRAMS", "program_inputs"]
