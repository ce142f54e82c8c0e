"""Lowering the Dynamo graph to a functional aten graph with attention kept whole.

SDPA is composite: traced as is, it becomes a backend kernel
(``_scaled_dot_product_flash_attention_for_cpu``, cuDNN, ...) or, on the math
path, a chain of matmuls in which no attention is left to find.  We put a leaf
op in its place first, so every attention site reaches the SP rewrite as one node
whatever the device; the rewrite calls real SDPA on local tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from autosp.analysis.attention import SDPA_SIGNATURE, AttentionSpec
from autosp.flex_mods import call_unfunctionalized


@torch.library.custom_op("autosp::sdpa", mutates_args=())
def sdpa_leaf(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    return F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attn_mask,
        dropout_p=dropout_p,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=enable_gqa,
    )


@sdpa_leaf.register_fake
def _(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return query.new_empty((*query.shape[:-1], value.shape[-1]))


def _no_backward(ctx: Any, grad: torch.Tensor) -> None:
    raise RuntimeError("autosp::sdpa is a placeholder for lowering; the SP rewrite replaces it before autograd")


sdpa_leaf.register_autograd(_no_backward, setup_context=lambda ctx, inputs, output: None)


SDPA = AttentionSpec(
    name="sdpa",
    targets=(F.scaled_dot_product_attention,),
    layout="BHSD",
    mask="attn_mask",
    causal="is_causal",
    leaf=torch.ops.autosp.sdpa.default,
    signature=SDPA_SIGNATURE,
    pads_heads=True,
)


# FlexAttention is a higher-order op that lowering keeps as one node (its score_mod and mask_mod
# are subgraphs). Ulysses gives each rank its heads, ring its query rows, hybrid both
# (`autosp.flex_blocks` cuts the block mask to them).
FLEX = AttentionSpec(
    name="flex_attention",
    targets=tuple(t for t in (getattr(torch.ops.higher_order, "flex_attention", None),) if t is not None),
    layout="BHSD",
    variants=("ulysses", "ring", "hybrid"),
    pads_heads=True,  # the padding heads' mods see the last real head's index (``autosp.flex_blocks``)
)


def sdpa_args(args: tuple, kwargs: dict) -> dict[str, Any]:
    """SDPA's arguments by name, defaults filled in."""
    bound = dict(zip(SDPA_SIGNATURE, args))
    bound.update(kwargs)
    defaults = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}
    return {**defaults, **bound}


def insert_leaves(gm: torch.fx.GraphModule, specs: Sequence[AttentionSpec]) -> int:
    """Point attention calls at their leaf ops; return how many were replaced."""
    leaf_of = {t: s.leaf for s in specs if s.leaf is not None for t in s.targets}
    count = 0
    # Subgraphs too: attention inside ``torch.utils.checkpoint`` sits in a higher-order op's body.
    for module in gm.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        replaced = 0
        for node in module.graph.nodes:
            if node.op == "call_function" and node.target in leaf_of:
                node.target = leaf_of[node.target]
                replaced += 1
        if replaced:
            module.recompile()
            count += replaced
    return count


class _GradModeInterpreter(torch.fx.Interpreter):
    """Runs the Dynamo graph node by node, so each aten node keeps the source line of its op.

    The aten graph records ops, not grad mode: a value the program computes under ``no_grad``
    (a buffer's running statistics, a target made from the model's own output) would carry a
    gradient once AOT autograd differentiates the rewritten graph. Such values are detached as
    they are made, which is what eager autograd does to them, so the aten graph means what the
    program meant. An op that hands back one of its inputs (``x.mul_(2)``, ``x.requires_grad_()``)
    returns that very tensor in eager, which keeps its gradient, so it is left alone.
    """

    def run(self, *args: Any, **kwargs: Any) -> Any:
        # Called under ``no_grad`` as a whole (evaluation), nothing will be differentiated.
        self.training = torch.is_grad_enabled()
        return super().run(*args, **kwargs)

    def _as_eager(self, out: Any, args: tuple, kwargs: dict) -> Any:
        if not self.training or torch.is_grad_enabled():
            return out
        given = {id(t) for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        return torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t if id(t) in given else t.detach(), out)

    def call_function(self, target: Any, args: tuple, kwargs: dict) -> Any:
        if target in FLEX.targets:
            return self._as_eager(call_unfunctionalized(target, args, kwargs), args, kwargs)
        return self._as_eager(super().call_function(target, args, kwargs), args, kwargs)

    def call_method(self, target: Any, args: tuple, kwargs: dict) -> Any:
        return self._as_eager(super().call_method(target, args, kwargs), args, kwargs)

    def call_module(self, target: Any, args: tuple, kwargs: dict) -> Any:
        return self._as_eager(super().call_module(target, args, kwargs), args, kwargs)


