"""In-place writes that autograd does not record, refused before lowering unless made explicit.

Under ``torch.no_grad()`` (or through a ``detach()``ed alias) eager lets code write into a tensor
that requires grad: the values change and autograd stays as it was, so the gradient flows on as if
the write had not happened (an activation clamped in place, a parameter renormalised in place).
The aten graph AutoSP lowers to holds the write's result as a plain value, whose derivative AOT
autograd would take (or, for a parameter, the trace fails): a silently wrong gradient. Plain
``torch.compile`` keeps grad mode in its graph; AutoSP's lowering does not. ``autosp.straight_through``
states the writes it can in the graph; any other is refused, naming the line. Writes into buffers
and other tensors that share no storage with a tensor that requires grad (running statistics,
caches, counters) are what they always were.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from autosp.errors import AutoSPError

_IN_PLACE_OPERATORS = {
    operator.setitem,
    operator.iadd,
    operator.isub,
    operator.imul,
    operator.itruediv,
    operator.ifloordiv,
    operator.imod,
    operator.ipow,
    operator.iand,
    operator.ior,
    operator.ixor,
    operator.imatmul,
}
# Methods that end in "_" and write no values.
_NOT_WRITES = {"requires_grad_", "retain_grad", "share_memory_", "detach_", "register_hook_"}


def _writes(node: torch.fx.Node) -> bool:
    """Whether ``node`` writes into its first argument (by the convention of torch's names)."""
    if node.op == "call_method":
        name = str(node.target)
    elif node.op == "call_function":
        if node.target in _IN_PLACE_OPERATORS or node.kwargs.get("inplace") is True:
            return True
        name = getattr(node.target, "__name__", "")
    else:
        return False
    if name.startswith("_foreach_"):  # an optimizer's updates: torch._foreach_add_(params, ...)
        return name.endswith("_")
    return name.endswith("_") and not name.startswith("_") and name not in _NOT_WRITES


def _written(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes ``node`` writes into: its first argument, or each of a list of them (``_foreach_*_``)."""
    first = node.args[0]
    targets = first if isinstance(first, (list, tuple)) else [first]
    return [t for t in targets if isinstance(t, torch.fx.Node)]


def value_of(n: object) -> torch.Tensor | None:
    v = n.meta.get("example_value") if isinstance(n, torch.fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def storage_of(t: torch.Tensor) -> StorageWeakRef | None:
    try:
        return StorageWeakRef(t.untyped_storage())
    except (NotImplementedError, RuntimeError):  # a tensor without storage (a sparse or nested one)
        return None


def writes_held_tensors(gm: torch.fx.GraphModule) -> list[str]:
    """Tensors ``gm`` (or a subgraph) holds as attributes and writes in place, by attribute name.

    Dynamo keeps some real tensors in the graph module rather than lifting them as inputs: an
    optimizer's parameters and state (``torch.compile`` of a whole training step). Lowering runs the
    graph on fake inputs, but such a tensor is the real one, and a write into it ran for real at
    compile time: an SGD momentum buffer updated once more than the program asked, silently.
    """
    found: set[str] = set()
    for module in gm.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        held = {
            storage: str(n.target)
            for n in module.graph.nodes
            if n.op == "get_attr" and (v := value_of(n)) is not None and (storage := storage_of(v)) is not None
        }
        if not held:
            continue
        for node in module.graph.nodes:
            if node.args and _writes(node):
                found.update(
                    held[s] for t in _written(node) if (v := value_of(t)) is not None and (s := storage_of(v)) in held
                )
    return sorted(found)


# node.meta key of a write that ``autosp.straight_through`` made explicit: not refused.
STRAIGHT_THROUGH_WRITE = "autosp_straight_through"


def grad_modes(nodes: list[torch.fx.Node]) -> Iterator[tuple[torch.fx.Node, bool]]:
    """Each node with the grad mode it runs in (Dynamo records ``no_grad`` as ``_set_grad_enabled`` calls)."""
    enabled = True
    for node in nodes:
        if node.op == "call_function" and node.target is torch._C._set_grad_enabled:
            enabled = bool(node.args[0])
        yield node, enabled


def untracked(nodes: list[torch.fx.Node]) -> Iterator[tuple[torch.fx.Node, list[torch.Tensor]]]:
    """Each write in ``nodes`` into a tensor that requires grad that autograd does not record, with
    the values it writes into."""
    tracked = {storage_of(v) for n in nodes if (v := value_of(n)) is not None and v.requires_grad} - {None}
    for node, enabled in grad_modes(nodes):
        if not node.args or not _writes(node):
            continue
        targets = [v for t in _written(node) if (v := value_of(t)) is not None and storage_of(v) in tracked]
        if targets and not (enabled and all(t.requires_grad for t in targets)):
            yield node, targets


def refuse_untracked_writes(
    gm: torch.fx.GraphModule, grad_enabled: bool, where: Callable[[torch.fx.Node], str | None] | None = None
) -> None:
    """Raise if ``gm`` (or a subgraph) writes in place into a tensor that requires grad, unrecorded.

    ``grad_enabled``: the grad mode the graph is called in (nothing is differentiated without it).
    """
    if not grad_enabled:
        return
    for module in gm.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        for node, _ in untracked(list(module.graph.nodes)):
            if node.meta.get(STRAIGHT_THROUGH_WRITE):
                continue
            line = where(node) if where else None
            raise AutoSPError(
                "an in-place write that autograd does not record (under torch.no_grad(), or through a "
                "detach()ed alias) changes a tensor that requires grad"
                + (f" ({line})" if line else "")
                + ": eager keeps that tensor's gradient as if the write had not happened, which AutoSP's "
                "lowering cannot express. Write it out of place (x = x + (x.clamp(...) - x).detach() keeps "
                "the gradient as eager does), or, for a parameter, change it outside the compiled forward "
                "(before the call, or after the optimizer step)"
            )


__all__ = [
    "STRAIGHT_THROUGH_WRITE",
    "grad_modes",
    "refuse_untracked_writes",
    "storage_of",
    "untracked",
    "value_of",
    "writes_held_tensors",
]
