"""Models with SDPA in one layer and FlexAttention (block mask, score_mod) in the next."""

from __future__ import annotations

import warnings
from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

VOCAB, DIM, HEADS = 50, 32, 4
HEAD_DIM = DIM // HEADS


class SdpaThenFlex(nn.Module):
    def __init__(self, kv_heads: int) -> None:
        super().__init__()
        self.kv_heads = kv_heads
        self.emb = nn.Embedding(VOCAB, DIM)
        self.qkv1 = nn.Linear(DIM, 3 * DIM)
        self.q2 = nn.Linear(DIM, DIM)
        self.kv2 = nn.Linear(DIM, 2 * kv_heads * HEAD_DIM)
        self.out = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx: torch.Tensor, block_mask, labels: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        b, s, d = x.shape
        q, k, v = self.qkv1(x).view(b, s, 3, HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4)
        x = x + F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        q = self.q2(x).view(b, s, HEADS, HEAD_DIM).transpose(1, 2)
        k, v = self.kv2(x).view(b, s, 2, self.kv_heads, HEAD_DIM).permute(2, 0, 3, 1, 4)

        def head_bias(score, b, h, q_idx, kv_idx):
            return score - (h + 1) * 0.05 * (q_idx - kv_idx).abs()  # a different slope per global head

        y = flex_attention(q, k, v, score_mod=head_bias, block_mask=block_mask, enable_gqa=self.kv_heads != HEADS)
        x = x + self.out(y.transpose(1, 2).reshape(b, s, d))
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def block_mask(kind: str, seq: int):
    """``documents``: causal within three uneven packed documents that cross the ranks' chunks.
    ``per_head``: heads 0 and 1 see their document, heads 2 and 3 a causal window of 24 (a per-head mask)."""
    docs = (torch.arange(seq) * 3) // seq
    docs[seq // 3 - 2] = 1

    def documents(b, h, q, k):
        return (docs[q] == docs[k]) & (k <= q)

    def per_head(b, h, q, k):
        return torch.where(h < 2, docs[q] == docs[k], q - k < 24) & (k <= q)

    fn, heads = (documents, None) if kind == "documents" else (per_head, HEADS)
    return create_block_mask(fn, None, heads, seq, seq, device="cpu", BLOCK_SIZE=16)


def run(rank: int, world: int, variant: str, cases: list[tuple[str, int]], seq: int) -> dict:
    import autosp

    results = {}
    for kind, kv_heads in cases:
        torch.manual_seed(0)
        model = SdpaThenFlex(kv_heads)
        args = (torch.randint(0, VOCAB, (2, seq)), block_mask(kind, seq), torch.randint(0, VOCAB, (2, seq)))
        # Forward only: torch 2.13 has no FlexAttention backward on CPU, on one device or several.
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # flex_attention's own "called without torch.compile" note
            reference = model(*args)
            compiled = autosp.compile(model, sp_size=world, backend="aot_eager", variant=variant)
            loss = compiled(*args)
        reports = compiled.autosp_reports
        results[kind, kv_heads] = {
            "loss": loss,
            "reference": reference,
            "notes": [n for r in reports for n in r.notes],
            "fallbacks": [f for r in reports for f in r.fallbacks],
            "sites": [s.spec.name for r in reports for s in r.sites],
            "collectives": sum((r.collectives for r in reports), start=Counter()),
        }
    return results
