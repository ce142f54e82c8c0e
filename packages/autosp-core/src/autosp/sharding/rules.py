"""Propagation rules: for each aten op, the placement of its result and how to compute it locally.

A rule receives the op's arguments with every tensor as an ``SPValue`` and returns
``SPValue`` (or a tuple of them).  Ops without a rule run replicated: their
sharded inputs are gathered first, which is always correct and reported as a
fallback, so an op we do not know can cost memory but never change a result.
"""

from __future__ import annotations

import math
import operator
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

from autosp.sharding.context import SPContext, SPValue
from autosp.sharding.dims import broadcast_dim, map_view, normalize_dim
from autosp.sharding.placement import HeadShard, Partial, Replicate, SeqAxis, Shard
from autosp.sharding.redistribute import gather, slice_to, to_replicate, to_shard

aten = torch.ops.aten
Rule = Callable[[SPContext, torch.fx.Node, tuple, dict], Any]
RULES: dict[Any, Rule] = {}


def rule(*ops: Any) -> Callable[[Rule], Rule]:
    def register(fn: Rule) -> Rule:
        for op in ops:
            RULES[op] = fn
        return fn

    return register


def values(tree: Any) -> list[SPValue]:
    return [v for v in pytree.tree_leaves(tree) if isinstance(v, SPValue)]


def locals_of(tree: Any) -> Any:
    return pytree.tree_map(lambda v: v.local if isinstance(v, SPValue) else v, tree)


def call(node: torch.fx.Node, args: tuple, kwargs: dict) -> Any:
    return node.target(*locals_of(args), **locals_of(kwargs))


def wrap(out: Any, gval: Any, placement_of: Callable[[int, torch.Tensor], Any]) -> Any:
    """Pair each tensor of ``out`` with its global value and placement."""
    if isinstance(out, torch.Tensor):
        return SPValue(out, placement_of(0, gval), gval)
    if isinstance(out, (tuple, list)):
        return type(out)(wrap(o, g, lambda _i, gv, i=i: placement_of(i, gv)) for i, (o, g) in enumerate(zip(out, gval)))
    return out


def replicated(ctx: SPContext, node: torch.fx.Node, args: tuple, kwargs: dict, axis: SeqAxis | None = None) -> Any:
    """Run the op on whole values; the result is replicated."""
    return wrap(call(node, args, kwargs), node.meta["val"], lambda _i, _g: Replicate(axis))


def fallback(ctx: SPContext, node: torch.fx.Node, args: tuple, kwargs: dict) -> Any:
    """Gather every distributed input and run the op on whole values."""
    why = f"{node.name} ({node.target}) has no sharding rule for its inputs"
    gathered = pytree.tree_map(lambda v: to_replicate(ctx, v, why) if isinstance(v, SPValue) else v, (args, kwargs))
    return replicated(ctx, node, *gathered)


def all_replicated(args: Any) -> bool:
    return all(isinstance(v.placement, Replicate) for v in values(args))


def reduce_partials(ctx: SPContext, tree: Any) -> Any:
    return pytree.tree_map(
        lambda v: to_replicate(ctx, v) if isinstance(v, SPValue) and isinstance(v.placement, Partial) else v, tree
    )


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


def _partial_ok(op: Any, args: tuple, kwargs: dict) -> bool:
    kind = _LINEAR.get(op)
    if kind is None or kwargs.get("alpha", 1) != 1:
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
    lead = next((v for v in tensors if isinstance(v.placement, Shard)), None)
    if lead is None:
        if any(isinstance(v.placement, HeadShard) for v in tensors):
            return fallback(ctx, node, args, kwargs)
        axis = _elementwise_axis(tensors, out_ndim, out_val)
        return replicated(ctx, node, args, kwargs, axis)
    target: Shard = lead.placement
    out_dim = broadcast_dim(out_ndim, lead.ndim, target.axis.dim)
    out_shape = out_val.shape if isinstance(out_val, torch.Tensor) else out_val[0].shape

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
    aten.copy.default,
    aten.full_like.default,
    aten.zeros_like.default,
    aten.ones_like.default,
    aten.empty_like.default,
    aten.clamp.default,
    aten.clamp.Tensor,
    aten.masked_fill.Tensor,
    aten.fill.Scalar,
    aten.tril.default,
    aten.triu.default,
):
    RULES[_op] = elementwise


