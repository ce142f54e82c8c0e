"""Parameter, gradient and optimizer-state bytes per rank for a parallel layout.

AutoSP replicates parameters over the SP ranks (their gradients are all-reduced inside the
backward), so only data parallelism shards training state: ZeRO-1 the optimizer state,
ZeRO-2 also the gradients, ZeRO-3 / FSDP also the parameters, each over ``shard_degree``
ranks (the dp group by default, as ``autosp-train`` does; ``shard_over="world"`` for
DeepSpeed-style sharding over dp x sp).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from autosp.errors import ConfigError

# Bytes per parameter of AdamW's state: two moments, plus an fp32 master copy when training in 16 bits.
OPTIMIZERS = ("adamw", "sgd", "none")


@dataclass(frozen=True)
class Layout:
    """How the GPUs are used.

    Attributes:
        sp: ranks that share one sequence.
        dp: data-parallel replicas (``gpus = sp * dp``).
        zero: ZeRO stage 0-3 (3 is FSDP's full sharding).
        shard_over: "dp" (default) or "world": the ranks ZeRO shards over.
        optimizer: "adamw", "sgd" (momentum) or "none".
    """

    sp: int
    dp: int = 1
    zero: int = 0
    shard_over: str = "dp"
    optimizer: str = "adamw"

    def __post_init__(self) -> None:
        if self.sp < 1 or self.dp < 1:
            raise ConfigError(f"sp={self.sp}, dp={self.dp}: both must be >= 1")
        if self.zero not in (0, 1, 2, 3):
            raise ConfigError(f"zero={self.zero}: give a ZeRO stage 0, 1, 2 or 3 (3 = FSDP full sharding)")
        if self.shard_over not in ("dp", "world"):
            raise ConfigError(f"shard_over={self.shard_over!r}: give 'dp' or 'world'")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"optimizer={self.optimizer!r}: give one of {', '.join(OPTIMIZERS)}")

    @property
    def gpus(self) -> int:
        return self.sp * self.dp

    @property
    def shard_degree(self) -> int:
        return self.dp if self.shard_over == "dp" else self.gpus


@dataclass(frozen=True)
class StateBytes:
    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


def optimizer_bytes_per_param(optimizer: str, dtype: torch.dtype) -> int:
    master = 4 if dtype != torch.float32 else 0
    moments = {"adamw": 8, "sgd": 4, "none": 0}[optimizer]
    return (master + moments) if optimizer != "none" else 0


def state_bytes(params: int, dtype: torch.dtype, layout: Layout) -> StateBytes:
    """Per rank, at rest between steps. Gradients are in the parameters' dtype."""
    size = torch.empty((), dtype=dtype).element_size()
    n = layout.shard_degree
    p = params * size / (n if layout.zero >= 3 else 1)
    g = params * size / (n if layout.zero >= 2 else 1)
    o = params * optimizer_bytes_per_param(layout.optimizer, dtype) / (n if layout.zero >= 1 else 1)
    return StateBytes(p, g, o)


__all__ = ["OPTIMIZERS", "Layout", "StateBytes", "optimizer_bytes_per_param", "state_bytes"]
