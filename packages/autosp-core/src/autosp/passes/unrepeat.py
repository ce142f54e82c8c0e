"""Exchange k and v before the model repeats them to the query-head count.

Llama-style code repeats kv heads (``repeat_kv``: unsqueeze, expand, reshape)
before SDPA.  All-to-all after that moves H/Hkv times the bytes it needs to.
This pass finds the repeat feeding an attention site and hands SDPA the
un-repeated tensor with ``enable_gqa=True``, which computes the same thing;
every variant then moves Hkv heads only (Ulysses' all-to-alls, ring's blocks).
"""

from __future__ import annotations

import torch

from autosp.analysis.attention import find_attention_sites
from autosp.context import CompileContext
from autosp.lowering import SDPA
from autosp.passes.manager import Pass, Stage

aten = torch.ops.aten
_RESHAPES = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.clone.default}
_UNSQUEEZES = {aten.unsqueeze.default, aten.slice.Tensor, aten.alias.default}


def _shape(node: torch.fx.Node) -> tuple:
    return tuple(node.meta["val"].shape)


def find_repeat_base(k: torch.fx.Node) -> torch.fx.Node | None:
    """The [B, Hkv, S, D] tensor that ``k`` ([B, Hkv * n, S, D]) repeats head by head, if it does."""
    if not isinstance(k, torch.fx.Node) or "val" not in k.meta or k.meta["val"].dim() != 4:
        return None
    b, h, s, d = _shape(k)
    node = k
    while node.op == "call_function" and node.target in _RESHAPES:
        node = node.args[0]
    if node.op != "call_function" or node.target is not aten.expand.default:
        return None
    src = node.args[0]
    src_shape, out_shape = _shape(src), _shape(node)
    if len(src_shape) != 5 or src_shape[2] != 1 or out_shape != (b, src_shape[1], h // src_shape[1], s, d):
        return None
    base = src
    while base.op == "call_function" and base.target in _UNSQUEEZES and _shape(base) != (b, src_shape[1], s, d):
        if base.target is aten.slice.Tensor and _shape(base) != _shape(base.args[0]):
            return None
        base = base.args[0]
    if _shape(base) != (b, src_shape[1], s, d):
        return None
    return base


def unrepeat_kv(gm: torch.fx.GraphModule, ctx: CompileContext) -> None:
    changed = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target != SDPA.leaf:
            continue
        args = list(node.args)
        if len(args) < 3:
            continue
        k_base, v_base = find_repeat_base(args[1]), find_repeat_base(args[2])
        if k_base is None or v_base is None or _shape(k_base)[1] != _shape(v_base)[1]:
            continue
        args[1], args[2] = k_base, v_base
        kwargs = dict(node.kwargs)
        if len(args) > 7:
            args[7] = True
        else:
            kwargs["enable_gqa"] = True
        node.args, node.kwargs = tuple(args), kwargs
        changed += 1
    if changed:
        gm.graph.eliminate_dead_code()
        gm.recompile()
        ctx.report.notes.append(f"autosp.unrepeat_kv: {changed} attention site(s) exchange k/v before repeat")
        # Sites are keyed by node name and read kv heads from the graph; refresh them. Only the kept
        # ones: lowering dropped the attention no variant rewrites (cross-attention, other lengths).
        specs = [SDPA, *ctx.registry.attention.values()]
        kept = {s.name for s in ctx.sites}
        ctx.sites = [s for s in find_attention_sites(gm, specs) if s.name in kept]


UNREPEAT_KV = Pass(
    "autosp.unrepeat_kv",
    Stage.GRAPH,
    unrepeat_kv,
    requires=("autosp.lower",),
    before=("autosp.shard",),
    applies=lambda ctx: ctx.sp,
    doc="exchange k/v before the model repeats kv heads",
)

__all__ = ["UNREPEAT_KV", "find_repeat_base", "unrepeat_kv"]
