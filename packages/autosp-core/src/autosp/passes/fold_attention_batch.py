"""SDPA on more or fewer than 4 dims becomes SDPA on 4: batch dims folded into one, or lifted, and back.

``F.scaled_dot_product_attention`` treats every dim before ``[H, L, E]`` as batch, so block-local
attention can call it on ``[B, chunks, H, chunk, E]`` (the sequence split into chunks, attention
inside each). The attention analysis and the variants read SDPA's ``[B, H, S, E]`` layout; folding
``[B, chunks]`` into one batch dim before the call, and back after it, is the same computation, so
such programs are found and rewritten like any other. A mask is broadcast to the folded dims first.
Leading dims of a symbolic size are left as they are (the analysis then refuses, naming the call).

SDPA on 3 dims (``[batch * heads, L, E]``, as code written before 4-D SDPA calls it) or on 2
(``[L, E]``) treats its leading dim as batch; lifted to ``[1, N, L, E]`` (``[1, 1, L, E]``) that dim
becomes the heads, which attention keeps as independent as the batch: the same computation, so
Ulysses splits those N entries over the ranks (it needs N divisible by sp_size) and ring takes the
sequence as for any other call. A mask of 3 dims (``[N or 1, L, S]``) is lifted alike; a mask of
fewer broadcasts as it did.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx

from autosp.context import CompileContext
from autosp.passes.manager import Pass, Stage

SDPA_ARGS = ("query", "key", "value", "attn_mask")
SDPA_REST = ("dropout_p", "is_causal", "scale", "enable_gqa")  # positional after the mask, as keywords


def _val(node: Any) -> Any:
    return node.meta.get("example_value", node.meta.get("val")) if isinstance(node, fx.Node) else None


def _static(shape: Any) -> bool:
    return all(isinstance(n, int) for n in shape)


def _tensor_args(node: fx.Node) -> dict[str, Any]:
    named = dict(zip(SDPA_ARGS, node.args))
    named.update({k: v for k, v in node.kwargs.items() if k in SDPA_ARGS})
    return named


class _Call:
    """Inserts ``fn(*args)`` nodes with their example values computed in the graph's fake mode."""

    def __init__(self, graph: fx.Graph, fake_mode: Any) -> None:
        self.graph, self.fake_mode = graph, fake_mode

    def __call__(self, fn: Any, *args: Any, **kwargs: Any) -> fx.Node:
        new = self.graph.call_function(fn, args, kwargs)
        fake = {k: _val(v) if isinstance(v, fx.Node) else v for k, v in kwargs.items()}
        with self.fake_mode:
            new.meta["example_value"] = fn(*(_val(a) if isinstance(a, fx.Node) else a for a in args), **fake)
        return new


def _rebuild(
    node: fx.Node,
    call: _Call,
    to_four: Callable[[fx.Node], fx.Node],
    mask_to_four: Callable[[fx.Node], fx.Node],
    back: Callable[[fx.Node], fx.Node],
) -> None:
    """``node`` replaced by SDPA on ``to_four`` of q, k, v (and ``mask_to_four`` of its mask), then ``back``."""
    named = _tensor_args(node)
    mask = named.get("attn_mask")
    with call.graph.inserting_before(node):
        qkv = [to_four(named[a]) for a in SDPA_ARGS[:3]]
        mask4 = mask_to_four(mask) if mask is not None else None
    kwargs: dict[str, Any] = dict(zip(SDPA_REST, node.args[len(SDPA_ARGS) :]))
    kwargs.update({key: val for key, val in node.kwargs.items() if key not in SDPA_ARGS})
    if mask4 is not None:
        kwargs["attn_mask"] = mask4
    # Before the node after it (inserting_after would put each new node straight after ``node``,
    # in reverse order).
    with call.graph.inserting_before(node.next):
        out = back(call(F.scaled_dot_product_attention, *qkv, **kwargs))
    if list(_val(out).shape) != list(_val(node).shape):
        raise AssertionError(
            f"fold_attention_batch: {node.name} gave {list(_val(out).shape)}, not {list(_val(node).shape)}"
        )
    node.replace_all_uses_with(out)
    call.graph.erase_node(node)


