"""Elementwise ops, broadcasting included: operands are aligned to the sharded one."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

from autosp.sharding.context import SPContext, SPValue
from autosp.sharding.dims import broadcast_dim
from autosp.sharding.placement import HeadShard, Partial, Replicate, SeqAxis, Shard
from autosp.sharding.redistribute import to_replicate, to_shard
from autosp.sharding.rules.base import (
    RULES,
    call,
    declare,
    fallback,
    reduce_partials,
    replicated,
    values,
    wrap,
)

aten = torch.ops.aten

# --- elementwise ------------------------------------------------------------------------------

# Ops through which a partial sum stays a partial sum, and which operands may be partial.
_LINEAR = {
    aten.add.Tensor: "all",
    aten.sub.Tensor: "all",
    aten.neg.default: "all",
    aten.mul.Tensor: "one",
    aten.div.Tensor: "first",
    aten.clone.default: "all",
    aten._to_copy.default: "all",
    aten.alias.default: "all",
}


def _float_to_float(args: tuple, kwargs: dict) -> bool:
    """A cast that keeps every summand exact: float to a float at least as wide.

    A narrower one (fp32 -> bf16) would round each rank's summand before the sum, where the
    single-device program rounds the sum: the engine sums first, then casts.
    """
    source = args[0].gval.dtype
    target = kwargs.get("dtype") or source
    if not (source.is_floating_point and target.is_floating_point):
        return False
    return target == source or torch.promote_types(source, target) == target and target.itemsize > source.itemsize


def _partial_ok(op: Any, args: tuple, kwargs: dict) -> bool:
    kind = _LINEAR.get(op)
    if kind is None or kwargs.get("alpha", 1) != 1:
        return False
    if kind == "all" and any(isinstance(a, (int, float, bool)) for a in args[1:]):
        # ``partial + 1`` would add the constant once per rank.
        return False
    if op is aten._to_copy.default and not _float_to_float(args, kwargs):
        # Rounding each summand (to an integer, a bool, a narrower float) is not rounding their sum.
        return False
    tensors = values(args)
    partial = [isinstance(v.placement, Partial) for v in tensors]
    others_plain = all(isinstance(v.placement, Replicate) for v in tensors if not isinstance(v.placement, Partial))
    if kind == "all":
        return all(partial)
    if kind == "one":
        return sum(partial) == 1 and others_plain
    return partial[0] and sum(partial) == 1 and others_plain


def elementwise(ctx: SPContext, node: torch.fx.Node, args: tuple, kwargs: dict) -> Any:
    tensors = values((args, kwargs))
    if any(isinstance(v.placement, Partial) for v in tensors):
        if _partial_ok(node.target, args, kwargs):
            return wrap(call(node, args, kwargs), node.meta["val"], lambda _i, _g: Partial())
        args, kwargs = reduce_partials(ctx, (args, kwargs))
        tensors = values((args, kwargs))
    out_val = node.meta["val"]
    out_ndim = out_val.dim() if isinstance(out_val, torch.Tensor) else out_val[0].dim()
    out_shape = out_val.shape if isinstance(out_val, torch.Tensor) else out_val[0].shape
    # Only an operand whose sharded dim has the result's extent can lay out the result; a piece of
    # a length-1 slice broadcast along the sequence (``x[:, :1] + y``) is made whole first.
    lead = next((v for v in tensors if isinstance(v.placement, Shard) and _spans(v, out_ndim, out_shape)), None)
    if lead is None and any(isinstance(v.placement, Shard) for v in tensors):
        args, kwargs = pytree.tree_map(
            lambda v: to_replicate(ctx, v) if isinstance(v, SPValue) and isinstance(v.placement, Shard) else v,
            (args, kwargs),
            is_leaf=lambda x: isinstance(x, SPValue),
        )
        tensors = values((args, kwargs))
    if lead is None:
        if any(isinstance(v.placement, HeadShard) for v in tensors):
            return fallback(ctx, node, args, kwargs)
        axis = _elementwise_axis(tensors, out_ndim, out_val)
        return replicated(ctx, node, args, kwargs, axis)
    target: Shard = lead.placement
    out_dim = broadcast_dim(out_ndim, lead.ndim, target.axis.dim)

    def align(v: Any) -> Any:
        if not isinstance(v, SPValue):
            return v
        d = out_dim - (out_ndim - v.ndim)
        if d < 0 or v.gval.shape[d] == 1:
            if isinstance(v.placement, Replicate):
                return v.local
            return to_replicate(ctx, v, f"{node.name}: operand sharded on a broadcast dim").local
        if v.gval.shape[d] != out_shape[out_dim]:
            return to_replicate(ctx, v, f"{node.name}: operand shape mismatch").local
        return to_shard(ctx, v, d, target)

    local_args, local_kwargs = pytree.tree_map(align, (args, kwargs), is_leaf=lambda x: isinstance(x, SPValue))
    out = node.target(*local_args, **local_kwargs)
    placement = Shard(target.axis.at(out_dim), target.ranges)
    return wrap(out, out_val, lambda _i, _g: placement)


def _spans(v: SPValue, out_ndim: int, out_shape: Any) -> bool:
    """Whether ``v``'s sharded dim is as long in the result (not broadcast from length 1)."""
    dim = v.placement.axis.dim
    return v.gval.shape[dim] == out_shape[broadcast_dim(out_ndim, v.ndim, dim)]