def is_elementwise(op: Any) -> bool:
    return isinstance(op, torch._ops.OpOverload) and torch.Tag.pointwise in op.tags


# --- shape ops ----------------------------------------------------------------------------------


def _reshape(ctx: SPContext, node: torch.fx.Node, v: SPValue) -> SPValue:
    out_val = node.meta["val"]
    p = v.placement
    if isinstance(p, (Replicate, Partial)):
        axis = map_view(p.axis, v.gval.shape, out_val.shape) if isinstance(p, Replicate) and p.axis else None
        local = v.local.reshape(out_val.shape)
        return SPValue(local, Replicate(axis) if isinstance(p, Replicate) else p, out_val)
    if isinstance(p, HeadShard):
        v = to_replicate(ctx, v, f"{node.name}: reshape of head-sharded value")
        return _reshape(ctx, node, v)
    axis = map_view(p.axis, v.gval.shape, out_val.shape)
    if axis is None:
        v = to_replicate(ctx, v, f"{node.name}: reshape splits the sequence axis")
        return _reshape(ctx, node, v)
    shape = list(out_val.shape)
    shape[axis.dim] = axis.outer(shape[axis.dim]) * p.local_length(ctx.rank) * axis.inner
    return SPValue(v.local.reshape(shape), Shard(axis, p.ranges), out_val)


@rule(
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.squeeze.default,
    aten.flatten.using_ints,
    aten.unflatten.int,
)
def reshape_rule(ctx, node, args, kwargs):
    return _reshape(ctx, node, args[0])


@rule(aten.expand.default)
def expand_rule(ctx, node, args, kwargs):
    v, sizes = args[0], list(args[1])
    p = v.placement
    shift = len(sizes) - v.ndim
    if isinstance(p, Replicate):
        axis = p.axis.at(p.axis.dim + shift) if p.axis else None
        return replicated(ctx, node, args, kwargs, axis)
    if isinstance(p, Shard):
        dim = p.axis.dim + shift
        sizes[dim] = v.local.shape[p.axis.dim]
        return SPValue(v.local.expand(sizes), Shard(p.axis.at(dim), p.ranges), node.meta["val"])
    return fallback(ctx, node, args, kwargs)


def _permuted(ctx, node, args, kwargs, new_dim: Callable[[int], int]):
    v = args[0]
    p = v.placement
    out = call(node, args, kwargs)
    if isinstance(p, Replicate):
        placement = Replicate(p.axis.at(new_dim(p.axis.dim)) if p.axis else None)
    elif isinstance(p, Shard):
        placement = Shard(p.axis.at(new_dim(p.axis.dim)), p.ranges)
    elif isinstance(p, HeadShard):
        placement = HeadShard(new_dim(p.dim), p.ranges)
    else:
        placement = p
    return SPValue(out, placement, node.meta["val"])


@rule(aten.permute.default)
def permute_rule(ctx, node, args, kwargs):
    order = [normalize_dim(d, args[0].ndim) for d in args[1]]
    return _permuted(ctx, node, args, kwargs, order.index)


@rule(aten.transpose.int)
def transpose_rule(ctx, node, args, kwargs):
    a, b = (normalize_dim(d, args[0].ndim) for d in args[1:3])
    return _permuted(ctx, node, args, kwargs, lambda d: b if d == a else a if d == b else d)


@rule(aten.t.default)
def t_rule(ctx, node, args, kwargs):
    return _permuted(ctx, node, args, kwargs, lambda d: (args[0].ndim - 1 - d) if args[0].ndim == 2 else d)


