"""Move each collective's wait down to its first use and each start up to its inputs.

Collectives are start/wait pairs (``autosp::all_to_all`` + ``autosp::wait_exchange``,
``_c10d_functional.*`` + ``wait_tensor``). Whatever the graph runs between a start and its wait
runs while the data is in flight, so the pass widens that window as far as the data allows:

* a wait sinks to just before its first user (the graph's output if it has no other);
* a start rises to just after the last of its inputs, but never above another collective (every
  rank must issue the collectives of a group in the same order, so their relative order is kept),
  above a node with side effects, or above an op the pass does not know (a plugin's op may
  communicate inside).

Only the position of these nodes changes, never what they compute: every node still comes after
its inputs. Aten ops are pure and deterministic in a functional graph, so moving a start or a wait
across them cannot change a value. ``describe_overlap`` says, per exchange, what compute runs
while it is in flight; the pass writes that into the report.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import torch
from torch import fx

from autosp.passes.manager import Pass, Stage
from autosp.sharding import collectives as C

if TYPE_CHECKING:
    from autosp.context import CompileContext

_FUNCTIONAL = "_c10d_functional."
_WAIT_TENSOR = "wait_tensor"
_PURE_NAMESPACES = frozenset({"aten", "prims"})
_MATMULS = frozenset(
    getattr(torch.ops.aten, name).default for name in ("mm", "addmm", "bmm", "baddbmm") if hasattr(torch.ops.aten, name)
)


def _name(node: fx.Node) -> str:
    return str(node.target)


def is_wait(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    return node.target in C.WAIT_OPS or (_name(node).startswith(_FUNCTIONAL) and _WAIT_TENSOR in _name(node))


def is_start(node: fx.Node) -> bool:
    """A collective whose result is only usable after a wait."""
    if node.op != "call_function":
        return False
    return node.target in C.START_OPS or (_name(node).startswith(_FUNCTIONAL) and _WAIT_TENSOR not in _name(node))


def is_collective(node: fx.Node) -> bool:
    return node.op == "call_function" and (is_start(node) or node.target in C.COLLECTIVE_OPS)


def _known_pure(node: fx.Node) -> bool:
    """An op the pass may move a start across: functional aten/prims, or a plain Python getitem."""
    if node.op != "call_function" or node.is_impure():
        return False
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target.namespace in _PURE_NAMESPACES
    return getattr(target, "__module__", None) == "_operator"


def _is_compute(node: fx.Node) -> bool:
    return node.op == "call_function" and not is_start(node) and not is_wait(node)


def sink_waits(graph: fx.Graph) -> int:
    """Each wait to just before its first user; returns how many moved. Waits keep their relative order."""
    moved = 0
    for wait in [n for n in graph.nodes if is_wait(n)]:
        users = set(wait.users)
        cur = wait.next
        while cur.op != "output" and cur not in users:
            cur = cur.next
        if cur is not wait.next:
            cur.prepend(wait)
            moved += 1
    return moved


def hoist_starts(graph: fx.Graph) -> int:
    """Each start to just after its last input, not across a collective or an unknown op; returns how many moved."""
    moved = 0
    for start in [n for n in graph.nodes if is_start(n)]:
        inputs = set(start.all_input_nodes)
        cur = start.prev
        while cur.op == "call_function" and cur not in inputs and (is_wait(cur) or _known_pure(cur)):
            cur = cur.prev
        if cur is not start.prev:
            cur.append(start)
            moved += 1
    return moved


def _wait_of(start: fx.Node) -> fx.Node | None:
    waits = [u for u in start.users if is_wait(u)]
    return waits[0] if len(waits) == 1 else None


def _kind(node: fx.Node) -> str:
    if node.target in _MATMULS:
        return "matmul"
    if "attention" in _name(node) or "sdpa" in _name(node):
        return "attention"
    return "other"


def describe_overlap(graph: fx.Graph) -> list[tuple[str, Counter[str]]]:
    """Per start/wait pair in graph order: its name and the compute between them by kind.

    The name is the collective and its ordinal, with the attention call nearest to the start
    (``all_to_all 3 @attention 1``), which places it in its layer.
    """
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    attention = [n for n in nodes if n.op == "call_function" and _kind(n) == "attention"]
    pairs = []
    for k, start in enumerate(n for n in nodes if is_start(n)):
        label = f"{_name(start).split('.')[1]} {k}"
        if attention:
            near = min(range(len(attention)), key=lambda i: abs(index[attention[i]] - index[start]))
            label += f" @attention {near}"
        wait = _wait_of(start)
        between = nodes[index[start] + 1 : index[wait]] if wait is not None else []
        pairs.append((label, Counter(_kind(n) for n in between if _is_compute(n))))
    return pairs


def overlap_lines(stage: str, pairs: list[tuple[str, Counter[str]]]) -> list[str]:
    """One summary line, then one line per exchange: ``overlap forward: all_to_all 3 @attention 1: ...``."""
    busy = sum(1 for _, kinds in pairs if kinds["attention"] or kinds["matmul"])
    lines = [f"overlap {stage}: {busy} of {len(pairs)} collectives in flight over attention or matmuls"]
    for label, kinds in pairs:
        lines.append(
            f"overlap {stage}: {label} in flight over attention x{kinds['attention']}, "
            f"matmul x{kinds['matmul']}, other x{kinds['other']}"
        )
    return lines


def _run(gm: fx.GraphModule, ctx: CompileContext, stage: str) -> None:
    graph = gm.graph
    if sink_waits(graph) + hoist_starts(graph):
        graph.lint()
        gm.recompile()
    pairs = describe_overlap(graph)
    if pairs:
        ctx.report.notes.extend(overlap_lines(stage, pairs))


def overlap_forward(gm: fx.GraphModule, ctx: CompileContext) -> None:
    _run(gm, ctx, "forward")


def overlap_backward(gm: fx.GraphModule, ctx: CompileContext) -> None:
    _run(gm, ctx, "backward")


def _sp(ctx: CompileContext) -> bool:
    return ctx.sp


OVERLAP = Pass(
    "autosp.overlap",
    Stage.FORWARD,
    overlap_forward,
    after=("autosp.dce_forward",),
    applies=_sp,
    doc="waits down to their first use, starts up to their inputs",
)
OVERLAP_BACKWARD = Pass(
    "autosp.overlap_backward",
    Stage.BACKWARD,
    overlap_backward,
    after=("autosp.dce_backward",),
    applies=_sp,
    doc="the same on the backward graph",
)

__all__ = [
    "OVERLAP",
    "OVERLAP_BACKWARD",
    "describe_overlap",
    "hoist_starts",
    "is_collective",
    "overlap_backward",
    "overlap_forward",
    "overlap_lines",
    "sink_waits",
]
