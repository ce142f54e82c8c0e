"""Matmuls that are the last readers of a large activation move up to their inputs in the backward.

A linear layer's backward reads its input twice: for the input's gradient and for the weight's.
The partitioner places the weight's gradient, a small ``[out, in]`` result, late, after the
gradients of the layers below it; the ``[tokens, features]`` activation it reads stays allocated
until then. Under SAC that is a recomputed MLP activation (``silu(gate) * up``, ``[tokens, ffn]``)
held through the whole gated unit's backward (measured with ``autosp_tools.bench.peak``: one
``[tokens, ffn]`` buffer more at the backward's peak). Moving such a matmul, with the views that
feed only it, to just after its last input frees that activation as soon as it can be. Only the
order changes: the same ops on the same values, so results are bitwise the same.
"""

from __future__ import annotations

import torch
from torch import fx

from autosp.context import CompileContext
from autosp_sac.graph import MATMULS, aten, nbytes

_VIEWS = frozenset(
    {
        aten.t.default,
        aten.permute.default,
        aten.transpose.int,
        aten.view.default,
        aten.reshape.default,
        aten._unsafe_view.default,
    }
)


def _is_view(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in _VIEWS


def _feeding_views(mm: fx.Node) -> list[fx.Node]:
    """Views that exist only to feed ``mm`` (chains of single-user views into it)."""
    chain: list[fx.Node] = []
    stack = list(mm.all_input_nodes)
    while stack:
        node = stack.pop()
        if _is_view(node) and len(node.users) == 1 and node not in chain:
            chain.append(node)
            stack.extend(node.all_input_nodes)
    return chain


def _base(node: fx.Node) -> fx.Node:
    while _is_view(node):
        node = node.all_input_nodes[0]
    return node


def _mutates(node: fx.Node) -> bool:
    """An op that may write a tensor in place: nothing is moved across one."""
    target = node.target
    if node.op != "call_function":
        return False
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.is_mutable
    return isinstance(target, torch._ops.HigherOrderOperator)


def _readers(base: fx.Node) -> list[fx.Node]:
    """Nodes that read ``base``'s storage: its users, seen through views."""
    out, stack = [], list(base.users)
    while stack:
        node = stack.pop()
        if _is_view(node):
            stack.extend(node.users)
        else:
            out.append(node)
    return out


def free_early(gm: fx.GraphModule, ctx: CompileContext) -> None:
    graph = gm.graph
    moved = 0
    for mm in [n for n in graph.nodes if n.op == "call_function" and n.target in MATMULS]:
        pos = {n: i for i, n in enumerate(graph.nodes)}
        group = _feeding_views(mm)
        members = set(group) | {mm}
        deps = {a for n in members for a in n.all_input_nodes if a not in members}
        if not deps:
            continue
        anchor = max(deps, key=pos.__getitem__)
        first = min(pos[n] for n in members)
        if pos[anchor] + 1 >= first:
            continue
        crossed = list(graph.nodes)[pos[anchor] + 1 : pos[mm]]
        if any(_mutates(n) for n in crossed if n not in members):
            continue  # a write it would move across could change what it reads
        bases = {_base(a) for a in deps}
        # What moving frees sooner: inputs whose every other reader already ran by the anchor.
        freed = sum(
            nbytes(b)
            for b in bases
            if all(r in members or pos[r] <= pos[anchor] for r in _readers(b))
            and all(r.op != "output" for r in _readers(b))
        )
        if freed <= nbytes(mm):
            continue
        at = anchor
        for node in sorted(members, key=pos.__getitem__):
            at.append(node)  # fx: moves ``node`` to just after ``at``
            at = node
        moved += 1
    if moved:
        graph.lint()
        gm.recompile()
    ctx.report.sac["matmuls moved up to free their inputs"] = moved


__all__ = ["free_early"]
