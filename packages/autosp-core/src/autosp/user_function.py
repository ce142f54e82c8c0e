"""A custom ``torch.autograd.Function`` in the compiled graph, kept as one op with the user's backward.

Dynamo turns ``MyFunction.apply(...)`` into the higher-order op ``autograd_function_apply`` with
the forward and the backward as subgraphs. Lowering to aten would trace the forward's ops and
drop the backward (autograd would then differentiate the forward, which is not what a gradient
reversal or a straight-through estimator means). So, before lowering, each such call becomes
``autosp::user_function``: an opaque op that runs the forward subgraph, saves what the user's
``ctx.save_for_backward`` saved, and whose autograd formula runs the user's backward subgraph.

Its sharding rule (``autosp.sharding.rules.user_function``) runs it whole on every rank and hands
the user's backward the true gradient of its outputs, so a backward that is not linear in the
gradient (a clamp, a normalisation) stays exact.
"""

from __future__ import annotations

import hashlib
import itertools
import operator
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, cast

import torch
from torch import Tensor

from autosp.errors import AutoSPError
from autosp.token_wise_body import is_token_wise


@dataclass(frozen=True)
class Body:
    """One Function's subgraphs and how its forward's results are laid out.

    ``saved_from[i]``: where saved value ``i`` comes from: ``("arg", k)``, the forward saved its
    argument ``k`` as it is; ``("out", k)``, its result ``k``; ``None``, an intermediate, which the op
    returns as an extra output after the results, in order.
    """

    fwd: torch.fx.GraphModule
    bwd: torch.fx.GraphModule
    n_out: int
    tuple_out: bool
    saved_from: tuple[tuple[str, int] | None, ...]
    non_differentiable: frozenset[int]
    draws: tuple[str, ...] = ()  # the random ops its forward runs (aten names)
    token_wise: bool = False  # elementwise forward and backward over inputs of one shape (autosp.token_wise_body)
    what: str = "a custom torch.autograd.Function"  # for the report (autosp.tensor_hooks keeps hooks as bodies)


BODIES: dict[str, Body] = {}
_unique = itertools.count()


def _run(gm: torch.fx.GraphModule, *args: Any) -> Any:
    # The subgraphs switch grad mode off and back on themselves; keep the caller's.
    with torch.set_grad_enabled(torch.is_grad_enabled()):
        return torch.fx.Interpreter(gm).run(*args)


def _forward(body: Body, args: list[Tensor]) -> tuple[list[Tensor], list[Tensor]]:
    out, saved = _run(body.fwd, *args)
    outs = list(out) if body.tuple_out else [out]
    extra = [s for s, where in zip(saved, body.saved_from) if where is None]
    return outs, extra


# Tagged as drawing random numbers, whether or not the forward draws any: no partitioner or SAC policy
# then recomputes it in the backward, which would draw a second mask for one the user's backward saved
# (and run the user's forward twice).
@torch.library.custom_op("autosp::user_function", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,))
def user_function(args: list[Tensor], key: str) -> list[Tensor]:
    outs, extra = _forward(BODIES[key], args)
    # An op's results may not alias its inputs or each other (an identity forward returns its input).
    seen = {t.untyped_storage().data_ptr() for t in args}
    fresh = []
    for t in outs + extra:
        ptr = t.untyped_storage().data_ptr()
        fresh.append(t.clone(memory_format=torch.contiguous_format) if ptr in seen else t.contiguous())
        seen.add(ptr)
    return fresh


@user_function.register_fake
def _(args, key):
    outs, extra = _forward(BODIES[key], args)
    return [t.new_empty(t.shape) for t in outs + extra]


def _setup(ctx: Any, inputs: tuple, output: list[Tensor]) -> None:
    args, key = inputs
    body = BODIES[key]
    extra = iter(output[body.n_out :])
    ctx.key = key
    ctx.n_args = len(args)
    ctx.out_meta = [(o.shape, o.dtype, o.device) for o in output[: body.n_out]]
    sources = {"arg": args, "out": output}
    ctx.save_for_backward(*[next(extra) if w is None else sources[w[0]][w[1]] for w in body.saved_from])


