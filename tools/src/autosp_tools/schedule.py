"""The learning-rate schedule of autosp-train."""

from __future__ import annotations

import math

from autosp_tools.config import TrainConfig


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warmup then cosine decay; a pure function of the step, so resume needs no scheduler state."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    span = max(1, cfg.steps - cfg.warmup)
    progress = min(1.0, (step - cfg.warmup) / span)
    ratio = cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return cfg.lr * ratio


__all__ = ["lr_at"]