def _seq_dim(p: Any) -> int | None:
    if isinstance(p, (Shard, Replicate)) and getattr(p, "axis", None) is not None:
        return p.axis.dim
    return None


@rule(aten.slice.Tensor)
def slice_rule(ctx, node, args, kwargs):
    v = args[0]
    dim = normalize_dim(args[1] if len(args) > 1 else kwargs.get("dim", 0), v.ndim)
    start = args[2] if len(args) > 2 else kwargs.get("start")
    end = args[3] if len(args) > 3 else kwargs.get("end")
    step = args[4] if len(args) > 4 else kwargs.get("step", 1)
    p = v.placement
    if _seq_dim(p) != dim or isinstance(p, Partial):
        return _same_placement(ctx, node, args, kwargs)
    size = v.gval.shape[dim]
    start, end = _clamp_range(start, end, size)
    axis = p.axis
    if axis.inner != 1 or axis.outer(size) != 1 or step != 1:
        if isinstance(p, Replicate):
            return replicated(ctx, node, args, kwargs)
        return fallback(ctx, node, args, kwargs)
    new_axis = SeqAxis(dim, end - start)
    if isinstance(p, Replicate):
        return replicated(ctx, node, args, kwargs, new_axis)
    lo, hi = p.ranges[ctx.rank]
    a = min(max(start - lo, 0), hi - lo)
    b = min(max(end - lo, 0), hi - lo)
    ranges = tuple(
        (min(max(l, start), end) - start, min(max(h, start), end) - start) for l, h in p.ranges  # noqa: E741
    )
    return SPValue(v.local.narrow(dim, a, b - a), Shard(new_axis, ranges), node.meta["val"])


def _clamp_range(start: Any, end: Any, size: int) -> tuple[int, int]:
    start = 0 if start is None else start
    end = size if end is None else end
    start = start + size if start < 0 else start
    end = end + size if end < 0 else end
    return min(max(start, 0), size), min(max(end, 0), size)


def _same_placement(ctx, node, args, kwargs):
    """Ops that act on dims other than the sequence and keep its position."""
    v = args[0]
    out = call(node, args, kwargs)
    return wrap(out, node.meta["val"], lambda _i, _g: v.placement)


@rule(aten.select.int)
def select_rule(ctx, node, args, kwargs):
    v, dim, index = args
    dim = normalize_dim(dim, v.ndim)
    p = v.placement
    seq = _seq_dim(p)
    if seq != dim:
        out = call(node, args, kwargs)
        if isinstance(p, (Shard, Replicate)) and seq is not None:
            axis = p.axis.at(seq - 1 if seq > dim else seq)
            placement = Shard(axis, p.ranges) if isinstance(p, Shard) else Replicate(axis)
        else:
            placement = Replicate() if isinstance(p, Replicate) else p
        return SPValue(out, placement, node.meta["val"])
    if isinstance(p, Replicate):
        return replicated(ctx, node, args, kwargs)
    if p.axis.inner != 1 or p.axis.outer(v.gval.shape[dim]) != 1:
        return fallback(ctx, node, args, kwargs)
    # Only the owner of the position holds it: a partial sum with zeros elsewhere avoids a gather.
    index = index + v.gval.shape[dim] if index < 0 else index
    lo, hi = p.ranges[ctx.rank]
    if lo <= index < hi:
        out = v.local.select(dim, index - lo)
    else:
        # Zeros that still depend on the input: every rank must need the same backward collectives.
        out = v.local.sum(dim) * 0
    return SPValue(out, Partial(), node.meta["val"])


def _split_like(ctx, node, args, kwargs):
    v = args[0]
    dim = normalize_dim(args[2] if len(args) > 2 else kwargs.get("dim", 0), v.ndim)
    if _seq_dim(v.placement) == dim and not isinstance(v.placement, Replicate):
        return fallback(ctx, node, args, kwargs)
    return _same_placement(ctx, node, args, kwargs)


RULES[aten.split.Tensor] = _split_like
RULES[aten.split_with_sizes.default] = _split_like


