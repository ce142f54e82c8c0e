"""``torch.compiler.nested_compile_region`` bodies inlined into the graph that calls them.

A nested compile region asks torch to trace and compile a repeated block once (the
``invoke_subgraph`` higher-order op); it does not change what the program computes. AutoSP lowers
the graph itself and rewrites each call site's values by their placements, which differ from call
to call (a first block's input sharded, a later one's gathered), so one body could not serve them
all anyway; functorch's functionalization cannot trace the op either. Inlined, the region's ops are
ordinary ops of the graph, which the sharding rules see like any other.
"""

from __future__ import annotations

import operator
from typing import cast

import torch
import torch.fx as fx

from autosp.context import CompileContext
from autosp.passes.manager import Pass, Stage

_INVOKE = getattr(torch.ops.higher_order, "invoke_subgraph", None)


def inline_regions(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule | None:
    changed = False
    for module in list(gm.modules()):
        # A region called inside a region comes up with its caller's body: inlined on the next round.
        while isinstance(module, fx.GraphModule) and _inline_in(module):
            module.recompile()
            changed = True
    return gm if changed else None


def _inline_in(module: fx.GraphModule) -> bool:
    changed = False
    for node in list(module.graph.nodes):
        if not (node.op == "call_function" and _INVOKE is not None and node.target is _INVOKE):
            continue
        if any(u.target is not operator.getitem for u in node.users) or node.args[0].op != "get_attr":
            continue  # not the form Dynamo makes: left to the lowering, which says what fails
        getter = node.args[0]
        outputs = _copy_body(module, node, getattr(module, getter.target))
        for user in list(node.users):
            user.replace_all_uses_with(outputs[user.args[1]])
            module.graph.erase_node(user)
        module.graph.erase_node(node)
        # Only the body's getter goes: dead-code elimination would also drop the graph's in-place
        # method calls whose results go unused (``buf.add_(1)``), which FX counts as pure.
        if not getter.users:
            module.graph.erase_node(getter)
        changed = True
    return changed


def _copy_body(module: fx.GraphModule, call: fx.Node, body: fx.GraphModule) -> tuple[fx.Node, ...]:
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    env: dict[fx.Node, fx.Node] = dict(zip(placeholders, cast("tuple[fx.Node, ...]", call.args[2:])))
    with module.graph.inserting_before(call):
        for n in body.graph.nodes:
            if n.op == "get_attr":  # a higher-order op's body inside the region: it moves up with it
                name = f"{call.name}_{n.target}".replace(".", "_")
                setattr(module, name, _attr(body, n.target))
                env[n] = module.graph.get_attr(name)
        out = module.graph.graph_copy(body.graph, env)
    return cast("tuple[fx.Node, ...]", tuple(out) if isinstance(out, (tuple, list)) else (out,))


def _attr(module: torch.nn.Module, target: str) -> object:
    for part in target.split("."):
        module = getattr(module, part)
    return module


INLINE_REGIONS = Pass(
    "autosp.inline_regions",
    Stage.GRAPH,
    inline_regions,
    before=("autosp.fold_attention_batch",),
    applies=lambda ctx: ctx.sp,
    doc="inline torch.compiler.nested_compile_region bodies (invoke_subgraph)",
)

__all__ = ["INLINE_REGIONS", "inline_regions"]
