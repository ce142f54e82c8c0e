"""Tiled logits and loss: a token-wise LM head followed by cross entropy becomes one chunked op.

On the lowered aten graph, before the SP rewrite, the pass finds

    logits = hidden @ weight.T (+ bias)            # mm / addmm, [N', V]
    ... views, slices, clones of token dims ...    # logits[:, :-1].reshape(-1, V)
    ... casts, scaling, soft-cap ...               # .float(), / cap, tanh, * cap
    loss = nll_loss_forward(log_softmax(z), target, reduction=mean|sum, ignore_index)

and replaces it by ``autosp::linear_cross_entropy`` on the hidden states put through the same
token-dim ops (they commute with a token-wise matmul), so the ``[tokens, vocab]`` logits, their
log-softmax and their gradient are never whole in memory: only one chunk of rows at a time. Under
SP the op's sharding rule runs it on the local tokens of each rank and all-reduces ``[sum, count]``
once. It does not fire when any of the logits' intermediates is used elsewhere (returned, as HF
models return ``logits``, or read by another loss term such as label smoothing or a z-loss): those
values are live anyway, and the op could not reproduce that use. Every such skip is a report note.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

from autosp.analysis.users import live_users
from autosp.context import CompileContext
from autosp.linear_cross_entropy import OP, Step, format_epilogue, loss_dtype
from autosp.lowering import lower_to_aten
from autosp.passes.manager import Pass, Stage
from autosp.torch_compat import optimization_hint

aten = torch.ops.aten

CHUNK_BYTES = 32 * 2**20  # one chunk's logits: large enough for efficient matmuls, small next to the whole
MIN_ROWS = 64
INDEX_OPS = frozenset(
    {
        aten.view.default,
        aten._unsafe_view.default,
        aten.reshape.default,
        aten.clone.default,
        aten.slice.Tensor,
        aten.alias.default,
    }
)
LOSS_NAMES = ("cross_entropy", "nll_loss")


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _hint(n: int | torch.SymInt) -> int:
    """A size for chunking decisions; a data-dependent size gets torch's optimization hint, unguarded."""
    return n if isinstance(n, int) else int(optimization_hint(n))


def _epilogue_step(node: fx.Node) -> Step | None:
    """The elementwise step ``node`` applies to the logits chain, or None if it is not one we can replay."""
    t, args, kwargs = node.target, node.args, node.kwargs
    if t is aten._to_copy.default and set(kwargs) <= {"dtype"} and len(args) == 1 and "dtype" in kwargs:
        return ("to", kwargs["dtype"])
    if t in (aten.mul.Tensor, aten.div.Tensor) and not kwargs and len(args) == 2:
        if isinstance(args[1], (int, float)) and not isinstance(args[1], bool):
            return ("mul" if t is aten.mul.Tensor else "div", float(args[1]))
    if t is aten.tanh.default and len(args) == 1:
        return ("tanh", None)
    return None


class _Match:
    """One LM head + loss: the nodes it replaces and what the op needs."""

    def __init__(self, nll: fx.Node, mm: fx.Node, chain: list[fx.Node], steps: list[Step]) -> None:
        self.nll, self.mm, self.chain, self.steps = nll, mm, chain, steps

    @property
    def lsm(self) -> fx.Node:
        return self.nll.args[0]

    @property
    def vocab(self) -> int:
        return _val(self.lsm).shape[-1]