@rule(aten.unbind.int)
def unbind_rule(ctx, node, args, kwargs):
    v = args[0]
    dim = normalize_dim(args[1] if len(args) > 1 else 0, v.ndim)
    p = v.placement
    seq = _seq_dim(p)
    if seq == dim and not isinstance(p, Replicate):
        return fallback(ctx, node, args, kwargs)
    if isinstance(p, (Shard, Replicate)) and seq is not None:
        axis = p.axis.at(seq - 1 if seq > dim else seq)
        placement = Shard(axis, p.ranges) if isinstance(p, Shard) else Replicate(axis)
    else:
        placement = Replicate() if isinstance(p, Replicate) else p
    return wrap(call(node, args, kwargs), node.meta["val"], lambda _i, _g: placement)


@rule(aten.cat.default)
def cat_rule(ctx, node, args, kwargs):
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    out_val = node.meta["val"]
    dim = normalize_dim(dim, out_val.dim())
    # cat skips 1-D empty tensors (an empty KV cache, say); so do we.
    tensors = [t for t in args[0] if not (t.ndim == 1 and t.gval.numel() == 0)]
    if len(tensors) == 1 and tensors[0].ndim == out_val.dim():
        only = tensors[0]
        return SPValue(only.local.clone(), only.placement, out_val)
    args = (tensors, *args[1:])
    if all_replicated(tensors):
        axis = next((t.placement.axis for t in tensors if t.placement.axis and t.placement.axis.dim != dim), None)
        return replicated(ctx, node, args, kwargs, axis)
    lead = next((t for t in tensors if isinstance(t.placement, Shard)), None)
    if lead is None or lead.placement.axis.dim == dim or any(isinstance(t.placement, (Partial, HeadShard)) for t in tensors):
        return fallback(ctx, node, args, kwargs)
    target = lead.placement
    parts = [to_shard(ctx, t, target.axis.dim, target) for t in tensors]
    return SPValue(torch.cat(parts, dim), Shard(target.axis, target.ranges), out_val)


# --- contractions -----------------------------------------------------------------------------


def _mm_labels(ndim: int, which: str) -> list[str]:
    batch = [f"b{i}" for i in range(ndim - 2)]
    return batch + (["n", "k"] if which == "a" else ["k", "m"])


@rule(aten.mm.default, aten.bmm.default, aten.addmm.default, aten.baddbmm.default)
def matmul_rule(ctx, node, args, kwargs):
    has_bias = node.target in (aten.addmm.default, aten.baddbmm.default)
    bias = args[0] if has_bias else None
    a, b = (args[1], args[2]) if has_bias else (args[0], args[1])
    extra = args[3:] if has_bias else args[2:]
    if any(isinstance(v.placement, HeadShard) for v in (a, b)):
        return fallback(ctx, node, args, kwargs)
    a, b = _trigger(ctx, a, "a"), _trigger(ctx, b, "b")
    pa, pb = a.placement, b.placement
    la, lb = _mm_labels(a.ndim, "a"), _mm_labels(b.ndim, "b")
    out_labels = la[:-2] + ["n", "m"]
    if isinstance(pa, Partial) or isinstance(pb, Partial):
        if isinstance(pa, Partial) + isinstance(pb, Partial) == 1 and all_replicated([x for x in (a, b) if not isinstance(x.placement, Partial)]) and bias is None:
            return SPValue(torch.ops.aten.mm(a.local, b.local) if a.ndim == 2 else torch.bmm(a.local, b.local), Partial(), node.meta["val"]) if not extra else fallback(ctx, node, args, kwargs)
        a, b = to_replicate(ctx, a), to_replicate(ctx, b)
        pa, pb = a.placement, b.placement
    shard_label = None
    lead = None
    if isinstance(pa, Shard):
        shard_label, lead = la[pa.axis.dim], pa
    elif isinstance(pb, Shard):
        shard_label, lead = lb[pb.axis.dim], pb
    if lead is None:
        return replicated(ctx, node, args, kwargs, _mm_axis(pa, pb, la, lb, out_labels))
    if shard_label == "k":
        if not (isinstance(pa, Shard) and isinstance(pb, Shard) and pa.same_layout(pb) and bias is None):
            return fallback(ctx, node, args, kwargs)
        out = torch.matmul(a.local, b.local)
        return SPValue(out, Partial(), node.meta["val"])

    def aligned(v: SPValue, labels: list[str]) -> torch.Tensor:
        if shard_label in labels:
            return to_shard(ctx, v, labels.index(shard_label), lead)
        if isinstance(v.placement, Shard):
            return gather(ctx, v)
        return v.local

    la_local, lb_local = aligned(a, la), aligned(b, lb)
    out_dim = out_labels.index(shard_label)
    placement = Shard(lead.axis.at(out_dim), lead.ranges)
    if bias is not None:
        bias_local = bias.local if isinstance(bias.placement, Replicate) else gather(ctx, bias)
        out_ndim = len(out_labels)
        d = out_dim - (out_ndim - bias.ndim)
        if d >= 0 and bias.gval.shape[d] != 1:
            bias_local = slice_to(ctx, bias_local, d, lead.axis, lead.ranges)
        out = node.target(bias_local, la_local, lb_local, *extra, **kwargs)
    else:
        out = node.target(la_local, lb_local, *extra, **kwargs)
    return SPValue(out, placement, node.meta["val"])


