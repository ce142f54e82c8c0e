"""Attention that is not a variant's site: cross-attention, and self-attention over another length.

Each query row attends to the keys on its own, so a rank with some query rows and the whole
k and v computes exactly its rows of the output: no collective at all.  That covers
cross-attention from a sharded sequence to a short memory (an encoder's output, learned
latents, an image's tokens).  A causal flag ties rows to absolute positions, and k/v sharded
along their own sequence (learned queries attending to the sequence, a decoder over a shorter
length than the one sharded) would need a variant: both go to ``whole_attention``, the
always-right path (inputs gathered, attention whole on every rank).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from autosp.lowering import SDPA, sdpa_args
from autosp.sharding.context import SPContext, SPValue
from autosp.sharding.placement import Replicate, SeqAxis, Shard
from autosp.sharding.redistribute import to_replicate, to_shard
from autosp.sharding.rules.base import rule


def _whole(x: Any) -> bool:
    return not isinstance(x, SPValue) or isinstance(x.placement, Replicate)


def _rows_of(ctx: SPContext, mask: Any, q: SPValue) -> Any:
    """The mask's rows for this rank's queries; a mask broadcast over the rows stays whole."""
    if mask is None:
        return None
    if not isinstance(mask, SPValue):
        mask = SPValue(mask, Replicate(), mask)
    row = mask.ndim - 2
    if mask.gval.shape[row] == 1:
        return mask.local if _whole(mask) else None
    placement = q.placement
    assert isinstance(placement, Shard)  # the rule checked it
    target = Shard(SeqAxis(row, placement.axis.length), placement.ranges)
    return to_shard(ctx, mask, row, target)


def _sdpa(a: dict[str, Any], q: Any, k: Any, v: Any, mask: Any, is_causal: bool) -> torch.Tensor:
    # SDPA itself, not the leaf: the leaf only holds attention together while the graph is lowered
    # (it has no backward), so whatever this rule computes must not call it.
    return F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        dropout_p=a["dropout_p"],
        is_causal=is_causal,
        scale=a["scale"],
        enable_gqa=a["enable_gqa"],
    )


def whole_attention(ctx: SPContext, node: torch.fx.Node, args: tuple, kwargs: dict) -> SPValue:
    """The always-right path: q, k, v and the mask gathered, attention computed whole on every rank."""
    why = f"{node.name} (attention): computed whole on every rank"
    a = sdpa_args(args, kwargs)
    local = {
        name: to_replicate(ctx, x, why).local if isinstance(x, SPValue) else x
        for name, x in a.items()
        if name in ("query", "key", "value", "attn_mask")
    }
    out = _sdpa(a, local["query"], local["key"], local["value"], local["attn_mask"], a["is_causal"])
    return SPValue(out, Replicate(), node.meta.get("val", out))


@rule(SDPA.leaf)
def query_rows_attention(ctx: SPContext, node: torch.fx.Node, args: tuple, kwargs: dict) -> Any:
    a = sdpa_args(args, kwargs)
    q, k, v, mask = a["query"], a["key"], a["value"], a["attn_mask"]
    if not any(isinstance(x, SPValue) and not isinstance(x.placement, Replicate) for x in (q, k, v, mask)):
        return whole_attention(ctx, node, args, kwargs)  # nothing distributed: no collective either
    rows = isinstance(q, SPValue) and isinstance(q.placement, Shard) and q.placement.axis.dim == 2
    # Dropout: the kernel draws one mask over every row; this rank's rows alone would draw another.
    if not rows or a["dropout_p"] or q.placement.axis.inner != 1 or a["is_causal"] or not (_whole(k) and _whole(v)):
        return whole_attention(ctx, node, args, kwargs)
    local_mask = _rows_of(ctx, mask, q)
    if mask is not None and local_mask is None:
        return whole_attention(ctx, node, args, kwargs)
    ctx.note("query_rows_attention")
    out = _sdpa(
        a,
        q.local,
        k.local if isinstance(k, SPValue) else k,
        v.local if isinstance(v, SPValue) else v,
        local_mask,
        False,
    )
    return SPValue(out, q.placement, node.meta["val"])


__all__ = ["query_rows_attention", "whole_attention"]
