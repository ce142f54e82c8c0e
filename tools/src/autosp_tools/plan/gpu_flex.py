"""gpu_check's FlexAttention stage: values and every gradient on CUDA, where Flex has a backward.

torch has no FlexAttention backward on CPU, so the CPU suite checks Flex forward only; this runs
``autosp.verify`` (single-device eager reference, values and gradients) on a model with an SDPA
layer and a Flex layer (a per-head ``score_mod`` and a block mask of packed documents made outside
the compiled function). On the CPU (``--quick`` self-test) it compares the loss alone.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HEADS, KV_HEADS = 64, 64, 4, 2
HEAD_DIM = DIM // HEADS


class SdpaThenFlex(nn.Module):
    """Causal SDPA, then Flex with GQA, a slope per global head and a document block mask."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.q2 = nn.Linear(DIM, DIM)
        self.kv2 = nn.Linear(DIM, 2 * KV_HEADS * HEAD_DIM)
        self.out = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx: torch.Tensor, block_mask: Any, labels: torch.Tensor) -> torch.Tensor:
        from torch.nn.attention.flex_attention import flex_attention

        x = self.emb(idx)
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4)
        x = x + F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        q = self.q2(x).view(b, s, HEADS, HEAD_DIM).transpose(1, 2)
        k, v = self.kv2(x).view(b, s, 2, KV_HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4)

        def head_slope(score, b, h, q_idx, kv_idx):
            return score - (h + 1) * 0.05 * (q_idx - kv_idx).abs()

        y = flex_attention(q, k, v, score_mod=head_slope, block_mask=block_mask, enable_gqa=True)
        x = x + self.out(y.transpose(1, 2).reshape(b, s, d))
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def document_mask(seq: int, device: torch.device) -> Any:
    """Causal within three uneven packed documents whose boundaries cross the ranks' chunks."""
    from torch.nn.attention.flex_attention import create_block_mask

    docs = ((torch.arange(seq) * 3) // seq).to(device)
    docs[seq // 3 - 5] = 1

    def documents(b, h, q, k):
        return (docs[q] == docs[k]) & (k <= q)

    return create_block_mask(documents, None, None, seq, seq, device=str(device), BLOCK_SIZE=min(128, seq // 4))


def flex_rank(cfg: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    """One rank: ``autosp.verify`` on CUDA; on the CPU, the forward's loss against eager."""
    import autosp

    device = torch.device(cfg["device"], 0) if cfg["device"] == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = SdpaThenFlex().to(device)
    seq = cfg["seq"]
    gen = torch.Generator().manual_seed(2)
    ids, labels = (torch.randint(0, VOCAB, (2, seq), generator=gen).to(device) for _ in range(2))
    args = (ids, document_mask(seq, device), labels)
    options = {"sp_size": world, "backend": cfg["backend"], "variant": cfg["variant"]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # flex_attention's "called without torch.compile" in the reference
        if device.type == "cuda":
            report = autosp.verify(model, *args, **options)
            return {"passed": True, "report": str(report)[:2000]}
        with torch.no_grad():
            reference = model(*args)
            loss = autosp.compile(model, **options)(*args)
    diff = float((loss - reference).abs())
    return {"passed": diff <= 1e-5 * max(1.0, float(reference.abs())), "loss_diff": diff, "forward_only": True}


__all__ = ["SdpaThenFlex", "document_mask", "flex_rank"]
