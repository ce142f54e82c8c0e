"""Gradient hooks on the program's values (``Tensor.register_hook`` inside the compiled code).

Dynamo records ``y.register_hook(fn)`` as the higher-order op ``register_hook(y, body, *captured)``,
whose body is ``fn`` traced. On one device the hook fires once, on ``y``'s whole gradient summed
over every use of ``y`` (uses before the registration too), and what it returns replaces that
gradient. Lowering to aten cannot trace it (the fake values need no gradient), and run on a rank's
shard a hook that is not token-wise (``g / g.norm()``) would compute something else.

So each hooked value becomes a chain of ``autosp::user_function`` identities, one per hook, whose
backward is the hook's body: the custom-Function rule runs them whole on every rank and hands each
the true gradient, so any hook keeps its meaning; a hook found elementwise (``g * 2``,
``g.clamp``; see ``autosp.token_wise_body``) runs on each rank's positions instead. Every use of
the value reads the chain's end, the last-registered hook nearest the value, so the backward
applies them in registration order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from autosp.errors import AutoSPError
from autosp.user_function import USER_FUNCTION, Body, pick_result, register_body, token_wise


def is_hook(node: torch.fx.Node) -> bool:
    # Dynamo imports the op when it first traces a hook (torch.ops.higher_order has it from then on).
    return (
        node.op == "call_function"
        and isinstance(node.target, torch._ops.HigherOrderOperator)
        and node.target.name() == "register_hook"
    )


def _identity(n_captured: int) -> torch.fx.GraphModule:
    """The forward: the value as it is, its hook's captured values saved for the backward."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    captured = [graph.placeholder(f"captured{i}") for i in range(n_captured)]
    graph.output((x, tuple(captured)))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def _backward(hook: torch.fx.GraphModule, n_captured: int) -> torch.fx.GraphModule:
    """The hook's body inlined; a hook that returns nothing leaves the gradient as it was."""
    graph = torch.fx.Graph()
    grad = graph.placeholder("grad")
    captured = [graph.placeholder(f"captured{i}") for i in range(n_captured)]
    inputs = [n for n in hook.graph.nodes if n.op == "placeholder"]
    if len(inputs) != 1 + n_captured:
        raise AutoSPError(f"internal: a gradient hook's body takes {len(inputs)} values, not {1 + n_captured}")
    result = graph.graph_copy(hook.graph, dict(zip(inputs, [grad, *captured])))
    graph.output(grad if result is None else result)
    # Rooted at the body, so constants it reads as attributes resolve.
    return torch.fx.GraphModule(hook, graph)


def _hooked_values(graph: torch.fx.Graph) -> dict[torch.fx.Node, list[torch.fx.Node]]:
    """Each hooked value and its hooks in registration order (a hook on a hook's result is on the value)."""
    chains: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for node in graph.nodes:
        if is_hook(node):
            root = node.args[0]
            while isinstance(root, torch.fx.Node) and is_hook(root):
                root = root.args[0]
            assert isinstance(root, torch.fx.Node)
            chains.setdefault(root, []).append(node)
    return chains


def _gradient_flow(graph: torch.fx.Graph) -> dict[torch.fx.Node, bool]:
    """Whether each node's value can carry a gradient back to its inputs: it needs one itself, and
    some use of it reaches the graph's outputs through values that need one (Dynamo's example
    values say; a node without one, or with a tuple, is taken to, so a refusal errs safe)."""
    flows: dict[torch.fx.Node, bool] = {}
    for node in reversed(graph.nodes):  # every use of a node comes after it
        if node.op == "output":
            flows[node] = True
            continue
        value = node.meta.get("example_value")
        needs = value.requires_grad if isinstance(value, torch.Tensor) else True
        flows[node] = needs and any(flows[u] for u in node.users)
    return flows