def _match(nll: fx.Node) -> _Match | str:
    """The pattern ending at ``nll``, or why it is left as is."""
    lsm, target, weight, reduction, _ignore = nll.args
    if weight is not None:
        return "a class-weighted loss"
    if reduction not in (1, 2):
        return "a per-token loss (reduction='none')"
    if not isinstance(lsm, fx.Node) or lsm.target is not aten._log_softmax.default:
        return "its input is not a log-softmax"
    z, dim, half_to_float = lsm.args
    if half_to_float or _val(z).dim() != 2 or dim not in (1, -1) or _val(target).dim() != 1:
        return "not a [tokens, vocab] loss"
    if live_users(lsm) != [nll]:
        return "the log-probabilities are used beyond the loss (label smoothing, z-loss, an output)"
    chain: list[fx.Node] = []
    steps: list[Step] = []
    cur, nxt = z, lsm
    while True:
        if live_users(cur) != [nxt]:
            return (
                f"the logits ({cur.name}) are used elsewhere (returned or read by another op), so they are live anyway"
            )
        if cur.target in (aten.mm.default, aten.addmm.default):
            break
        step = _epilogue_step(cur)
        if step is None and cur.target not in INDEX_OPS:
            return f"the logits pass through {cur.target}, which the tiled op cannot replay"
        if step is not None:
            steps.append(step)
        chain.append(cur)
        cur, nxt = cur.args[0], cur
        if not isinstance(cur, fx.Node):
            return "the logits do not come from a matmul"
    if cur.target is aten.addmm.default and cur.kwargs:
        return "an addmm with beta/alpha"
    if cur.target is aten.addmm.default and _val(cur.args[0]).dim() == 2 and _val(cur.args[0]).shape[0] != 1:
        # The tiled op adds one bias row to every chunk of tokens; this one differs per token.
        return "an addmm with a bias row per token"
    chain.reverse()
    steps.reverse()
    return _Match(nll, cur, chain, steps)


def _mirror(node: fx.Node, h: fx.Node, vocab: int, dim: int) -> tuple[Any, tuple, dict] | str:
    """The op that does to the hidden rows what ``node`` does to the logits' rows."""
    t, args = node.target, node.args
    in_val, out_val = _val(args[0]), _val(node)
    if t in (aten.view.default, aten._unsafe_view.default, aten.reshape.default):
        shape = list(args[1])
        if in_val.shape[-1] != vocab or out_val.shape[-1] != vocab or shape[-1] != vocab:
            return "a reshape that mixes the vocabulary with the tokens"
        return t, (h, [*shape[:-1], dim]), dict(node.kwargs)
    if t is aten.slice.Tensor:
        if (args[1] if len(args) > 1 else 0) % in_val.dim() == in_val.dim() - 1:
            return "a slice of the vocabulary"
        return t, (h, *args[1:]), dict(node.kwargs)
    return t, (h, *args[1:]), dict(node.kwargs)


