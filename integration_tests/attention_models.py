"""Small language models whose attention is written out by hand, or split by graph breaks.

Each family spells attention the way some well-known codebase does (nanoGPT, HF ``eager``,
GPT-2, Gemma-2's soft-capping, ALiBi, BLOOM's ``baddbmm``, ``torch.einsum``, ``nn.MultiheadAttention``) or breaks the program the way real training code does
(a ``print`` between layers, ``torch.utils.checkpoint`` around each layer).  The tests hold
AutoSP to single-device eager on all of them.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as ckpt

VOCAB, DIM, HEADS, LAYERS, MAX_SEQ = 32, 32, 4, 2, 64


def _causal(t: int) -> torch.Tensor:
    return torch.tril(torch.ones(MAX_SEQ, MAX_SEQ, dtype=torch.bool))[:t, :t]


def nano(q, k, v, m, h=None):
    """nanoGPT: a ``tril`` buffer sliced to the length, ``masked_fill`` with -inf."""
    t = q.shape[2]
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
    att = att.masked_fill(m.bias[:, :, :t, :t] == 0, float("-inf"))
    return F.softmax(att, dim=-1) @ v


def hf_eager(q, k, v, m, h=None):
    """HF ``eager_attention_forward``: additive 4-D mask, softmax in fp32, dropout, GQA by repeat."""
    rep = q.shape[1] // k.shape[1]
    k = k[:, :, None].expand(k.shape[0], k.shape[1], rep, *k.shape[2:]).reshape(q.shape[0], -1, *k.shape[2:])
    v = v[:, :, None].expand(v.shape[0], v.shape[1], rep, *v.shape[2:]).reshape(q.shape[0], -1, *v.shape[2:])
    scores = torch.matmul(q, k.transpose(2, 3)) * q.shape[-1] ** -0.5
    scores = scores + m.additive_mask[:, :, : q.shape[2], : k.shape[2]]
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    probs = F.dropout(probs, p=0.0, training=m.training)
    return torch.matmul(probs, v)


def gpt2(q, k, v, m, h=None):
    """GPT-2: divide by a 0-d tensor, ``torch.where`` with the dtype's minimum, then the padding mask."""
    t = q.shape[2]
    att = torch.matmul(q, k.transpose(-1, -2))
    att = att / torch.full([], v.size(-1) ** 0.5, dtype=att.dtype, device=att.device)
    att = torch.where(m.bias[:, :, :t, :t].bool(), att, torch.full([], torch.finfo(att.dtype).min, dtype=att.dtype))
    if m.padding is not None:
        att = att + m.padding
    return torch.matmul(F.softmax(att, dim=-1).type(v.dtype), v)


def alibi(q, k, v, m, h=None):
    """ALiBi: a per-head linear distance bias built in the model, causal by -inf."""
    t = q.shape[2]
    pos = torch.arange(t, device=q.device)
    dist = (pos[None, :] - pos[:, None]).to(q.dtype)
    slopes = 2.0 ** (-8.0 * torch.arange(1, q.shape[1] + 1, device=q.device, dtype=q.dtype) / q.shape[1])
    att = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]) + slopes[:, None, None] * dist
    att = att.masked_fill(~_causal(t).to(q.device), float("-inf"))
    return att.softmax(-1) @ v


def bloom(q, k, v, m, h=None):
    """BLOOM: batch and heads merged, the per-head ALiBi bias and the scale inside ``alibi.baddbmm``, a
    4-D view masked (here with -inf, so SDPA computes it), softmax in fp32, ``bmm`` with v."""
    b, nh, t, d = q.shape
    rep = nh // k.shape[1]
    q3, k3, v3 = (x.reshape(b * nh, t, d) for x in (q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)))
    slopes = 2.0 ** (-8.0 * torch.arange(1, nh + 1, device=q.device, dtype=q.dtype) / nh)
    alibi = (slopes[:, None] * torch.arange(t, device=q.device, dtype=q.dtype)).repeat(b, 1)[:, None, :]
    att = alibi.baddbmm(q3, k3.transpose(-1, -2), beta=1.0, alpha=d**-0.5).view(b, nh, t, t)
    probs = F.softmax(att.masked_fill(~_causal(t).to(q.device), float("-inf")), dim=-1, dtype=torch.float32)
    return torch.bmm(probs.to(q.dtype).view(b * nh, t, t), v3).view(b, nh, t, d)


def einsum(q, k, v, m, h=None):
    """Research code: ``torch.einsum`` over [B, S, H, d] (no transpose to heads first), the causal mask
    by ``masked_fill`` with -inf, the output back in the tokens-first layout."""
    t = q.shape[2]
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    att = torch.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
    att = att.masked_fill(~_causal(t).to(q.device), float("-inf")).softmax(-1)
    return torch.einsum("bhqk,bkhd->bqhd", att, v).transpose(1, 2)


