"""Llama-style causal LMs whose ``forward(input_ids, labels)`` returns the loss.

``hf`` builds ``transformers.LlamaForCausalLM`` from a small config made in code;
``builtin`` is ``autosp.testing``'s Llama-style model of the same shape, for when
transformers is missing. Both use ``F.scaled_dot_product_attention`` and shift labels inside, which
is what AutoSP needs: every rank passes the same full-length ``input_ids``.
"""

from __future__ import annotations

import importlib.util
from dataclasses import asdict, dataclass

import torch
from torch import nn

from autosp.testing.models import Config, LlamaLike, hf_causal_lm


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
    # The model of the peak and step-time targets (tools/scripts/peak_breakdown.py's default).
    "small-wide": (256, 4, 8, 2, 688),
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
        self.lm = hf_causal_lm(
            "llama",
            vocab=cfg.vocab,
            dim=cfg.dim,
            hidden=cfg.hidden,
            layers=cfg.layers,
            heads=cfg.heads,
            kv_heads=cfg.kv_heads,
            max_len=cfg.max_len,
        )

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=input_ids, labels=labels, use_cache=False).loss


class LlamaLM(LlamaLike):
    """The built-in Llama: ``autosp.testing``'s Llama-style model at HF Llama's init scale (std 0.02),
    so the two implementations train alike."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(
            Config(
                vocab=cfg.vocab,
                dim=cfg.dim,
                heads=cfg.heads,
                kv_heads=cfg.kv_heads,
                layers=cfg.layers,
                hidden=cfg.hidden,
                max_len=cfg.max_len,
            ),
            init_std=0.02,
        )


__all__ = ["PRESETS", "HFCausalLM", "LlamaLM", "ModelConfig", "build_model", "count_params", "resolve_impl"]