def _elementwise_axis(tensors: list[SPValue], out_ndim: int, out_val: Any) -> SeqAxis | None:
    if not isinstance(out_val, torch.Tensor):
        return None
    for v in tensors:
        axis = v.placement.axis if isinstance(v.placement, Replicate) else None
        if axis is not None:
            d = broadcast_dim(out_ndim, v.ndim, axis.dim)
            if v.gval.shape[axis.dim] == out_val.shape[d]:
                return axis.at(d)
    return None


# In-place variants never reach the rules: lowering functionalizes the graph.
for _op in (
    aten.masked_fill.Scalar,
    aten.masked_fill.Tensor,
    aten.where.self,
    aten.where.ScalarSelf,
    aten.where.ScalarOther,
    aten._to_copy.default,
    aten.clone.default,
    aten.alias.default,
    aten.detach.default,
    aten.lift_fresh_copy.default,
    aten.full_like.default,
    aten.zeros_like.default,
    aten.ones_like.default,
    aten.empty_like.default,
    aten.clamp.default,
    aten.clamp.Tensor,
    aten.masked_fill.Tensor,
    aten.fill.Scalar,
):
    RULES[_op] = elementwise
# Partial inputs are handled above (linear ops keep them; the rest reduce them first).
declare(elementwise, (Partial,))


def log_sigmoid_rule(ctx: SPContext, node: torch.fx.Node, args: tuple, kwargs: dict) -> Any:
    """``log_sigmoid_forward``: elementwise, though torch does not tag it pointwise (``F.logsigmoid``,
    the log-space gates of linear attention). Its second result is a buffer for its backward, of the
    input's shape on CPU and empty on CUDA: an empty one is the same on every rank, so replicated."""
    out, buffer = elementwise(ctx, node, args, kwargs)
    if buffer.gval.numel() == 0 and not isinstance(buffer.placement, Replicate):
        buffer = SPValue(buffer.local, Replicate(), buffer.gval)
    return out, buffer


RULES[aten.log_sigmoid_forward.default] = log_sigmoid_rule


def copy_values(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    """``aten.copy``'s value, written with ops that have a derivative (``aten.copy`` has none)."""
    return src.to(dtype=dst.dtype, device=dst.device).expand(dst.shape).clone()


class _Retargeted:
    """``node`` as a rule sees it, with another function computing its value."""

    def __init__(self, node: torch.fx.Node, target: Any) -> None:
        self.node, self.target = node, target

    def __getattr__(self, name: str) -> Any:
        return getattr(self.node, name)


def copy_rule(ctx: SPContext, node: torch.fx.Node, args: tuple, kwargs: dict) -> Any:
    """Functionalized in-place updates (``x[:, 1:] += y``) leave ``aten.copy(dst, src)`` in the graph.

    Its value is ``src`` cast and broadcast to ``dst``: elementwise, but the sharded program is
    differentiated afterwards and ``aten.copy`` has no derivative, so ``copy_values`` computes it.
    """
    return elementwise(ctx, _Retargeted(node, copy_values), args, kwargs)  # type: ignore[arg-type]


RULES[aten.copy.default] = declare(copy_rule, (Partial,))
