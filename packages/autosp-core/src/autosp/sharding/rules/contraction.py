"""Matmuls and embedding lookups: where sharding starts, and where sums become partial."""

from __future__ import annotations

from typing import Any

import torch

from autosp.sharding.context import SPContext, SPValue
from autosp.sharding.placement import Partial, Replicate, SeqAxis, Shard
from autosp.sharding.redistribute import gather, slice_to, to_replicate, to_shard
from autosp.sharding.rules.base import (
    fallback,
    replicated,
    rule,
)
from autosp.tiled_mlp import OP as TILED_MLP

aten = torch.ops.aten

# --- contractions -----------------------------------------------------------------------------


def _mm_labels(ndim: int, which: str) -> list[str]:
    batch = [f"b{i}" for i in range(ndim - 2)]
    return batch + (["n", "k"] if which == "a" else ["k", "m"])


@rule(aten.mm.default, aten.bmm.default, aten.addmm.default, aten.baddbmm.default, accepts=(Partial,))
def matmul_rule(ctx, node, args, kwargs):
    has_bias = node.target in (aten.addmm.default, aten.baddbmm.default)
    bias = args[0] if has_bias else None
    a, b = (args[1], args[2]) if has_bias else (args[0], args[1])
    extra = args[3:] if has_bias else args[2:]
    partial = [isinstance(v.placement, Partial) for v in (a, b)]
    if any(partial):
        other = b if partial[0] else a
        if sum(partial) == 1 and isinstance(other.placement, Replicate) and bias is None and not extra:
            # A matmul is linear in each operand: a partial sum times a whole value stays partial.
            return SPValue(node.target(a.local, b.local), Partial(), node.meta["val"])
    # Anything else needs whole values for the partial operands (a bias would be added once per rank).
    a, b = _whole(ctx, a), _whole(ctx, b)
    if bias is not None:
        bias = _whole(ctx, bias)
    args = (bias, a, b, *extra) if has_bias else (a, b, *extra)
    a, b = _trigger(ctx, a, _mm_labels(a.ndim, "a")), _trigger(ctx, b, _mm_labels(b.ndim, "b"))
    pa, pb = a.placement, b.placement
    la, lb = _mm_labels(a.ndim, "a"), _mm_labels(b.ndim, "b")
    out_labels = la[:-2] + ["n", "m"]
    shard_label = None
    lead = None
    if isinstance(pa, Shard):
        shard_label, lead = la[pa.axis.dim], pa
    elif isinstance(pb, Shard):
        shard_label, lead = lb[pb.axis.dim], pb
    if lead is None:
        if bias is not None and not isinstance(bias.placement, Replicate):
            bias = to_replicate(ctx, bias, f"{node.name}: sharded bias with whole operands")
            args = (bias, a, b, *extra)
        return replicated(ctx, node, args, kwargs, _mm_axis(pa, pb, la, lb, out_labels))
    if shard_label == "k":
        # Both operands must hold the same positions of the contracted dim: b sharded on its own
        # "m" with a layout that happens to match a's is no partial product.
        both_k = isinstance(pa, Shard) and isinstance(pb, Shard) and lb[pb.axis.dim] == "k"
        if not (both_k and pa.same_layout(pb) and bias is None):
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


@rule(TILED_MLP)
def tiled_mlp_rule(ctx, node, args, kwargs):
    """The tiled MLP on this rank's rows: it is row-wise, so the rows keep their sharding.

    The weights are whole on every rank; each rank's weight gradients cover its rows, which the
    gradient all-reduce sums, as for a plain matmul on sharded rows.
    """
    x, *weights = args[:6]
    p = x.placement
    if not isinstance(p, Shard) or p.axis.dim != 0 or x.ndim != 2:
        return fallback(ctx, node, args, kwargs)
    local = [
        to_replicate(ctx, w, f"{node.name}: MLP weight gathered").local if w is not None else None for w in weights
    ]
    return SPValue(TILED_MLP(x.local, *local, *args[6:]), p, node.meta["val"])


def _whole(ctx: SPContext, v: SPValue) -> SPValue:
    """A partial sum all-reduced; other placements as they are."""
    return to_replicate(ctx, v) if isinstance(v.placement, Partial) else v


def _trigger(ctx: SPContext, v: SPValue, labels: list[str] | None = None) -> SPValue:
    """Split a replicated operand whose sequence axis survives a token-wise op: this is where sharding starts.

    ``labels`` name the operand's dims for a matmul; a sequence on the contracted dim ("k") is left whole.
    """
    p = v.placement
    if not (isinstance(p, Replicate) and p.axis is not None):
        return v
    if labels is not None and labels[p.axis.dim] == "k":
        return v
    ranges = ctx.layout(p.axis.length)
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
    scale_grad_by_freq = args[3] if len(args) > 3 else kwargs.get("scale_grad_by_freq", False)
    if scale_grad_by_freq:
        # The backward divides each row's gradient by how often its index occurs in the whole
        # batch: a rank counting its own tokens would divide by less. Looked up whole, the result
        # replicated; the next token-wise op shards it.
        indices = to_replicate(ctx, indices, f"{node.name}: embedding with scale_grad_by_freq looked up whole")
    else:
        indices = _trigger(ctx, indices)
    p = indices.placement
    out = torch.ops.aten.embedding(weight.local, indices.local, *args[2:], **kwargs)
    if isinstance(p, Shard):
        return SPValue(out, p, node.meta["val"])
    if isinstance(p, Replicate):
        return SPValue(out, p, node.meta["val"])
    return fallback(ctx, node, args, kwargs)


@rule(aten.index.Tensor)
def table_lookup_rule(ctx, node, args, kwargs):
    """``table[idx]`` with one integer index tensor: a lookup per index, like ``embedding``.

    ``cos[position_ids]``, ``experts[choice]``: the result's leading dims are the index's, so it
    keeps the index's placement; the table is read whole (its local gradient is partial, the
    convention for whole values). Anything else (several index tensors, a distributed table)
    runs whole.
    """
    table, indices = args[0], args[1]
    lookup = len(indices) == 1 and isinstance(indices[0], SPValue) and not indices[0].local.dtype.is_floating_point
    if not lookup or indices[0].local.dtype == torch.bool or kwargs or not isinstance(table.placement, Replicate):
        return fallback(ctx, node, args, kwargs)
    idx = _trigger(ctx, indices[0])
    p = idx.placement
    if not isinstance(p, (Shard, Replicate)):
        return fallback(ctx, node, (table, [idx]), kwargs)
    return SPValue(aten.index.Tensor(table.local, [idx.local]), p, node.meta["val"])
