"""Tiled MLPs: a token-wise MLP becomes one chunked op, so its ``[tokens, ffn]`` values are never whole.

On the lowered aten graph, before the SP rewrite, the pass finds

    z = x @ w_in.T (+ b_in)              # mm / addmm on [N, D] rows, then views of the token dims
    h = act(z)                           # silu, gelu (erf or tanh), relu
      or act(x @ w_gate.T) * z           # gated (Llama's SwiGLU, GeGLU), either operand order
    out = h @ w_out.T (+ b_out)          # views of the token dims back to [N, F] rows first

and replaces it by ``autosp::tiled_mlp`` on ``x``, which computes (and in the backward recomputes
and differentiates) one chunk of rows at a time. Under SP the op's rule runs it on each rank's
tokens. It fires only where every intermediate is read by the MLP alone: a value used elsewhere
(returned, or read by an auxiliary loss) is live anyway and the op could not give it. Each MLP
tiled or left is a report note.

On by default with ``sac=True`` only (``tile_mlp="auto"``): the backward recomputes the first
matmuls, which SAC on does anyway; with SAC off that is a third more MLP FLOPs, in exchange for
the MLP's share of the activation peak.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import fx

from autosp.analysis.users import live_users
from autosp.context import CompileContext
from autosp.passes.manager import Pass, Stage
from autosp.passes.tile_loss import _hint, _val, lowered_on_one_rank  # the same graph helpers
from autosp.tiled_mlp import OP

aten = torch.ops.aten

CHUNK_BYTES = 4 * 2**20  # one chunk's [rows, ffn] values: large enough for efficient matmuls
MIN_ROWS = 64
VIEWS = frozenset({aten.view.default, aten._unsafe_view.default, aten.reshape.default})


def _only_user(node: fx.Node, user: fx.Node) -> bool:
    return live_users(node) == [user]


def _activation(node: fx.Node) -> str | None:
    if node.target is aten.silu.default and len(node.args) == 1:
        return "silu"
    if node.target is aten.relu.default and len(node.args) == 1:
        return "relu"
    if node.target is aten.gelu.default and len(node.args) == 1:
        approximate = str(node.kwargs.get("approximate", "none"))
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(approximate)
    return None


class _Chain:
    """Views from a matmul's ``[N, F]`` rows to an elementwise value and back: token dims only."""

    def __init__(self) -> None:
        self.nodes: list[fx.Node] = []

    def down_to_rows(self, node: Any, user: fx.Node, features: int) -> Any:
        """Walk from ``node`` (read by ``user``) back through views of its token dims."""
        while isinstance(node, fx.Node) and node.target in VIEWS:
            if not _only_user(node, user) or _val(node).shape[-1] != features:
                return None
            if _val(node.args[0]).shape[-1] != features:
                return None
            self.nodes.append(node)
            node, user = node.args[0], node
        if not isinstance(node, fx.Node) or not _only_user(node, user):
            return None
        return node


def _linear(node: Any) -> tuple[Any, Any, Any] | None:
    """``(x, weight, bias)`` of ``x @ weight.T (+ bias)`` as lowering writes ``F.linear`` on rows."""
    if not isinstance(node, fx.Node) or node.kwargs:
        return None
    if node.target is aten.mm.default:
        bias, (x, wt) = None, node.args
    elif node.target is aten.addmm.default and len(node.args) == 3:
        bias, x, wt = node.args
        if _val(bias).dim() != 1:
            return None
    else:
        return None
    if not isinstance(wt, fx.Node) or wt.target is not aten.t.default or len(wt.users) != 1:
        return None
    if _val(x).dim() != 2:
        return None
    return x, wt.args[0], bias


class _Match:
    def __init__(self, out_mm: fx.Node) -> None:
        self.out_mm = out_mm
        self.dead: list[fx.Node] = [out_mm]
        self.erased: set[fx.Node] = set()
        self.x: fx.Node | None = None
        self.args: tuple = ()
        self.act = ""


