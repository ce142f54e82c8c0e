"""A token-wise LM head and cross entropy computed in row chunks: the ``[tokens, vocab]`` logits never live.

``autosp::linear_cross_entropy(hidden [N, D], weight [V, D], bias [V]?, target [N], ...)`` returns
``[sum, count]``: the summed token losses and the number of non-ignored tokens, exactly what
``nll_loss_forward(log_softmax(epilogue(hidden @ weight.T + bias)), target, reduction=sum)`` gives,
up to the order of the sum's additions. The forward keeps nothing but its inputs; the backward
recomputes each chunk's logits and writes ``dhidden`` and accumulates ``dweight``/``dbias``.

The epilogue is what a model does to its logits between the matmul and the loss, elementwise and
with constants only: casts (``logits.float()``), scaling and a soft-cap (``cap * tanh(z / cap)``).
It is a string so the op stays one opaque node through make_fx, AOT autograd and Inductor:
``"to:float32,div:30.0,tanh,mul:30.0"``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

EPILOGUE_KINDS = ("to", "mul", "div", "tanh")
Step = tuple[str, Any]


def parse_epilogue(spec: str) -> list[Step]:
    steps: list[Step] = []
    for item in filter(None, spec.split(",")):
        kind, _, arg = item.partition(":")
        if kind == "to":
            dtype = getattr(torch, arg, None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"linear_cross_entropy: unknown dtype {arg!r} in epilogue {spec!r}")
            steps.append((kind, dtype))
        elif kind in ("mul", "div"):
            steps.append((kind, float(arg)))
        elif kind == "tanh" and not arg:
            steps.append((kind, None))
        else:
            raise ValueError(f"linear_cross_entropy: epilogue step {item!r} is not one of {EPILOGUE_KINDS}")
    return steps


def format_epilogue(steps: list[Step]) -> str:
    """The inverse of ``parse_epilogue``; floats by ``repr`` so constants round-trip exactly."""
    out = []
    for kind, arg in steps:
        if kind == "to":
            out.append(f"to:{str(arg).removeprefix('torch.')}")
        elif kind in ("mul", "div"):
            out.append(f"{kind}:{float(arg)!r}")
        else:
            out.append(kind)
    return ",".join(out)


def loss_dtype(hidden_dtype: torch.dtype, steps: list[Step]) -> torch.dtype:
    """The dtype the log-softmax runs in: the matmul's, then each cast's."""
    dtype = hidden_dtype
    for kind, arg in steps:
        if kind == "to":
            dtype = arg
    return dtype


def _logits(h: Tensor, w: Tensor, b: Tensor | None, steps: list[Step]) -> tuple[Tensor, list[Any]]:
    """One chunk's logits, and what the epilogue's backward needs (the dtype before a cast, tanh's output)."""
    z = h @ w.t() if b is None else torch.addmm(b, h, w.t())
    saved: list[Any] = []
    for kind, arg in steps:
        if kind == "to":
            saved.append(z.dtype)
            z = z.to(arg)
        elif kind == "mul":
            z = z * arg
        elif kind == "div":
            z = z / arg
        else:
            z = torch.tanh(z)
            saved.append(z)
    return z, saved


def _epilogue_backward(dz: Tensor, steps: list[Step], saved: list[Any]) -> Tensor:
    for kind, arg in reversed(steps):
        if kind == "to":
            dz = dz.to(saved.pop())
        elif kind == "mul":
            dz = dz * arg
        elif kind == "div":
            dz = dz / arg
        else:
            y = saved.pop()
            dz = dz * (1 - y * y)
    return dz


def _rows(n: int, chunk: int) -> range:
    return range(0, n, max(int(chunk), 1))


@torch.library.custom_op("autosp::linear_cross_entropy", mutates_args=())
def linear_cross_entropy(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor, ignore_index: int, epilogue: str, chunk: int
) -> Tensor:
    steps = parse_epilogue(epilogue)
    dtype = loss_dtype(hidden.dtype, steps)
    # fp32 (or wider) accumulation over chunks: the single-device sum rounds once per element too.
    acc = torch.promote_types(dtype, torch.float32)
    total = hidden.new_zeros((), dtype=acc)
    for lo in _rows(hidden.shape[0], chunk):
        h, t = hidden[lo : lo + chunk], target[lo : lo + chunk]
        z, _ = _logits(h, weight, bias, steps)
        total += F.nll_loss(z.log_softmax(-1), t, reduction="sum", ignore_index=ignore_index).to(acc)
    count = (target != ignore_index).sum().to(acc)
    return torch.stack([total, count]).to(dtype)


@linear_cross_entropy.register_fake
def _(hidden, weight, bias, target, ignore_index, epilogue, chunk):
    return hidden.new_empty((2,), dtype=loss_dtype(hidden.dtype, parse_epilogue(epilogue)))


@torch.library.custom_op("autosp::linear_cross_entropy_backward", mutates_args=())
def linear_cross_entropy_backward(
    grad_sum: Tensor,
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    target: Tensor,
    ignore_index: int,
    epilogue: str,
    chunk: int,
) -> tuple[Tensor, Tensor, Tensor]:
    steps = parse_epilogue(epilogue)
    dhidden = torch.empty_like(hidden, memory_format=torch.contiguous_format)
    acc = torch.promote_types(weight.dtype, torch.float32)
    dweight = torch.zeros(weight.shape, dtype=acc, device=weight.device)
    dbias = torch.zeros(bias.shape if bias is not None else (0,), dtype=acc, device=weight.device)
    for lo in _rows(hidden.shape[0], chunk):
        h, t = hidden[lo : lo + chunk], target[lo : lo + chunk]
        z, saved = _logits(h, weight, bias, steps)
        # d(sum of -log_softmax[target]) / dz = softmax - onehot, on the tokens that count.
        valid = t != ignore_index
        g = grad_sum.to(z.dtype)
        dz = z.log_softmax(-1).exp_().mul_((valid.to(z.dtype) * g).unsqueeze(1))
        rows = valid.nonzero().squeeze(1)
        dz[rows, t[rows]] -= g
        dz = _epilogue_backward(dz, steps, saved).to(hidden.dtype)
        dhidden[lo : lo + chunk] = dz @ weight
        dweight += (dz.t() @ h).to(acc)
        if bias is not None:
            dbias += dz.sum(0).to(acc)
    return dhidden, dweight.to(weight.dtype), dbias.to(bias.dtype if bias is not None else weight.dtype)


@linear_cross_entropy_backward.register_fake
def _(grad_sum, hidden, weight, bias, target, ignore_index, epilogue, chunk):
    db = bias.new_empty(bias.shape) if bias is not None else weight.new_empty((0,))
    return torch.empty_like(hidden, memory_format=torch.contiguous_format), torch.empty_like(weight), db


def _setup(ctx: Any, inputs: tuple, output: Tensor) -> None:
    hidden, weight, bias, target, ctx.ignore_index, ctx.epilogue, ctx.chunk = inputs
    ctx.has_bias = bias is not None
    ctx.save_for_backward(hidden, weight, bias, target)


def _backward(ctx: Any, grad: Tensor):
    hidden, weight, bias, target = ctx.saved_tensors
    # The count is piecewise constant in the inputs: only the sum's gradient flows.
    dh, dw, db = linear_cross_entropy_backward(
        grad[0], hidden, weight, bias if ctx.has_bias else None, target, ctx.ignore_index, ctx.epilogue, ctx.chunk
    )
    return dh, dw, (db if ctx.has_bias else None), None, None, None, None


linear_cross_entropy.register_autograd(_backward, setup_context=_setup)

OP = torch.ops.autosp.linear_cross_entropy.default

__all__ = [
    "OP",
    "format_epilogue",
    "linear_cross_entropy",
    "linear_cross_entropy_backward",
    "loss_dtype",
    "parse_epilogue",
]
