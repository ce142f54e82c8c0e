"""One program, one graph: every SP rank compiles the same graph, whatever order its Python took.

Python hashes strings with a seed of its own in each process (unless ``PYTHONHASHSEED`` is set) and
other objects by address, so a loop over a set visits its items in another order on each rank: HF
Gemma-3 and Gemma-4 compute their rotary tables ``for layer_type in set(config.layer_types)``.
Dynamo traces the order it saw. The ranks' graphs then hold the same computations with inputs
lifted in another order and independent nodes in another order: compiled as traced, the ranks would
issue their collectives in other orders (gradient buckets follow the input order), and compared as
traced they were refused (``ProgramMismatch``) on about half the launches with torchrun.

So every rank compiles a canonical form of its graph, one that depends on the program alone:

- the graph's inputs in the natural order of their names (Dynamo names an input by where it came
  from, ``L_self_modules_layers_modules_2_...``), the compiled graph reordering the arguments that
  Dynamo passes (``inputs_in_canonical_order``, ``permuted``);
- the lowered aten graph's nodes in depth-first order from its outputs, each node's arguments in
  order, named in that order (``canonical_order``). Only pure nodes move, and never past an
  effectful one (a random draw, a write, an assertion): those keep their order and split the
  graph into stretches, each ordered on its own. Two graphs that differ in the order of
  independent pure work come out the same, node for node; graphs whose draws or writes come in
  another order stay different, and are refused, as the programs differ.

The ranks compare digests of that form (``program_text``), so a program traced in another order
on each rank is one program, and a program that differs is still refused.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import fx

from autosp.lowering import SDPA, sdpa_args

_SUFFIX = re.compile(r"_\d+$")
_NAME = re.compile(r"\b[A-Za-z_][A-Za-z0-9_]*\b")
# The Python operators make_fx records on symbolic sizes; their in-place forms and item writes are effects.
_PURE_OPERATORS = frozenset(
    getattr(operator, name)
    for name in (
        "getitem add sub mul truediv floordiv mod pow neg pos abs eq ne lt le gt ge and_ or_ xor not_ "
        "invert lshift rshift truth"
    ).split()
)


def natural_key(name: str) -> tuple[Any, ...]:
    """``layers_2`` before ``layers_10``: text and numbers alternate, so positions compare alike."""
    return tuple(int(part) if i % 2 else part for i, part in enumerate(re.split(r"(\d+)", name)))


@contextlib.contextmanager
def inputs_in_canonical_order(gm: fx.GraphModule) -> Iterator[list[int] | None]:
    """``gm``'s placeholders in the natural order of their names while the block runs.

    Yields ``order``: the new input i is the one Dynamo passes at ``order[i]``; None when the order
    is that already. The nodes keep their meta and Dynamo's attributes (AOT autograd reads each
    placeholder's ``_dynamo_source``). Dynamo reads the graph's placeholders again after its backend
    returns, to pass the arguments in their order, so the block ends with Dynamo's order restored:
    the graph compiled in the block takes its arguments through ``permuted``.
    """
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    order = sorted(range(len(placeholders)), key=lambda i: natural_key(str(placeholders[i].target)))
    if order == list(range(len(placeholders))):
        yield None
        return
    _place(gm, [placeholders[i] for i in order])
    try:
        yield order
    finally:
        _place(gm, placeholders)


def _place(gm: fx.GraphModule, placeholders: Sequence[fx.Node]) -> None:
    anchor = next(n for n in gm.graph.nodes if n.op != "placeholder")  # the output node at least
    for node in placeholders:
        anchor.prepend(node)
    gm.recompile()


def permuted(fn: Callable[..., Any], order: Sequence[int] | None) -> Callable[..., Any]:
    """``fn``, compiled for inputs in ``order``, called with the arguments in Dynamo's order."""
    if order is None:
        return fn
    order = tuple(order)

    @functools.wraps(fn)
    def run(*args: Any) -> Any:
        return fn(*(args[i] for i in order))

    return run


def _pure(node: fx.Node) -> bool:
    """A node that reads its arguments only and writes nothing: free to move between its inputs and users.

    Only aten's and prims' ops are judged by their schemas (a random draw is an effect), AutoSP's
    attention leaf by its dropout; any other op (a collective, a custom op that runs a hook or a
    user's Function, a higher-order op) is taken as an effect: it keeps its place, whatever its
    schema says.
    """
    if node.op == "get_attr":
        return True
    if node.op != "call_function" or node.is_impure():
        return False
    target = node.target
    if target is SDPA.leaf:  # draws a dropout mask only when dropout_p says so
        return not sdpa_args(node.args, node.kwargs)["dropout_p"]
    if isinstance(target, torch._ops.OpOverload):
        return (
            target.namespace in ("aten", "prims")
            and not target._schema.is_mutable
            and torch.Tag.nondeterministic_seeded not in target.tags
        )
    return target in _PURE_OPERATORS


def _stretches(nodes: Sequence[fx.Node]) -> tuple[list[list[fx.Node]], list[fx.Node]]:
    """The pure nodes of each stretch (stretch k: after k effects), and the effects in order."""
    stretches: list[list[fx.Node]] = [[]]
    effects: list[fx.Node] = []
    for node in nodes:
        if _pure(node):
            stretches[-1].append(node)
        else:
            effects.append(node)
            stretches.append([])
    return stretches, effects


