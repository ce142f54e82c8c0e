"""A sequence-aware cost model: does recomputing the cheap part pay at this length?

Recomputing token-wise matmuls costs O(s*d^2) FLOPs and re-running the
all-to-alls that feed attention moves O(s*d) bytes, while attention itself costs
O(s^2*d). The step-time overhead of full recompute therefore falls with the
sequence length; ``sac="auto"`` turns it on below a threshold.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import fx

from autosp.hardware import HardwareProfile
from autosp_sac.graph import MATMULS, JointInfo, hint, nbytes

COLLECTIVE_PREFIX = "autosp."
OVERHEAD_THRESHOLD = 0.10


@dataclass(frozen=True)
class Costs:
    matmul_flops: float
    attention_flops: float
    comm_bytes: float

    def step_seconds(self, hw: HardwareProfile) -> float:
        # Forward plus a backward of about twice the forward; communication forward and backward.
        return 3 * (self.matmul_flops + self.attention_flops) / hw.flops + 2 * self.comm_bytes / hw.comm_bandwidth

    def recompute_seconds(self, hw: HardwareProfile) -> float:
        return self.matmul_flops / hw.flops + self.comm_bytes / hw.comm_bandwidth

    def overhead(self, hw: HardwareProfile) -> float:
        step = self.step_seconds(hw)
        return self.recompute_seconds(hw) / step if step else 0.0


def _shape(node: fx.Node) -> tuple[int, ...]:
    val = node.meta.get("val")
    return tuple(hint(s) for s in val.shape) if isinstance(val, torch.Tensor) else ()


def matmul_flops(node: fx.Node) -> float:
    a, b = (
        (node.args[1], node.args[2])
        if node.target in (torch.ops.aten.addmm.default, torch.ops.aten.baddbmm.default)
        else node.args[:2]
    )
    out = _shape(node)
    k = _shape(a)[-1] if isinstance(a, fx.Node) else 0
    return 2.0 * math.prod(out) * k


def attention_flops(node: fx.Node) -> float:
    q, k = node.args[0], node.args[1]
    qs, ks = _shape(q), _shape(k)
    if len(qs) != 4 or len(ks) != 4:
        return 0.0
    b, h, s, d = qs
    flops = 4.0 * b * h * s * ks[2] * d
    causal = any(a is True for a in node.args[3:6]) or node.kwargs.get("is_causal", False)
    return flops / 2 if causal else flops


def is_collective(node: fx.Node) -> bool:
    return str(node.target).startswith(COLLECTIVE_PREFIX) and "all_to_all" in str(node.target)


def estimate(info: JointInfo) -> Costs:
    mm = sum(matmul_flops(n) for n in info.forward if n.target in MATMULS)
    attn = sum(attention_flops(n) for n in info.attention)
    comm = sum(nbytes(n) for n in info.forward if is_collective(n))
    return Costs(mm, attn, comm)


__all__ = ["OVERHEAD_THRESHOLD", "Costs", "attention_flops", "estimate", "matmul_flops"]