def _rows(ctx: CompileContext, vocab: int, dtype: torch.dtype) -> int:
    chosen = ctx.options.tile_loss
    if not isinstance(chosen, bool):
        return int(chosen)
    return max(MIN_ROWS, CHUNK_BYTES // (vocab * max(dtype.itemsize, 4)))


def _rewrite(gm: fx.GraphModule, ctx: CompileContext, m: _Match) -> str:
    graph = gm.graph
    mm = m.mm
    bias, a, b_t = mm.args if mm.target is aten.addmm.default else (None, *mm.args)
    n_tokens, vocab = _hint(_val(m.lsm).shape[0]), m.vocab
    dim = _val(a).shape[-1]
    dtype = loss_dtype(_val(a).dtype, m.steps)
    rows = _rows(ctx, vocab, dtype)
    local = math.ceil(n_tokens / ctx.world)
    if local <= rows:
        return f"{local} tokens per rank fit in one chunk of {rows} rows: nothing to save"
    new: list[fx.Node] = []

    def add(target: Callable[..., Any], args: tuple, kwargs: dict | None = None) -> fx.Node:
        node = graph.call_function(target, args, kwargs or {})
        with ctx.fake_mode:
            node.meta["val"] = target(
                *pytree.tree_map_only(fx.Node, _val, args), **pytree.tree_map_only(fx.Node, _val, kwargs or {})
            )
        new.append(node)
        return node

    with graph.inserting_before(m.nll):
        weight = b_t.args[0] if b_t.target is aten.t.default else add(aten.t.default, (b_t,))
        h = a
        for node in m.chain:
            if _epilogue_step(node) is not None:
                continue
            mirrored = _mirror(node, h, vocab, dim)
            if isinstance(mirrored, str):
                for n in reversed(new):
                    graph.erase_node(n)
                return mirrored
            h = add(*mirrored)
        _, target, _, reduction, ignore_index = m.nll.args
        if _val(h).shape[0] != _val(target).shape[0]:
            for n in reversed(new):
                graph.erase_node(n)
            return "hidden rows and targets disagree"
        stats = add(OP, (h, weight, bias, target, ignore_index, format_epilogue(m.steps), rows))
        total = add(aten.select.int, (stats, 0, 0))
        count = add(aten.select.int, (stats, 0, 1))
        loss = add(aten.div.Tensor, (total, count)) if reduction == 1 else total
    for user in list(m.nll.users):
        if user.target is not operator.getitem:
            raise AssertionError(f"nll_loss_forward used by {user.target}")
        user.replace_all_uses_with(loss if user.args[1] == 0 else count)
        graph.erase_node(user)
    dead = [m.nll, m.lsm, *reversed(m.chain), mm]
    for node in dead:
        for user in list(node.users):
            if user.target is aten.detach.default and not user.users:
                graph.erase_node(user)
        graph.erase_node(node)
    if b_t.target is aten.t.default and not b_t.users:
        graph.erase_node(b_t)
    gm.recompile()
    mib = local * vocab * dtype.itemsize / 2**20
    return (
        f"tiled {mm.name} ([{n_tokens}, {dim}] x [{vocab}, {dim}]) and its cross entropy in chunks of "
        f"{rows} rows: the [{local}, {vocab}] logits per rank ({mib:.1f} MiB, and their log-softmax and "
        "gradient) are never whole"
    )


def _has_loss(gm: fx.GraphModule) -> bool:
    return any(
        n.op in ("call_function", "call_method") and any(s in str(n.target) for s in LOSS_NAMES) for n in gm.graph.nodes
    )


def has_symbolic_shapes(inputs: list[Any]) -> bool:
    return any(
        isinstance(x, torch.SymInt) or (isinstance(x, torch.Tensor) and not all(isinstance(d, int) for d in x.shape))
        for x in inputs
    )


def lowered_on_one_rank(gm: fx.GraphModule, ctx: CompileContext, name: str) -> fx.GraphModule | None:
    """``gm`` lowered to aten for a memory pass on one rank (nothing else lowers it there), or None.

    None, with a note, when lowering is not tried or fails: only a memory optimisation is lost.
    """
    if has_symbolic_shapes(ctx.fake_inputs):
        # Tracing adds guards on the symbolic length, which would make Dynamo recompile lengths
        # that the graph Dynamo made serves (under SP the graph is lowered anyway).
        ctx.report.notes.append(f"{name}: not tried on one rank with a dynamic length")
        return None
    try:
        return lower_to_aten(gm, ctx.fake_inputs, ctx.fake_mode)
    except Exception as e:  # noqa: BLE001 - the graph runs as it is
        ctx.report.notes.append(f"{name}: not tried, lowering the graph failed: {type(e).__name__}: {e}")
        return None


def tile_loss(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule | None:
    lowered: fx.GraphModule | None = gm
    if not ctx.sp:
        # Lower only when there is a loss to tile.
        lowered = lowered_on_one_rank(gm, ctx, "tile_loss") if _has_loss(gm) else None
        if lowered is None:
            return None
    tiled = False
    for nll in [n for n in lowered.graph.nodes if n.target is aten.nll_loss_forward.default]:
        found = _match(nll)
        why = found if isinstance(found, str) else _rewrite(lowered, ctx, found)
        done = why.startswith("tiled")
        tiled |= done
        ctx.report.notes.append(f"tile_loss: {why}" if done else f"tile_loss: {nll.name} not tiled: {why}")
    return lowered if tiled or ctx.sp else None


def _enabled(ctx: CompileContext) -> bool:
    return ctx.options.tile_loss is not False


TILE_LOSS = Pass(
    "autosp.tile_loss",
    Stage.GRAPH,
    tile_loss,
    after=("autosp.lower", "autosp.unrepeat_kv"),
    before=("autosp.shard",),
    applies=_enabled,
    doc="LM head + cross entropy in token chunks: the [tokens, vocab] logits are never whole",
)

__all__ = ["CHUNK_BYTES", "TILE_LOSS", "lowered_on_one_rank", "tile_loss"]
