"""The vocabulary of fuzz programs: ops that real models apply to ``[B, S, D]`` activations.

Body ops map ``x`` [B, S, D] (and the batch of inputs) to ``x`` [B, S', D]; loss heads map it to
a scalar. Each is built from one entry of a spec (see ``fuzz_programs``), a plain dict.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

Spec = dict[str, Any]
Batch = dict[str, torch.Tensor]

VOCAB = 32  # token ids and LM targets
CLASSES = 3

# Simplest first in every list: hypothesis shrinks towards the first element.
MASKS = ("none", "causal", "bool_causal", "additive_causal", "window", "padding", "document", "alibi")
TENSOR_MASKS = MASKS[2:]
SEQ_OPS = (
    "drop_first",
    "drop_last",
    "roll",
    "cat_token",
    "token_shift",
    "flip",
    "downsample",
    "stride2",
    "flip_add",
    "roll_add",
)
POOLS = (
    "mean",
    "first",
    "last",
    "sum",
    "amax",
    "logsumexp",
    "norm",
    "index_select",
    "gather",
    "masked_mean",
    "last_valid",
    "attn_pool",
    "std",
    "max",
    "attn_map",
    "topk",
    "hf_last",
)
POOL_HEADS = ("ce", "weighted_ce", "margin", "bce", "mse", "contrastive")


def length_after(op: Spec, s: int) -> int:
    """The sequence length after body op ``op`` applied to length ``s``."""
    if op["op"] == "seq" and op["kind"] in ("drop_first", "drop_last"):
        return s - 1
    if op["op"] == "seq" and op["kind"] == "cat_token":
        return s + 1
    if op["op"] == "seq" and op["kind"] == "downsample":
        return s // 2
    if op["op"] == "seq" and op["kind"] == "stride2":
        return (s + 1) // 2
    return s


def fit(t: torch.Tensor, n: int) -> torch.Tensor:
    """A per-token input ``[B, S]`` aligned with a sequence of length ``n``: cut at the end, or 1s in front."""
    s = t.shape[1]
    if n <= s:
        return t[:, :n]
    return torch.cat([t.new_ones(t.shape[0], n - s), t], dim=1)


# ---- body ops: each maps x [B, S, D] (and the batch) to x [B, S', D] ----


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim) + 0.1 * torch.randn(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


def make_norm(kind: str, dim: int) -> nn.Module:
    return RMSNorm(dim) if kind == "rms" else nn.LayerNorm(dim)


ACTS = {"gelu": F.gelu, "silu": F.silu, "tanh": torch.tanh}


class Linear(nn.Module):
    def __init__(self, op: Spec, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        return self.lin(x)


class Norm(nn.Module):
    def __init__(self, op: Spec, dim: int) -> None:
        super().__init__()
        self.norm = make_norm(op["kind"], dim)

    def forward(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        return self.norm(x)


class Act(nn.Module):
    def __init__(self, op: Spec, dim: int) -> None:
        super().__init__()
        self.kind = op["kind"]

    def forward(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        return ACTS[self.kind](x)


class MLP(nn.Module):
    def __init__(self, op: Spec, dim: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)
        self.kind, self.residual = op["act"], op["residual"]

    def forward(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        out = self.down(ACTS[self.kind](self.up(x)))
        return x + out if self.residual else out


def rope(t: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Rotary embedding of ``t`` [B, H, S, hd] at ``positions`` [B, S] (default: ``arange(S)``)."""
    s, hd = t.shape[-2], t.shape[-1]
    inv = 1.0 / (100.0 ** (torch.arange(0, hd, 2, device=t.device, dtype=torch.float32) / hd))
    if positions is None:
        ang = torch.arange(s, device=t.device, dtype=torch.float32)[:, None] * inv[None, :]  # [S, hd/2]
    else:
        ang = (positions.to(torch.float32)[..., None] * inv)[:, None]  # [B, 1, S, hd/2]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    a, b = t.chunk(2, dim=-1)
    return t * cos + torch.cat([-b, a], dim=-1) * sin


