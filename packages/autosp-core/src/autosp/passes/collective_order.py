"""Every rank issues its collectives in the graph's order, under Inductor too.

The SP rewrite emits the same collectives in the same order on every rank, but each rank compiles
its own graph, and the graphs differ in rank-dependent sizes (which piece a slice takes, a rank
whose piece is empty). Inductor, left alone, schedules them by those sizes, and the ranks part:

* its memory-driven reordering (``reorder_for_peak_memory``) put two independent exchanges of a
  model attending to a sequence and to its reverse in one order on rank 0 and in the other on
  rank 1 (deadlock; two exchanges of one size would have swapped data silently);
* it drops an op whose result nothing reads, and a result can go unread on one rank only: a rank
  whose piece of a slice is empty gets an empty gradient piece, which Inductor folds away, and
  with it the reduce-scatter that made it; its peers wait in that reduce-scatter forever
  (queries sliced to their last 4 tokens, all on rank 1).

So, for a graph AutoSP compiles with Inductor:

1. ``keep_collectives``: the group ops count as side-effectful while Inductor compiles the graph,
   so no rank drops one. Only then: the partitioner, which ran before, refuses impure ops in a
   graph with recompute tags (SAC), and recomputing an exchange is its choice to make.
2. ``CollectiveOrder`` (post-grad pass): each group op depends on the one before it, through
   Inductor's own ``control_deps`` (how it keeps random ops in program order), and carries its
   position in the graph's order.
3. ``ChainScheduled`` (before fusion): the same chain again, between the scheduler nodes of the
   group ops themselves. The first chain runs through each op's result, and a result that is
   empty on one rank (its piece of a reduce-scatter) is dead code there: Inductor removes it, and
   the ordering edge with it, and the op floats to wherever the scheduler likes (a rotated
   sequence, ``torch.cat([x[:, k:], x[:, :k]], 1)``, lost it on one rank). An op's own buffer is
   never removed (the op is side-effectful), so the chain here holds, as Inductor's own
   ``decide_global_ordering_of_comms`` keeps its collectives in order.
4. ``ScheduleCheck`` (after fusion, in place of Inductor's own memory reordering, which is
   switched off for these graphs): the schedule's group ops must come in that order, or compiling
   fails here, on this rank, with an error that says so, instead of a hang. The memory reordering
   then runs as Inductor would run it, and its result is kept only where it keeps that order.

An op talks to a group when its schema takes a ``group_name`` (the c10d convention, which AutoSP's
collectives, the ring ops and plugins' ops follow), and so do the waits of functional collectives.
Compute stays free to move around them, so overlap keeps.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.fx import Graph, Node

from autosp.errors import AutoSPError
from autosp.sharding import collectives as C
from autosp.torch_compat import CustomSchedulerPass

_WAITS = frozenset({torch.ops._c10d_functional.wait_tensor.default})
INDEX = "autosp_group_op"  # node meta: the op's position among the graph's group ops
_SOURCE = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()


def talks_to(target: Any) -> bool:
    """Whether an op communicates over a process group."""
    if target in _WAITS:
        return True
    return isinstance(target, torch._ops.OpOverload) and any(a.name == "group_name" for a in target._schema.arguments)


def is_wait(node: Node) -> bool:
    """A wait of a functional collective or of AutoSP's exchange: completes an op on this rank alone."""
    return node.op == "call_function" and (node.target in _WAITS or node.target in C.WAIT_OPS)


def talks_to_group(node: Node) -> bool:
    return node.op == "call_function" and talks_to(node.target)


def group_op_sequence(graph: Graph, label: Callable[[str], str] = str) -> list[str]:
    """The graph's group ops in its order, each as ``op@label(group)``: what every SP rank must issue alike.

    Waits are left out: a wait completes an op this rank issued, on this rank alone, and pairs with
    nothing on another rank; where the overlap pass puts it follows this rank's graph (Inductor's
    decompositions drop a cat of zero rows, the padding of a piece that is already the longest, on
    that rank only), so two ranks may wait at other points of one sequence.

    Sizes and other arguments may differ between ranks (their pieces); which ops, in which order, may
    not. An all-reduce is the exception: every rank sends the same shape (a partial sum, a gradient
    bucket), so its dtype and shape are part of it (``op[float32 2x8]@group``) and a rank whose
    program differs there (a bucket missing a gradient) is refused at compile time rather than
    aborting inside gloo. ``label``: how a group's name reads, alike on the ranks of the SP group (a
    hybrid layout's sub-groups have other names on other ranks: ``group_size_label``).
    """
    out = []
    for node in graph.nodes:
        if not talks_to_group(node) or is_wait(node):
            continue
        schema = node.target._schema
        names = [a.name for a in schema.arguments]
        i = names.index("group_name") if "group_name" in names else None
        group = node.kwargs.get("group_name", node.args[i] if i is not None and i < len(node.args) else None)
        name = f"{schema.name}{_reduced_shape(node)}" if schema.name.endswith("::all_reduce") else schema.name
        out.append(f"{name}@{label(group)}" if isinstance(group, str) else name)
    return out