def softcap(q, k, v, m, h=None):
    """Gemma-2: scores soft-capped by ``tanh`` - no SDPA call computes this, so it stays written out."""
    t = q.shape[2]
    att = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    att = torch.tanh(att / 5.0) * 5.0
    att = att.masked_fill(~_causal(t).to(q.device), float("-inf"))
    return att.softmax(-1) @ v


def flat(q, k, v, m, h=None):
    """Older HF code (XGLM): batch and heads merged, the causal mask added on a 4-D view, a floor clamp."""
    b, nh, t, d = q.shape
    rep = nh // k.shape[1]
    k, v = (x.repeat_interleave(rep, 1) for x in (k, v))
    q3, k3, v3 = (x.reshape(b * nh, t, d) for x in (q * d**-0.5, k, v))  # XGLM scales q in its projection
    att = torch.bmm(q3, k3.transpose(1, 2)).view(b, nh, t, t)
    att = att + torch.where(_causal(t).to(q.device), 0.0, torch.finfo(q.dtype).min)
    att = torch.max(att, torch.tensor(torch.finfo(q.dtype).min, device=q.device)).view(b * nh, t, t)
    return torch.bmm(att.softmax(-1), v3).view(b, nh, t, d)


def sdpa(q, k, v, m, h=None):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


def sdpa_padded(q, k, v, m, h=None):
    """SDPA with the padding mask broadcast over queries ([B, 1, 1, S]), as HF code passes it."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=m.padding, enable_gqa=q.shape[1] != k.shape[1])


def cross(q, k, v, m, h=None):
    """Self-attention, then cross-attention to 6 learned latents (a memory of another length, Perceiver-style)."""
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    b, hd = q.shape[0], q.shape[-1]
    mk, mv = m.kv(m.latents.expand(b, -1, -1)).view(b, -1, 2, HEADS, hd).unbind(2)
    return y + F.scaled_dot_product_attention(q, mk.transpose(1, 2), mv.transpose(1, 2))


def cross_written(q, k, v, m, h=None):
    """The same cross-attention to latents, written out (scores soft-capped: kept as written)."""
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    b, hd = q.shape[0], q.shape[-1]
    mk, mv = m.kv(m.latents.expand(b, -1, -1)).view(b, -1, 2, HEADS, hd).unbind(2)
    att = torch.tanh((q @ mk.transpose(1, 2).transpose(-2, -1)) / 4.0) * 4.0
    return y + att.softmax(-1) @ mv.transpose(1, 2)


def mha(q, k, v, m, h=None):
    """``nn.MultiheadAttention`` on the block's input (its own projections): Dynamo keeps it one call."""
    t = q.shape[2]
    y, _ = m.mha(h, h, h, attn_mask=~_causal(t).to(h.device), need_weights=False)
    return y.view(h.shape[0], t, HEADS, -1).transpose(1, 2)


def no_attention(q, k, v, m, h=None):
    """No mixing along the sequence at all: a token-wise model."""
    return v


ATTENTION: dict[str, Callable] = {
    "nano": nano,
    "hf_eager": hf_eager,
    "gpt2": gpt2,
    "alibi": alibi,
    "bloom": bloom,
    "einsum": einsum,
    "softcap": softcap,
    "flat": flat,
    "sdpa": sdpa,
    "sdpa_padded": sdpa_padded,
    "cross": cross,
    "cross_written": cross_written,
    "mha": mha,
    "none": no_attention,
}


