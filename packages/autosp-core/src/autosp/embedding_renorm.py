"""``nn.Embedding(max_norm=...)``'s in-place renormalisation, written out in the graph before lowering.

Eager's ``F.embedding(ids, weight, max_norm=m)`` first renormalises, through a ``detach()``ed alias,
every row of the table that ``ids`` looks up (``torch.embedding_renorm_``), then looks them up. Dynamo
keeps the call whole, and AutoSP's lowering cannot trace a write into a parameter hidden inside it.
Written out as eager runs it, the write is an untracked write through a detached alias, which
``autosp.straight_through`` states exactly (later reads see the renormalised rows, the gradient flows
to the table as in eager, the table gets its new rows after the call), or ``autosp.untracked_writes``
refuses, naming the line. The renormalisation reads the ids whole: the sharding engine has no rule
for it, so every rank renormalises the rows of every token, as the single device did, and the tables
stay alike.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F

from autosp.untracked_writes import value_of

_FUNCTIONS = {
    # target: the names of its positional parameters
    F.embedding: ("input", "weight", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse"),
    F.embedding_bag: (
        "input",
        "weight",
        "offsets",
        "max_norm",
        "norm_type",
        "scale_grad_by_freq",
        "mode",
        "sparse",
        "per_sample_weights",
        "include_last_offset",
        "padding_idx",
    ),
}


def bound_args(node: torch.fx.Node) -> dict[str, Any]:
    """An ``F.embedding`` or ``F.embedding_bag`` call's arguments by name."""
    return dict(zip(_FUNCTIONS[node.target], node.args)) | dict(node.kwargs)


def write_out_renorms(gm: torch.fx.GraphModule) -> int:
    """Split each embedding lookup with ``max_norm`` in ``gm``'s own graph into eager's renormalisation
    and a lookup without it; returns how many were split.

    A call whose weight or ids the graph does not hold as traced tensors is left as it is (the SP
    rewrite then refuses it, naming the line).
    """
    graph, split = gm.graph, 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _FUNCTIONS:
            continue
        bound = bound_args(node)
        max_norm = bound.get("max_norm")
        weight, ids = bound.get("weight"), bound.get("input")
        table, looked_up = value_of(weight), value_of(ids)
        if max_norm is None or table is None or looked_up is None:
            continue
        norm_type = float(bound.get("norm_type", 2.0))
        fake = getattr(table, "fake_mode", None)
        with graph.inserting_before(node):
            detached = graph.call_method("detach", (weight,))
            contiguous = graph.call_method("contiguous", (ids,))
            renorm = graph.call_function(torch.embedding_renorm_, (detached, contiguous, float(max_norm), norm_type))
        for new in (detached, contiguous, renorm):
            new.meta.update({k: node.meta[k] for k in ("stack_trace", "nn_module_stack") if k in node.meta})
        with fake if fake is not None else contextlib.nullcontext():
            detached.meta["example_value"] = table.detach()
            contiguous.meta["example_value"] = looked_up.contiguous()
        renorm.meta["example_value"] = detached.meta["example_value"]  # the write hands back its target
        if "max_norm" in node.kwargs:
            node.update_kwarg("max_norm", None)
        else:
            node.update_arg(_FUNCTIONS[node.target].index("max_norm"), None)
        split += 1
    if split:
        graph.lint()
        gm.recompile()
    return split


__all__ = ["bound_args", "write_out_renorms"]
