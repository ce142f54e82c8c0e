"""A token-wise MLP computed in row chunks: its ``[tokens, ffn]`` intermediates are never whole.

``autosp::tiled_mlp(x [N, D], w_in [F, D], b_in [F]?, w_gate [F, D]?, w_out [D, F], b_out [D]?, act, chunk)``
returns what the model's MLP gives for each row of ``x``:

* plain: ``act(x @ w_in.T + b_in) @ w_out.T + b_out``
* gated (``w_gate`` given, SwiGLU / GeGLU): ``(act(x @ w_gate.T) * (x @ w_in.T)) @ w_out.T + b_out``

The forward keeps nothing but its inputs. The backward recomputes one chunk of rows at a time
and differentiates it with the aten backward ops single-device autograd uses (``silu_backward``,
``gelu_backward``, ``threshold_backward``), writing ``dx`` per chunk and accumulating the
weights' gradients in fp32 (the
memory trick of Snowflake's ALST TiledMLP, done by the compiler). Results equal the whole-matrix
computation up to the order of the matmuls' and the gradient sums' additions.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu")


def _act(kind: str, z: Tensor) -> Tensor:
    if kind == "silu":
        return F.silu(z)
    if kind == "gelu":
        return F.gelu(z)
    if kind == "gelu_tanh":
        return F.gelu(z, approximate="tanh")
    if kind == "relu":
        return F.relu(z)
    raise ValueError(f"tiled_mlp: activation {kind!r} is not one of {ACTIVATIONS}")


def _linear(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    return x @ w.t() if b is None else torch.addmm(b, x, w.t())


def _rows(n: int, chunk: int) -> range:
    return range(0, n, max(int(chunk), 1))


def _chunk(
    x: Tensor, w_in: Tensor, b_in: Tensor | None, w_gate: Tensor | None, w_out: Tensor, b_out: Tensor | None, act: str
) -> Tensor:
    hidden = _linear(x, w_in, b_in)
    hidden = _act(act, hidden) if w_gate is None else _act(act, x @ w_gate.t()) * hidden
    return _linear(hidden, w_out, b_out)


@torch.library.custom_op("autosp::tiled_mlp", mutates_args=())
def tiled_mlp(
    x: Tensor,
    w_in: Tensor,
    b_in: Tensor | None,
    w_gate: Tensor | None,
    w_out: Tensor,
    b_out: Tensor | None,
    act: str,
    chunk: int,
) -> Tensor:
    out = x.new_empty((x.shape[0], w_out.shape[0]))
    for lo in _rows(x.shape[0], chunk):
        out[lo : lo + chunk] = _chunk(x[lo : lo + chunk], w_in, b_in, w_gate, w_out, b_out, act)
    return out


@tiled_mlp.register_fake
def _(x, w_in, b_in, w_gate, w_out, b_out, act, chunk):
    _act(act, x.new_empty(()))  # an unknown activation fails while tracing, not at run time
    return x.new_empty((x.shape[0], w_out.shape[0]))


def _empty_like_opt(t: Tensor | None, like: Tensor) -> Tensor:
    return t.new_empty(t.shape) if t is not None else like.new_empty((0,))


def _act_backward(kind: str, grad: Tensor, z: Tensor) -> Tensor:
    """The derivative single-device autograd applies (the same aten backward ops).

    relu's is ``threshold_backward`` on its output there, here on its input: ``relu(z) > 0``
    exactly where ``z > 0``, so the result is the same and the output need not stay live.
    """
    aten = torch.ops.aten
    if kind == "silu":
        return aten.silu_backward(grad, z)
    if kind in ("gelu", "gelu_tanh"):
        return aten.gelu_backward(grad, z, approximate="tanh" if kind == "gelu_tanh" else "none")
    return aten.threshold_backward(grad, z, 0)


@torch.library.custom_op("autosp::tiled_mlp_backward", mutates_args=())
def tiled_mlp_backward(
    grad: Tensor,
    x: Tensor,
    w_in: Tensor,
    b_in: Tensor | None,
    w_gate: Tensor | None,
    w_out: Tensor,
    b_out: Tensor | None,
    act: str,
    chunk: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``dx`` and the gradients of ``w_in, b_in, w_gate, w_out, b_out`` (empty where absent)."""

    def zeros(p: Tensor | None) -> Tensor:
        shape = p.shape if p is not None else (0,)
        return torch.zeros(shape, dtype=torch.promote_types(x.dtype, torch.float32), device=x.device)

    d_w_in, d_b_in, d_w_gate, d_w_out, d_b_out = map(zeros, (w_in, b_in, w_gate, w_out, b_out))
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    for lo in _rows(x.shape[0], chunk):
        xc, g = x[lo : lo + chunk], grad[lo : lo + chunk]
        # The order, the in-place products and the dels keep at most four [rows, ffn] values live
        # at once (three when not gated): this loop is where a tiled program's backward peaks.
        z = _linear(xc, w_in, b_in)
        if w_gate is None:
            a = _act(act, z)
            d_w_out += g.t() @ a
            del a
            dz = _act_backward(act, g @ w_out, z)
            del z
            dx[lo : lo + chunk] = dz @ w_in
        else:
            zg = xc @ w_gate.t()
            a = _act(act, zg)
            d_w_out += g.t() @ (a * z)
            dh = g @ w_out
            z.mul_(dh)  # dh * z, the activation's gradient, in z's buffer
            dz = a.mul_(dh)  # dh * a, in a's buffer
            del dh, a
            dzg = _act_backward(act, z, zg)
            del z, zg
            d_w_gate += dzg.t() @ xc
            dx[lo : lo + chunk] = torch.addmm(dz @ w_in, dzg, w_gate)
            del dzg
        d_w_in += dz.t() @ xc
        if b_in is not None:
            d_b_in += dz.sum(0)
        if b_out is not None:
            d_b_out += g.sum(0)
        del dz  # before the next chunk's values
    return (
        dx,
        d_w_in.to(w_in.dtype),
        d_b_in.to(x.dtype),
        d_w_gate.to(x.dtype),
        d_w_out.to(w_out.dtype),
        d_b_out.to(x.dtype),
    )