def _trigger(ctx: SPContext, v: SPValue, which: str) -> SPValue:
    """Split a replicated operand whose sequence axis survives a token-wise op: this is where sharding starts."""
    p = v.placement
    if not (isinstance(p, Replicate) and p.axis is not None):
        return v
    labels = _mm_labels(v.ndim, which) if which in "ab" else None
    if labels is not None and labels[p.axis.dim] == "k":
        return v
    ranges = ctx.even_ranges(p.axis.length)
    ctx.note("shard_start")
    target = Shard(p.axis, ranges)
    return SPValue(slice_to(ctx, v.local, p.axis.dim, p.axis, ranges), target, v.gval)


def _mm_axis(pa: Any, pb: Any, la: list[str], lb: list[str], out_labels: list[str]) -> SeqAxis | None:
    for p, labels in ((pa, la), (pb, lb)):
        if isinstance(p, Replicate) and p.axis is not None and labels[p.axis.dim] != "k":
            return p.axis.at(out_labels.index(labels[p.axis.dim]))
    return None


@rule(aten.embedding.default)
def embedding_rule(ctx, node, args, kwargs):
    weight, indices = args[0], args[1]
    if not isinstance(weight.placement, Replicate):
        weight = to_replicate(ctx, weight, f"{node.name}: embedding table is distributed")
    indices = _trigger(ctx, indices, "index")
    p = indices.placement
    out = torch.ops.aten.embedding(weight.local, indices.local, *args[2:], **kwargs)
    if isinstance(p, Shard):
        return SPValue(out, p, node.meta["val"])
    if isinstance(p, Replicate):
        return SPValue(out, p, node.meta["val"])
    return fallback(ctx, node, args, kwargs)


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


