"""The SP rewrite: run the lowered graph on this rank's pieces, tracing what runs.

Each node is evaluated by its sharding rule on ``SPValue``s under make_fx, so
the resulting graph holds exactly the local computation plus the collectives
and slices that the changes of placement need.  Graph inputs arrive whole on
every rank (the user's contract) and start replicated; sharding begins where a
token-wise op (embedding, matmul) first meets the sequence axis.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import has_free_unbacked_symbols
from torch.utils import _pytree as pytree

from autosp.analysis.constants import constants, fake_constants
from autosp.analysis.source import user_line
from autosp.errors import AutoSPError
from autosp.sharding import collectives as C
from autosp.sharding.context import SPContext, SPValue
from autosp.sharding.dims import guess_seq_dim
from autosp.sharding.placement import HeadShard, Partial, Replicate, SeqAxis, Shard, chunk_ranges
from autosp.sharding.redistribute import gather, to_replicate, to_shard
from autosp.sharding.rules import all_replicated, elementwise_rule, fallback, is_elementwise, replicated, values
from autosp.sharding.rules.base import Rule, accepted


def _input_value(node: torch.fx.Node, x: Any, ctx: SPContext, is_param: bool) -> Any:
    if not isinstance(x, torch.Tensor):
        return x
    dim = None if is_param else guess_seq_dim(x.shape, ctx.seq_len)
    axis = SeqAxis(dim, ctx.seq_len) if dim is not None else None
    return SPValue(x, Replicate(axis), node.meta.get("val", x))


def normalize_inputs(ctx: SPContext, node: torch.fx.Node, fn: Rule, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Whole values for the placements ``fn`` did not declare it handles.

    A ``Partial`` input is all-reduced (exact, and not a fallback: a partial sum must become
    whole before anything nonlinear); a ``HeadShard`` input is gathered and reported.
    """
    ok = accepted(fn)

    def fix(v: Any) -> Any:
        if not isinstance(v, SPValue):
            return v
        if isinstance(v.placement, Partial) and Partial not in ok:
            return to_replicate(ctx, v)
        if isinstance(v.placement, HeadShard) and HeadShard not in ok:
            return to_replicate(ctx, v, f"{node.name} ({node.target}): head-sharded input gathered")
        return v

    return pytree.tree_map(fix, (args, kwargs), is_leaf=lambda x: isinstance(x, SPValue))


def _aliases(n: torch.fx.Node) -> list[torch.fx.Node]:
    """``n`` and the values it is a view of: a write into ``n`` changes all of them."""
    chain = [n]
    while isinstance(n.target, torch._ops.OpOverload) and n.args and isinstance(n.args[0], torch.fx.Node):
        returns = n.target._schema.returns
        if not returns or returns[0].alias_info is None or returns[0].alias_info.is_write:
            break
        n = n.args[0]
        chain.append(n)
    return chain


