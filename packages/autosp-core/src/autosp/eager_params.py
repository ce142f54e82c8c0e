"""Parameters that a compiled call used outside every AutoSP graph: code Dynamo ran in eager.

Dynamo runs some of a compiled call's code in eager: a ``torch.compiler.disable``'d function, a
frame it skips, a call it could not trace. That code is no graph AutoSP rewrites, so it computes
the whole sequence on every rank: exact (what crosses a graph break is whole), but a layer run
there costs one device's memory and time on every rank, and nothing says so. The forward leaves a
trace that does: the call's autograd graph. Each compiled graph is one node there
(``CompiledFunctionBackward``); a parameter read by a graph hangs off such a node, and one read by
eager code hangs off an eager op's node. Walking the graph from the call's outputs finds the latter.

Only calls that build an autograd graph show it (training): under ``torch.no_grad()`` nothing is
recorded, and such a call is not walked.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.utils import _pytree as pytree

# AOT autograd's node for a compiled graph, under every backend that goes through it (aot_eager, inductor).
_COMPILED = "CompiledFunctionBackward"
_SHOWN = 4


def params_used_in_eager(outputs: Any, named: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """Names of the parameters in ``named`` that eager autograd nodes behind ``outputs`` read."""
    names = {id(p): n for n, p in named}
    if not names:
        return []
    stack = [t.grad_fn for t in pytree.tree_leaves(outputs) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    seen = {id(node) for node in stack}
    found: dict[str, None] = {}  # ordered, without repeats
    while stack:
        node = stack.pop()
        eager = type(node).__name__ != _COMPILED
        for child, _ in node.next_functions:
            if child is None:
                continue
            leaf = getattr(child, "variable", None)  # an AccumulateGrad: the parameter it feeds
            if eager and leaf is not None and id(leaf) in names:
                found[names[id(leaf)]] = None
            if id(child) not in seen:
                seen.add(id(child))
                stack.append(child)
    return list(found)


def eager_params_message(world: int, names: list[str]) -> str:
    shown = ", ".join(names[:_SHOWN]) + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")
    return (
        f"sp_size={world}, but {len(names)} parameter(s) of the model ({shown}) were used by code that ran in "
        "eager, outside every AutoSP graph: that code computed the whole sequence on every rank (exact, but "
        "without sequence parallelism or its memory saving). Dynamo runs code in eager inside a "
        "torch.compiler.disable'd function, or where a graph break falls in code it does not resume in "
        "(TORCH_LOGS=graph_breaks names each break); remove the break or the disable to have it compiled."
    )


__all__ = ["eager_params_message", "params_used_in_eager"]
