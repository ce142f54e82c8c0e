"""Propagation rules, common part: for each aten op, the placement of its result and how to compute it locally.

A rule receives the op's arguments with every tensor as an ``SPValue`` and returns
``SPValue`` (or a tuple of them).  Ops without a rule run replicated: their
sharded inputs are gathered first, which is always correct and reported as a
fallback, so an op we do not know can cost memory but never change a result.

A rule sees ``Partial`` or ``HeadShard`` inputs only if it declares so
(``accepts=``): the engine reduces or gathers them first otherwise, so a rule
cannot compute on a summand while claiming a whole value (see ../README.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from autosp.sharding.context import SPContext, SPValue
from autosp.sharding.placement import Partial, Replicate, SeqAxis, Shard
from autosp.sharding.redistribute import to_replicate

aten = torch.ops.aten
Rule = Callable[[SPContext, torch.fx.Node, tuple, dict], Any]
# Core's own rules; ``autosp.builtins`` registers them through ``autosp_register_sharding_rules``.
RULES: dict[Any, Rule] = {}


def declare(fn: Rule, accepts: Iterable[type] = ()) -> Rule:
    """Record which non-plain placements ``fn`` handles itself (``Partial``, ``HeadShard``)."""
    fn.accepts = frozenset(accepts)  # type: ignore[attr-defined]
    return fn


def accepted(fn: Rule) -> frozenset[type]:
    """Placements a rule declared it handles; undeclared rules get Replicate and Shard inputs only."""
    return getattr(fn, "accepts", frozenset())


def rule(*ops: Any, accepts: Iterable[type] = ()) -> Callable[[Rule], Rule]:
    def register(fn: Rule) -> Rule:
        declare(fn, accepts)
        for op in ops:
            RULES[op] = fn
        return fn

    return register


def values(tree: Any) -> list[SPValue]:
    return [v for v in pytree.tree_leaves(tree) if isinstance(v, SPValue)]


def locals_of(tree: Any) -> Any:
    return pytree.tree_map(lambda v: v.local if isinstance(v, SPValue) else v, tree)


def call(node: torch.fx.Node, args: tuple, kwargs: dict) -> Any:
    return node.target(*locals_of(args), **locals_of(kwargs))


def wrap(out: Any, gval: Any, placement_of: Callable[[int, torch.Tensor], Any]) -> Any:
    """Pair each tensor of ``out`` with its global value and placement."""
    if isinstance(out, torch.Tensor):
        return SPValue(out, placement_of(0, gval), gval)
    if isinstance(out, (tuple, list)):
        return type(out)(wrap(o, g, lambda _i, gv, i=i: placement_of(i, gv)) for i, (o, g) in enumerate(zip(out, gval)))
    return out


def replicated(ctx: SPContext, node: torch.fx.Node, args: tuple, kwargs: dict, axis: SeqAxis | None = None) -> Any:
    """Run the op on whole values; the result is replicated.

    A node that lowering left without ``meta["val"]`` (a decomposition's) gets its local
    result as its global value: run on whole values, the two are the same.
    """
    out = call(node, args, kwargs)
    return wrap(out, node.meta.get("val", out), lambda _i, _g: Replicate(axis))


def linked_zeros(t: torch.Tensor) -> torch.Tensor:
    """Zeros of ``t``'s shape that still depend on ``t``: a rank whose result holds nothing of a
    collective's output still runs that collective's backward, as its peers do. ``masked_fill``, not
    ``* 0``: an inf or nan in ``t`` must not leak through (nor into its gradient)."""
    return t.masked_fill(torch.ones((), dtype=torch.bool, device=t.device), 0)


def fallback(ctx: SPContext, node: torch.fx.Node, args: tuple, kwargs: dict) -> Any:
    """Gather every distributed input and run the op on whole values."""
    why = f"{node.name} ({node.target}) has no sharding rule for its inputs"
    gathered = pytree.tree_map(lambda v: to_replicate(ctx, v, why) if isinstance(v, SPValue) else v, (args, kwargs))
    return replicated(ctx, node, *gathered)


def all_replicated(args: Any) -> bool:
    return all(isinstance(v.placement, Replicate) for v in values(args))


def reduce_partials(ctx: SPContext, tree: Any) -> Any:
    return pytree.tree_map(
        lambda v: to_replicate(ctx, v) if isinstance(v, SPValue) and isinstance(v.placement, Partial) else v, tree
    )


def seq_dim(p: Any) -> int | None:
    if isinstance(p, (Shard, Replicate)) and getattr(p, "axis", None) is not None:
        return p.axis.dim
    return None


def is_elementwise(op: Any) -> bool:
    return isinstance(op, torch._ops.OpOverload) and torch.Tag.pointwise in op.tags


__all__ = [
    "RULES",
    "Rule",
    "accepted",
    "all_replicated",
    "declare",
    "call",
    "fallback",
    "is_elementwise",
    "linked_zeros",
    "locals_of",
    "reduce_partials",
    "replicated",
    "rule",
    "seq_dim",
    "values",
    "wrap",
]