def lower_to_aten(gm: torch.fx.GraphModule, fake_inputs: Sequence[Any], fake_mode: Any) -> torch.fx.GraphModule:
    """Trace ``gm`` into functional aten ops on fake inputs (meta ``val`` on every node).

    A graph holding ``torch.func.vmap`` (Dynamo inlines it as level increments and batched
    calls; ``associative_scan``'s generic path, HF Mamba's scan) is traced twice: functorch's
    ``functionalize`` cannot interpret those level calls inside its own level (an internal
    assert), so the first trace runs the vmaps into plain aten ops and the second functionalizes
    that graph, node by node so each keeps its source line.
    """
    from torch._dispatch.python import enable_python_dispatcher
    from torch.func import functionalize
    from torch.fx import traceback as fx_traceback

    def run(*args: Any) -> Any:
        return _GradModeInterpreter(gm).run(*args)

    with fake_mode, enable_python_dispatcher(), fx_traceback.preserve_node_meta():
        if _has_vmap(gm):
            unbatched = make_fx(run, pre_dispatch=False)(*fake_inputs)
            return make_fx(functionalize(torch.fx.Interpreter(unbatched).run, remove="mutations"), pre_dispatch=False)(
                *fake_inputs
            )
        return make_fx(functionalize(run, remove="mutations"), pre_dispatch=False)(*fake_inputs)


_LEVELS = ("_vmap_increment_nesting", "_grad_increment_nesting", "_jvp_increment_nesting")


def _has_vmap(gm: torch.fx.GraphModule) -> bool:
    """Whether Dynamo put a functorch transform (``torch.func.vmap``, or ``grad``, ``vjp``, ``jvp``, which
    it inlines as levels too) into ``gm`` or one of its subgraphs."""
    return any(
        node.op == "call_function" and getattr(node.target, "__name__", "") in _LEVELS
        for module in gm.modules()
        if isinstance(module, torch.fx.GraphModule)
        for node in module.graph.nodes
    )


def _kernel_signatures() -> dict[Any, tuple[str | None, ...]]:
    """SDPA's backend kernels and the names of their arguments (None: an argument SDPA has no use for).

    Code that Dynamo keeps as one call (``F.multi_head_attention_forward``, inside
    ``nn.MultiheadAttention`` and ``nn.TransformerEncoderLayer``) reaches the lowered graph as the
    kernel SDPA dispatched to, not as SDPA.
    """
    aten = torch.ops.aten
    table: dict[Any, tuple[str | None, ...]] = {
        aten._scaled_dot_product_flash_attention_for_cpu.default: (
            "query",
            "key",
            "value",
            "dropout_p",
            "is_causal",
            "attn_mask",
            "scale",
        ),
        aten._scaled_dot_product_attention_math.default: (
            "query",
            "key",
            "value",
            "attn_mask",
            "dropout_p",
            "is_causal",
            None,
            "scale",
            "enable_gqa",
        ),
        aten._scaled_dot_product_flash_attention.default: (
            "query",
            "key",
            "value",
            "dropout_p",
            "is_causal",
            None,
            "scale",
        ),
        aten._scaled_dot_product_efficient_attention.default: (
            "query",
            "key",
            "value",
            "attn_mask",
            None,
            "dropout_p",
            "is_causal",
            "scale",
        ),
        aten._scaled_dot_product_cudnn_attention.default: (
            "query",
            "key",
            "value",
            "attn_mask",
            None,
            "dropout_p",
            "is_causal",
            None,
            "scale",
        ),
    }
    return table


def leaves_for_kernels(gm: torch.fx.GraphModule) -> int:
    """Replace SDPA backend kernels whose only used output is the attention output by the leaf."""
    import operator

    table = _kernel_signatures()
    count = 0
    for node in list(gm.graph.nodes):
        names = table.get(node.target) if node.op == "call_function" else None
        if names is None:
            continue
        users = [u for u in node.users if not (u.target is operator.getitem and not u.users)]
        if not users or any(u.target is not operator.getitem or u.args[1] != 0 for u in users):
            continue  # the log-sum-exp or the weights are used: leave the kernel as it is
        given = {name: arg for name, arg in zip(names, node.args) if name is not None}
        given.update(node.kwargs)
        if given.get("dropout_mask") is not None:
            continue
        kwargs = {k: given[k] for k in SDPA_SIGNATURE[3:] if given.get(k) is not None}
        with gm.graph.inserting_before(node):
            leaf = gm.graph.call_function(
                torch.ops.autosp.sdpa.default, (given["query"], given["key"], given["value"]), kwargs
            )
        leaf.meta.update(node.meta)
        for u in list(node.users):
            u.replace_all_uses_with(leaf)
            gm.graph.erase_node(u)
        gm.graph.erase_node(node)
        count += 1
    if count:
        # The kernels return their output in their own strides, which the views after them rely on;
        # the leaf's output is contiguous. In a functional graph a reshape computes what a view did.
        for node in gm.graph.nodes:
            if node.op == "call_function" and node.target is torch.ops.aten.view.default:
                node.target = torch.ops.aten.reshape.default
        gm.recompile()
    return count


__all__ = ["FLEX", "SDPA", "insert_leaves", "leaves_for_kernels", "lower_to_aten", "sdpa_args", "sdpa_leaf"]
