"""Small models and a graph-capturing Dynamo backend for the unit tests."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F


def capture_graphs(fn: Any, *args: Any, **kwargs: Any) -> tuple[list[torch.fx.GraphModule], Any]:
    """Dynamo graphs of ``fn(*args, **kwargs)`` (run eagerly by the recording backend) and its result."""
    graphs: list[torch.fx.GraphModule] = []

    def record(gm: torch.fx.GraphModule, example_inputs: list[Any]):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(fn, backend=record)(*args, **kwargs)
    return graphs, out


class TinyAttention(nn.Module):
    """One causal SDPA self-attention layer: x [B, S, 16] -> [B, S, 16], 2 heads."""

    def __init__(self, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.o = nn.Linear(dim, dim)

    def forward(self, x):
        B, S, D = x.shape
        q, k, v = self.qkv(x).view(B, S, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(a.transpose(1, 2).reshape(B, S, D))


class MLP(nn.Module):
    """No attention at all."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x))).sum()