def _same_rows(a: fx.Node, b: fx.Node) -> bool:
    """The two matmuls read the same rows: one node, or equal views of one node."""
    if a is b:
        return True
    return (
        a.target in VIEWS
        and b.target in VIEWS
        and a.args[0] is b.args[0]
        and list(_val(a).shape) == list(_val(b).shape)
    )


def _match(out_mm: fx.Node) -> _Match | str | None:
    """The MLP ending at ``out_mm``, why it is left as is, or None when ``out_mm`` ends no MLP."""
    found = _linear(out_mm)
    if found is None:
        return None
    h2d, w_out, b_out = found
    features = _val(h2d).shape[-1]
    m = _Match(out_mm)
    chain = _Chain()
    h = chain.down_to_rows(h2d, out_mm, features)
    if h is None:
        top: Any = h2d
        while isinstance(top, fx.Node) and top.target in VIEWS:
            top = top.args[0]
        gated = isinstance(top, fx.Node) and top.target is aten.mul.Tensor
        if isinstance(top, fx.Node) and (
            _activation(top) is not None
            or (gated and any(isinstance(a, fx.Node) and _activation(a) is not None for a in top.args))
        ):
            return "its hidden values are read elsewhere (returned, or by another loss term), so they are live anyway"
        return None
    act = _activation(h)
    if act is not None:
        z, w_gate = h.args[0], None
        branches = [(z, h)]
        first: list[Any] = [h]
    elif h.target is aten.mul.Tensor and len(h.args) == 2 and all(isinstance(a, fx.Node) for a in h.args):
        acts = [a for a in h.args if _activation(a) is not None]
        if len(acts) != 1 or h.args[0] is h.args[1]:
            return None
        a_node = acts[0]
        act = _activation(a_node)
        up = h.args[1] if h.args[0] is a_node else h.args[0]
        branches = [(a_node.args[0], a_node), (up, h)]
        first = [h, a_node]
        if not _only_user(a_node, h):
            return f"its activation ({a_node.name}) is read elsewhere"
    else:
        return None
    if list(_val(h).shape) != list(_val(h.args[0]).shape) or (
        h.target is aten.mul.Tensor and list(_val(h.args[0]).shape) != list(_val(h.args[1]).shape)
    ):
        return "its elementwise step broadcasts"
    linears = []
    for value, reader in branches:
        mm = chain.down_to_rows(value, reader, features)
        lin = _linear(mm)
        if lin is None:
            return f"{value.name} does not come from a token-wise matmul of the MLP's input alone"
        linears.append((mm, lin))
        chain.nodes.append(mm)
    rows_a = linears[0][1][0]
    if len(linears) == 2 and not _same_rows(rows_a, linears[1][1][0]):
        return "its two matmuls read different rows"
    if _val(rows_a).shape[0] != _val(h2d).shape[0]:
        return "its rows change between the matmuls"
    if len(linears) == 2:
        (_, (_, w_gate, gate_bias)), (_, (_, w_in, b_in)) = linears
        if gate_bias is not None or b_in is not None:
            return "a gated MLP with biases on its first matmuls"
    else:
        w_gate = None
        (_, (_, w_in, b_in)) = linears[0]
    m.dead += [*chain.nodes, *first]
    assert act is not None
    m.x, m.act = rows_a, act
    m.args = (w_in, b_in, w_gate, w_out, b_out)
    return m


