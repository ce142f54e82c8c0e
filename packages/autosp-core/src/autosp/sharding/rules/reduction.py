"""Reductions, row-wise normalisations, the loss, and creation ops."""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from autosp.linear_cross_entropy import OP as LINEAR_CROSS_ENTROPY
from autosp.sharding import collectives as C
from autosp.sharding.context import SPContext, SPValue
from autosp.sharding.dims import normalize_dim
from autosp.sharding.placement import HeadShard, Partial, Replicate, SeqAxis, Shard
from autosp.sharding.redistribute import to_replicate, to_shard
from autosp.sharding.rules.base import (
    RULES,
    Rule,
    call,
    fallback,
    reduce_partials,
    replicated,
    rule,
    seq_dim,
    values,
    wrap,
)

aten = torch.ops.aten

# --- reductions and normalisations ------------------------------------------------------------


def _reduced_dims(node: torch.fx.Node, v: SPValue, args: tuple, kwargs: dict) -> tuple[list[int], bool]:
    dims = args[1] if len(args) > 1 else kwargs.get("dim")
    keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return list(range(v.ndim)), keepdim
    if isinstance(dims, int):
        dims = [dims]
    return [normalize_dim(d, v.ndim) for d in dims], keepdim


def _after_reduce(dim: int, dims: list[int], keepdim: bool) -> int:
    return dim if keepdim else dim - sum(1 for d in dims if d < dim)


@rule(aten.sum.dim_IntList, aten.sum.default, aten.mean.dim, aten.mean.default, accepts=(Partial,))
def sum_rule(ctx, node, args, kwargs):
    v = args[0]
    p = v.placement
    if isinstance(p, HeadShard):
        return fallback(ctx, node, args, kwargs)
    if isinstance(p, Partial):
        return wrap(call(node, args, kwargs), node.meta["val"], lambda _i, _g: Partial())
    dims, keepdim = _reduced_dims(node, v, args, kwargs)
    seq = seq_dim(p)
    if seq is not None and seq not in dims:
        out = call(node, args, kwargs)
        axis = p.axis.at(_after_reduce(seq, dims, keepdim))
        placement = Shard(axis, p.ranges) if isinstance(p, Shard) else Replicate(axis)
        return SPValue(out, placement, node.meta["val"])
    if isinstance(p, Replicate):
        return replicated(ctx, node, args, kwargs)
    # A reduction over the sequence is a partial sum; a mean divides by the global count.
    is_mean = node.target in (aten.mean.dim, aten.mean.default)
    dtype = kwargs.get("dtype")
    local = v.local if dtype is None else v.local.to(dtype)
    total = local.sum(dim=dims, keepdim=keepdim) if dims else local.sum()
    if is_mean:
        count = math.prod(v.gval.shape[d] for d in dims)
        total = total / count
    if total.dtype != node.meta["val"].dtype:
        total = total.to(node.meta["val"].dtype)
    return SPValue(total, Partial(), node.meta["val"])


def _rowwise(dim_of: Callable[[tuple, dict, int], list[int]]) -> Rule:
    def rowwise_rule(ctx, node, args, kwargs):
        v = args[0]
        p = v.placement
        if isinstance(p, Partial):
            args, kwargs = reduce_partials(ctx, (args, kwargs))
            v, p = args[0], args[0].placement
        if isinstance(p, HeadShard) or seq_dim(p) in dim_of(args, kwargs, v.ndim):
            return fallback(ctx, node, args, kwargs)
        rest = values((args[1:], kwargs))
        if any(not isinstance(r.placement, Replicate) for r in rest):
            return fallback(ctx, node, args, kwargs)
        out = call(node, args, kwargs)
        gval = node.meta["val"]
        if isinstance(p, Replicate):
            return wrap(out, gval, lambda i, g: Replicate(p.axis if i == 0 else None))
        # Extra outputs (mean, rstd) keep the leading dims, so the sequence stays where it was.
        return wrap(
            out,
            gval,
            lambda i, g: p if g.dim() > p.axis.dim and g.shape[p.axis.dim] == v.gval.shape[p.axis.dim] else Replicate(),
        )

    return rowwise_rule


def _softmax_dims(args: tuple, kwargs: dict, ndim: int) -> list[int]:
    return [normalize_dim(args[1], ndim)]


def _norm_dims(args: tuple, kwargs: dict, ndim: int) -> list[int]:
    return list(range(ndim - len(args[1]), ndim))


