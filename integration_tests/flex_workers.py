"""Models with SDPA in one layer and FlexAttention (block mask, score_mod) in the next."""

from __future__ import annotations

import warnings
from collections import Counter

import torch
from torch.nn.attention.flex_attention import create_block_mask

from autosp.testing.models import SdpaThenFlex

VOCAB, HEADS = 50, 4


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
