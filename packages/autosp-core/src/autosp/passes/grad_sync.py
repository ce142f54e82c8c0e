"""Bucketed all-reduce of input gradients over the SP group, inside the compiled backward.

Inputs are replicated, so their gradients are partial sums over ranks (see
``autosp.sharding.collectives``). One collective per parameter pays a round
trip each (on gloo the latency, not the bytes, dominates small models), so the
gradients are packed into buckets in about the order the backward produces them.
Each bucket's all-reduce is a functional collective issued as soon as its last
gradient exists (and the bucket before it was issued) and waited on only before
the graph returns, which lets the remaining backward run while the reduction is
in flight.

Every rank must pack the same gradients into the same buckets and issue them in
the same sequence, or an all-reduce would sum one parameter's gradient with
another's. The joint graph is this rank's own, and its node order may differ
between ranks (a rank that holds no piece of a value computes a zero instead),
so the plan is made from the input slots alone, the same on every rank: the
reverse of the input order (Dynamo lifts parameters as the forward first reads
them, so the backward finishes them about last to first).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from torch._guards import detect_fake_mode

from autosp.context import CompileContext
from autosp.errors import AutoSPError


@dataclass
class Bucket:
    key: tuple[torch.dtype, torch.device]
    grads: list[tuple[int, fx.Node]] = field(default_factory=list)  # (output slot, gradient node)
    nbytes: int = 0


def _static_nbytes(val: Any) -> int | None:
    """Bytes of a fake tensor, or None when its size is symbolic (``int()`` would specialise it)."""
    if not isinstance(val, torch.Tensor):
        return None
    numel = val.numel()
    return numel * val.element_size() if isinstance(numel, int) else None


def plan_buckets(grads: list[tuple[int, fx.Node]], cap_bytes: int) -> list[Bucket]:
    """Group gradients into buckets of one dtype, by descending output slot (see the module's doc).

    As DDP does, a bucket closes once it holds ``cap_bytes`` or more, so it is at most one
    gradient over the cap. A gradient of symbolic size gets a bucket of its own (it is
    reduced without packing). The plan reads slots, dtypes and sizes only, never node order.
    """
    open_buckets: dict[tuple[torch.dtype, torch.device], Bucket] = {}
    buckets: list[Bucket] = []
    for slot, node in sorted(grads, key=lambda g: -g[0]):
        val = node.meta["val"]
        key = (val.dtype, val.device)
        size = _static_nbytes(val)
        if size is None:
            buckets.append(Bucket(key, [(slot, node)], 0))
            continue
        bucket = open_buckets.get(key)
        if bucket is None:
            bucket = open_buckets[key] = Bucket(key)
            buckets.append(bucket)
        bucket.grads.append((slot, node))
        bucket.nbytes += size
        if bucket.nbytes >= cap_bytes:
            del open_buckets[key]
    return buckets


def _call(graph: fx.Graph, target: Any, args: tuple, fake_mode: Any) -> fx.Node:
    """A new node with its fake value computed from its arguments' values."""
    node = graph.call_function(target, args)
    fake_args = fx.node.map_arg(args, lambda n: n.meta["val"])
    with fake_mode:
        node.meta["val"] = target(*fake_args)
    return node


def sync_grads(gm: fx.GraphModule, ctx: CompileContext) -> None:
    num_fwd = ctx.num_fwd_outputs
    if num_fwd is None:
        raise AutoSPError("autosp.sync_grads ran before the partitioner said which outputs are the forward's")
    out = gm.graph.output_node()
    flat = list(out.args[0])
    grads = [(i, g) for i, g in enumerate(flat) if i >= num_fwd and isinstance(g, fx.Node)]
    if not grads:
        return
    vals = [g.meta.get("val") for _, g in grads]
    fake_mode = detect_fake_mode(vals)
    if fake_mode is None or not all(isinstance(v, torch.Tensor) for v in vals):
        # A gradient left unsynchronised would be silently wrong; refuse instead.
        raise AutoSPError("autosp.sync_grads: a gradient of the joint graph has no fake value to plan buckets with")
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    cap = int(ctx.options.grad_bucket_mb * 2**20)
    c10d = torch.ops._c10d_functional
    g = gm.graph
    pending: list[tuple[Bucket, fx.Node]] = []
    # The previous bucket's all-reduce, and the position of the gradient it was placed after.
    issued: tuple[fx.Node, int] | None = None
    for bucket in plan_buckets(grads, cap):
        # Right after the bucket's last gradient, so the reduction starts as early as it can, but
        # never before the bucket planned before it: the sequence of collectives is the plan's.
        last = max((n for _, n in bucket.grads), key=order.__getitem__)
        anchor, position = (last, order[last])
        if issued is not None and issued[1] >= position:
            anchor, position = issued
        with g.inserting_before(anchor.next):
            if len(bucket.grads) == 1:
                packed = bucket.grads[0][1]
            else:
                flats = [_call(g, torch.ops.aten.reshape.default, (n, [-1]), fake_mode) for _, n in bucket.grads]
                packed = _call(g, torch.ops.aten.cat.default, (flats,), fake_mode)
            reduced = _call(g, c10d.all_reduce.default, (packed, "sum", ctx.group_name), fake_mode)
        issued = (reduced, position)
        pending.append((bucket, reduced))
        ctx.report.collectives["grad_all_reduce"] += 1
    with g.inserting_before(out):
        for bucket, reduced in pending:
            done = _call(g, c10d.wait_tensor.default, (reduced,), fake_mode)
            if len(bucket.grads) == 1:
                flat[bucket.grads[0][0]] = done
                continue
            shapes = [n.meta["val"].shape for _, n in bucket.grads]
            pieces = _call(
                g, torch.ops.aten.split_with_sizes.default, (done, [int(shape.numel()) for shape in shapes]), fake_mode
            )
            for k, ((slot, _), shape) in enumerate(zip(bucket.grads, shapes)):
                piece = _call(g, operator.getitem, (pieces, k), fake_mode)
                flat[slot] = _call(g, torch.ops.aten.view.default, (piece, list(shape)), fake_mode)
    out.args = (flat, *out.args[1:])
    g.lint()
    gm.recompile()


__all__ = ["Bucket", "plan_buckets", "sync_grads"]