@rule(aten.sum.dim_IntList, aten.sum.default, aten.mean.dim, aten.mean.default)
def sum_rule(ctx, node, args, kwargs):
    v = args[0]
    p = v.placement
    if isinstance(p, HeadShard):
        return fallback(ctx, node, args, kwargs)
    if isinstance(p, Partial):
        return wrap(call(node, args, kwargs), node.meta["val"], lambda _i, _g: Partial())
    dims, keepdim = _reduced_dims(node, v, args, kwargs)
    seq = _seq_dim(p)
    if seq is not None and seq not in dims:
        out = call(node, args, kwargs)
        axis = p.axis.at(_after_reduce(seq, dims, keepdim))
        placement = Shard(axis, p.ranges) if isinstance(p, Shard) else Replicate(axis)
        return SPValue(out, placement, node.meta["val"])
    if isinstance(p, Replicate):
        return replicated(ctx, node, args, kwargs)
    if p.axis.inner != 1 and p.axis.outer(v.gval.shape[seq]) != 1 and False:
        return fallback(ctx, node, args, kwargs)
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
        if isinstance(p, HeadShard) or _seq_dim(p) in dim_of(args, kwargs, v.ndim):
            return fallback(ctx, node, args, kwargs)
        rest = values((args[1:], kwargs))
        if any(not isinstance(r.placement, Replicate) for r in rest):
            return fallback(ctx, node, args, kwargs)
        out = call(node, args, kwargs)
        gval = node.meta["val"]
        if isinstance(p, Replicate):
            return wrap(out, gval, lambda i, g: Replicate(p.axis if i == 0 else None))
        # Extra outputs (mean, rstd) keep the leading dims, so the sequence stays where it was.
        return wrap(out, gval, lambda i, g: p if g.dim() > p.axis.dim and g.shape[p.axis.dim] == v.gval.shape[p.axis.dim] else Replicate())

    return rowwise_rule


def _softmax_dims(args: tuple, kwargs: dict, ndim: int) -> list[int]:
    return [normalize_dim(args[1], ndim)]


def _norm_dims(args: tuple, kwargs: dict, ndim: int) -> list[int]:
    return list(range(ndim - len(args[1]), ndim))


RULES[aten._softmax.default] = _rowwise(_softmax_dims)
RULES[aten._log_softmax.default] = _rowwise(_softmax_dims)
RULES[aten.native_layer_norm.default] = _rowwise(_norm_dims)
if hasattr(aten, "_fused_rms_norm"):
    RULES[aten._fused_rms_norm.default] = _rowwise(_norm_dims)


# --- loss --------------------------------------------------------------------------------------


@rule(aten.nll_loss_forward.default)
def nll_loss_rule(ctx, node, args, kwargs):
    inp, target, weight, reduction, ignore_index = args
    p = inp.placement
    if not isinstance(p, Shard) or p.axis.dim != 0 or inp.ndim != 2:
        return fallback(ctx, node, args, kwargs)
    if weight is not None and not isinstance(weight.placement, Replicate):
        weight = to_replicate(ctx, weight)
    if target.gval.shape[0] != inp.gval.shape[0]:
        return fallback(ctx, node, args, kwargs)
    target_local = to_shard(ctx, target, 0, p)
    w = weight.local if weight is not None else None
    if reduction == 0:
        out, tw = aten.nll_loss_forward(inp.local, target_local, w, 0, ignore_index)
        return (SPValue(out, p, node.meta["val"][0]), SPValue(tw, Partial(), node.meta["val"][1]))
    # Sum and count of non-ignored tokens are both partial: the mean is their exact global ratio.
    total, count = aten.nll_loss_forward(inp.local, target_local, w, 2, ignore_index)
    if reduction == 2:
        return (SPValue(total, Partial(), node.meta["val"][0]), SPValue(count, Partial(), node.meta["val"][1]))
    total = gather(ctx, SPValue(total, Partial(), node.meta["val"][0]))
    count = gather(ctx, SPValue(count, Partial(), node.meta["val"][1]))
    return (SPValue(total / count, Replicate(), node.meta["val"][0]), SPValue(count, Replicate(), node.meta["val"][1]))


# --- creation ---------------------------------------------------------------------------------


@rule(aten.arange.default, aten.arange.start, aten.arange.start_step)
def arange_rule(ctx, node, args, kwargs):
    out_val = node.meta["val"]
    axis = SeqAxis(0, ctx.seq_len) if out_val.shape[0] == ctx.seq_len else None
    return replicated(ctx, node, args, kwargs, axis)


def getitem(ctx: SPContext, node: torch.fx.Node, args: tuple, kwargs: dict) -> Any:
    return operator.getitem(args[0], args[1])


__all__ = ["RULES", "all_replicated", "call", "elementwise", "fallback", "getitem", "is_elementwise", "replicated", "rule", "values", "wrap"]
