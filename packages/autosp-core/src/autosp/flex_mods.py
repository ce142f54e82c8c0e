"""FlexAttention's ``score_mod`` and ``mask_mod`` through AutoSP's traces, as plain ``torch.compile`` sees them.

A mod may read a tensor it captures (``bias[h, q_idx - kv_idx]``, ``doc_ids[b, q_idx]``). Flex
turns each such read into ``mod_index``, an autograd.Function whose backward scatters the
gradient into the captured tensor with an op that Flex's backward (its reference math vmaps the
mod over all pairs; Inductor's kernel adds atomically) knows how to sum over the pairs. Two of
AutoSP's traces break that:

* lowering functionalizes with ``torch.func.functionalize``, which has no rule for an
  autograd.Function ("NYI: Functionalize rule for custom_function_call"): the mods are traced as
  they are, without being functionalized again (Dynamo's are functional; one that writes in place
  is refused);
* ``make_fx`` inlines ``mod_index`` into ``aten.index``, whose own backward scatters into one new
  tensor per pair, which the vmapped backward cannot return ("can not return a BatchedTensor").
  After the SP rewrite, each ``aten.index`` in a mod becomes ``mod_index`` again, so AOT autograd
  differentiates the mods as it does for plain ``torch.compile``. Its forward is ``aten.index``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from autosp.errors import AutoSPError


def call_unfunctionalized(target: Any, args: tuple, kwargs: dict) -> Any:
    """The Flex higher-order op under ``torch.func.functionalize``, its mods not functionalized."""
    from torch._functorch.pyfunctorch import FunctionalizeInterpreter, retrieve_current_functorch_interpreter
    from torch._subclasses.functional_tensor import FunctorchFunctionalizeAPI

    for mod in tree_leaves((args, kwargs)):
        if isinstance(mod, torch.fx.GraphModule):
            _refuse_writes(mod)
    interpreter = retrieve_current_functorch_interpreter()
    if not isinstance(interpreter, FunctionalizeInterpreter):
        return target(*args, **kwargs)
    api = FunctorchFunctionalizeAPI(interpreter)
    inner: Any = api.unwrap_tensors((args, kwargs))  # type: ignore[arg-type]
    inner_args, inner_kwargs = inner
    with api.redispatch_to_next():
        out = target(*inner_args, **inner_kwargs)
    return api.wrap_tensors(out)


def _refuse_writes(mod: torch.fx.GraphModule) -> None:
    for node in mod.graph.nodes:
        target = node.target
        op_writes = isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable
        method_writes = node.op == "call_method" and str(target).endswith("_") and not str(target).startswith("_")
        if op_writes or method_writes:
            raise AutoSPError(
                f"a FlexAttention score_mod or mask_mod writes in place ({node.format_node()}): write it out of place"
            )


def refuse_computed_captures(
    gm: torch.fx.GraphModule, flex_ops: tuple, grad_enabled: bool, where: Callable[[torch.fx.Node], str]
) -> None:
    """Refuse a Flex mod that captures a tensor the compiled code computes and that requires grad.

    torch 2.13 differentiates a mod's captured tensors only when they are graph inputs (a
    parameter): for one computed in the graph (``self.bias * 2``, an activation) AOT autograd's
    backward fails ("Expected a proper Tensor but got None"), plain ``torch.compile`` too, after
    the forward ran. Said before any collective, with what to do instead.
    """
    if not grad_enabled:
        return
    for module in gm.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        for node in module.graph.nodes:
            if node.op != "call_function" or node.target not in flex_ops:
                continue
            for buffer in tree_leaves(node.args[7:]):
                value = buffer.meta.get("example_value") if isinstance(buffer, torch.fx.Node) else None
                if buffer.op in ("placeholder", "get_attr") or not isinstance(value, torch.Tensor):
                    continue
                if value.requires_grad:
                    line = where(node)
                    raise AutoSPError(
                        f"a FlexAttention score_mod or mask_mod reads {buffer.name}, a tensor computed in the compiled "
                        f"code that requires grad{f' ({line})' if line else ''}: torch 2.13 cannot differentiate "
                        "such a read under torch.compile (its backward fails, on one device too). Read the parameter "
                        "itself in the mod and compute there (score + 2 * bias[h, d] rather than capturing "
                        "bias * 2), or detach the tensor if it needs no gradient"
                    )


def restore_mod_index(gm: torch.fx.GraphModule, flex_ops: tuple) -> int:
    """``aten.index`` -> ``mod_index`` in the mods of every Flex call of ``gm``; returns how many."""
    from torch._dynamo._trace_wrapped_higher_order_op import mod_index

    mods = {
        id(m): m
        for node in gm.graph.nodes
        if node.op == "call_function" and node.target in flex_ops
        for arg in tree_leaves((node.args, node.kwargs))
        if isinstance(arg, torch.fx.Node) and arg.op == "get_attr"
        for m in [getattr(gm, str(arg.target))]
        if isinstance(m, torch.fx.GraphModule)
    }
    count = 0
    for mod in mods.values():
        reads = [n for n in mod.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.index.Tensor]
        for node in reads:
            node.target = mod_index
            count += 1
        if reads:
            mod.recompile()
    return count


__all__ = ["call_unfunctionalized", "refuse_computed_captures", "restore_mod_index"]
