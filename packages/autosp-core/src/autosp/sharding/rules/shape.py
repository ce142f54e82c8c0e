"""Shape ops: reshapes, permutations, slices, selects, splits and concatenation."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from autosp.sharding.context import SPContext, SPValue
from autosp.sharding.dims import map_view, normalize_dim
from autosp.sharding.placement import HeadShard, Partial, Replicate, SeqAxis, Shard
from autosp.sharding.redistribute import to_replicate, to_shard
from autosp.sharding.rules.base import (
    RULES,
    all_replicated,
    call,
    declare,
    fallback,
    linked_zeros,
    replicated,
    rule,
    seq_dim,
    wrap,
)

aten = torch.ops.aten

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
    accepts=(Partial,),
)
def reshape_rule(ctx, node, args, kwargs):
    return _reshape(ctx, node, args[0])


@rule(aten.expand.default, accepts=(Partial,))
def expand_rule(ctx, node, args, kwargs):
    v, sizes = args[0], list(args[1])
    shift = len(sizes) - v.ndim
    out_shape = node.meta["val"].shape

    def broadcast(dim: int) -> bool:
        return v.gval.shape[dim] != out_shape[dim + shift]

    p = v.placement
    if isinstance(p, Shard) and broadcast(p.axis.dim):
        # A sequence piece of length 1 (``x[:, :1]``) copied along that dim: every position of the
        # result is that one element, which only its owner holds. Gather it (one element long).
        v = to_replicate(ctx, v)
        args, p = (v, *args[1:]), v.placement
    if isinstance(p, Replicate):
        keep = p.axis is not None and not broadcast(p.axis.dim)
        return replicated(ctx, node, args, kwargs, p.axis.at(p.axis.dim + shift) if keep else None)
    if isinstance(p, Shard):
        dim = p.axis.dim + shift
        sizes[dim] = v.local.shape[p.axis.dim]
        return SPValue(v.local.expand(sizes), Shard(p.axis.at(dim), p.ranges), node.meta["val"])
    # Broadcasting copies a summand: the copies still sum to the whole value.
    return SPValue(call(node, args, kwargs), p, node.meta["val"])


@rule(aten.repeat.default, accepts=(Partial,))
def repeat_rule(ctx, node, args, kwargs):
    """``x.repeat(*counts)``, local: copies along other dims than the sequence (k and v once per query
    group, two attention maps side by side) are token-wise, and ``c`` copies along the sequence
    dim make it ``c x`` the sequence (``outer`` grows by ``c``), which every rank's copies of its
    own pieces lay out exactly."""
    v, counts = args[0], list(args[1])
    shift = len(counts) - v.ndim
    p = v.placement
    if isinstance(p, Partial):  # copies of a summand sum to copies of the whole value
        return SPValue(call(node, args, kwargs), p, node.meta["val"])
    seq = seq_dim(p)
    if seq is None:
        return replicated(ctx, node, args, kwargs)
    out = call(node, args, kwargs)
    placement = Shard(p.axis.at(seq + shift), p.ranges) if isinstance(p, Shard) else Replicate(p.axis.at(seq + shift))
    return SPValue(out, placement, node.meta["val"])


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


@rule(aten.permute.default, accepts=(Partial, HeadShard))
def permute_rule(ctx, node, args, kwargs):
    order = [normalize_dim(d, args[0].ndim) for d in args[1]]
    return _permuted(ctx, node, args, kwargs, order.index)


@rule(aten.transpose.int, accepts=(Partial, HeadShard))
def transpose_rule(ctx, node, args, kwargs):
    a, b = (normalize_dim(d, args[0].ndim) for d in args[1:3])
    return _permuted(ctx, node, args, kwargs, lambda d: b if d == a else a if d == b else d)


@rule(aten.t.default, accepts=(Partial, HeadShard))
def t_rule(ctx, node, args, kwargs):
    return _permuted(ctx, node, args, kwargs, lambda d: (args[0].ndim - 1 - d) if args[0].ndim == 2 else d)


@rule(aten.slice.Tensor, accepts=(Partial,))
def slice_rule(ctx, node, args, kwargs):
    v = args[0]
    dim = normalize_dim(args[1] if len(args) > 1 else kwargs.get("dim", 0), v.ndim)
    start = args[2] if len(args) > 2 else kwargs.get("start")
    end = args[3] if len(args) > 3 else kwargs.get("end")
    step = args[4] if len(args) > 4 else kwargs.get("step", 1)
    p = v.placement
    if seq_dim(p) != dim or isinstance(p, Partial):
        return _same_placement(ctx, node, args, kwargs)
    size = v.gval.shape[dim]
    start, end = _clamp_range(start, end, size)
    if end - start == 0:
        # Nothing of the sequence is left: an empty value, the same on every rank.
        return SPValue(v.local.narrow(dim, 0, 0), Replicate(), node.meta["val"])
    axis = p.axis
    if axis.inner != 1 or axis.outer(size) != 1 or not isinstance(step, int):
        if isinstance(p, Replicate):
            return replicated(ctx, node, args, kwargs)
        return fallback(ctx, node, args, kwargs)
    if isinstance(p, Replicate):
        return replicated(ctx, node, args, kwargs, SeqAxis(dim, end - start) if step == 1 else None)
    return _slice_pieces(ctx, node, v, dim, start, end, step)


def _slice_pieces(
    ctx: SPContext, node: torch.fx.Node, v: SPValue, dim: int, start: int, end: int, step: int
) -> SPValue:
    """``x[start:end:step]`` along the sequence, each rank keeping the kept positions it holds.

    Kept position ``p = start + j * step`` is output position ``j``: a piece ``[lo, hi)`` of the input
    holds output positions ``[ceil((lo - start) / step), ceil((hi - start) / step))`` (clamped to the
    slice), so every rank slices its own pieces (with the step, from the first kept position in
    each) and nothing crosses. ``x[:, ::2]`` of a contiguous layout keeps it contiguous.
    """
    p = v.placement
    assert isinstance(p, Shard)

    def out(q: int) -> int:  # output positions before input position q
        return -(-(min(max(q, start), end) - start) // step)

    ranges = tuple(tuple((out(lo), out(hi)) for lo, hi in pieces) for pieces in p.ranges)
    parts, offset = [], 0
    for lo, hi in p.ranges[ctx.rank]:
        j0, j1 = out(lo), out(hi)
        if j1 == j0:
            parts.append(v.local.narrow(dim, offset, 0))
        else:
            first = offset + start + j0 * step - lo  # the piece's first kept position, in the local tensor
            parts.append(aten.slice(v.local, dim, first, first + (j1 - j0 - 1) * step + 1, step))
        offset += hi - lo
    local = parts[0] if len(parts) == 1 else torch.cat(parts, dim)
    return SPValue(local, Shard(SeqAxis(dim, out(end)), ranges), node.meta["val"])


def _clamp_range(start: Any, end: Any, size: int) -> tuple[int, int]:
    start = 0 if start is None else start
    end = size if end is None else end
    start = start + size if start < 0 else start
    end = end + size if end < 0 else end
    start, end = min(max(start, 0), size), min(max(end, 0), size)
    return start, max(start, end)


def _same_placement(ctx, node, args, kwargs):
    """Ops that act on dims other than the sequence and keep its position."""
    v = args[0]
    out = call(node, args, kwargs)
    return wrap(out, node.meta["val"], lambda _i, _g: v.placement)


@rule(aten.select.int, accepts=(Partial,))
def select_rule(ctx, node, args, kwargs):
    v, dim, index = args
    dim = normalize_dim(dim, v.ndim)
    p = v.placement
    seq = seq_dim(p)
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
    if p.axis.inner != 1 or p.axis.outer(v.gval.shape[dim]) != 1 or v.gval.dtype == torch.bool:
        # A bool has no sum to be partial in: gather instead.
        return fallback(ctx, node, args, kwargs)
    # Only the owner of the position holds it: a partial sum with zeros elsewhere avoids a gather.
    index = index + v.gval.shape[dim] if index < 0 else index
    offset, out = 0, None
    for lo, hi in p.ranges[ctx.rank]:
        if lo <= index < hi:
            out = v.local.select(dim, offset + index - lo)
        offset += hi - lo
    if out is None:
        # The position is another rank's: zeros that still depend on this rank's piece.
        out = linked_zeros(v.local.sum(dim, dtype=v.local.dtype))
    return SPValue(out, Partial(), node.meta["val"])


def _split_like(ctx, node, args, kwargs):
    v = args[0]
    dim = normalize_dim(args[2] if len(args) > 2 else kwargs.get("dim", 0), v.ndim)
    if seq_dim(v.placement) == dim:
        if isinstance(v.placement, Replicate):
            # The pieces hold parts of the sequence, not the sequence: no axis to claim.
            return replicated(ctx, node, args, kwargs)
        return fallback(ctx, node, args, kwargs)
    return _same_placement(ctx, node, args, kwargs)


RULES[aten.split.Tensor] = declare(_split_like, (Partial,))
RULES[aten.split_with_sizes.default] = _split_like


@rule(aten.unbind.int, accepts=(Partial,))
def unbind_rule(ctx, node, args, kwargs):
    v = args[0]
    dim = normalize_dim(args[1] if len(args) > 1 else 0, v.ndim)
    p = v.placement
    seq = seq_dim(p)
    if seq == dim:
        if isinstance(p, Replicate):
            return replicated(ctx, node, args, kwargs)
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
    if (
        lead is None
        or lead.placement.axis.dim == dim
        or any(isinstance(t.placement, (Partial, HeadShard)) for t in tensors)
    ):
        return fallback(ctx, node, args, kwargs)
    target = lead.placement
    parts = [to_shard(ctx, t, target.axis.dim, target) for t in tensors]
    return SPValue(torch.cat(parts, dim), Shard(target.axis, target.ranges), out_val)


@rule(aten.stack.default)
def stack_rule(ctx, node, args, kwargs):
    """``stack`` of equal-shape values along a new dim: token-wise when none stacks along the sequence.

    Interleaved rotary embeddings (GPT-J, CodeGen, Cohere, GLM) write ``stack((-x2, x1), -1)`` on
    sequence-sharded q and k; every operand is laid out like the first sharded one, and the
    sequence dim moves up by one when the new dim comes before it.
    """
    tensors = list(args[0])
    out_val = node.meta["val"]
    dim = normalize_dim(args[1] if len(args) > 1 else kwargs.get("dim", 0), out_val.dim())
    lead = next((t for t in tensors if isinstance(t.placement, Shard)), None)
    if lead is None:
        axis = next((t.placement.axis for t in tensors if t.placement.axis is not None), None)
        return replicated(ctx, node, args, kwargs, axis.at(axis.dim + (dim <= axis.dim)) if axis else None)
    target = lead.placement
    parts = [to_shard(ctx, t, target.axis.dim, target) for t in tensors]
    out_dim = target.axis.dim + (dim <= target.axis.dim)
    return SPValue(torch.stack(parts, dim), Shard(target.axis.at(out_dim), target.ranges), out_val)


@rule(aten.view_as_complex.default, aten.view_as_real.default)
def complex_view_rule(ctx, node, args, kwargs):
    """Pairs of the last dim as complex numbers and back (Meta's Llama and torchtitan's rotary
    embedding): only the last dim changes, so a sequence on any other dim stays where it is.

    A piece cut along another dim keeps the last dim's unit stride and even strides elsewhere, so
    the local ``view_as_complex`` is as valid as the whole one.
    """
    v = args[0]
    p = v.placement
    seq = seq_dim(p)
    last = v.ndim - 1
    if seq is None or (node.target is aten.view_as_complex.default and seq == last):
        return replicated(ctx, node, args, kwargs) if isinstance(p, Replicate) else fallback(ctx, node, args, kwargs)
    return wrap(call(node, args, kwargs), node.meta["val"], lambda _i, _g: p)


@rule(aten.gather.default)
def gather_rule(ctx, node, args, kwargs):
    """``x.gather(d, index)`` along a dim other than the sequence: token-wise, so it stays sharded.

    ``out[.., j, .., k] = x[.., j, .., index[.., j, .., k]]`` pairs position j of ``index`` with
    position j of ``x``, so both cut to the same intervals give exactly this rank's output
    (DPO's and GRPO's ``logp.gather(-1, labels[..., None])``).
    """
    x, index = args[0], args[2]
    dim = normalize_dim(args[1], x.ndim)
    lead = next((v.placement for v in (x, index) if isinstance(v.placement, Shard)), None)
    if lead is None:
        return replicated(ctx, node, args, kwargs)
    sdim = lead.axis.dim
    if sdim == dim or x.ndim != index.ndim or x.gval.shape[sdim] != index.gval.shape[sdim]:
        return fallback(ctx, node, args, kwargs)
    local = aten.gather(to_shard(ctx, x, sdim, lead), dim, to_shard(ctx, index, sdim, lead), **kwargs)
    return SPValue(local, Shard(lead.axis, lead.ranges), node.meta["val"])


@rule(
    aten.new_empty.default,
    aten.new_zeros.default,
    aten.new_ones.default,
    aten.new_full.default,
    accepts=(Partial, HeadShard),
)
def new_tensor_rule(ctx, node, args, kwargs):
    """A fresh tensor of the size the program asks for, whole on every rank: the operand lends only
    its dtype and device, so no piece of it need be gathered (DeepSeek's MLA fills a ``new_empty``
    with the no-rotary and rotary halves of q and k)."""
    out = call(node, (args[0].local, *args[1:]), kwargs)
    return SPValue(out, Replicate(), node.meta["val"])


def _scatter_into(
    ctx: SPContext, node: torch.fx.Node, base: SPValue, others: list[SPValue], dim: int, local_fn: Callable
) -> SPValue | None:
    """``base`` with values written along ``dim`` (not the sequence), each position of ``others`` going
    to the same sequence position of ``base``: token-wise, so every operand is cut like the first
    sharded one and written locally. None where that does not hold (the caller falls back)."""
    lead = next((v.placement for v in (base, *others) if isinstance(v.placement, Shard)), None)
    if lead is None:
        return None
    sdim = lead.axis.dim
    if sdim == dim or any(v.ndim != base.ndim or v.gval.shape[sdim] != base.gval.shape[sdim] for v in others):
        return None
    pieces = [to_shard(ctx, v, sdim, lead) for v in (base, *others)]
    return SPValue(local_fn(*pieces), Shard(lead.axis, lead.ranges), node.meta["val"])


@rule(aten.slice_scatter.default)
def slice_scatter_rule(ctx, node, args, kwargs):
    """``base[..., a:b, ...] = src`` along a dim other than the sequence (a head dim split in two halves)."""
    base, src, rest = args[0], args[1], list(args[2:])
    dim = normalize_dim(rest[0] if rest else kwargs.get("dim", 0), base.ndim)
    if all_replicated((base, src)):
        return replicated(ctx, node, args, kwargs)
    out = _scatter_into(ctx, node, base, [src], dim, lambda b, x: aten.slice_scatter(b, x, *rest, **kwargs))
    return out if out is not None else fallback(ctx, node, args, kwargs)


@rule(aten.scatter.value, aten.scatter.src, aten.scatter_add.default, aten.scatter_reduce.two)
def scatter_rule(ctx, node, args, kwargs):
    """``x.scatter(d, index, src)`` along a dim other than the sequence, ``index`` (and ``src``) as long
    as ``x`` along it: position j of ``index`` writes into position j of ``x`` (a mask over experts
    or expert groups per token, as DeepSeek-V3's router builds)."""
    base, index = args[0], args[2]
    dim = normalize_dim(args[1], base.ndim)
    src = args[3] if len(args) > 3 and isinstance(args[3], SPValue) else None
    operands = [index, *([src] if src is not None else [])]
    tail = list(args[3 + (src is not None) :])

    def local(b, i, *x):
        return node.target(b, dim, i, *x, *tail, **kwargs)

    if all_replicated((base, *operands)):
        return replicated(ctx, node, args, kwargs)
    out = _scatter_into(ctx, node, base, operands, dim, local)
    return out if out is not None else fallback(ctx, node, args, kwargs)


@rule(aten.sym_size.int, accepts=(Partial, HeadShard))
def sym_size_rule(ctx, node, args, kwargs):
    # Shapes in the graph are global sizes; rules derive the local ones, so answer globally.
    v, dim = args
    if isinstance(v.placement, Replicate):
        return v.local.size(dim)
    return v.gval.shape[dim]
