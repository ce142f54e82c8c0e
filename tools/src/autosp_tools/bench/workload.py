"""The model and batch every method trains, plus the pieces the hand-written baselines reuse.

All methods share ``autosp_tools.model.LlamaLM`` (the built-in Llama) built from the same
seed, so they start from identical weights and see the identical batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from autosp_tools.model import PRESETS, LlamaLM, ModelConfig

VOCAB = 264
IGNORE = -100


@dataclass(frozen=True)
class Workload:
    size: str
    seq_len: int
    batch_size: int
    seed: int = 0

    def model_config(self) -> ModelConfig:
        dim, layers, heads, kv_heads, hidden = PRESETS[self.size]
        return ModelConfig(
            vocab=VOCAB,
            dim=dim,
            layers=layers,
            heads=heads,
            kv_heads=kv_heads,
            hidden=hidden,
            max_len=max(self.seq_len, 2),
            impl="builtin",
        )

    @property
    def tokens(self) -> int:
        return self.seq_len * self.batch_size


def build_model(w: Workload, device: torch.device) -> LlamaLM:
    torch.manual_seed(w.seed)
    return LlamaLM(w.model_config()).to(device)


def make_batch(w: Workload, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(w.seed + 1)
    ids = torch.randint(0, VOCAB, (w.batch_size, w.seq_len), generator=gen)
    labels = ids.clone()
    # A few ignored targets make the token-weighted loss differ from a plain mean over ranks.
    labels[0, 1 : max(2, w.seq_len // 8)] = IGNORE
    return ids.to(device), labels.to(device)


def rope_tables(lm: LlamaLM, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape ``[..., S, head_dim]`` for integer positions ``pos`` of shape ``[..., S]``."""
    freqs = pos.float()[..., None] * lm.inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    dtype = lm.embed.weight.dtype  # angles in fp32, applied in the model's dtype (as LlamaLM does)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def repeat_kv(x: torch.Tensor, rep: int, head_dim: int) -> torch.Tensor:
    """``[B, S, kv, D] -> [B, S, kv * rep, D]`` (heads in dim 2)."""
    if rep == 1:
        return x
    B, S, kv, D = x.shape
    return x[:, :, :, None].expand(B, S, kv, rep, D).reshape(B, S, kv * rep, D)


class PositionIdsLM(nn.Module):
    """``LlamaLM`` taking ``position_ids`` as an input, as DeepSpeed's AutoSP requires.

    Same weights and math as ``LlamaLM``; labels are still shifted inside, which is the case
    DeepSpeed's pass gets wrong (each rank shifts its own shard and drops the boundary token).
    """

    def __init__(self, lm: LlamaLM) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        lm = self.lm
        cos, sin = rope_tables(lm, position_ids)
        cos, sin = cos[:, None], sin[:, None]
        x = lm.embed(input_ids)
        for block in lm.blocks:
            x = block(x, cos, sin)
        logits = lm.head(lm.norm(x))
        return F.cross_entropy(logits[:, :-1].reshape(-1, lm.c.vocab), labels[:, 1:].reshape(-1), ignore_index=IGNORE)


__all__ = ["IGNORE", "VOCAB", "PositionIdsLM", "Workload", "build_model", "make_batch", "repeat_kv", "rope_tables"]