@tiled_mlp_backward.register_fake
def _(grad, x, w_in, b_in, w_gate, w_out, b_out, act, chunk):
    return (
        torch.empty_like(x, memory_format=torch.contiguous_format),
        torch.empty_like(w_in),
        _empty_like_opt(b_in, x),
        _empty_like_opt(w_gate, x),
        torch.empty_like(w_out),
        _empty_like_opt(b_out, x),
    )


def _setup(ctx: Any, inputs: tuple, output: Tensor) -> None:
    x, w_in, b_in, w_gate, w_out, b_out, ctx.act, ctx.chunk = inputs
    ctx.present = (b_in is not None, w_gate is not None, b_out is not None)
    ctx.save_for_backward(x, w_in, b_in, w_gate, w_out, b_out)


def _backward(ctx: Any, grad: Tensor):
    x, w_in, b_in, w_gate, w_out, b_out = ctx.saved_tensors
    has_b_in, has_gate, has_b_out = ctx.present
    dx, dw_in, db_in, dw_gate, dw_out, db_out = tiled_mlp_backward(
        grad,
        x,
        w_in,
        b_in if has_b_in else None,
        w_gate if has_gate else None,
        w_out,
        b_out if has_b_out else None,
        ctx.act,
        ctx.chunk,
    )
    return (
        dx,
        dw_in,
        db_in if has_b_in else None,
        dw_gate if has_gate else None,
        dw_out,
        db_out if has_b_out else None,
        None,
        None,
    )


tiled_mlp.register_autograd(_backward, setup_context=_setup)

OP = torch.ops.autosp.tiled_mlp.default

__all__ = ["ACTIVATIONS", "OP", "tiled_mlp", "tiled_mlp_backward"]