def _topk_dims(args: tuple, kwargs: dict, ndim: int) -> list[int]:
    dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
    return [normalize_dim(dim, ndim)]


def _sort_dims(args: tuple, kwargs: dict, ndim: int) -> list[int]:
    dim = args[1] if len(args) > 1 else kwargs.get("dim", -1)
    return [normalize_dim(dim, ndim)]


RULES[aten._softmax.default] = _rowwise(_softmax_dims)
# Per-token choices (an MoE router's top-k experts): along any axis but the sequence, token-wise.
RULES[aten.topk.default] = _rowwise(_topk_dims)
RULES[aten.sort.default] = _rowwise(_sort_dims)
RULES[aten._log_softmax.default] = _rowwise(_softmax_dims)
RULES[aten.native_layer_norm.default] = _rowwise(_norm_dims)
if hasattr(aten, "_fused_rms_norm"):
    RULES[aten._fused_rms_norm.default] = _rowwise(_norm_dims)


# Reductions and scans along other axes than the sequence are token-wise: each rank computes its
# positions' results, the sequence axis kept where it lands (QK-norm's vector norm over the head
# dim, a max over experts or classes). Along the sequence they run whole, their input gathered:
# `Partial` is a summand, which a max or a median is not.
@dataclass(frozen=True)
class _Along:
    dim_at: int  # where the dim argument sits (an int, a list, or None/[] for every dim)
    keepdim_at: int | str | None  # its position, its keyword (var/std), or None for scans (shape kept)


_ALONG = {
    aten.amax.default: _Along(1, 2),
    aten.amin.default: _Along(1, 2),
    aten.logsumexp.default: _Along(1, 2),
    aten.max.dim: _Along(1, 2),
    aten.min.dim: _Along(1, 2),
    aten.argmax.default: _Along(1, 2),
    aten.argmin.default: _Along(1, 2),
    aten.median.dim: _Along(1, 2),
    aten.mode.default: _Along(1, 2),
    aten.any.dim: _Along(1, 2),
    aten.any.dims: _Along(1, 2),
    aten.all.dim: _Along(1, 2),
    aten.prod.dim_int: _Along(1, 2),
    aten.kthvalue.default: _Along(2, 3),
    aten.linalg_vector_norm.default: _Along(2, 3),
    aten.var.correction: _Along(1, "keepdim"),
    aten.std.correction: _Along(1, "keepdim"),
    aten.var_mean.correction: _Along(1, "keepdim"),
    aten.cumprod.default: _Along(1, None),
    aten.cummax.default: _Along(1, None),
    aten.cummin.default: _Along(1, None),
}
_DEFAULT_DIM = {aten.kthvalue.default: -1, aten.mode.default: -1}


def along_other_axes_rule(ctx, node, args, kwargs):
    v, along = args[0], _ALONG[node.target]
    p = v.placement
    if isinstance(p, HeadShard) or any(not isinstance(r.placement, Replicate) for r in values((args[1:], kwargs))):
        return fallback(ctx, node, args, kwargs)
    seq = seq_dim(p)
    dim = args[along.dim_at] if len(args) > along.dim_at else kwargs.get("dim", _DEFAULT_DIM.get(node.target))
    dims = [normalize_dim(d, v.ndim) for d in ([dim] if isinstance(dim, int) else list(dim or ()))] if v.ndim else []
    if seq is None or not dims or seq in dims:  # every dim, or the sequence's among them
        return replicated(ctx, node, args, kwargs) if isinstance(p, Replicate) else fallback(ctx, node, args, kwargs)
    if along.keepdim_at is None:
        keepdim = True
    elif isinstance(along.keepdim_at, str):
        keepdim = bool(kwargs.get(along.keepdim_at, False))
    else:
        keepdim = bool(args[along.keepdim_at]) if len(args) > along.keepdim_at else bool(kwargs.get("keepdim", False))
    axis = p.axis.at(_after_reduce(seq, dims, keepdim))
    placement = Shard(axis, p.ranges) if isinstance(p, Shard) else Replicate(axis)
    return wrap(call(node, args, kwargs), node.meta["val"], lambda _i, _g: placement)


for _op in _ALONG:
    RULES[_op] = along_other_axes_rule


# --- loss --------------------------------------------------------------------------------------


@rule(aten.nll_loss_forward.default)
def nll_loss_rule(ctx, node, args, kwargs):
    inp, target = args[:2]
    p = inp.placement
    if not isinstance(p, Shard) or p.axis.dim != 0 or inp.ndim != 2 or target.gval.shape[0] != inp.gval.shape[0]:
        return fallback(ctx, node, args, kwargs)
    return _token_loss(ctx, node, args, p, 0)