def _backward(ctx: Any, grads: list[Tensor | None]) -> tuple[list[Tensor | None], None]:
    body = BODIES[ctx.key]
    # Autograd hands a Function zeros for outputs that got no gradient (or are non-differentiable).
    given = [
        torch.zeros(shape, dtype=dtype, device=device) if g is None or i in body.non_differentiable else g
        for i, (g, (shape, dtype, device)) in enumerate(zip(grads, ctx.out_meta))
    ]
    out = _run(body.bwd, *given, *ctx.saved_tensors)
    out = list(out) if isinstance(out, (tuple, list)) else [out]
    return out + [None] * (ctx.n_args - len(out)), None


user_function.register_autograd(_backward, setup_context=_setup)
USER_FUNCTION = torch.ops.autosp.user_function.default


def _key(fwd: torch.fx.GraphModule, bwd: torch.fx.GraphModule, flags: dict[str, Any]) -> str:
    """Named by its code and the call's flags, so caches keyed on the graph hold a backward only for
    the same code; two Functions of the same code whose results differ in ``mark_non_differentiable``
    (a flag of the call, not in the code) get two names.

    Constants held as attributes are not in the code: such a body gets a name of its own.
    """
    text = fwd.code + "\0" + bwd.code + "\0" + repr(sorted(flags.items()))
    if any(n.op == "get_attr" for g in (fwd, bwd) for n in g.graph.nodes):
        text += f"\0{id(fwd)}:{next(_unique)}"
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def register_body(body: Body, flags: dict[str, Any]) -> str:
    """Keep ``body`` in BODIES under its name (see ``_key``); return the name the op is called with.

    Whether it is token-wise depends on the call's shapes too (one code may be called on a weight of
    another shape elsewhere), so it is part of the name.
    """
    key = _key(body.fwd, body.bwd, {**flags, "token_wise": body.token_wise})
    BODIES[key] = body
    return key


def fake_mode_of(args: list[Any]) -> Any:
    """The call's fake values' own mode: the tracing context may hold another (detect_fake_mode would pick that one)."""
    from torch._subclasses.fake_tensor import FakeTensor

    modes = {id(a.fake_mode): a.fake_mode for a in args if isinstance(a, FakeTensor)}
    if len(modes) != 1:
        raise AutoSPError("internal: a custom Function's arguments carry no single fake mode; please report this")
    return next(iter(modes.values()))