def _depth_first(roots: Sequence[fx.Node], member: Callable[[fx.Node], bool]) -> list[fx.Node]:
    """Post-order from ``roots`` in order, arguments in order, through the nodes ``member`` admits."""
    out: list[fx.Node] = []
    seen: set[fx.Node] = set()
    for root in roots:
        if root in seen:
            continue
        seen.add(root)
        stack = [(root, iter(root.all_input_nodes))]
        while stack:
            node, inputs = stack[-1]
            nxt = next((a for a in inputs if a not in seen and member(a)), None)
            if nxt is None:
                stack.pop()
                out.append(node)
            else:
                seen.add(nxt)
                stack.append((nxt, iter(nxt.all_input_nodes)))
    return out


def canonical_nodes(graph: fx.Graph) -> list[fx.Node] | None:
    """The graph's nodes but placeholders and output in canonical order (see the module's doc).

    Built from the end: each stretch's pure nodes are reached depth-first from the nodes after it
    that use them, taken in their canonical order, which is already known. None when some pure node
    is used by nothing (the caller eliminates dead code first).
    """
    nodes = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    stretches, effects = _stretches(nodes)
    # Each placed node's position counted from the end: the canonical order of what follows stretch k.
    position: dict[fx.Node, int] = {next(iter(graph.find_nodes(op="output"))): 0}
    for k in range(len(effects), -1, -1):
        if k < len(effects):
            position[effects[k]] = len(position)
        uses: dict[fx.Node, tuple[int, int]] = {}
        for node in stretches[k]:
            firsts = [(-position[user], user.all_input_nodes.index(node)) for user in node.users if user in position]
            if firsts:
                uses[node] = min(firsts)
        roots = sorted(uses, key=uses.__getitem__)
        ordered = _depth_first(roots, set(stretches[k]).__contains__)
        if len(ordered) != len(stretches[k]):
            return None
        for node in reversed(ordered):
            position[node] = len(position)
    return sorted((n for n in position if n.op != "output"), key=position.__getitem__, reverse=True)


def canonical_order(gm: fx.GraphModule) -> bool:
    """Rebuild ``gm``'s graph in canonical order with names given in that order; False when it cannot
    (a dead pure node: eliminate dead code first), leaving ``gm`` as it was."""
    graph = gm.graph
    order = canonical_nodes(graph)
    if order is None:
        return False
    new = fx.Graph(owning_module=gm, tracer_cls=graph._tracer_cls, tracer_extras=graph._tracer_extras)
    new._codegen = graph._codegen
    env: dict[fx.Node, fx.Node] = {}
    output = next(iter(graph.find_nodes(op="output")))
    for node in [*graph.find_nodes(op="placeholder"), *order, output]:
        name = node.name if node.op in ("placeholder", "output") else _SUFFIX.sub("", node.name)
        copy = new.create_node(
            node.op,
            node.target,
            fx.map_arg(node.args, env.__getitem__),
            fx.map_arg(node.kwargs, env.__getitem__),
            name=name,
            type_expr=node.type,
        )
        copy.meta = dict(node.meta)
        env[node] = copy
    gm.graph = new  # the setter recompiles
    return True


def _root_lines(gm: fx.GraphModule) -> list[str]:
    """The Dynamo graph's own lines as a sorted list, node names without their counters: the same for
    two traces that differ only in the order of their nodes (what they compute is compared on the
    lowered graph, which keeps how the nodes connect)."""
    names = {n.name for n in gm.graph.nodes}

    def base(match: re.Match[str]) -> str:
        word = match.group(0)
        return _SUFFIX.sub("", word) if word in names else word

    lines = [line.split(";  ")[0].rstrip() for line in gm.code.splitlines()]
    return sorted(_NAME.sub(base, line) for line in lines if line.strip())


def program_code(gm: fx.GraphModule, lowered: str | None) -> str:
    """What of ``gm`` the SP ranks compare: with the lowered graph in canonical form, the Dynamo graph's
    lines in an order that does not depend on the trace's, its subgraphs and the lowered graph;
    without it (not lowered: a failed compile), the Dynamo graph's code as traced."""
    if lowered is None:
        return _modules_code(gm, "graph")
    # Subgraphs by their code alone: their attribute names (wrap_body_0) count in the trace's order.
    bodies = sorted(m.code for name, m in gm.named_modules() if name and isinstance(m, fx.GraphModule))
    return "\n".join(["# graph", *_root_lines(gm), *(f"# subgraph\n{code}" for code in bodies), "# lowered", lowered])


def lowered_code(gm: fx.GraphModule) -> str:
    """The lowered graph's code and its subgraphs' (FlexAttention's score_mod), in canonical form."""
    return _modules_code(gm, "lowered graph")


def _modules_code(gm: fx.GraphModule, root: str) -> str:
    return "\n".join(f"# {name or root}\n{m.code}" for name, m in gm.named_modules() if isinstance(m, fx.GraphModule))


__all__ = [
    "canonical_nodes",
    "canonical_order",
    "inputs_in_canonical_order",
    "lowered_code",
    "natural_key",
    "permuted",
    "program_code",
]
