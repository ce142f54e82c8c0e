"""In-place writes that autograd does not record, stated in the graph before lowering.

Under ``torch.no_grad()``, or through a ``detach()``ed or ``.data`` alias, eager lets code write
into a tensor that requires grad: its values change and its autograd history does not, so later
reads see the new values while the gradient flows on to the tensor as if the write had not happened
(an activation clamped in place, Gemma-3n clamping a parameter through ``.data`` in its forward).
AutoSP's lowered graph records ops, not grad mode: it would hold the write's result as a plain value
and lose (or differentiate) that path, and a parameter written in place fails to trace.

So the writes go into a copy of the tensor made where it is made, every alias of it taken before the
last write (``.data``, ``detach()``, their views) is taken of the copy, and each later reader of the
tensor (or of a write's result, the tensor itself) reads
``autosp::straight_through(tensor, copy)``: the copy's values at that point, the gradient passed to
the tensor unchanged. That is eager's meaning, stated in the graph; the op is pointwise, so the
sharding engine lays it out like any other. A written graph input (a parameter) gets the copy's
final values after the call, through ``.data`` as eager wrote them (``ExplicitWrites.write_back``).

Only what this states exactly is rewritten; ``autosp.untracked_writes`` refuses the rest:
- another alias of the storage that requires grad (a view taken before the write) read after it:
  eager regenerates its values and keeps its history, which one read cannot stand for;
- a read of the tensor before the write, with grad on, by anything other than a view: that op may
  have saved it for its backward, which eager then refuses (modified by an in-place operation);
- writes inside a higher-order op's body (a checkpointed layer), or into several tensors at once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from autosp.untracked_writes import STRAIGHT_THROUGH_WRITE, grad_modes, storage_of, untracked, value_of


@torch.library.custom_op("autosp::straight_through", mutates_args=(), tags=(torch.Tag.pointwise,))
def straight_through(tensor: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value``'s values; the gradient goes to ``tensor`` (``value`` is a detached read of it)."""
    return value.clone()