@rule(aten.nll_loss2d_forward.default)
def nll_loss2d_rule(ctx, node, args, kwargs):
    """Classes on dim 1 of ``[N, C, H, W]`` (``cross_entropy(logits.transpose(1, 2), labels)`` lowers
    to it on ``[B, V, S, 1]``): input position ``(n, h, w)`` is target position ``(n, h, w)``, so
    logits sharded on H or W pair with the target sharded on the dim before."""
    inp, target = args[:2]
    p = inp.placement
    if not isinstance(p, Shard) or p.axis.dim < 2 or target.gval.shape[p.axis.dim - 1] != inp.gval.shape[p.axis.dim]:
        return fallback(ctx, node, args, kwargs)
    return _token_loss(ctx, node, args, p, p.axis.dim - 1)


def _token_loss(ctx: SPContext, node: torch.fx.Node, args: tuple, p: Shard, target_dim: int) -> tuple[SPValue, SPValue]:
    """``node``'s loss on this rank's positions, the target laid out like the input on ``target_dim``."""
    inp, target, weight, reduction, ignore_index = args
    if weight is not None and not isinstance(weight.placement, Replicate):
        weight = to_replicate(ctx, weight)
    target_local = to_shard(ctx, target, target_dim, p)
    w = weight.local if weight is not None else None
    if reduction == 0:
        out, tw = node.target(inp.local, target_local, w, 0, ignore_index)
        per_position = Shard(p.axis.at(target_dim), p.ranges)
        return (SPValue(out, per_position, node.meta["val"][0]), SPValue(tw, Partial(), node.meta["val"][1]))
    # Sum and count of non-ignored tokens are both partial: the mean is their exact global ratio.
    total, count = node.target(inp.local, target_local, w, 2, ignore_index)
    if reduction == 2:
        return (SPValue(total, Partial(), node.meta["val"][0]), SPValue(count, Partial(), node.meta["val"][1]))
    total, count = reduce_together(ctx, total, count)
    return (SPValue(total / count, Replicate(), node.meta["val"][0]), SPValue(count, Replicate(), node.meta["val"][1]))


@rule(LINEAR_CROSS_ENTROPY)
def linear_cross_entropy_rule(ctx, node, args, kwargs):
    """The tiled LM head + loss on this rank's tokens: ``[sum, count]`` is partial, made whole in one all-reduce."""
    hidden, weight, bias, target, *rest = args
    p = hidden.placement
    if not isinstance(p, Shard) or p.axis.dim != 0 or hidden.ndim != 2 or target.gval.shape[0] != hidden.gval.shape[0]:
        return fallback(ctx, node, args, kwargs)
    weight = to_replicate(ctx, weight, f"{node.name}: LM head weight gathered")
    bias = to_replicate(ctx, bias, f"{node.name}: LM head bias gathered") if bias is not None else None
    target_local = to_shard(ctx, target, 0, p)
    stats = LINEAR_CROSS_ENTROPY(
        hidden.local, weight.local, bias.local if bias is not None else None, target_local, *rest
    )
    # sum and count are already one vector: one all-reduce, as in reduce_together.
    ctx.note("all_reduce")
    return SPValue(C.all_reduce(stats, ctx.group_name, False), Replicate(), node.meta["val"])


def reduce_together(ctx: SPContext, *summands: torch.Tensor) -> list[torch.Tensor]:
    """Partial scalars of one dtype made whole in one all-reduce of a small vector.

    A mean loss needs its sum and its count: packed, they cost one round trip instead of two.
    Each element is summed on its own, so the result is exactly that of separate all-reduces;
    the backward is one all-reduce of the packed gradient (the count's is zero).
    """
    packed = torch.stack(summands)
    ctx.note("all_reduce")
    whole = C.all_reduce(packed, ctx.group_name, False)
    return list(whole.unbind(0))


# --- creation ---------------------------------------------------------------------------------


@rule(aten.arange.default, aten.arange.start, aten.arange.start_step)
def arange_rule(ctx, node, args, kwargs):
    out_val = node.meta["val"]
    axis = SeqAxis(0, ctx.seq_len) if out_val.shape[0] == ctx.seq_len else None
    return replicated(ctx, node, args, kwargs, axis)


def getitem(ctx: SPContext, node: torch.fx.Node, args: tuple, kwargs: dict) -> Any:
    return operator.getitem(args[0], args[1])