def _random_ops(fwd: torch.fx.GraphModule, args: list[Any]) -> tuple[str, ...]:
    """The random ops the forward runs, found in its aten trace on the call's fake values.

    The op is opaque to the SP program, so ``autosp.rng_check`` would not see them otherwise; every
    rank runs it whole, which matches one device only while the ranks' generators agree.
    """
    from torch.fx.experimental.proxy_tensor import make_fx

    with fake_mode_of(args):
        traced = make_fx(lambda *a: _run(fwd, *a))(*args)
    return tuple(
        n.target.name()
        for n in traced.graph.nodes
        if isinstance(n.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in n.target.tags
    )


def _body(owner: torch.fx.GraphModule, node: torch.fx.Node) -> Body:
    fwd, bwd = (getattr(owner, str(n.target)) for n in node.args[:2] if isinstance(n, torch.fx.Node))
    placeholders = [n for n in fwd.graph.nodes if n.op == "placeholder"]
    out, saved = next(n for n in fwd.graph.nodes if n.op == "output").args[0]
    tuple_out = isinstance(out, (tuple, list))
    results = list(out) if tuple_out else [out]
    # Saved as they are, arguments and results are not returned twice (an output's copy costs memory).
    index = {r: ("out", i) for i, r in enumerate(results)} | {p: ("arg", i) for i, p in enumerate(placeholders)}
    examples = [a.meta.get("example_value") for a in node.args[2:] if isinstance(a, torch.fx.Node)]
    body = Body(
        fwd=fwd,
        bwd=bwd,
        n_out=len(out) if tuple_out else 1,
        tuple_out=tuple_out,
        saved_from=tuple(index.get(s) for s in saved),
        non_differentiable=frozenset(cast(Sequence[int], node.kwargs.get("non_differentiable_idx") or ())),
        draws=_random_ops(fwd, examples),
    )
    return replace(body, token_wise=not body.draws and token_wise(body, examples))


def token_wise(body: Body, examples: list[Any]) -> bool:
    """Whether ``body`` run on each rank's positions computes its part of the whole (autosp.token_wise_body)."""

    if not examples or not all(isinstance(e, Tensor) for e in examples):
        return False

    def run_fwd(*args: Tensor) -> tuple[list[Tensor], list[Tensor]]:
        out, saved = _run(body.fwd, *args)
        return (list(out) if body.tuple_out else [out]), list(saved)

    return is_token_wise(run_fwd, lambda *a: _run(body.bwd, *a), examples, fake_mode_of(examples))


def _why_not(node: torch.fx.Node) -> str | None:
    if node.kwargs.get("dirty_idx"):
        return "it modifies an input in place (ctx.mark_dirty)"
    for a in node.args[2:]:
        if not (isinstance(a, torch.fx.Node) and isinstance(a.meta.get("example_value"), Tensor)):
            return "an argument that is not a tensor reaches it as a graph value (a symbolic size?)"
    return None


def is_function_call(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is getattr(
        torch.ops.higher_order, "autograd_function_apply", None
    )


def keep_user_functions(gm: torch.fx.GraphModule, where: Any = None) -> int:
    """Replace every custom Function call in ``gm`` (and its subgraphs) by ``autosp::user_function``.

    ``where(node)`` names the user's line for an error. Returns how many calls were replaced.
    """
    count = 0
    for module in list(gm.modules()):
        if not isinstance(module, torch.fx.GraphModule):
            continue
        graph = module.graph
        calls = [n for n in graph.nodes if is_function_call(n)]
        for node in calls:  # all refusals before any change
            why = _why_not(node)
            if why is not None:
                line = where(node) if where else None
                raise AutoSPError(
                    f"a custom torch.autograd.Function is not supported with sp_size > 1 when {why}"
                    + (f" ({line})" if line else "")
                    + ". Call it from a function decorated with @torch.compiler.disable: a graph break, which "
                    "AutoSP keeps exact (the values crossing it are gathered whole), or compile with sp_size=1"
                )
        for node in calls:
            body = _body(module, node)
            key = register_body(body, dict(node.kwargs))
            with graph.inserting_before(node):
                call = graph.call_function(USER_FUNCTION, (list(node.args[2:]), key))
            call.meta.update({k: v for k, v in node.meta.items() if k != "example_value"})
            value = node.meta.get("example_value")
            values = list(value) if body.tuple_out and value is not None else [value] * body.n_out
            results: list[torch.fx.Node] = []
            for i in range(body.n_out):
                with graph.inserting_after(call if not results else results[-1]):
                    r = graph.call_function(pick_result, (call, i, i in body.non_differentiable))
                r.meta.update(call.meta)
                r.meta["example_value"] = values[i]
                results.append(r)
            if body.tuple_out:
                for user in list(node.users):
                    if user.target is not operator.getitem:
                        raise AutoSPError(f"internal: {node.name}'s results are read by {user.target}, not by index")
                    user.replace_all_uses_with(results[user.args[1]])
                    graph.erase_node(user)
            else:
                node.replace_all_uses_with(results[0])
            bodies = node.args[:2]
            graph.erase_node(node)
            for attr in bodies:
                # The subgraphs now live in BODIES only: later passes that walk submodules (attention
                # leaves) must not rewrite the user's forward.
                if not attr.users:
                    graph.erase_node(attr)
                    delattr(module, attr.target)
            count += 1
        if calls:
            module.recompile()
    return count


def pick_result(results: list[Tensor], i: int, non_differentiable: bool) -> Tensor:
    # What ctx.mark_non_differentiable means: no gradient flows back through that result.
    return results[i].detach() if non_differentiable else results[i]


__all__ = [
    "BODIES",
    "USER_FUNCTION",
    "Body",
    "is_function_call",
    "keep_user_functions",
    "pick_result",
    "register_body",
    "token_wise",
    "user_function",
]