def _reduced_shape(node: Node) -> str:
    val = node.args[0].meta.get("val") if node.args and isinstance(node.args[0], Node) else None
    if not isinstance(val, torch.Tensor):
        return ""
    return f"[{str(val.dtype).removeprefix('torch.')} {'x'.join(str(n) for n in val.shape)}]"


def group_size_label(name: str) -> str:
    """A group by its size: the same on every rank, whichever sub-group of a layout the rank is in."""
    try:
        return f"{_resolve_process_group(cast(Any, name)).size()} ranks"  # torch types the name as GroupName
    except (RuntimeError, ValueError, KeyError):
        return name


@contextlib.contextmanager
def never_merged(graph: Graph) -> Iterator[None]:
    """AOT's CSE (run before the min-cut partitioner) leaves the graph's group ops alone in this block.

    Two collectives of equal inputs on one rank (all-reduces of zeros for positions another rank
    holds) are two steps of the exchange, not one value: merged on one rank only, every later
    collective would pair with another rank's next one, silently. CSE skips random ops by their
    packet; the group ops join that list here, so everything else is still deduplicated.
    """
    from torch._functorch import compile_utils

    rand_ops = getattr(compile_utils, "rand_ops", None)
    if not isinstance(rand_ops, list):  # a torch without the list: no CSE at all, which is always safe
        with torch._functorch.config.patch(cse=False):
            yield
        return
    packets = {getattr(n.target, "overloadpacket", n.target) for n in graph.nodes if talks_to_group(n)}
    added = [p for p in packets if p not in rand_ops]
    rand_ops.extend(added)
    try:
        yield
    finally:
        for p in added:
            rand_ops.remove(p)


@contextlib.contextmanager
def keep_collectives(graph: Graph) -> Iterator[None]:
    """The graph's group ops count as side-effectful (never eliminated) inside this block."""
    from torch.fx.node import _side_effectful_functions

    added = {n.target for n in graph.nodes if talks_to_group(n)} - _side_effectful_functions
    _side_effectful_functions.update(added)
    try:
        yield
    finally:
        _side_effectful_functions.difference_update(added)


def chain_collectives(graph: Graph) -> int:
    """Number the group ops in graph order and make each depend on the one before; return how many."""
    from torch._inductor.fx_passes.control_dependencies import preserve_node_ordering
    from torch.utils._ordered_set import OrderedSet

    ops = [n for n in graph.nodes if talks_to_group(n)]
    for i, node in enumerate(ops):
        node.meta[INDEX] = i  # copied onto the control_deps node and into its subgraph
    preserve_node_ordering(graph, {ops[i]: OrderedSet([ops[i - 1]]) for i in range(1, len(ops))})
    return len(ops)


class CollectiveOrder(CustomGraphPass):
    """Inductor's ``post_grad_custom_post_pass``: the pass already set there, if any, then the chain."""

    def __init__(self, then: Any = None) -> None:
        self.then = then

    def __call__(self, graph: Graph) -> None:
        if self.then is not None:
            self.then(graph)
        chain_collectives(graph)

    def uuid(self) -> str:
        then = self.then.uuid() if isinstance(self.then, CustomGraphPass) else repr(self.then)
        return f"autosp-collective-order-{_SOURCE}-{then}"


def group_op_index(snode: Any) -> list[int]:
    """Graph positions of the group ops a scheduler node runs (none for compute)."""
    found: list[int] = []
    for sub in snode.get_nodes():
        ir_node = sub.node
        if ir_node is None or not talks_to(getattr(ir_node, "op_overload", None)):
            continue
        found.extend(sorted({o.meta[INDEX] for o in ir_node.get_origins() if isinstance(o, Node) and INDEX in o.meta}))
    return found


def scheduled_order(nodes: list[Any]) -> list[int]:
    """Graph positions of the group ops, in the order the scheduler nodes run them."""
    return [i for snode in nodes for i in group_op_index(snode)]


