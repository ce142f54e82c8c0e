"""Collectives of the SP program as custom ops with fake kernels and autograd.

They stay single nodes through make_fx, AOT autograd and Inductor, so the
passes can count and tag them, and their backward is exactly what the
placement algebra needs:

* Gradients of ``Replicate`` values are kept *partial* (their sum over ranks is
  the true gradient); gradients of ``Shard`` values are the true gradient of
  the local interval; gradients of ``Partial`` values are the true gradient.
* Hence ``all_gather`` (Shard -> Replicate) has a reduce-scatter backward and
  ``all_reduce`` (Partial -> Replicate) an all-reduce backward, unless the
  result is a program output whose incoming gradient is already the true one
  (``grad_replicated=True``): then the backward is a local slice or identity.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.distributed_c10d import _resolve_process_group


def _group(name: str) -> dist.ProcessGroup:
    return _resolve_process_group(name)


def _gathered_shape(x: Tensor, dim: int, sizes: list[int]) -> list[int]:
    shape = list(x.shape)
    shape[dim] = sum(sizes)
    return shape


# --- all_gather: concatenate uneven pieces along ``dim`` -------------------------------------


@torch.library.custom_op("autosp::all_gather", mutates_args=())
def all_gather(x: Tensor, dim: int, sizes: list[int], group_name: str, grad_replicated: bool) -> Tensor:
    group = _group(group_name)
    moved = x.movedim(dim, 0).contiguous()
    widest = max(sizes)
    if moved.shape[0] < widest:
        pad = moved.new_zeros((widest - moved.shape[0], *moved.shape[1:]))
        moved = torch.cat([moved, pad])
    pieces = [torch.empty_like(moved) for _ in sizes]
    dist.all_gather(pieces, moved, group=group)
    full = torch.cat([p[:n] for p, n in zip(pieces, sizes)])
    return full.movedim(0, dim).contiguous()


@all_gather.register_fake
def _(x, dim, sizes, group_name, grad_replicated):
    return x.new_empty(_gathered_shape(x, dim, sizes))


def _all_gather_setup(ctx: Any, inputs: tuple, output: Tensor) -> None:
    _, ctx.dim, ctx.sizes, ctx.group_name, ctx.grad_replicated = inputs


def _all_gather_backward(ctx: Any, grad: Tensor):
    if ctx.grad_replicated:
        rank = dist.get_rank(_group(ctx.group_name))
        start = sum(ctx.sizes[:rank])
        local = grad.narrow(ctx.dim, start, ctx.sizes[rank]).contiguous()
    else:
        local = reduce_scatter(grad.contiguous(), ctx.dim, ctx.sizes, ctx.group_name)
    return local, None, None, None, None


all_gather.register_autograd(_all_gather_backward, setup_context=_all_gather_setup)


# --- reduce_scatter: sum over ranks, keep this rank's uneven piece ---------------------------


@torch.library.custom_op("autosp::reduce_scatter", mutates_args=())
def reduce_scatter(x: Tensor, dim: int, sizes: list[int], group_name: str) -> Tensor:
    group = _group(group_name)
    rank = dist.get_rank(group)
    start = sum(sizes[:rank])
    if dist.get_backend(group) == "nccl" and len(set(sizes)) == 1:
        moved = x.movedim(dim, 0).contiguous()
        out = moved.new_empty((sizes[rank], *moved.shape[1:]))
        dist.reduce_scatter_tensor(out, moved, group=group)
        return out.movedim(0, dim).contiguous()
    # gloo has no reduce-scatter: an all-reduce and a local slice give the same result.
    total = x.contiguous().clone()
    dist.all_reduce(total, group=group)
    # A copy, never a view: Inductor takes a custom op's output for a fresh, aligned allocation,
    # and a narrow along dim 0 would keep a rank-dependent storage offset.
    return total.narrow(dim, start, sizes[rank]).clone(memory_format=torch.contiguous_format)


@reduce_scatter.register_fake
def _(x, dim, sizes, group_name):
    rank = dist.get_rank(_group(group_name))
    shape = list(x.shape)
    shape[dim] = sizes[rank]
    return x.new_empty(shape)


# --- all_reduce (sum) --------------------------------------------------------------------------


@torch.library.custom_op("autosp::all_reduce", mutates_args=())
def all_reduce(x: Tensor, group_name: str, grad_replicated: bool) -> Tensor:
    out = x.contiguous().clone()
    dist.all_reduce(out, group=_group(group_name))
    return out


@all_reduce.register_fake
def _(x, group_name, grad_replicated):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _all_reduce_setup(ctx: Any, inputs: tuple, output: Tensor) -> None:
    _, ctx.group_name, ctx.grad_replicated = inputs


def _all_reduce_backward(ctx: Any, grad: Tensor):
    if ctx.grad_replicated:
        return grad, None, None
    return all_reduce(grad, ctx.group_name, True), None, None


all_reduce.register_autograd(_all_reduce_backward, setup_context=_all_reduce_setup)


# --- all_to_all: split ``scatter_dim`` over ranks, concatenate ``gather_dim`` ----------------


@torch.library.custom_op("autosp::all_to_all", mutates_args=())
def all_to_all(x: Tensor, scatter_dim: int, gather_dim: int, group_name: str) -> Tensor:
    group = _group(group_name)
    world = dist.get_world_size(group)
    moved = x.movedim(scatter_dim, 0)
    chunk = moved.shape[0] // world
    send = moved.reshape(world, chunk, *moved.shape[1:]).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    pieces = [recv[r].movedim(0, scatter_dim) for r in range(world)]
    return torch.cat(pieces, dim=gather_dim).contiguous()


@all_to_all.register_fake
def _(x, scatter_dim, gather_dim, group_name):
    world = dist.get_world_size(_group(group_name))
    shape = list(x.shape)
    shape[scatter_dim] = shape[scatter_dim] // world
    shape[gather_dim] = shape[gather_dim] * world
    return x.new_empty(shape)


def _all_to_all_setup(ctx: Any, inputs: tuple, output: Tensor) -> None:
    _, ctx.scatter_dim, ctx.gather_dim, ctx.group_name = inputs


def _all_to_all_backward(ctx: Any, grad: Tensor):
    back = all_to_all(grad.contiguous(), ctx.gather_dim, ctx.scatter_dim, ctx.group_name)
    return back, None, None, None


all_to_all.register_autograd(_all_to_all_backward, setup_context=_all_to_all_setup)


# --- scale_grad: identity forward, scaled backward ---------------------------------------------


@torch.library.custom_op("autosp::scale_grad", mutates_args=())
def scale_grad(x: Tensor, scale: float) -> Tensor:
    return x.clone()


@scale_grad.register_fake
def _(x, scale):
    return torch.empty_like(x)


def _scale_grad_setup(ctx: Any, inputs: tuple, output: Tensor) -> None:
    ctx.scale = inputs[1]


def _scale_grad_backward(ctx: Any, grad: Tensor):
    return grad * ctx.scale, None


scale_grad.register_autograd(_scale_grad_backward, setup_context=_scale_grad_setup)

COLLECTIVE_OPS = frozenset(
    {
        torch.ops.autosp.all_gather.default,
        torch.ops.autosp.reduce_scatter.default,
        torch.ops.autosp.all_reduce.default,
        torch.ops.autosp.all_to_all.default,
    }
)

__all__ = ["COLLECTIVE_OPS", "all_gather", "all_reduce", "all_to_all", "reduce_scatter", "scale_grad"]
