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

from autosp import peer_failure


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
    peer_failure.wait(dist.all_gather(pieces, moved, group=group, async_op=True), group, moved.device)
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
        peer_failure.wait(dist.reduce_scatter_tensor(out, moved, group=group, async_op=True), group, out.device)
        return out.movedim(0, dim).contiguous()
    # gloo has no reduce-scatter: an all-reduce and a local slice give the same result.
    total = x.contiguous().clone()
    peer_failure.wait(dist.all_reduce(total, group=group, async_op=True), group, total.device)
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
    group = _group(group_name)
    peer_failure.wait(dist.all_reduce(out, group=group, async_op=True), group, out.device)
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
#
# One exchange is two ops, so that compute which does not need it can run while it is in flight
# (``autosp.passes.overlap`` moves the wait down to the first use):
#
# * ``autosp::all_to_all`` starts it and returns the receive buffer, flat: its contents are
#   undefined until the wait. The send side is this op's own copy, so a compiler may reuse the
#   input's memory as soon as the start has run.
# * ``autosp::wait_exchange`` waits (when the exchange is still pending) and lays the received
#   blocks out as the result. On a buffer whose exchange is already complete (a wait recomputed in
#   the backward on a buffer the forward saved) it only lays it out.
#
# The buffer is flat with the input's numel, the same for an exchange and its inverse, so the
# backward of each op is the other op of the inverse exchange: the wait's backward starts the
# inverse all-to-all of the incoming gradient, the start's backward waits for it. The backward is
# thus a start/wait pair too, which the overlap pass places like the forward's.

_PENDING: dict[int, tuple[Any, Tensor, Tensor]] = {}  # receive buffer address -> (work, recv, send)


def _exchanged_shape(shape: list[Any], scatter_dim: int, gather_dim: int, world: int) -> list[Any]:
    out = list(shape)
    out[scatter_dim] = out[scatter_dim] // world
    out[gather_dim] = out[gather_dim] * world
    return out


