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


__all__ = ["call_unfunctionalized", "restore_mod_index"]