def _rows(ctx: CompileContext, features: int, dtype: torch.dtype) -> int:
    chosen = ctx.options.tile_mlp
    if isinstance(chosen, int) and not isinstance(chosen, bool):
        return chosen
    return max(MIN_ROWS, CHUNK_BYTES // (features * dtype.itemsize))


def _rewrite(gm: fx.GraphModule, ctx: CompileContext, m: _Match) -> str:
    assert m.x is not None
    x_val, out_val = _val(m.x), _val(m.out_mm)
    n_tokens, dim = _hint(x_val.shape[0]), x_val.shape[1]
    features = _val(m.args[0]).shape[0]
    rows = _rows(ctx, features, x_val.dtype)
    local = math.ceil(n_tokens / ctx.world)
    if local <= rows:
        return f"{m.out_mm.name} not tiled: its {local} rows per rank (its rows over the SP ranks) fit in one chunk of {rows}"
    graph = gm.graph
    with graph.inserting_before(m.out_mm):
        node = graph.call_function(OP, (m.x, *m.args, m.act, rows))
    with ctx.fake_mode:
        node.meta["val"] = OP(x_val, *(_val(a) if isinstance(a, fx.Node) else a for a in m.args), m.act, rows)
    if list(node.meta["val"].shape) != list(out_val.shape):
        graph.erase_node(node)
        return f"{m.out_mm.name} not tiled: the op's shape {list(node.meta['val'].shape)} is not {list(out_val.shape)}"
    m.out_mm.replace_all_uses_with(node)
    weights_t: list[Any] = [a for d in m.dead if d.target in (aten.mm.default, aten.addmm.default) for a in d.args[-1:]]
    position = {n: i for i, n in enumerate(graph.nodes)}
    for dead in sorted(set(m.dead), key=position.__getitem__, reverse=True):  # readers before what they read
        for user in list(dead.users):
            if user.target is aten.detach.default and not user.users:
                graph.erase_node(user)
        graph.erase_node(dead)
        m.erased.add(dead)
    for t in weights_t:
        if isinstance(t, fx.Node) and not t.users:
            graph.erase_node(t)
    mib = local * features * x_val.dtype.itemsize / 2**20
    gated = "gated " if m.args[2] is not None else ""
    return (
        f"tiled the {gated}{m.act} MLP ([{n_tokens}, {dim}] -> {features} -> {dim}) ending at {m.out_mm.name} "
        f"in chunks of {rows} rows: its [{local}, {features}] values per rank ({mib:.1f} MiB each) are never whole"
    )


def tile_mlp(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule | None:
    if not ctx.sp:
        # Nothing lowered the graph on one rank (tile_loss may have, when it tiled): lower it here.
        lowered = lowered_on_one_rank(gm, ctx, "tile_mlp")
        if lowered is None:
            return None
        gm = lowered
    tiled, erased = False, set()
    for mm in [n for n in gm.graph.nodes if n.target in (aten.mm.default, aten.addmm.default)]:
        if mm in erased:
            continue
        found = _match(mm)
        if found is None:
            continue
        if isinstance(found, _Match):
            why = _rewrite(gm, ctx, found)
            erased |= found.erased
        else:
            why = found
        if isinstance(found, str):
            why = f"{mm.name} not tiled: {why}"
        tiled |= why.startswith("tiled")
        ctx.report.notes.append(f"tile_mlp: {why}")
    if tiled:
        gm.graph.lint()
        gm.recompile()
    return gm if tiled or ctx.sp else None


def _enabled(ctx: CompileContext) -> bool:
    chosen = ctx.options.tile_mlp
    # "auto": where SAC recomputes the MLP's first matmuls in the backward anyway, tiling costs no
    # FLOPs (measured: the same step time) and takes the MLP's values off the activation peak.
    return chosen is not False and (chosen != "auto" or ctx.options.sac is True)


TILE_MLP = Pass(
    "autosp.tile_mlp",
    Stage.GRAPH,
    tile_mlp,
    after=("autosp.lower", "autosp.unrepeat_kv", "autosp.tile_loss"),
    before=("autosp.shard",),
    applies=_enabled,
    doc="token-wise MLPs in token chunks: their [tokens, ffn] values are never whole",
)

__all__ = ["CHUNK_BYTES", "TILE_MLP", "tile_mlp"]