def _rewrite(graph: fx.Graph, node: fx.Node) -> tuple[str, bool] | None:
    """A note on what happened to one SDPA call and whether it was rewritten; None for 4-D calls."""
    named = _tensor_args(node)
    q, k, v, mask = (named.get(a) for a in SDPA_ARGS)
    vals = [_val(t) for t in (q, k, v)]
    if not all(isinstance(t, torch.Tensor) for t in vals) or vals[0].dim() == 4:
        return None
    nd = vals[0].dim()
    lead = list(vals[0].shape[: nd - 3])
    if nd > 4 and (any(t.dim() != nd or list(t.shape[: nd - 3]) != lead for t in vals) or not _static(lead)):
        return f"{node.name}: SDPA on {nd}-D q/k/v whose batch dims differ or are symbolic: left as is", False
    if nd < 4 and (nd not in (2, 3) or any(t.dim() != nd for t in vals)):
        return f"{node.name}: SDPA on {[t.dim() for t in vals]}-D q/k/v: left as is", False
    mask_val = _val(mask)
    if mask is not None and not isinstance(mask_val, torch.Tensor):
        return f"{node.name}: SDPA on {nd}-D q/k/v with a mask of unknown shape: left as is", False
    fake_mode = getattr(vals[0], "fake_mode", None)  # the mode of the values the graph's meta holds
    if fake_mode is None:
        return f"{node.name}: SDPA on {nd}-D q/k/v without fake values: left as is", False
    call = _Call(graph, fake_mode)

    def unsqueezed(t: fx.Node, dims: int) -> fx.Node:
        for _ in range(dims):
            t = call(torch.unsqueeze, t, 0)
        return t

    if nd > 4:

        def mask_folded(m: fx.Node) -> fx.Node:
            expanded = call(torch.Tensor.expand, unsqueezed(m, nd - mask_val.dim()), [*lead, -1, -1, -1])
            return call(torch.flatten, expanded, 0, nd - 4)

        _rebuild(
            node,
            call,
            lambda t: call(torch.flatten, t, 0, nd - 4),
            mask_folded,
            lambda out: call(torch.unflatten, out, 0, tuple(lead)),
        )
        note = f"computed with its {math.prod(lead)} batch entries ({lead}) folded into one dim"
        return f"{node.name}: SDPA on {nd}-D q/k/v {note}", True

    def squeezed(t: fx.Node) -> fx.Node:
        for _ in range(4 - nd):
            t = call(torch.squeeze, t, 0)
        return t

    # A 3-D mask is [N or 1, L, S]: its leading dim is q's. One of fewer dims broadcasts as it did.
    _rebuild(
        node, call, lambda t: unsqueezed(t, 4 - nd), lambda m: unsqueezed(m, 1) if mask_val.dim() == 3 else m, squeezed
    )
    return f"{node.name}: SDPA on {nd}-D q/k/v computed on 4, its leading dim lifted to the heads", True


def fold_attention_batch(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule | None:
    changed = False
    for module in list(gm.modules()):
        if not isinstance(module, fx.GraphModule):
            continue
        rewritten = False
        for node in [
            n for n in module.graph.nodes if n.op == "call_function" and n.target is F.scaled_dot_product_attention
        ]:
            outcome = _rewrite(module.graph, node)
            if outcome is not None:
                ctx.report.notes.append(outcome[0])
                rewritten |= outcome[1]
        if rewritten:
            module.recompile()
        changed |= rewritten
    return gm if changed else None


FOLD_ATTENTION_BATCH = Pass(
    "autosp.fold_attention_batch",
    Stage.GRAPH,
    fold_attention_batch,
    before=("autosp.find_attention",),
    applies=lambda ctx: ctx.sp,
    doc="SDPA on other than 4 dims: its batch dims folded into one, or lifted to 4",
)

__all__ = ["FOLD_ATTENTION_BATCH", "fold_attention_batch"]