@torch.library.custom_op("autosp::all_to_all", mutates_args=())
def all_to_all_start(x: Tensor, scatter_dim: int, gather_dim: int, group_name: str) -> Tensor:
    group = _group(group_name)
    world = dist.get_world_size(group)
    moved = x.movedim(scatter_dim, 0)
    send = x.new_empty((world, moved.shape[0] // world, *moved.shape[1:]))
    send.copy_(moved.reshape(send.shape))
    recv = torch.empty_like(send)
    if recv.numel() == 0:
        return recv.view(-1)
    work = dist.all_to_all_single(recv, send, group=group, async_op=True)
    # Both buffers stay referenced until the wait: gloo reads and writes them in the background.
    _PENDING[recv.data_ptr()] = (work, recv, send)
    return recv.view(-1)


@all_to_all_start.register_fake
def _(x, scatter_dim, gather_dim, group_name):
    return x.new_empty((x.numel(),))


@torch.library.custom_op("autosp::wait_exchange", mutates_args=())
def all_to_all_wait(buf: Tensor, shape: list[int], scatter_dim: int, gather_dim: int, group_name: str) -> Tensor:
    group = _group(group_name)
    if buf.numel():
        pending = _PENDING.pop(buf.data_ptr(), None)
        if pending is not None:
            work, _, send = pending
            peer_failure.wait(work, group, send.device)
            # The send copy dies here, before the layout below allocates the result: the wait's
            # peak is the receive buffer and the result, not the send copy as well. Gloo's worker
            # thread drops its own reference to the buffers only a moment after the wait returns,
            # so on CPU (where the wait means the exchange is done) the memory is released
            # explicitly, or the peak would depend on that race. On CUDA the wait only orders
            # streams: the buffer must live until the communication stream is done with it.
            if send.device.type == "cpu":
                send.untyped_storage().resize_(0)
            del pending, work, send
    world = dist.get_world_size(group)
    rest = [n for d, n in enumerate(shape) if d != scatter_dim]
    recv = buf.view(world, shape[scatter_dim] // world, *rest)
    pieces = [recv[r].movedim(0, scatter_dim) for r in range(world)]
    return torch.cat(pieces, dim=gather_dim).contiguous()


@all_to_all_wait.register_fake
def _(buf, shape, scatter_dim, gather_dim, group_name):
    world = dist.get_world_size(_group(group_name))
    return buf.new_empty(_exchanged_shape(shape, scatter_dim, gather_dim, world))


def _start_setup(ctx: Any, inputs: tuple, output: Tensor) -> None:
    x, ctx.scatter_dim, ctx.gather_dim, ctx.group_name = inputs
    world = dist.get_world_size(_group(ctx.group_name))
    ctx.out_shape = _exchanged_shape(list(x.shape), ctx.scatter_dim, ctx.gather_dim, world)


def _start_backward(ctx: Any, grad_buf: Tensor):
    # ``grad_buf`` is the inverse exchange in flight, started by the wait's backward.
    grad = all_to_all_wait(grad_buf, ctx.out_shape, ctx.gather_dim, ctx.scatter_dim, ctx.group_name)
    return grad, None, None, None


all_to_all_start.register_autograd(_start_backward, setup_context=_start_setup)


def _wait_setup(ctx: Any, inputs: tuple, output: Tensor) -> None:
    _, _, ctx.scatter_dim, ctx.gather_dim, ctx.group_name = inputs


def _wait_backward(ctx: Any, grad: Tensor):
    return all_to_all_start(grad.contiguous(), ctx.gather_dim, ctx.scatter_dim, ctx.group_name), None, None, None, None


all_to_all_wait.register_autograd(_wait_backward, setup_context=_wait_setup)


def all_to_all(x: Tensor, scatter_dim: int, gather_dim: int, group_name: str) -> Tensor:
    """The whole exchange: start, then wait (``autosp.passes.overlap`` may move them apart)."""
    buf = all_to_all_start(x, scatter_dim, gather_dim, group_name)
    return all_to_all_wait(buf, list(x.shape), scatter_dim, gather_dim, group_name)


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

# --- gradient conventions around code that must see whole gradients ------------------------------
#
# A user's own backward (``autosp::user_function``) may not be linear in the gradient (a clamp), so
# it must get the true gradient, not the partial one a replicated value carries. ``sum_grads`` sits
# after such code: identity forward, its backward sums the partial gradients into the true one.
# ``grad_once`` sits before it: identity forward, its backward keeps the (true) gradient on one rank
# and zeros elsewhere, which is the partial convention again, exactly (no 1/P rounding).


@torch.library.custom_op("autosp::sum_grads", mutates_args=())
def sum_grads(x: Tensor, group_name: str) -> Tensor:
    return x.clone()


@sum_grads.register_fake
def _(x, group_name):
    return torch.empty_like(x)


def _sum_grads_setup(ctx: Any, inputs: tuple, output: Tensor) -> None:
    ctx.group_name = inputs[1]


def _sum_grads_backward(ctx: Any, grad: Tensor):
    return all_reduce(grad, ctx.group_name, True), None


sum_grads.register_autograd(_sum_grads_backward, setup_context=_sum_grads_setup)


@torch.library.custom_op("autosp::grad_once", mutates_args=())
def grad_once(x: Tensor, keep: bool) -> Tensor:
    return x.clone()


@grad_once.register_fake
def _(x, keep):
    return torch.empty_like(x)


def _grad_once_setup(ctx: Any, inputs: tuple, output: Tensor) -> None:
    # ``keep`` is an argument, not read from the group here: the forward graph then differs per rank,
    # so no compile cache hands one rank's backward to another.
    ctx.keep = inputs[1]


def _grad_once_backward(ctx: Any, grad: Tensor):
    # The same ops on every rank, the zeros depending on the gradient: the joint graphs then differ
    # by a constant only, so the gradient buckets planned on them pair up across ranks.
    # masked_fill, not ``* 0``: an inf or nan in the gradient must not leak into the sum.
    drop = torch.full((), not ctx.keep, dtype=torch.bool, device=grad.device)
    return grad.masked_fill(drop, 0), None


grad_once.register_autograd(_grad_once_backward, setup_context=_grad_once_setup)

COLLECTIVE_OPS = frozenset(
    {
        torch.ops.autosp.all_gather.default,
        torch.ops.autosp.reduce_scatter.default,
        torch.ops.autosp.all_reduce.default,
        torch.ops.autosp.all_to_all.default,
    }
)

# Ops whose result is only usable after a later wait, and those waits.
START_OPS = frozenset({torch.ops.autosp.all_to_all.default})
WAIT_OPS = frozenset({torch.ops.autosp.wait_exchange.default})

__all__ = [
    "COLLECTIVE_OPS",
    "START_OPS",
    "WAIT_OPS",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "all_to_all_start",
    "all_to_all_wait",
    "grad_once",
    "reduce_scatter",
    "scale_grad",
    "sum_grads",
]
