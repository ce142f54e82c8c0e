"""Whether a custom Function's (or a gradient hook's) forward and backward are elementwise over its inputs.

Such a body computes each position of every result, and of every input's gradient, from the same
position of its inputs (and of the gradients of its results) alone, so each rank can run it on its
own positions with no collective: BLOOM's GeLU Function, a straight-through clamp, ``g * 2`` as a
hook. ``autosp.sharding.rules.user_function`` then keeps the sequence shard through it.

Decided by construction, never by a name: both subgraphs are traced to aten on the call's fake
values, and every op must be tagged pointwise (or copy, cast or alias a value, or make a 0-d
constant), every value must have the inputs' one shape (or be 0-d), and nothing may draw random
numbers. Anything else (a reduction, a reshape to another shape, a transpose, a matmul, a size
baked into a new tensor, an input of another shape such as a weight or a captured scalar) leaves
the body whole on every rank, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

aten = torch.ops.aten

# Ops that keep a value's shape and position without being tagged pointwise.
_SHAPE_KEEPING = {
    aten.clone.default,
    aten.detach.default,
    aten.alias.default,
    aten._to_copy.default,
    aten.zeros_like.default,
    aten.ones_like.default,
    aten.full_like.default,
    aten.empty_like.default,
    # Every value has the one shape or is 0-d, so these are identities or a constant's broadcast
    # (``x.view_as(x)``, ``c.expand_as(x)``); a transpose, which may keep a square shape, is not here.
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.expand.default,
}
# Ops that make a constant: allowed only when the constant is 0-d (a size baked into one is not).
_CONSTANTS = {aten.scalar_tensor.default, aten.lift_fresh_copy.default, aten.full.default, aten.tensor.default}


def _trace(fn: Callable[..., Any], args: Sequence[Any]) -> torch.fx.GraphModule:
    from torch.fx.experimental.proxy_tensor import make_fx

    with torch.no_grad():
        return make_fx(fn)(*args)


def _elementwise(gm: torch.fx.GraphModule, shape: torch.Size) -> bool:
    def fits(v: Any) -> bool:
        return not isinstance(v, torch.Tensor) or v.shape == shape or v.dim() == 0

    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        val = node.meta.get("val")
        if not all(fits(v) for v in pytree.tree_leaves(val)):
            return False
        if node.op == "placeholder":
            continue
        if node.op == "get_attr":  # a constant tensor the body holds
            if not (isinstance(val, torch.Tensor) and val.dim() == 0):
                return False
            continue
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            return False
        if torch.Tag.nondeterministic_seeded in target.tags:
            return False
        if not (torch.Tag.pointwise in target.tags or target in _SHAPE_KEEPING or target in _CONSTANTS):
            return False
        if target in _CONSTANTS and not (isinstance(val, torch.Tensor) and val.dim() == 0):
            return False
    return True


def is_token_wise(
    run_fwd: Callable[..., tuple[list[torch.Tensor], list[torch.Tensor]]],
    run_bwd: Callable[..., Any],
    args: Sequence[Any],
    fake_mode: Any,
) -> bool:
    """Whether ``run_fwd(*args) -> (results, saved)`` and ``run_bwd(*grads, *saved)`` are elementwise.

    ``args`` are the call's fake values; every one must be a tensor of one shape.
    """
    if not args or not all(isinstance(a, torch.Tensor) for a in args):
        return False
    shape = args[0].shape
    if len(shape) == 0 or any(a.shape != shape for a in args):
        return False
    with fake_mode:
        fwd = _trace(run_fwd, args)
        # The forward's results and saved values, as the trace found them.
        results, saved = pytree.tree_map(
            lambda n: n.meta.get("val") if isinstance(n, torch.fx.Node) else n,
            next(n for n in fwd.graph.nodes if n.op == "output").args[0],
        )
        if any(not isinstance(t, torch.Tensor) or t.shape != shape for t in [*results, *saved]):
            return False
        grads = [torch.empty_like(r) for r in results]
        bwd = _trace(run_bwd, [*grads, *saved])
    return _elementwise(fwd, shape) and _elementwise(bwd, shape)


__all__ = ["is_token_wise"]