@straight_through.register_fake
def _(tensor: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(value)


def _backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
    return grad, None


straight_through.register_autograd(_backward)


_OP = torch.ops.autosp.straight_through.default


@dataclass
class ExplicitWrites:
    """What ``make_writes_explicit`` did to a graph: how many writes, and which inputs to write back."""

    writes: int = 0
    # (placeholder index, output index): the graph returns the input's final values at that output.
    inputs: list[tuple[int, int]] = field(default_factory=list)

    def write_back(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` (the compiled graph) writing each written input's final values into it, as eager did,
        and returning the graph's own outputs."""
        if not self.inputs:
            return fn
        inputs, extra = list(self.inputs), len(self.inputs)

        def run(*args: Any) -> Any:
            outs = fn(*args)
            with torch.no_grad():
                for i, at in inputs:
                    # Through .data, as the program wrote: the tensor's version counter stays.
                    args[i].data.copy_(outs[at])
            return outs[:-extra]

        return run


def make_writes_explicit(gm: torch.fx.GraphModule) -> ExplicitWrites:
    """Rewrite, in ``gm``'s own graph, each untracked write this module can state exactly.

    Called in the grad mode the graph runs in (nothing is differentiated without it).
    """
    done = ExplicitWrites()
    if not torch.is_grad_enabled():
        return done
    graph = gm.graph
    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    by_storage: dict[StorageWeakRef, list[torch.fx.Node]] = {}
    for node, targets in untracked(nodes):
        first = node.args[0]
        if len(targets) == 1 and isinstance(first, torch.fx.Node) and (s := storage_of(targets[0])) is not None:
            by_storage.setdefault(s, []).append(node)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    modes = dict(grad_modes(nodes))
    for storage, writes in by_storage.items():
        root = _sole_root(nodes, order, modes, storage, writes)
        if root is not None:
            copy = _write_into_copy(graph, nodes[: order[writes[-1]] + 1], root, storage, writes, placeholders)
            _read_through(graph, modes, root, copy, writes)
            if root.op == "placeholder":
                out = graph.output_node()
                outs = tuple(out.args[0]) if isinstance(out.args[0], (tuple, list)) else (out.args[0],)
                out.args = ((*outs, copy),)
                done.inputs.append((placeholders.index(root), len(outs)))
            done.writes += len(writes)
    if done.writes:
        graph.lint()
        gm.recompile()
    return done


def _sole_root(
    nodes: list[torch.fx.Node],
    order: dict[torch.fx.Node, int],
    modes: dict[torch.fx.Node, bool],
    storage: StorageWeakRef,
    writes: list[torch.fx.Node],
) -> torch.fx.Node | None:
    """The one tensor requiring grad in ``storage`` whose later readers can be given the written
    values, or None where no single read stands for eager's meaning."""
    first, last = order[writes[0]], order[writes[-1]]
    aliases = [n for n in nodes[:last] if _aliases(n, storage)]
    grad = [n for n in aliases if value_of(n).requires_grad]
    if not grad or order[grad[0]] > first:
        return None
    root = grad[0]
    for alias in aliases:
        for user in alias.users:
            if _aliases(user, storage) or user in writes or not modes.get(user, True):
                continue
            if value_of(alias) is not value_of(root) and value_of(alias).requires_grad:
                return None  # a view that requires grad, read: its history is not the tensor's
            if order.get(user, len(order)) < first:
                return None  # read before, grad on: saved by that op, eager refuses its backward (or, through .data, uses the new values)
    return root


def _aliases(node: torch.fx.Node, storage: StorageWeakRef) -> bool:
    v = value_of(node)
    return v is not None and storage_of(v) == storage


def _fake(node: torch.fx.Node) -> contextlib.AbstractContextManager[Any]:
    mode = getattr(value_of(node), "fake_mode", None)
    return mode if mode is not None else contextlib.nullcontext()


def _write_into_copy(
    graph: torch.fx.Graph,
    upto_last: list[torch.fx.Node],
    root: torch.fx.Node,
    storage: StorageWeakRef,
    writes: list[torch.fx.Node],
    placeholders: list[torch.fx.Node],
) -> torch.fx.Node:
    """A copy of ``root`` made where it is made; the writes and the aliases taken up to the last one take it
    (``_sole_root`` made sure no alias that requires grad is read with grad on)."""
    value = value_of(root)
    assert value is not None
    with graph.inserting_after(placeholders[-1] if root.op == "placeholder" else root):
        detached = graph.call_method("detach", (root,))
    with graph.inserting_after(detached):
        copy = graph.call_method("clone", (detached,))
    with _fake(root):
        detached.meta["example_value"] = value.detach()
        copy.meta["example_value"] = detached.meta["example_value"].clone()
    for node in upto_last:  # later readers read through straight_through (_read_through)
        if node.args and node.args[0] is root and (node in writes or _aliases(node, storage)):
            node.update_arg(0, copy)
    return copy


def _read_through(
    graph: torch.fx.Graph,
    modes: dict[torch.fx.Node, bool],
    root: torch.fx.Node,
    copy: torch.fx.Node,
    writes: list[torch.fx.Node],
) -> None:
    """After each write, the readers of ``root`` up to the next write read ``straight_through(root, copy)``."""
    value = value_of(root)
    assert value is not None
    for write in reversed(writes):  # each reader takes the last write before it
        anchor = write
        if not modes[write]:  # made with grad on, or the lowering would detach it
            with graph.inserting_after(anchor):
                anchor = graph.call_function(torch._C._set_grad_enabled, (True,))
        with graph.inserting_after(anchor):
            explicit = graph.call_function(_OP, (root, copy))
        if not modes[write]:
            with graph.inserting_after(explicit):
                graph.call_function(torch._C._set_grad_enabled, (False,))
        explicit.meta.update({k: write.meta[k] for k in ("stack_trace", "nn_module_stack") if k in write.meta})
        with _fake(root), torch.enable_grad():
            explicit.meta["example_value"] = _OP(value, value.detach())
        position = {n: i for i, n in enumerate(graph.nodes)}  # with the nodes inserted so far
        for same in [root, *(n for n in writes if value_of(n) is value)]:  # `x = x.clamp_()` hands back x
            for user in list(same.users):
                if user.target is not _OP and position[user] > position[write]:
                    user.replace_input_with(same, explicit)
        write.meta[STRAIGHT_THROUGH_WRITE] = True


__all__ = ["ExplicitWrites", "make_writes_explicit", "straight_through"]
