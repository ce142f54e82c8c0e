"""Llama-style causal LMs whose ``forward(input_ids, labels)`` returns the loss.

``hf`` builds ``transformers.LlamaForCausalLM`` from a small config made in code;
``builtin`` is a self-contained module of the same shape for when transformers is
missing. Both use ``F.scaled_dot_product_attention`` and shift labels inside, which
is what AutoSP needs: every rank passes the same full-length ``input_ids``.
"""

from __future__ import annotations

import importlib.util
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ModelConfig:
    vocab: int
    dim: int
    layers: int
    heads: int
    kv_heads: int
    hidden: int
    max_len: int
    impl: str = "hf"

    def as_dict(self) -> dict[str, int | str]:
        return asdict(self)


# (dim, layers, heads, kv_heads, hidden)
PRESETS: dict[str, tuple[int, int, int, int, int]] = {
    "tiny": (64, 2, 4, 2, 128),
    "small": (128, 4, 4, 2, 384),
    "base": (256, 6, 8, 4, 768),
    "medium": (512, 8, 8, 4, 1536),
}


def resolve_impl(impl: str) -> str:
    if impl != "auto":
        return impl
    return "hf" if importlib.util.find_spec("transformers") is not None else "builtin"


def build_model(cfg: ModelConfig) -> nn.Module:
    if cfg.impl == "hf":
        return HFCausalLM(cfg)
    if cfg.impl == "builtin":
        return LlamaLM(cfg)
    raise ValueError(f"unknown model implementation {cfg.impl!r}; use 'hf', 'builtin' or 'auto'")


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


class HFCausalLM(nn.Module):
    """``LlamaForCausalLM`` behind a positional ``(input_ids, labels) -> loss`` signature."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=cfg.vocab,
            hidden_size=cfg.dim,
            intermediate_size=cfg.hidden,
            num_hidden_layers=cfg.layers,
            num_attention_heads=cfg.heads,
            num_key_value_heads=cfg.kv_heads,
            max_position_embeddings=cfg.max_len,
            tie_word_embeddings=False,
            use_cache=False,
            # AutoSP finds attention through F.scaled_dot_product_attention.
            attn_implementation="sdpa",  # type: ignore[call-arg]  # a PretrainedConfig kwarg
        )
        self.lm = LlamaForCausalLM(config)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=input_ids, labels=labels, use_cache=False).loss


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Block(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.c = c
        hd = c.dim // c.heads
        self.q = nn.Linear(c.dim, c.heads * hd, bias=False)
        self.k = nn.Linear(c.dim, c.kv_heads * hd, bias=False)
        self.v = nn.Linear(c.dim, c.kv_heads * hd, bias=False)
        self.o = nn.Linear(c.dim, c.dim, bias=False)
        self.gate = nn.Linear(c.dim, c.hidden, bias=False)
        self.up = nn.Linear(c.dim, c.hidden, bias=False)
        self.down = nn.Linear(c.hidden, c.dim, bias=False)
        self.n1, self.n2 = RMSNorm(c.dim), RMSNorm(c.dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        c = self.c
        hd = c.dim // c.heads
        h = self.n1(x)
        q = self.q(h).view(B, S, c.heads, hd).transpose(1, 2)
        k = self.k(h).view(B, S, c.kv_heads, hd).transpose(1, 2)
        v = self.v(h).view(B, S, c.kv_heads, hd).transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        rep = c.heads // c.kv_heads
        k = k[:, :, None].expand(B, c.kv_heads, rep, S, hd).reshape(B, c.heads, S, hd)
        v = v[:, :, None].expand(B, c.kv_heads, rep, S, hd).reshape(B, c.heads, S, hd)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(B, S, c.dim))
        h = self.n2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class LlamaLM(nn.Module):
    """RoPE from arange, RMSNorm, SwiGLU, GQA via repeat_kv; labels shifted inside."""

    inv_freq: torch.Tensor

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.c = c
        self.embed = nn.Embedding(c.vocab, c.dim)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.norm = RMSNorm(c.dim)
        self.head = nn.Linear(c.dim, c.vocab, bias=False)
        hd = c.dim // c.heads
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd)), persistent=False)
        # Same init scale as HF Llama (initializer_range=0.02) so the two train alike.
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        _, S = input_ids.shape
        pos = torch.arange(S, device=input_ids.device)
        freqs = torch.outer(pos.float(), self.inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos()[None, None], emb.sin()[None, None]
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits[:, :-1].reshape(-1, self.c.vocab), labels[:, 1:].reshape(-1), ignore_index=-100)


__all__ = ["PRESETS", "HFCausalLM", "LlamaLM", "ModelConfig", "build_model", "count_params", "resolve_impl"]
