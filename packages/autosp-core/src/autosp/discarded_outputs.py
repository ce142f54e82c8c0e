"""An input reached only through outputs the caller gave no gradient keeps ``.grad`` None, as in eager.

AOT autograd's backward is an ``autograd.Function``: an output given no gradient (a backbone's
``pooler_output`` that the head ignores) reaches it as zeros, so a parameter feeding only such
outputs got a zero ``.grad`` where the single-device program leaves ``None``, and an optimizer
steps it (AdamW's weight decay and momentum) where eager skips it. This gives such inputs ``None``.

Two halves:

- ``reach`` (compile time) reads the lowered single-device graph (functional aten, the program's
  meaning before any SP rewrite): per output, the floating-point inputs a gradient can flow back to.
  Integer and boolean values and ``detach`` carry none. An input the graph writes (``copy_`` into an
  input after functionalization) can pass a gradient on through the written tensor, which no hook
  sees, so what flows into a write is always kept.
- ``drop_discarded`` (run time) hooks each output the caller can differentiate; a hook on the
  compiled backward node then replaces with ``None`` the gradient of each input that no output given
  a gradient reaches.

A program on one rank is not lowered by the passes; ``reach_alone`` lowers it for this analysis
only, where two or more outputs carry a gradient (with one, nothing can be dropped) and its sizes
are static (its guards would otherwise specialise a dynamic graph).

Invariant: only a gradient that is exactly zero by construction becomes ``None``. Whatever is not
understood (an output that cannot be hooked, an edge of the backward node that matches no input, a
graph whose outputs do not line up) keeps the compiled gradient: at worst a zero where eager has
``None``, never a missing gradient.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

_NO_GRADIENT = (torch.ops.aten.detach.default,)
_BACKWARD_NODE = "CompiledFunctionBackward"
_SEARCH_DEPTH = 4  # AOT regenerates an aliased output with a view or two after the compiled node


@dataclass(frozen=True)
class Reach:
    """Per graph output, a bitmask of the inputs its gradient can reach; ``kept``: inputs always kept."""

    outputs: tuple[int, ...]
    kept: int

    @property
    def can_drop(self) -> bool:
        # With one distinct reach, any output given a gradient reaches every input any output reaches.
        return len({m for m in self.outputs if m}) > 1


def _carries_gradient(node: torch.fx.Node) -> bool:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return val.is_floating_point() or val.is_complex()
    return True  # tuples of results and unknown values: conservatively yes


def reach(gm: torch.fx.GraphModule) -> Reach | None:
    """What each output of ``gm`` can send a gradient back to; ``None`` if the graph's form is not understood."""
    masks: dict[torch.fx.Node, int] = {}
    kept = 0
    placeholders = 0
    output: torch.fx.Node | None = None
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            masks[node] = (1 << placeholders) if _carries_gradient(node) else 0
            placeholders += 1
            continue
        if node.op == "output":
            output = node
            break
        inputs = functools.reduce(operator.or_, (masks.get(a, 0) for a in node.all_input_nodes), 0)
        target = node.target
        if isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable:
            kept |= inputs
        masks[node] = inputs if target not in _NO_GRADIENT and _carries_gradient(node) else 0
    if output is None:
        return None
    flat = torch.utils._pytree.tree_leaves(output.args[0])
    return Reach(tuple(masks.get(v, 0) if isinstance(v, torch.fx.Node) else 0 for v in flat), kept)


def _differentiable_outputs(gm: torch.fx.GraphModule) -> int:
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    values = [v.meta.get("example_value") for v in torch.utils._pytree.tree_leaves(output.args[0])]
    # A value Dynamo recorded no tensor for counts too: unknown, so not ruled out.
    return sum(1 for v in values if not isinstance(v, torch.Tensor) or v.requires_grad)


def _symbolic(values: Sequence[Any]) -> bool:
    return any(
        isinstance(v, torch.SymInt) or (isinstance(v, torch.Tensor) and not all(isinstance(n, int) for n in v.shape))
        for v in values
    )