class ChainScheduled(CustomSchedulerPass):
    """Inductor's ``_pre_fusion_custom_pass``: each group op's node waits for the one before it.

    Ordering-only edges (``WeakDep``, ``is_fake``: no buffer lives longer for them) on the previous
    op's own buffers, then the nodes sorted again and the ancestors that fusion checks for cycles
    recomputed, so no fusion can undo the order.
    """

    def __init__(self, then: Any = None) -> None:
        self.then = then

    def __call__(self, nodes: list[Any]) -> list[Any]:
        if self.then is not None:
            nodes = self.then(nodes)
        positions = {n: group_op_index(n) for n in nodes}
        ops = sorted((n for n in nodes if positions[n]), key=lambda n: positions[n][0])
        if len(ops) < 2:
            return nodes
        from torch._inductor.dependencies import WeakDep

        for before, node in zip(ops, ops[1:]):
            mutating = next(iter(node.get_buffer_names()))
            for name in before.get_buffer_names():
                node.add_fake_dep(WeakDep(name, mutating_buf=mutating, is_fake=True))
        scheduler = nodes[0].scheduler
        nodes = scheduler.topological_sort_schedule(nodes)
        scheduler.nodes = nodes  # what the ancestors and input distances are computed over
        scheduler.compute_ancestors()
        if hasattr(scheduler, "compute_input_distances"):  # fusion scores by them from torch 2.13 on
            scheduler.compute_input_distances()
        return nodes

    def uuid(self) -> str:
        then = self.then.uuid() if isinstance(self.then, CustomSchedulerPass) else repr(self.then)
        return f"autosp-chain-scheduled-{_SOURCE}-{then}"

    def __reduce__(self) -> tuple[Any, ...]:
        return (str, (self.uuid(),))


def _in_order(order: list[int]) -> bool:
    return all(a < b for a, b in zip(order, order[1:]))


class ScheduleCheck(CustomSchedulerPass):
    """Inductor's ``_post_fusion_custom_pass``: the schedule keeps the group ops' order, or it fails.

    ``reorder``: whether Inductor's memory reordering was on (it runs here instead, kept only if
    it keeps the order).
    """

    def __init__(self, reorder: bool, then: Any = None) -> None:
        self.reorder, self.then = reorder, then

    def __call__(self, nodes: list[Any]) -> list[Any]:
        if self.then is not None:
            nodes = self.then(nodes)
        order = scheduled_order(nodes)
        if not _in_order(order):
            raise AutoSPError(
                "Inductor scheduled this rank's collectives out of the graph's order (positions "
                f"{order}): the ranks would wait in different collectives. Compile with "
                "backend='aot_eager' meanwhile, and report the model"
            )
        if not self.reorder:
            return nodes
        from torch._inductor.memory import reorder_for_peak_memory
        from torch._inductor.virtualized import V
        from torch.utils._ordered_set import OrderedSet

        if not nodes:
            return nodes
        scheduler = nodes[0].scheduler  # still being built: V.graph.scheduler is not set yet
        reordered = reorder_for_peak_memory(
            nodes,
            scheduler.name_to_buf,
            scheduler.name_to_fused_node,
            OrderedSet(V.graph.graph_inputs.keys()),
            OrderedSet(V.graph.get_output_names()),
        )
        return reordered if _in_order(scheduled_order(reordered)) else nodes

    def uuid(self) -> str:
        then = self.then.uuid() if isinstance(self.then, CustomSchedulerPass) else repr(self.then)
        return f"autosp-schedule-check-{_SOURCE}-{self.reorder}-{then}"

    def __reduce__(self) -> tuple[Any, ...]:
        # Inductor pickles its config for cache keys; the uuid says what makes this pass differ.
        return (str, (self.uuid(),))


def inductor_patches() -> dict[str, Any]:
    """The Inductor config AutoSP compiles its graphs with (see the module docstring)."""
    config = torch._inductor.config
    return {
        "post_grad_custom_post_pass": CollectiveOrder(config.post_grad_custom_post_pass),
        "_pre_fusion_custom_pass": ChainScheduled(config._pre_fusion_custom_pass),
        "_post_fusion_custom_pass": ScheduleCheck(config.reorder_for_peak_memory, config._post_fusion_custom_pass),
        "reorder_for_peak_memory": False,
    }


__all__ = [
    "INDEX",
    "ChainScheduled",
    "CollectiveOrder",
    "ScheduleCheck",
    "chain_collectives",
    "group_op_index",
    "group_op_sequence",
    "group_size_label",
    "inductor_patches",
    "is_wait",
    "keep_collectives",
    "scheduled_order",
    "talks_to",
    "talks_to_group",
]
