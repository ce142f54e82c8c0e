"""What a compiled call ran outside every AutoSP graph: code Dynamo ran in eager.

Dynamo runs some of a compiled call's code in eager: a ``torch.compiler.disable``'d function, a
frame it skips, a call it could not trace. That code is no graph AutoSP rewrites, so it computes
the whole sequence on every rank: exact (what crosses a graph break is whole), but a layer or an
attention run there costs one device's memory and time on every rank, and nothing says so. The
forward leaves a trace that does: the call's autograd graph. Each compiled graph is one node there
(``CompiledFunctionBackward``); a parameter read by a graph hangs off such a node, one read by
eager code hangs off an eager op's node, and attention computed in eager is a node of its own
(SDPA's backward, or an ``autograd.Function`` named for attention, as flash-attn's are).

Only calls that build an autograd graph show it (training): under ``torch.no_grad()`` nothing is
recorded, and such a call is not walked.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

# AOT autograd's node for a compiled graph, under every backend that goes through it (aot_eager, inductor).
_COMPILED = "CompiledFunctionBackward"
# SDPA's kernels' backward nodes (ScaledDotProductFlashAttentionForCpuBackward0, ...) and Functions
# named for attention (flash-attn's FlashAttnFunc, xformers' ...Attention...).
_ATTENTION = re.compile(r"ScaledDotProduct|Attention|Attn", re.IGNORECASE)
_SHOWN = 4


@dataclass
class EagerWork:
    """What the call computed in eager: parameters read there, attention kinds computed there."""

    params: list[str] = field(default_factory=list)
    attention: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.params or self.attention)


def eager_work(outputs: Any, named: Iterable[tuple[str, torch.Tensor]], inputs: Iterable[Any] = ()) -> EagerWork:
    """The parameters in ``named`` that eager nodes behind ``outputs`` read, and the attention nodes among them.

    The walk ends at ``inputs``, the call's arguments: what made them (the user's code before the
    call) is not the call's.
    """
    names = {id(p): n for n, p in named}
    # Seen from the start: never expanded, nor counted.
    seen = {id(t.grad_fn) for t in inputs if isinstance(t, torch.Tensor) and t.grad_fn is not None}
    stack = [
        t.grad_fn
        for t in pytree.tree_leaves(outputs)
        if isinstance(t, torch.Tensor) and t.grad_fn is not None and id(t.grad_fn) not in seen
    ]
    seen |= {id(node) for node in stack}
    params: dict[str, None] = {}  # ordered, without repeats
    attention: dict[str, None] = {}
    while stack:
        node = stack.pop()
        kind = type(node).__name__
        eager = kind != _COMPILED
        if eager and _ATTENTION.search(kind):
            attention[kind] = None
        for child, _ in node.next_functions:
            if child is None:
                continue
            leaf = getattr(child, "variable", None)  # an AccumulateGrad: the parameter it feeds
            if eager and leaf is not None and id(leaf) in names:
                params[names[id(leaf)]] = None
            if id(child) not in seen:
                seen.add(id(child))
                stack.append(child)
    return EagerWork(list(params), list(attention))


def _some(items: list[str]) -> str:
    return ", ".join(items[:_SHOWN]) + (f" and {len(items) - _SHOWN} more" if len(items) > _SHOWN else "")


def eager_work_message(world: int, work: EagerWork) -> str:
    what = []
    if work.params:
        what.append(f"{len(work.params)} parameter(s) of the model ({_some(work.params)}) were read")
    if work.attention:
        what.append(f"attention ({_some(work.attention)}) was computed")
    return (
        f"sp_size={world}, but {' and '.join(what)} by code that ran in eager, outside every AutoSP graph: that "
        "code computed the whole sequence on every rank (exact, but without sequence parallelism or its memory "
        "saving). Dynamo runs code in eager inside a torch.compiler.disable'd function, or where a graph break "
        "falls in code it does not resume in (TORCH_LOGS=graph_breaks names each break); remove the break or the "
        "disable to have it compiled."
    )


__all__ = ["EagerWork", "eager_work", "eager_work_message"]