def written_and_read_later(node: torch.fx.Node, order: dict[torch.fx.Node, int]) -> list[torch.fx.Node]:
    """The arguments an in-place op writes into that some later node reads (itself or through a view)."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or not target._schema.is_mutable:
        return []
    schema_args = target._schema.arguments
    written = []
    for i, arg in enumerate(node.args):
        info = schema_args[i].alias_info if i < len(schema_args) else None
        if info is not None and info.is_write and isinstance(arg, torch.fx.Node):
            chain = _aliases(arg)
            if any(u is not node and order[u] > order[node] for a in chain for u in a.users):
                written.append(arg)
    return written


def _is_view(n: torch.fx.Node) -> bool:
    if not isinstance(n.target, torch._ops.OpOverload):
        return False
    returns = n.target._schema.returns
    return bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write


def _writes_through(node: torch.fx.Node, chain: list[torch.fx.Node], env: dict, order: dict) -> bool:
    """Whether a write into ``chain[0]``, a view of whole values, reaches every later reader here too.

    So it does when every value of the chain is whole on every rank and each local tensor is a view
    of the next one's (the rules ran the view ops on the local tensors), and no other view of them,
    made before the write and read after it, could be a copy (a rank's pieces put together). Decompositions
    write so: ``F.pad(mode="circular")`` fills slices of a new tensor.
    """
    vals = [env[n] for n in chain]
    if not all(isinstance(v, SPValue) and isinstance(v.placement, Replicate) for v in vals):
        return False
    is_alias_of = torch._C._is_alias_of  # type: ignore[attr-defined]
    if not all(is_alias_of(a.local, b.local) for a, b in zip(vals, vals[1:])):
        return False
    siblings = [u for a in chain for u in a.users if u not in chain and order[u] < order[node] and _is_view(u)]
    return not any(order[w] > order[node] for u in siblings for w in u.users)


def evaluate_in_place(
    ctx: SPContext,
    node: torch.fx.Node,
    args: tuple,
    kwargs: dict,
    written: list[torch.fx.Node],
    env: dict,
    order: dict[torch.fx.Node, int],
) -> Any:
    """An in-place op (lowering leaves some, from decompositions) whose write later nodes read.

    A rule would write into this rank's pieces or a gathered copy, not into the value the later
    readers get. A whole (``Replicate``) value that is no view is the very tensor they read, so
    the op runs whole on it (``fallback``) and the write reaches them, as does a write into a view
    of whole values that shares their storage here (``_writes_through``); anything else is refused.
    """
    for arg in written:
        v = env[arg]
        chain = _aliases(arg)
        if len(chain) > 1 and _writes_through(node, chain, env, order):
            continue
        if len(chain) > 1 or (isinstance(v, SPValue) and not isinstance(v.placement, Replicate)):
            where = "a view" if len(_aliases(arg)) > 1 else f"{v.placement} (not whole on every rank)"
            line = user_line(node)
            raise AutoSPError(
                f"{node.name} ({node.target}) writes in place into {arg.name}, {where}, which later nodes read"
                + (f" ({line})" if line else "")
                + ": the write would reach only this rank's copy. Write the update out of place "
                "(x = x.masked_fill(m, 0) instead of x.masked_fill_(m, 0), torch.cat of the pieces instead of "
                "writes into slices); a write inside a torch function at that line is its decomposition's"
            )
    return fallback(ctx, node, args, kwargs)


def _data_dependent(val: Any) -> bool:
    shapes = [t.shape for t in pytree.tree_leaves(val) if isinstance(t, torch.Tensor)]
    return any(has_free_unbacked_symbols(shape) for shape in shapes)


def evaluate(ctx: SPContext, node: torch.fx.Node, args: tuple, kwargs: dict) -> Any:
    """This rank's value of ``node``: the attention rule at attention sites, else the op's sharding rule."""
    if node.target is operator.getitem:
        return operator.getitem(args[0], args[1])
    site = ctx.sites.get(node.name)
    if site is not None:
        return ctx.attention_rule(ctx, node, site, args, kwargs)
    if "val" not in node.meta:
        return fallback(ctx, node, args, kwargs) if values((args, kwargs)) else node.target(*args, **kwargs)
    if _data_dependent(node.meta["val"]):
        # A size that depends on the data (boolean indexing, nonzero: BART pools its last <eos> so)
        # exists in the lowering's trace only, and rules read sizes from ``meta["val"]``. Run whole,
        # from the arguments of this trace.
        return fallback(ctx, node, args, kwargs) if values((args, kwargs)) else node.target(*args, **kwargs)
    fn = ctx.rules.get(node.target)
    if fn is None and is_elementwise(node.target):
        fn = elementwise_rule
    if fn is not None:
        args, kwargs = normalize_inputs(ctx, node, fn, args, kwargs)
        return fn(ctx, node, args, kwargs)
    if all_replicated((args, kwargs)):
        return replicated(ctx, node, args, kwargs)
    return fallback(ctx, node, args, kwargs)


def finish(ctx: SPContext, v: Any, may_need_grad: bool = True) -> Any:
    """Whole outputs on every rank, with backward formulas for a gradient that arrives whole.

    ``may_need_grad=False``: no input the output depends on requires grad, so a whole output is
    returned as the very tensor the graph computed (an input returned as it is stays that object,
    as in eager: ``self.pe = self.pe.to(x.dtype)`` keeps a ``nn.Buffer`` a buffer across a graph
    break) instead of a copy made to scale a gradient that never comes.
    """
    if not isinstance(v, SPValue):
        ctx.output_shards.append(None)
        return v
    shape = [int(n) if isinstance(n, int) else str(n) for n in v.gval.shape]
    p = v.placement
    if ctx.sharded_outputs and isinstance(p, Shard) and p.axis.inner == 1:
        dim, length = p.axis.dim, p.axis.length
        # What a DTensor ``Shard(dim)`` holds: torch.chunk's contiguous pieces in rank order, for a
        # length the ranks split evenly or not (logits[:, :-1]). A symbolic length must split evenly:
        # the DTensor's global size is then each rank's piece times the ranks, whatever the call's length.
        if isinstance(length, int) or length % ctx.world == 0:
            ranges = chunk_ranges(length, ctx.world) if isinstance(length, int) else ctx.even_ranges(length)
            ctx.output_shards.append((dim, length))
            ctx.outputs.append(f"{shape} shard -> returned as this rank's piece (outputs='sharded')")
            return to_shard(ctx, v, dim, Shard(SeqAxis(dim, length), ranges))
        ctx.notes.append(
            f"an output of symbolic length {length} along the sequence is gathered whole (outputs='sharded' "
            f"returns a DTensor only where the length splits evenly over {ctx.world} ranks, or is not symbolic)"
        )
    ctx.output_shards.append(None)
    ctx.outputs.append(
        f"{shape} {type(v.placement).__name__.lower()}"
        + (" -> gathered whole" if not isinstance(v.placement, Replicate) else "")
    )
    if isinstance(v.placement, Replicate):
        if may_need_grad and (v.local.is_floating_point() or v.local.is_complex()):
            # Gradients of replicated values are kept partial: each rank takes 1/P of the incoming one.
            return C.scale_grad(v.local, 1.0 / ctx.world)
        return v.local
    return gather(ctx, v, for_output=True)


def shard_graph(
    gm: torch.fx.GraphModule,
    ctx: SPContext,
    fake_inputs: Sequence[Any],
    is_param: Sequence[bool],
    fake_mode: Any,
) -> torch.fx.GraphModule:
    """The graph this rank runs; ``gm`` is the lowered, functional aten graph."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    grad_reach = _may_need_grad(gm, placeholders, fake_inputs)

    def run(*inputs: Any) -> Any:
        ctx.outputs.clear()
        ctx.output_shards.clear()
        env: dict[torch.fx.Node, Any] = {}
        for node, x, param in zip(placeholders, inputs, is_param):
            env[node] = _input_value(node, x, ctx, param)
        for node in gm.graph.nodes:
            if node.op == "call_function":
                args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: env[n])
                written = written_and_read_later(node, order)
                if written:
                    env[node] = evaluate_in_place(ctx, node, args, kwargs, written, env, order)
                else:
                    env[node] = evaluate(ctx, node, args, kwargs)
            elif node.op == "output":

                def done(n: torch.fx.Node) -> Any:
                    grad = n in grad_reach
                    return pytree.tree_map(
                        lambda v: finish(ctx, v, grad), env[n], is_leaf=lambda x: isinstance(x, SPValue)
                    )

                return torch.fx.node.map_arg(node.args[0], done)
            elif node.op == "get_attr":
                value = getattr(gm, node.target)
                is_tensor = isinstance(value, torch.Tensor)
                env[node] = SPValue(value, Replicate(), node.meta.get("val", value)) if is_tensor else value
            elif node.op != "placeholder":
                raise NotImplementedError(f"unexpected node {node.op} in the lowered graph")
        raise AssertionError("graph has no output")

    from torch._dispatch.python import enable_python_dispatcher

    with fake_mode, enable_python_dispatcher():
        traced = make_fx(run, pre_dispatch=False)(*fake_inputs)
    refuse_traced_global_values(traced, constants(gm))
    return traced