def reach_alone(gm: torch.fx.GraphModule, fake_inputs: Sequence[Any], fake_mode: Any) -> Reach | None:
    """``reach`` of Dynamo's graph ``gm`` lowered apart (one rank: the passes do not lower it); ``None``
    where nothing can be dropped, the graph has symbolic sizes, or the lowering fails (the compiled
    gradients are then kept as they are).

    Symbolic sizes are left alone: lowering on Dynamo's fakes would add its guards to Dynamo's
    shape environment, specialising a graph that torch alone keeps general (a recompile per length).
    """
    if _differentiable_outputs(gm) < 2 or _symbolic(fake_inputs):
        return None
    from autosp.lowering import lower_to_aten

    try:
        return reach(lower_to_aten(gm, fake_inputs, fake_mode))
    except Exception:  # noqa: BLE001 - torch compiles it regardless; only the analysis is given up
        return None


def _backward_node(outs: Sequence[Any], args: Sequence[Any]) -> Any:
    """The compiled backward node this call made, or ``None`` unless exactly one is found.

    Searched from the outputs and stopped at the inputs' own history, so that an output aliasing an
    input that an earlier compiled graph made does not lead to that graph's node.
    """
    boundary = {id(a.grad_fn) for a in args if isinstance(a, torch.Tensor) and a.grad_fn is not None}
    frontier = [o.grad_fn for o in outs if isinstance(o, torch.Tensor) and o.grad_fn is not None]
    found: dict[int, Any] = {}
    seen: set[int] = set()
    for _ in range(_SEARCH_DEPTH):
        step: list[Any] = []
        for node in frontier:
            if node is None or id(node) in seen or id(node) in boundary:
                continue
            seen.add(id(node))
            if node.name() == _BACKWARD_NODE:
                found[id(node)] = node
            else:
                step.extend(f for f, _ in node.next_functions)
        frontier = step
    return next(iter(found.values())) if len(found) == 1 else None


def _edge_inputs(node: Any, args: Sequence[Any]) -> list[int]:
    """Per edge of ``node``, the bitmask of the call's inputs it leads to (0: matches none)."""
    leaves: dict[int, int] = {}
    inner: dict[tuple[int, int], int] = {}
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor) and a.requires_grad:
            if a.grad_fn is None:
                leaves[id(a)] = leaves.get(id(a), 0) | 1 << i
            else:
                key = (id(a.grad_fn), a.output_nr)
                inner[key] = inner.get(key, 0) | 1 << i
    edges = []
    for fn, nr in node.next_functions:
        if fn is None:
            edges.append(0)
        elif (variable := getattr(fn, "variable", None)) is not None:
            edges.append(leaves.get(id(variable), 0))
        else:
            edges.append(inner.get((id(fn), nr), 0))
    return edges


def drop_discarded(fn: Callable[..., Any], found: Reach | None) -> Callable[..., Any]:
    """``fn`` whose backward gives ``None`` to inputs reached only through outputs given no gradient."""
    if found is None or not found.can_drop:
        return fn

    @functools.wraps(fn)
    def run(*args: Any) -> Any:
        outs = fn(*args)
        if not torch.is_grad_enabled() or len(outs) != len(found.outputs):
            return outs
        node = _backward_node(outs, args)
        if node is None:
            return outs
        edges = _edge_inputs(node, args)
        received = [found.kept]  # the inputs some output given a gradient reaches, in this backward

        def given(mask: int) -> Callable[[torch.Tensor | None], None]:
            def hook(grad: torch.Tensor | None) -> None:
                if grad is not None:
                    received[0] |= mask

            return hook

        for out, mask in zip(outs, found.outputs):
            if not (isinstance(out, torch.Tensor) and out.requires_grad and mask):
                continue
            if out.grad_fn is None:
                received[0] |= mask  # a leaf: no hook sees its gradient
            else:
                out.register_hook(given(mask))
        always = received[0]

        def drop(grad_inputs: tuple[Any, ...], _grad_outputs: tuple[Any, ...]) -> tuple[Any, ...]:
            reached, received[0] = received[0], always  # the next backward through this node starts afresh
            return tuple(
                None if g is not None and edge and not edge & reached else g for g, edge in zip(grad_inputs, edges)
            )

        node.register_hook(drop)
        return outs

    return run


__all__ = ["Reach", "drop_discarded", "reach", "reach_alone"]
