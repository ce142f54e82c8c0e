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


def _fold(graph: fx.Graph, node: fx.Node) -> str | None:
    named = _tensor_args(node)
    q, k, v, mask = (named.get(a) for a in SDPA_ARGS)
    vals = [_val(t) for t in (q, k, v)]
    if not all(isinstance(t, torch.Tensor) for t in vals) or vals[0].dim() == 4:
        return None
    if vals[0].dim() < 4:
        return _lift(graph, node)
    nd = vals[0].dim()
    lead = list(vals[0].shape[: nd - 3])
    if any(t.dim() != nd or list(t.shape[: nd - 3]) != lead for t in vals) or not _static(lead):
        return f"{node.name}: SDPA on {nd}-D q/k/v whose batch dims differ or are symbolic: left as is"
    mask_val = _val(mask)
    if mask is not None and not isinstance(mask_val, torch.Tensor):
        return f"{node.name}: SDPA on {nd}-D q/k/v with a mask of unknown shape: left as is"
    out_val = _val(node)
    fake_mode = getattr(vals[0], "fake_mode", None)  # the mode of the values the graph's meta holds
    if fake_mode is None:
        return f"{node.name}: SDPA on {nd}-D q/k/v without fake values: left as is"

    def call(fn: Any, *args: Any) -> fx.Node:
        new = graph.call_function(fn, args)
        with fake_mode:
            new.meta["example_value"] = fn(*(_val(a) if isinstance(a, fx.Node) else a for a in args))
        return new

    with graph.inserting_before(node):
        folded = [call(torch.flatten, t, 0, nd - 4) for t in (q, k, v)]
        if mask is not None:
            m = mask
            for _ in range(nd - mask_val.dim()):
                m = call(torch.unsqueeze, m, 0)
            folded.append(call(torch.flatten, call(torch.Tensor.expand, m, [*lead, -1, -1, -1]), 0, nd - 4))
    kwargs: dict[str, Any] = dict(zip(SDPA_REST, node.args[len(SDPA_ARGS) :]))
    kwargs.update({key: val for key, val in node.kwargs.items() if key not in SDPA_ARGS})
    if mask is not None:
        kwargs["attn_mask"] = folded[3]
    with graph.inserting_after(node):
        attention = graph.call_function(F.scaled_dot_product_attention, tuple(folded[:3]), kwargs)
    fake_kwargs: dict[str, Any] = {key: _val(val) if isinstance(val, fx.Node) else val for key, val in kwargs.items()}
    with fake_mode:
        attention.meta["example_value"] = F.scaled_dot_product_attention(*(_val(t) for t in folded[:3]), **fake_kwargs)
    with graph.inserting_after(attention):
        unfolded = call(torch.unflatten, attention, 0, tuple(lead))
    if list(_val(unfolded).shape) != list(out_val.shape):
        raise AssertionError(
            f"fold_attention_batch: {node.name} gave {list(_val(unfolded).shape)}, not {list(out_val.shape)}"
        )
    node.replace_all_uses_with(unfolded)
    graph.erase_node(node)
    return f"{node.name}: SDPA on {nd}-D q/k/v computed with its {math.prod(lead)} batch entries ({lead}) folded into one dim"


def _lift(graph: fx.Graph, node: fx.Node) -> str | None:
    named = _tensor_args(node)
    q, k, v, mask = (named.get(a) for a in SDPA_ARGS)
    vals = [_val(t) for t in (q, k, v)]
    nd = vals[0].dim()
    if nd not in (2, 3) or any(t.dim() != nd for t in vals):
        return f"{node.name}: SDPA on {[t.dim() for t in vals]}-D q/k/v: left as is"
    mask_val = _val(mask)
    if mask is not None and not isinstance(mask_val, torch.Tensor):
        return f"{node.name}: SDPA on {nd}-D q/k/v with a mask of unknown shape: left as is"
    fake_mode = getattr(vals[0], "fake_mode", None)
    if fake_mode is None:
        return f"{node.name}: SDPA on {nd}-D q/k/v without fake values: left as is"

    def lift(t: Any, dims: int) -> Any:
        for _ in range(dims):
            new = graph.call_function(torch.unsqueeze, (t, 0))
            with fake_mode:
                new.meta["example_value"] = torch.unsqueeze(_val(t), 0)
            t = new
        return t

    with graph.inserting_before(node):
        lifted = [lift(t, 4 - nd) for t in (q, k, v)]
        if mask is not None and mask_val.dim() == 3:  # [N or 1, L, S]: its leading dim is q's
            lifted.append(lift(mask, 1))
    kwargs: dict[str, Any] = dict(zip(SDPA_REST, node.args[len(SDPA_ARGS) :]))
    kwargs.update({key: val for key, val in node.kwargs.items() if key not in SDPA_ARGS})
    if mask is not None:
        kwargs["attn_mask"] = lifted[3] if len(lifted) == 4 else mask
    with graph.inserting_after(node):
        attention = graph.call_function(F.scaled_dot_product_attention, tuple(lifted[:3]), kwargs)
    fake_kwargs: dict[str, Any] = {key: _val(val) if isinstance(val, fx.Node) else val for key, val in kwargs.items()}
    with fake_mode:
        attention.meta["example_value"] = F.scaled_dot_product_attention(*(_val(t) for t in lifted[:3]), **fake_kwargs)
    out = attention
    for _ in range(4 - nd):
        with graph.inserting_after(out):
            new = graph.call_function(torch.squeeze, (out, 0))
        with fake_mode:
            new.meta["example_value"] = torch.squeeze(_val(out), 0)
        out = new
    if list(_val(out).shape) != list(_val(node).shape):
        raise AssertionError(
            f"fold_attention_batch: {node.name} gave {list(_val(out).shape)}, not {list(_val(node).shape)}"
        )
    node.replace_all_uses_with(out)
    graph.erase_node(node)
    return f"{node.name}: SDPA on {nd}-D q/k/v computed on 4, its leading dim lifted to the heads"


def fold_attention_batch(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule | None:
    changed = False
    for module in list(gm.modules()):
        if not isinstance(module, fx.GraphModule):
            continue
        folded = False
        for node in [
            n for n in module.graph.nodes if n.op == "call_function" and n.target is F.scaled_dot_product_attention
        ]:
            note = _fold(module.graph, node)
            if note is not None:
                ctx.report.notes.append(note)
                folded |= not note.endswith("left as is")
        if folded:
            module.recompile()
        changed |= folded
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
