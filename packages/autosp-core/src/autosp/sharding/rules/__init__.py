"""Propagation rules: for each aten op, the placement of its result and how to compute it locally.

A rule receives the op's arguments with every tensor as an ``SPValue`` and returns
``SPValue`` (or a tuple of them).  Ops without a rule run replicated: their
sharded inputs are gathered first, which is always correct and reported as a
fallback, so an op we do not know can cost memory but never change a result.
"""

from autosp.sharding.rules import (  # noqa: F401 - register rules
    attention_rows,
    contraction,
    elementwise,
    halo,
    position,
    reduction,
    reorder,
    shape,
    user_function,
)
from autosp.sharding.rules.base import (
    RULES,
    all_replicated,
    call,
    fallback,
    is_elementwise,
    replicated,
    rule,
    values,
    wrap,
)
from autosp.sharding.rules.elementwise import elementwise as elementwise_rule

__all__ = [
    "RULES",
    "all_replicated",
    "call",
    "elementwise_rule",
    "fallback",
    "is_elementwise",
    "replicated",
    "rule",
    "values",
    "wrap",
]