class Block(nn.Module):
    def __init__(self, attend: Callable, kv_heads: int) -> None:
        super().__init__()
        self.attend, self.kv_heads = attend, kv_heads
        hd = DIM // HEADS
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.q = nn.Linear(DIM, DIM)
        self.kv = nn.Linear(DIM, 2 * kv_heads * hd)
        self.o = nn.Linear(DIM, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))
        self.register_buffer("bias", torch.tril(torch.ones(MAX_SEQ, MAX_SEQ)).view(1, 1, MAX_SEQ, MAX_SEQ))
        additive = torch.zeros(MAX_SEQ, MAX_SEQ).masked_fill(~_causal(MAX_SEQ), torch.finfo(torch.float32).min)
        self.register_buffer("additive_mask", additive.view(1, 1, MAX_SEQ, MAX_SEQ))
        self.padding: torch.Tensor | None = None
        self.latents = nn.Parameter(torch.randn(1, 6, DIM) * 0.5) if attend in (cross, cross_written) else None
        self.mha = nn.MultiheadAttention(DIM, HEADS, batch_first=True) if attend is mha else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        hd = DIM // HEADS
        h = self.norm1(x)
        q = self.q(h).view(b, t, HEADS, hd).transpose(1, 2)
        k, v = self.kv(h).view(b, t, 2, self.kv_heads, hd).unbind(2)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        if self.attend not in (hf_eager, sdpa, sdpa_padded) and self.kv_heads != HEADS:
            k = k.repeat_interleave(HEADS // self.kv_heads, dim=1)
            v = v.repeat_interleave(HEADS // self.kv_heads, dim=1)
        y = self.attend(q, k, v, self, h).transpose(1, 2).reshape(b, t, DIM)
        x = x + self.o(y)
        return x + self.mlp(self.norm2(x))


class LM(nn.Module):
    """Token embedding, blocks, tied-free head; ``forward(ids, labels)`` returns the mean next-token loss.

    ``breaks``: "none", "between" (a graph break between the two layers), "before_head" (a break
    after the last layer) or "checkpoint" (each layer in ``torch.utils.checkpoint``).
    """

    def __init__(self, attention: str, breaks: str = "none", kv_heads: int = HEADS) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Embedding(MAX_SEQ, DIM)
        self.blocks = nn.ModuleList(Block(ATTENTION[attention], kv_heads) for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.breaks = breaks

    def _layer(self, i: int, x: torch.Tensor, padding: torch.Tensor | None) -> torch.Tensor:
        block = self.blocks[i]
        block.padding = padding
        if self.breaks == "checkpoint":
            return ckpt.checkpoint(block, x, use_reentrant=False)
        return block(x)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor, padding: torch.Tensor | None = None) -> torch.Tensor:
        x = self.emb(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        # Unrolled, as Dynamo resumes after a break in straight-line code (a break in a loop skips the frame).
        x = self._layer(0, x, padding)
        if self.breaks == "between":
            print("", end="")  # a graph break between the layers, as logging code makes one
        x = self._layer(1, x, padding)
        if self.breaks == "before_head":
            torch._dynamo.graph_break()  # the head and loss compile as a graph without attention
        logits = self.head(self.norm(x)).float()
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1), ignore_index=-100)


def doc_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """Block-diagonal causal [B, 1, S, S] mask of documents packed in a row: positions restart at 0."""
    doc = torch.cumsum((position_ids == 0).int(), dim=-1)
    same = doc[:, :, None] == doc[:, None, :]
    causal = torch.tril(
        torch.ones(position_ids.shape[1], position_ids.shape[1], dtype=torch.bool, device=position_ids.device)
    )
    return (same & causal)[:, None]


class PackedBlock(Block):
    """Attention over the documents packed in a row, by SDPA with a boolean mask or written out."""

    def __init__(self, written: bool) -> None:
        super().__init__(sdpa, HEADS)
        self.written = written
        self.mask: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        hd = DIM // HEADS
        h = self.norm1(x)
        q = self.q(h).view(b, t, HEADS, hd).transpose(1, 2)
        k, v = (y.transpose(1, 2) for y in self.kv(h).view(b, t, 2, HEADS, hd).unbind(2))
        if self.written:
            att = (q @ k.transpose(-2, -1)) / math.sqrt(hd)
            y = att.masked_fill(~self.mask, float("-inf")).softmax(-1) @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask)
        x = x + self.o(y.transpose(1, 2).reshape(b, t, DIM))
        return x + self.mlp(self.norm2(x))


class PackedLM(nn.Module):
    """Documents packed into rows: ``position_ids`` restart per document, the model builds the mask."""

    def __init__(self, written: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Embedding(MAX_SEQ, DIM)
        self.blocks = nn.ModuleList(PackedBlock(written) for _ in range(LAYERS))
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids) + self.pos(position_ids)
        mask = doc_mask(position_ids)
        for block in self.blocks:
            block.mask = mask
            x = block(x)
        logits = self.head(x)
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1), ignore_index=-100)


def packed_positions(seq: int, batch: int = 2, skewed: bool = False) -> torch.Tensor:
    """Uneven documents, some crossing the ranks' chunk boundaries (lengths 5, 1, seq-9, 3 / 2, seq-2).

    ``skewed``: a long document then a short one (3/4 + 1/4, 5/8 + 3/8 of the row), which leaves
    the zigzag layout's ranks 1.7x apart in causal work (ring balances them by the mask).
    """
    rows = [[5, 1, seq - 9, 3], [2, seq - 2]]
    if skewed:
        rows = [[3 * seq // 4, seq - 3 * seq // 4], [5 * seq // 8, seq - 5 * seq // 8]]
    return torch.stack([torch.cat([torch.arange(n) for n in rows[i % 2]]) for i in range(batch)])


def inputs(seq: int = 16, batch: int = 2) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100
    return ids, labels


def padding(seq: int = 16, batch: int = 2) -> torch.Tensor:
    """GPT-2's additive padding mask: the first row's last two keys are padding (right padding)."""
    pad = torch.zeros(batch, 1, 1, seq)
    pad[0, ..., -2:] = torch.finfo(torch.float32).min
    return pad


__all__ = ["ATTENTION", "LM", "PackedLM", "doc_mask", "inputs", "packed_positions", "padding"]
