"""``autosp_window::sliding_window_attention(q, k, v, window)``: query i sees keys j with 0 <= i - j < window.

q is [B, H, S, D]; k and v may have fewer heads (GQA: kv head h serves query heads
h*g .. h*g+g-1).  The eager kernel is a plain math reference; its backward is the
VJP of the same math, so single-device training through the op is exact.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor


def reference_attention(q: Tensor, k: Tensor, v: Tensor, window: int) -> Tensor:
    s = q.shape[-2]
    pos = torch.arange(s, device=q.device)
    allowed = (pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] < window)
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v)


@torch.library.custom_op("autosp_window::sliding_window_attention", mutates_args=())
def sliding_window_attention(q: Tensor, k: Tensor, v: Tensor, window: int) -> Tensor:
    return reference_attention(q, k, v, window)


@sliding_window_attention.register_fake
def _(q, k, v, window):
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


def _setup(ctx: Any, inputs: tuple, output: Tensor) -> None:
    q, k, v, ctx.window = inputs
    ctx.save_for_backward(q, k, v)


def _backward(ctx: Any, grad: Tensor):
    q, k, v = ctx.saved_tensors
    _, vjp = torch.func.vjp(lambda a, b, c: reference_attention(a, b, c, ctx.window), q, k, v)
    return (*vjp(grad), None)


sliding_window_attention.register_autograd(_backward, setup_context=_setup)

__all__ = ["reference_attention", "sliding_window_attention"]
