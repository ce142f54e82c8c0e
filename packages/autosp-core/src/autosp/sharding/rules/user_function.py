"""A user's own ``torch.autograd.Function`` (``autosp::user_function``): token-wise, or whole on every rank.

A body that ``autosp.token_wise_body`` found elementwise in its forward and its backward, over
inputs of one shape, runs on each rank's positions: every input laid out like the first sharded
one, every result (and every input's gradient) in that layout. Shard's convention holds through it
with nothing to add: each rank's backward gets, and returns, the true gradient of its positions.

Any other Function's forward is opaque and its backward is the user's, so no rule can split it.
Every rank runs it on whole inputs (gathered where they were sharded). Around it the gradient
convention changes hands (see ../README.md): the user's backward gets the true gradient of each
result (``sum_grads`` sums the partial ones), so even a backward that is not linear in the gradient
computes what it did on one device; what it returns is the true gradient of each input on every
rank, which ``grad_once`` keeps on rank 0 only, the partial convention of a replicated value,
exactly.
"""

from __future__ import annotations

from typing import Any

import torch

from autosp.sharding import collectives as C
from autosp.sharding.context import SPContext, SPValue
from autosp.sharding.placement import Replicate, Shard
from autosp.sharding.redistribute import to_replicate, to_shard
from autosp.sharding.rules.base import rule
from autosp.user_function import BODIES, USER_FUNCTION


def _differentiable(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


@rule(USER_FUNCTION)
def user_function_rule(ctx: SPContext, node: torch.fx.Node, args: tuple, kwargs: dict) -> Any:
    tensors, key = args
    if BODIES[key].token_wise and all(isinstance(v, SPValue) for v in tensors):
        target = next((v.placement for v in tensors if isinstance(v.placement, Shard)), None)
        if target is not None and all(g.shape == tensors[0].gval.shape for g in node.meta["val"]):
            local = [to_shard(ctx, v, target.axis.dim, target) for v in tensors]
            return [SPValue(t, target, g) for t, g in zip(USER_FUNCTION(local, key), node.meta["val"])]
    why = f"{node.name}: {BODIES[key].what} runs whole on every rank"
    whole = [to_replicate(ctx, v, why) if isinstance(v, SPValue) else v for v in tensors]
    local = [v.local if isinstance(v, SPValue) else v for v in whole]
    given = [C.grad_once(t, ctx.rank == 0) if _differentiable(t) else t for t in local]
    results = USER_FUNCTION(given, key)
    n_out = BODIES[key].n_out
    results = [C.sum_grads(t, ctx.group_name) if i < n_out and _differentiable(t) else t for i, t in enumerate(results)]
    ctx.note("user_function")
    return [SPValue(t, Replicate(), g) for t, g in zip(results, node.meta["val"])]