def _may_need_grad(gm: torch.fx.GraphModule, placeholders: list[torch.fx.Node], inputs: Sequence[Any]) -> set:
    """The nodes that depend on an input or constant that requires grad: a superset of those with a gradient."""
    reach = {n for n, x in zip(placeholders, inputs) if isinstance(x, torch.Tensor) and x.requires_grad}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = getattr(gm, node.target)
            if isinstance(value, torch.Tensor) and value.requires_grad:
                reach.add(node)
        elif node.op == "call_function" and any(a in reach for a in node.all_input_nodes):
            reach.add(node)
    return reach


def refuse_traced_global_values(traced: torch.fx.GraphModule, known: Sequence[Any] = ()) -> None:
    """A rule ran an op on a global value under the trace: refuse the program it would leave.

    A rule makes new global values with ``context.global_like`` instead (see the README).
    ``known``: the constants of the graph that was traced (fake ones too, when compiling on fake
    parameters).
    """
    leaked = fake_constants(traced, known)
    if leaked:
        raise AutoSPError(
            f"internal: the sharded graph holds fake tensors {'; '.join(leaked)}: a sharding rule ran an op on a "
            "global value while tracing; make it with autosp.sharding.context.global_like. "
            "Please report this with the program."
        )


__all__ = [
    "evaluate",
    "evaluate_in_place",
    "finish",
    "refuse_traced_global_values",
    "shard_graph",
    "written_and_read_later",
]
