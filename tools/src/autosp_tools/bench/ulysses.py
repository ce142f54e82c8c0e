"""The hand-written DeepSpeed-Ulysses baseline: the built-in Llama with ``DistributedAttention``.

Each rank feeds its own sequence shard ``[B, S/P, ...]``; positions are offset by the rank,
labels are shifted globally before sharding, the loss is the token-weighted mean over
ranks, and gradients are summed over the SP group after backward. This is what people
write by hand today, and what AutoSP is meant to replace.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from autosp.testing.models import LlamaBlock, rope
from autosp_tools.bench.workload import IGNORE, repeat_kv, rope_tables
from autosp_tools.model import LlamaLM


class LocalAttention(nn.Module):
    """Causal SDPA on head-sharded ``[B, S, h, D]`` tensors, GQA by repeating k/v locally."""

    def __init__(self, rep: int) -> None:
        super().__init__()
        self.rep = rep

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        D = q.shape[-1]
        k, v = repeat_kv(k, self.rep, D), repeat_kv(v, self.rep, D)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return a.transpose(1, 2)


class UlyssesLM(nn.Module):
    """Wraps a ``LlamaLM`` (sharing its parameters); ``forward`` returns ``(loss_sum, token_count)`` locally."""

    def __init__(self, lm: LlamaLM, group: Any) -> None:
        super().__init__()
        from deepspeed.sequence.layer import DistributedAttention

        self.lm = lm
        c = lm.c
        self.attn = nn.ModuleList(
            DistributedAttention(LocalAttention(c.heads // c.kv_heads), group, scatter_idx=2, gather_idx=1)
            for _ in lm.blocks
        )

    def forward(self, ids: torch.Tensor, targets: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lm, c = self.lm, self.lm.c
        hd = c.dim // c.heads
        cos, sin = rope_tables(lm, pos)
        cos, sin = cos[None, :, None], sin[None, :, None]  # [1, s, 1, D] for [B, s, h, D]
        x = lm.embed(ids)
        B, s, _ = x.shape
        for blk, attn in zip(lm.blocks, self.attn):
            block: LlamaBlock = blk  # type: ignore[assignment]  # ModuleList items are typed Module
            h = block.n1(x)
            q = rope(block.q(h).view(B, s, c.heads, hd), cos, sin)
            k = rope(block.k(h).view(B, s, c.kv_heads, hd), cos, sin)
            v = block.v(h).view(B, s, c.kv_heads, hd)
            a = attn(q, k, v, 0)
            x = x + block.o(a.reshape(B, s, c.dim))
            h = block.n2(x)
            x = x + block.down(F.silu(block.gate(h)) * block.up(h))
        logits = lm.head(lm.norm(x))
        flat = targets.reshape(-1)
        loss_sum = F.cross_entropy(logits.reshape(-1, c.vocab), flat, ignore_index=IGNORE, reduction="sum")
        return loss_sum, (flat != IGNORE).sum()


def shard_inputs(
    ids: torch.Tensor, labels: torch.Tensor, rank: int, world: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's ids, next-token targets and positions; the shift happens before sharding."""
    S = ids.shape[1]
    if S % world:
        raise ValueError(f"sequence length {S} is not a multiple of the SP size {world}")
    targets = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE)], dim=1)
    n = S // world
    sl = slice(rank * n, (rank + 1) * n)
    pos = torch.arange(rank * n, (rank + 1) * n, device=ids.device)
    return ids[:, sl].contiguous(), targets[:, sl].contiguous(), pos


def global_loss(loss_sum: torch.Tensor, count: torch.Tensor, group: Any) -> tuple[torch.Tensor, float]:
    """The local term to backpropagate and the exact global mean loss to report."""
    stats = torch.stack([loss_sum.detach().float(), count.float()])
    dist.all_reduce(stats, group=group)
    return loss_sum / stats[1], float(stats[0] / stats[1])


def all_reduce_grads(model: nn.Module, group: Any) -> None:
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)


__all__ = ["LocalAttention", "UlyssesLM", "all_reduce_grads", "global_loss", "shard_inputs"]