class Attention(nn.Module):
    """A pre-norm (or not) attention block: q/k/v projections (fused or not), GQA, RoPE, a mask kind.

    Optional keys: ``positions`` ("arange", or "input": RoPE at the ``pos_ids`` input, which restart
    at each packed document) and ``gqa`` ("repeat": HF's repeat_kv, or "sdpa": ``enable_gqa=True``).
    """

    def __init__(self, op: Spec, dim: int, heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, op["kv_heads"], dim // heads
        self.mask, self.residual, self.use_rope, self.fused = op["mask"], op["residual"], op["rope"], op["fused"]
        self.positions, self.gqa = op.get("positions", "arange"), op.get("gqa", "repeat")
        self.norm = make_norm(op["norm"], dim) if op["norm"] != "none" else None
        kv = self.kv_heads * self.hd
        if self.fused:
            self.qkv = nn.Linear(dim, dim + 2 * kv)
        else:
            self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, kv), nn.Linear(dim, kv)
        self.o = nn.Linear(dim, dim)

    def attn_mask(self, s: int, batch: Batch, device: torch.device) -> tuple[torch.Tensor | None, bool]:
        if self.mask == "none":
            return None, False
        if self.mask == "causal":
            return None, True
        i = torch.arange(s, device=device)
        causal = i[:, None] >= i[None, :]
        if self.mask == "bool_causal":
            return causal, False
        if self.mask == "additive_causal":
            return torch.zeros(s, s, device=device).masked_fill(~causal, torch.finfo(torch.float32).min), False
        if self.mask == "window":
            return causal & (i[:, None] - i[None, :] < 3), False
        if self.mask == "alibi":  # a per-head additive bias [1, H, S, S]: ALiBi's slopes, causal
            slopes = 2.0 ** -torch.arange(1, self.heads + 1, device=device, dtype=torch.float32)
            bias = -(i[:, None] - i[None, :]).float() * slopes[:, None, None]
            return bias.masked_fill(~causal, float("-inf"))[None], False
        if self.mask == "document":  # packed sequences: causal within each document of the ``doc`` input
            doc = fit(batch["doc"], s)
            return ((doc[:, :, None] == doc[:, None, :]) & causal)[:, None], False
        # Right padding from the ``keep`` input: key 0 is always kept, so no row is fully masked.
        keys = fit(batch["keep"], s).bool()[:, None, None, :]
        return keys & causal, False

    def forward(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        b, s, d = x.shape
        h = self.norm(x) if self.norm is not None else x
        kv = self.kv_heads * self.hd
        if self.fused:
            q, k, v = self.qkv(h).split([d, kv, kv], dim=-1)
        else:
            q, k, v = self.q(h), self.k(h), self.v(h)
        q = q.view(b, s, self.heads, self.hd).transpose(1, 2)  # [B, H, S, hd]
        k = k.view(b, s, self.kv_heads, self.hd).transpose(1, 2)
        v = v.view(b, s, self.kv_heads, self.hd).transpose(1, 2)
        if self.use_rope:
            positions = fit(batch["pos_ids"], s) if self.positions == "input" else None
            q, k = rope(q, positions), rope(k, positions)
        mask, causal = self.attn_mask(s, batch, x.device)
        if self.kv_heads != self.heads and self.gqa == "sdpa":
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True)
            return self.out(x, o)
        if self.kv_heads != self.heads:  # HF's repeat_kv
            n = self.heads // self.kv_heads
            k = k[:, :, None].expand(b, self.kv_heads, n, s, self.hd).reshape(b, self.heads, s, self.hd)
            v = v[:, :, None].expand(b, self.kv_heads, n, s, self.hd).reshape(b, self.heads, s, self.hd)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
        return self.out(x, o)

    def out(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        o = self.o(o.transpose(1, 2).reshape(x.shape))  # [B, H, S, hd] -> [B, S, D]
        return x + o if self.residual else o


class ManualAttention(nn.Module):
    """Attention written out (GPT-2's eager path): scores [B, S, S], tril mask, softmax, weighted sum."""

    def __init__(self, op: Spec, dim: int) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.causal = op["causal"]

    def forward(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        s = x.shape[1]
        scores = self.q(x) @ self.k(x).transpose(1, 2) / math.sqrt(x.shape[-1])
        if self.causal:
            keep = torch.tril(torch.ones(s, s, dtype=torch.bool, device=x.device))
            scores = scores.masked_fill(~keep, float("-inf"))
        return x + torch.softmax(scores, dim=-1) @ self.v(x)


class LinearAttention(nn.Module):
    """Causal linear attention in its parallel form (RetNet, linear transformers): the score matrix
    [B, S, S] is triangled with ``tril`` itself, optionally decayed by distance; or only its
    ``diagonal`` (each token with itself) is used."""

    def __init__(self, op: Spec, dim: int) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.kind = op["kind"]

    def forward(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        scores = self.q(x) @ self.k(x).transpose(1, 2) / x.shape[-1]  # [B, S, S]
        if self.kind == "diagonal":
            return x + scores.diagonal(dim1=1, dim2=2)[..., None] * self.v(x)
        if self.kind == "decay":
            i = torch.arange(x.shape[1], device=x.device)
            scores = scores * 0.9 ** (i[:, None] - i[None, :]).clamp(min=0).to(x.dtype)
        return x + scores.tril() @ self.v(x)


class SeqOp(nn.Module):
    """Shifts, rolls, slices and flips along the sequence; ``cat_token`` prepends a learned token."""

    def __init__(self, op: Spec, dim: int) -> None:
        super().__init__()
        self.kind = op["kind"]
        if self.kind == "cat_token":
            self.token = nn.Parameter(torch.randn(1, 1, dim))

    def forward(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        if self.kind == "drop_first":
            return x[:, 1:]
        if self.kind == "drop_last":
            return x[:, :-1]
        if self.kind == "roll":
            return torch.roll(x, 1, dims=1)
        if self.kind == "cat_token":
            return torch.cat([self.token.expand(x.shape[0], 1, x.shape[2]), x], dim=1)
        if self.kind == "token_shift":  # RWKV-style: each token mixed with the one before it
            prev = F.pad(x, (0, 0, 1, 0))[:, :-1]
            return 0.5 * (x + prev)
        if self.kind == "stride2":  # every other token
            return x[:, ::2]
        if self.kind == "downsample":  # hourglass/funnel: mean of adjacent token pairs, half the length
            b, s, d = x.shape
            return x[:, : s - s % 2].reshape(b, s // 2, 2, d).mean(dim=2)
        if self.kind == "flip_add":  # position t meets position S-1-t (bidirectional mixing)
            return x + 0.5 * torch.flip(x, dims=[1])
        if self.kind == "roll_add":
            return x + 0.5 * torch.roll(x, -2, dims=1)
        return torch.flip(x, dims=[1])


class Cumsum(nn.Module):
    def __init__(self, op: Spec, dim: int) -> None:
        super().__init__()
        self.kind = op["kind"]

    def forward(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        c = x.cumsum(dim=1)
        if self.kind == "mean":  # running mean over the prefix
            return c / torch.arange(1, x.shape[1] + 1, device=x.device, dtype=x.dtype)[None, :, None]
        return 0.25 * c


class SeqStat(nn.Module):
    """A sequence statistic broadcast back to every token (squeeze-excite gate, centring)."""

    def __init__(self, op: Spec, dim: int) -> None:
        super().__init__()
        self.kind = op["kind"]

    def forward(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        if self.kind == "gate_mean":
            return x * torch.sigmoid(x.mean(dim=1, keepdim=True))
        if self.kind == "center":
            return x - x.mean(dim=1, keepdim=True)
        if self.kind == "global_norm":  # over batch, sequence and features at once
            return x * (x.numel() ** 0.5) / x.norm()
        return x / (x.amax(dim=1, keepdim=True).abs() + 1.0)


class PosEmbed(nn.Module):
    def __init__(self, op: Spec, dim: int, max_len: int) -> None:
        super().__init__()
        self.table = nn.Embedding(max_len, dim)

    def forward(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        return x + self.table(torch.arange(x.shape[1], device=x.device))[None]


class MaskTail(nn.Module):
    def __init__(self, op: Spec, dim: int) -> None:
        super().__init__()
        self.k = op["k"]

    def forward(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        s = x.shape[1]
        keep = torch.arange(s, device=x.device) < s - self.k
        return x * keep[None, :, None].to(x.dtype)


class Conv(nn.Module):
    """A causal depthwise convolution along the sequence (Mamba/Hyena-style short conv)."""

    def __init__(self, op: Spec, dim: int) -> None:
        super().__init__()
        self.conv = nn.Conv1d(dim, dim, kernel_size=3, padding=2, groups=dim)

    def forward(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        return self.conv(x.transpose(1, 2))[..., : x.shape[1]].transpose(1, 2)


# ---- losses: each maps x [B, S, D] (and the batch) to a scalar ----


def shifted(x: torch.Tensor, labels: torch.Tensor, shift: str = "next") -> tuple[torch.Tensor, torch.Tensor]:
    """Alignment inside the model, whatever x's length: x at t predicts labels at t+1 (``shift``
    "next", a causal LM), or at t-1 ("prev", a backward LM: the hidden states are cut at the front)."""
    s_x, s = x.shape[1], labels.shape[1]
    n = min(s_x, s) - 1
    if shift == "prev":
        return x[:, s_x - n :], labels[:, s - n - 1 : s - 1]
    return x[:, s_x - n - 1 : s_x - 1], labels[:, s - n :]


class LMLoss(nn.Module):
    """Next-token cross entropy; optional keys ``smoothing`` (label smoothing), ``z_loss`` (PaLM's
    log-partition penalty over the kept tokens) and ``tied`` (the output matrix is the embedding's)."""

    def __init__(self, head: Spec, dim: int) -> None:
        super().__init__()
        self.shift = head.get("shift", "next")
        self.out, self.reduction = nn.Linear(dim, VOCAB), head["reduction"]
        self.smoothing, self.z_loss = head.get("smoothing", 0.0), head.get("z_loss", False)

    def tie(self, embedding: nn.Embedding) -> None:
        self.out.weight = embedding.weight

    def forward(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        h, tgt = shifted(x, batch["labels"], self.shift)
        logits = self.out(h).reshape(-1, VOCAB)
        loss = F.cross_entropy(
            logits, tgt.reshape(-1), ignore_index=-100, reduction=self.reduction, label_smoothing=self.smoothing
        )
        if self.reduction == "sum":
            loss = loss / tgt.numel()
        if self.z_loss:
            kept = (tgt.reshape(-1) != -100).to(logits.dtype)
            loss = loss + 1e-2 * (torch.logsumexp(logits, dim=-1).pow(2) * kept).sum() / kept.sum()
        return loss


class SeqLogprobLoss(nn.Module):
    """DPO-style: per-sequence sums of token log-probabilities against a reference, over the batch."""

    def __init__(self, head: Spec, dim: int) -> None:
        super().__init__()
        self.shift = head.get("shift", "next")
        self.out = nn.Linear(dim, VOCAB)

    def forward(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        h, tgt = shifted(x, batch["labels"], self.shift)
        logp = F.log_softmax(self.out(h), dim=-1)
        valid = tgt != -100
        tok = logp.gather(-1, tgt.clamp(min=0)[..., None]).squeeze(-1) * valid
        return -F.logsigmoid(0.1 * (tok.sum(dim=1) - batch["ref"])).mean()


class GRPOLoss(nn.Module):
    """GRPO/PPO-style policy loss: token log-ratio times a per-sequence advantage (``ref``), averaged
    per sequence over its kept tokens then over the batch (``norm`` "sequence"), or over all kept
    tokens of the batch (``norm`` "token", DAPO-style)."""

    def __init__(self, head: Spec, dim: int) -> None:
        super().__init__()
        self.shift = head.get("shift", "next")
        self.out, self.norm = nn.Linear(dim, VOCAB), head["norm"]

    def forward(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        h, tgt = shifted(x, batch["labels"], self.shift)
        logp = F.log_softmax(self.out(h), dim=-1).gather(-1, tgt.clamp(min=0)[..., None]).squeeze(-1)
        kept = (tgt != -100).to(logp.dtype)
        per_token = -torch.exp(logp - logp.detach()) * batch["ref"][:, None] * kept
        if self.norm == "sequence":
            return (per_token.sum(dim=1) / kept.sum(dim=1).clamp(min=1)).mean()
        return per_token.sum() / kept.sum().clamp(min=1)  # a batch with every label ignored: 0, not 0/0


class TokenMSELoss(nn.Module):
    """A per-token regression averaged over the tokens the ``keep`` mask selects."""

    def __init__(self, head: Spec, dim: int) -> None:
        super().__init__()
        self.out = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        m = fit(batch["keep"], x.shape[1]).to(x.dtype)
        err = (self.out(x).squeeze(-1) - 0.5).pow(2)
        return (err * m).sum() / m.sum()


class PoolLoss(nn.Module):
    """Pool the sequence to [B, D], then a batch-level head and loss over [B] targets."""

    def __init__(self, head: Spec, dim: int) -> None:
        super().__init__()
        self.pool, self.kind = head["pool"], head["head"]
        width = {"ce": CLASSES, "weighted_ce": CLASSES, "contrastive": dim}.get(self.kind, 1)
        self.out = nn.Linear(dim, width)
        if self.pool == "attn_pool":
            self.score = nn.Linear(dim, 1)
        if self.pool == "attn_map":  # SigLIP's MAP head: a learned query attends over the sequence
            self.query, self.kv = nn.Parameter(torch.randn(1, 4, 1, dim // 4)), nn.Linear(dim, 2 * dim)

    def pooled(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        b, s, d = x.shape
        p = self.pool
        if p == "mean":
            return x.mean(dim=1)
        if p == "first":
            return x[:, 0]
        if p == "last":
            return x[:, -1]
        if p == "sum":
            return x.sum(dim=1)
        if p == "amax":
            return x.amax(dim=1)
        if p == "logsumexp":
            return torch.logsumexp(x, dim=1)
        if p == "norm":
            return x.norm(dim=1)
        if p == "std":  # statistics pooling (speech, x-vectors)
            return x.std(dim=1)
        if p == "max":
            return x.max(dim=1).values
        if p == "index_select":  # every third token
            return x.index_select(1, torch.arange(0, s, 3, device=x.device)).mean(dim=1)
        if p == "gather":
            return x.gather(1, batch["pos"][:, None, None].expand(b, 1, d)).squeeze(1)
        keep = fit(batch["keep"], s)
        if p == "masked_mean":
            m = keep.to(x.dtype)[..., None]
            return (x * m).sum(dim=1) / m.sum(dim=1)
        if p == "last_valid":  # HF sequence classification: the last non-padding token
            return x[torch.arange(b, device=x.device), keep.sum(dim=1) - 1]
        if p == "topk":  # token routing (Mixture-of-Depths style): the 3 highest-scoring tokens
            idx = x.norm(dim=-1).topk(min(3, s), dim=1).indices  # [B, k]
            return x.gather(1, idx[..., None].expand(b, idx.shape[1], d)).mean(dim=1)
        if p == "hf_last":  # HF *ForSequenceClassification: first pad token - 1, modulo the length
            last = (keep == 0).int().argmax(dim=-1) - 1
            return x[torch.arange(b, device=x.device), last % s]
        if p == "attn_map":
            k, v = self.kv(x).view(b, s, 2, 4, d // 4).permute(2, 0, 3, 1, 4)  # 2 x [B, 4, S, D/4]
            o = F.scaled_dot_product_attention(self.query.expand(b, 4, 1, d // 4), k, v)  # [B, 4, 1, D/4]
            return o.reshape(b, d)
        a = torch.softmax(self.score(x).squeeze(-1), dim=1)
        return (a[..., None] * x).sum(dim=1)

    def forward(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        pooled = self.pooled(x, batch)
        out = self.out(pooled)
        y = batch["y"]
        if self.kind == "ce":
            return F.cross_entropy(out, y)
        if self.kind == "weighted_ce":
            w = batch["w"]
            return (F.cross_entropy(out, y, reduction="none") * w).sum() / w.sum()
        if self.kind == "contrastive":  # in-batch (CLIP-style): each pooled row against every other
            a, b = F.normalize(pooled, dim=-1), F.normalize(out, dim=-1)
            return F.cross_entropy(a @ b.T / 0.5, torch.arange(a.shape[0], device=a.device))
        score, sign = out.squeeze(-1), (y % 2).to(out.dtype)
        if self.kind == "margin":  # reward-model hinge
            return F.relu(1.0 - (2 * sign - 1) * score).mean()
        if self.kind == "bce":
            return F.binary_cross_entropy_with_logits(score, sign)
        return F.mse_loss(score, batch["ref"] * 0.1)


LOSSES = {"lm": LMLoss, "seq_logprob": SeqLogprobLoss, "token_mse": TokenMSELoss, "pool": PoolLoss, "grpo": GRPOLoss}


BODY = {
    "linear": Linear,
    "norm": Norm,
    "act": Act,
    "mlp": MLP,
    "seq": SeqOp,
    "cumsum": Cumsum,
    "seq_stat": SeqStat,
    "mask_tail": MaskTail,
    "conv": Conv,
    "manual_attention": ManualAttention,
    "linear_attention": LinearAttention,
}


__all__ = [
    "ACTS",
    "BODY",
    "CLASSES",
    "LOSSES",
    "MASKS",
    "POOLS",
    "POOL_HEADS",
    "SEQ_OPS",
    "TENSOR_MASKS",
    "VOCAB",
    "Attention",
    "PosEmbed",
    "Spec",
    "fit",
    "length_after",
]