def _refuse(why: str, line: str | None) -> AutoSPError:
    return AutoSPError(
        f"a gradient hook (Tensor.register_hook) in the compiled code cannot be kept with sp_size > 1: {why}"
        + (f" ({line})" if line else "")
        + ". Register it outside the compiled code, or call the code that registers it from a function "
        "decorated with @torch.compiler.disable (a graph break, which AutoSP keeps exact)"
    )


def _chain(
    module: torch.fx.GraphModule, value: torch.fx.Node, hooks: list[torch.fx.Node], at: torch.fx.Node
) -> torch.fx.Node:
    """Insert the identities after ``at``, the last-registered hook nearest ``value``; return the end."""
    graph, end = module.graph, value
    for h in reversed(hooks):
        n_captured = len(h.args) - 2
        body = Body(
            fwd=_identity(n_captured),
            bwd=_backward(getattr(module, str(h.args[1].target)), n_captured),
            n_out=1,
            tuple_out=False,
            saved_from=tuple(("arg", 1 + i) for i in range(n_captured)),
            non_differentiable=frozenset(),
            what="a gradient hook (Tensor.register_hook)",
        )
        examples = [n.meta.get("example_value") if isinstance(n, torch.fx.Node) else n for n in (value, *h.args[2:])]
        body = replace(body, token_wise=token_wise(body, examples))
        key = register_body(body, {"register_hook": True})
        with graph.inserting_after(at if end is value else end):
            call = graph.call_function(USER_FUNCTION, ([end, *h.args[2:]], key))
        with graph.inserting_after(call):
            picked = graph.call_function(pick_result, (call, 0, False))
        for n in (call, picked):
            n.meta.update({k: v for k, v in h.meta.items() if k != "example_value"})
        picked.meta["example_value"] = value.meta.get("example_value")
        end = picked
    return end


def keep_tensor_hooks(gm: torch.fx.GraphModule, where: Callable[[torch.fx.Node], str | None] | None = None) -> int:
    """Turn every ``register_hook`` in ``gm`` (and its subgraphs) into identities with the hook as backward.

    ``where(node)`` names the user's line for an error. Returns how many hooks were replaced.
    """
    count = 0
    for module in list(gm.modules()):
        if not isinstance(module, torch.fx.GraphModule):
            continue
        graph = module.graph
        chains = _hooked_values(graph)
        if not chains:
            continue
        order = {n: i for i, n in enumerate(graph.nodes)}
        flows = _gradient_flow(graph)
        plans = []
        for value, hooks in chains.items():  # all refusals before any change
            captured: list[torch.fx.Node] = []
            for h in hooks:
                for a in h.args[2:]:
                    if not (isinstance(a, torch.fx.Node) and isinstance(a.meta.get("example_value"), torch.Tensor)):
                        raise _refuse("it captures a value that is not a tensor", where(h) if where else None)
                    captured.append(a)
            # The chain goes where the value and everything the hooks captured exist; every use of
            # the value must come after that, to read the chain.
            at = max([value, *captured], key=order.__getitem__)
            # A read before that point (of the value, or of a hook's result) whose result carries no
            # gradient back (the hook's captured scale, computed from the value and detached) keeps
            # reading the value itself.
            reads = [(u, n) for n in (value, *hooks) for u in n.users if not is_hook(u)]
            if any(order[u] <= order[at] and flows[u] for u, _ in reads):
                raise _refuse(
                    "the hooked value is read, with a gradient, before a tensor its hook captures is computed",
                    where(hooks[0]) if where else None,
                )
            plans.append((value, hooks, at, reads))
        for value, hooks, at, reads in plans:
            end = _chain(module, value, hooks, at)
            for user, read in reads:
                user.replace_input_with(read, end if order[user] > order[at] else value)
            for h in reversed(hooks):
                attr = h.args[1]
                graph.erase_node(h)
                if isinstance(attr, torch.fx.Node) and not attr.users:
                    graph.erase_node(attr)
                    delattr(module, str(attr.target))
                count += 1
        module.recompile()
    return count


__all__ = ["is_hook", "keep_tensor_hooks"]
