"""A model with SDPA in one layer and FlexAttention (document mask, score_mod) in the next."""

from __future__ import annotations

import warnings
from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

VOCAB, DIM, HEADS = 50, 32, 4


class SdpaThenFlex(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.qkv1 = nn.Linear(DIM, 3 * DIM)
        self.qkv2 = nn.Linear(DIM, 3 * DIM)
        self.out = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def _heads(self, proj: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        return proj(x).view(b, s, 3, HEADS, d // HEADS).permute(2, 0, 3, 1, 4)

    def forward(self, idx: torch.Tensor, block_mask, labels: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        b, s, d = x.shape
        q, k, v = self._heads(self.qkv1, x)
        x = x + F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        q, k, v = self._heads(self.qkv2, x)

        def distance_bias(score, b, h, q_idx, kv_idx):
            return score - (h + 1) * 0.05 * (q_idx - kv_idx).abs()

        y = flex_attention(q, k, v, score_mod=distance_bias, block_mask=block_mask)
        x = x + self.out(y.transpose(1, 2).reshape(b, s, d))
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def document_mask(seq: int):
    """Causal attention within each of three packed documents that cross the ranks' chunks."""
    docs = (torch.arange(seq) * 3) // seq
    docs[seq // 3 - 2] = 1  # uneven documents

    def mask_mod(b, h, q, k):
        return (docs[q] == docs[k]) & (k <= q)

    return create_block_mask(mask_mod, None, None, seq, seq, device="cpu", BLOCK_SIZE=16)


def inputs(seq: int) -> tuple:
    torch.manual_seed(0)
    return torch.randint(0, VOCAB, (2, seq)), document_mask(seq), torch.randint(0, VOCAB, (2, seq))


def run(rank: int, world: int, variant: str, seq: int) -> dict:
    import autosp

    torch.manual_seed(0)
    model = SdpaThenFlex()
    args = inputs(seq)
    # Forward only: torch 2.13 has no FlexAttention backward on CPU, on one device or several.
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # flex_attention's own "called without torch.compile" note
        reference = model(*args)
        compiled = autosp.compile(model, sp_size=world, backend="aot_eager", variant=variant)
        loss = compiled(*args)
    notes = [n for r in compiled.autosp_reports for n in r.notes]
    collectives = sum((r.collectives for r in compiled.autosp_reports), start=Counter())
    return {"loss": loss, "reference": reference, "notes": notes, "shard_start": collectives["shard_start"]}
