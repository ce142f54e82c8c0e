"""Attention written out by hand, found in the lowered aten graph and turned into one SDPA call.

A model that spells attention as ``softmax(q @ k^T * c + mask) @ v`` (HF's ``eager`` attention,
nanoGPT, GPT-2, research code) reaches the lowered graph as ``bmm -> view -> score ops ->
_softmax -> bmm``; BLOOM's ``alibi.baddbmm(q, k^T, beta=b, alpha=a)`` puts a bias and a scale into
the score matmul itself (``a * q @ k^T + b * alibi``).  Written that way, each rank would hold its
rows of the full score matrix and gather k and v whole: exact (the sharding rules see to that), but
no variant could do its job.

A region becomes an SDPA call only when that is the same function.  The ops between the score
matmul and the softmax must be *affine in the scores* - ``f(s) = a * s + f(0)`` with ``a`` a
positive Python number (scaling, adding a mask or bias that does not depend on the scores,
masking with a constant ``<= -1e30`` or ``-inf``) - so SDPA with ``scale=a`` and
``attn_mask=f(0)`` computes the same softmax.  ``f(0)`` is built by running those very ops on a
zero tensor, so whatever mask the model builds comes along unchanged.  Anything else (soft-capping
with ``tanh``, the probabilities used elsewhere, as with ``output_attentions``, GPT-OSS's sinks:
``softmax(cat([s, sink], -1))[..., :-1]``) is left as written and said so: the region still counts
as attention for finding the sequence, and the sharding rules keep it exact.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any

import torch

from autosp.analysis.attention import AttentionSite
from autosp.analysis.layout import ELEMENTWISE, LAYOUT, chain_between, moves_like_reshape, static
from autosp.analysis.source import user_line
from autosp.analysis.users import live_users
from autosp.lowering import SDPA as SDPA_SPEC

aten = torch.ops.aten

# What ``torch.matmul`` puts between a 4-D operand and ``bmm``: a broadcast, a copy, one flattening view.
_BROADCAST = {aten.expand.default, aten.clone.default, aten.contiguous.default}
_FLATTEN = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}
_TO_BMM = _BROADCAST | _FLATTEN
_SCALE = {aten.mul.Tensor, aten.div.Tensor}
_ADD = {aten.add.Tensor, aten.sub.Tensor}
_MASK = {
    aten.masked_fill.Scalar,
    aten.masked_fill.Tensor,
    aten.where.self,
    aten.where.ScalarOther,
    aten.where.ScalarSelf,
}
_MASKED = -1e30  # a fill at or below this weighs nothing after softmax, whatever the score
_SCORE_MM = {aten.bmm.default, aten.baddbmm.default}
# What the lowering puts between a tensor constant and its use (``torch.tensor(x)`` in the model).
_SAME_VALUE = {aten.lift_fresh_copy.default, aten.detach.default, aten.alias.default, aten.clone.default}


@dataclass
class EagerRegion:
    """One hand-written attention: the nodes that compute it and what SDPA needs to replace it."""

    q: torch.fx.Node
    k: torch.fx.Node
    v: torch.fx.Node
    output: torch.fx.Node
    softmax: torch.fx.Node
    score_ops: list[torch.fx.Node] = field(default_factory=list)  # scores -> softmax input, in order
    scale: float = 1.0
    dropout_p: float = 0.0
    weights: list[torch.fx.Node] = field(default_factory=list)  # softmax -> the weights' matmul
    why_not: str | None = None  # set when the region is left as written
    scores: torch.fx.Node | None = None  # the score matmul's 4-D view: where the score ops start
    bias: torch.fx.Node | None = None  # baddbmm's ``self``, added ``beta`` times (absent when beta is 0)
    beta: float = 1.0
    # Which of q, k, v, output are the matmuls' own [B*H, ...] operands (k as k^T [B*H, d, Sk]) and
    # not 4-D tensors of the graph (einsum's layouts); ``heads`` is (B, H) of the scores then.
    merged: frozenset[str] = frozenset()
    heads: tuple = ()

    def shape4(self, which: str) -> tuple:
        """The [B, H, len, d] shape of ``q``, ``k`` or ``v`` as SDPA takes it."""
        shp = _shape(getattr(self, which))
        if which not in self.merged:
            return shp
        return (*self.heads, shp[2], shp[1]) if which == "k" else (*self.heads, *shp[1:])

    @property
    def line(self) -> str:
        """Where the model computes it: the softmax's innermost source line outside torch."""
        return user_line(self.softmax) or self.softmax.name


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else node


def _shape(node: Any) -> tuple:
    v = _val(node)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else ()


def _only_user(node: torch.fx.Node) -> torch.fx.Node | None:
    users = live_users(node)
    return users[0] if len(users) == 1 else None


def _to_4d(node: Any) -> torch.fx.Node | None:
    """The 4-D ``[B, H, rows, cols]`` tensor that ``node``, its ``[B*H, rows, cols]`` flattening, comes from.

    Only the ops ``torch.matmul`` lowers to may sit between: a broadcast (``expand``), a copy to
    contiguous, and the one view that merges batch and heads.  Any other view means another layout.
    """
    if not isinstance(node, torch.fx.Node) or node.target not in _FLATTEN:
        return None
    src = node.args[0]
    shp, src_shp = _shape(node), _shape(src)
    if len(shp) != 3 or len(src_shp) != 4 or shp[1:] != src_shp[2:] or shp[0] != src_shp[0] * src_shp[1]:
        return None
    node = src
    while node.op == "call_function" and node.target in _BROADCAST:
        src = node.args[0]
        if len(_shape(src)) != 4 or _shape(src)[2:] != _shape(node)[2:]:
            return None
        node = src
    return node


def _untranspose(node: torch.fx.Node) -> torch.fx.Node | None:
    """``k`` from ``k.transpose(-2, -1)`` (or the equivalent permute)."""
    if node.op != "call_function":
        return None
    if node.target is aten.transpose.int:
        dims = sorted(d % 4 for d in node.args[1:3])
        return node.args[0] if dims == [2, 3] else None
    if node.target is aten.permute.default and [d % 4 for d in node.args[1]] == [0, 1, 3, 2]:
        return node.args[0]
    return None


def _operands(mm: torch.fx.Node) -> tuple[Any, Any]:
    """The two batched matrices of a score ``bmm`` or ``baddbmm``."""
    return (mm.args[1], mm.args[2]) if mm.target is aten.baddbmm.default else (mm.args[0], mm.args[1])


def _baddbmm_factors(mm: torch.fx.Node) -> tuple[float | None, float | None]:
    """(alpha, beta) of a ``baddbmm`` as Python numbers, None where either is something else."""
    alpha = mm.kwargs.get("alpha", mm.args[4] if len(mm.args) > 4 else 1)
    beta = mm.kwargs.get("beta", mm.args[3] if len(mm.args) > 3 else 1)
    return _number(alpha), _number(beta)


def _number(x: Any) -> float | None:
    """A Python number, or the constant a 0-d ``full`` holds (GPT-2 divides by one), or a 0-d tensor
    constant of the graph (``torch.tensor(float("-inf"))`` in the model: fixed when it was traced)."""
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return float(x)
    if not isinstance(x, torch.fx.Node):
        return None
    if x.target in (aten.full.default, aten.scalar_tensor.default):
        value = x.args[1] if x.target is aten.full.default else x.args[0]
        if _shape(x) == () and isinstance(value, (int, float)):
            return float(value)
    while x.target in _SAME_VALUE and isinstance(x.args[0], torch.fx.Node):
        x = x.args[0]
    if x.op == "get_attr":
        held = getattr(x.graph.owning_module, str(x.target), None)
        if isinstance(held, torch.Tensor) and held.dim() == 0 and held.is_floating_point():
            return float(held)
    return None


def _depends_on(node: Any, roots: set[torch.fx.Node]) -> bool:
    seen: set[torch.fx.Node] = set()
    stack = [node] if isinstance(node, torch.fx.Node) else []
    while stack:
        n = stack.pop()
        if n in roots:
            return True
        if n in seen:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return False


def _score_op(node: torch.fx.Node, s: torch.fx.Node, roots: set[torch.fx.Node]) -> tuple[float, str | None]:
    """(factor on the scores, reason it is not affine) for one op between the scores and softmax."""
    t = node.target
    if sum(a is s for a in (*node.args, *node.kwargs.values())) != 1:
        return 1.0, f"{node.name} ({t}) takes the scores more than once"
    others = [a for a in (*node.args, *node.kwargs.values()) if a is not s]
    if any(_depends_on(o, roots) for o in others):
        return 1.0, f"{node.name} ({t}) mixes the scores with another value computed from q, k or v"
    if t in _SCALE and node.args[0] is s:
        c = _number(node.args[1])
        if c is None or c <= 0:
            return 1.0, f"{node.name} scales the scores by something other than a positive constant"
        return (c if t is aten.mul.Tensor else 1.0 / c), None
    if t is aten.mul.Tensor and node.args[1] is s:
        c = _number(node.args[0])
        if c is None or c <= 0:
            return 1.0, f"{node.name} scales the scores by something other than a positive constant"
        return c, None
    if t in _ADD:
        if t is aten.sub.Tensor and node.args[0] is not s:
            return 1.0, f"{node.name} negates the scores"
        alpha = node.kwargs.get("alpha", node.args[2] if len(node.args) > 2 else 1)
        if node.args[1] is s and alpha != 1:
            return 1.0, f"{node.name} adds a multiple of the scores"
        return 1.0, None
    if t in _MASK:
        fill = _mask_fill(node, s)
        if fill is None or not fill <= _MASKED:
            return 1.0, f"{node.name} masks with a value that still weighs after softmax (not <= -1e30 or -inf)"
        return 1.0, None
    if t is aten._to_copy.default and set(node.kwargs) <= {"dtype"} and len(node.args) == 1:
        return 1.0, None
    return 1.0, f"{node.name} ({t}) is not affine in the scores"


def _mask_fill(node: torch.fx.Node, s: torch.fx.Node) -> float | None:
    t, args = node.target, node.args
    if t in (aten.masked_fill.Scalar, aten.masked_fill.Tensor) and args[0] is s:
        return _number(args[2])
    if t in (aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf):
        if args[1] is s:
            return _number(args[2])
        if args[2] is s:
            return _number(args[1])
    return None


def find_eager_regions(gm: torch.fx.GraphModule) -> list[EagerRegion]:
    """Every ``bmm (or baddbmm) -> score ops -> softmax (-> dropout) -> bmm`` over 4-D q, k, v, in graph order.

    Also attention written over ``[B*H, S, d]`` (a 3-D softmax), as older Hugging Face code writes
    it (XGLM, BART, Marian), or whose flat scores are changed before a 4-D softmax (DeBERTa): found,
    so the graph shards its sequence, but always kept as written.
    """
    regions = []
    for sm in gm.graph.nodes:
        if sm.op != "call_function" or sm.target is not aten._softmax.default:
            continue
        region = _region_at(sm) if len(_shape(sm)) == 4 else None
        if region is None:
            region = _flat_region_at(sm)
        if region is not None:
            regions.append(region)
    return regions


def _back_to_bmm(node: Any, numel: int, depth: int = 0) -> torch.fx.Node | None:
    """The score ``bmm`` that ``node`` (the softmax's input) is computed from, through ops of its size."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function" or depth > 16:
        return None
    if node.target in _SCORE_MM:
        return node
    for arg in node.all_input_nodes:
        if math.prod(_shape(arg)) == numel:
            found = _back_to_bmm(arg, numel, depth + 1)
            if found is not None:
                return found
    return None


def _flat_kt_to_4d(node: Any) -> torch.fx.Node | None:
    """``k`` (4-D) from the score bmm's second operand: ``k3.transpose(1, 2)`` or a flattened ``k.transpose(-2, -1)``."""
    if (
        isinstance(node, torch.fx.Node)
        and node.target is aten.transpose.int
        and sorted(d % 3 for d in node.args[1:3]) == [1, 2]
    ):
        return _to_4d(node.args[0])
    kt = _to_4d(node)
    return _untranspose(kt) if kt is not None else None


def _flat_region_at(sm: torch.fx.Node) -> EagerRegion | None:
    """Attention whose scores are a ``[B*H, S, Sk]`` bmm up to the softmax: a 3-D softmax, or a 4-D one
    that :func:`_region_at` could not trace to a 4-D view of the scores (DeBERTa adds its relative
    terms to the flat scores before viewing them as ``[B, H, S, Sk]``). Always kept as written."""
    shp = _shape(sm)
    if len(shp) not in (3, 4) or sm.args[1] % len(shp) != len(shp) - 1:
        return None
    flat = (shp[0] * shp[1], *shp[2:]) if len(shp) == 4 else shp
    scores = _back_to_bmm(sm.args[0], math.prod(shp))
    if scores is None or _shape(scores) != flat:
        return None
    found = _forward_to_bmm(sm, [])
    if found is None:
        return None
    after, path = found
    a, b = _operands(scores)
    # 4-D tensors of the graph where it has them; else (nn.MultiheadAttention's [S, B*H, d] views
    # transposed) the operands themselves, as [1, B*H, len, d]: kept as written, only the lengths count.
    named = {"q": (_to_4d(a), a), "k": (_flat_kt_to_4d(b), b), "v": (_to_4d(after.args[1]), after.args[1])}
    q4 = named["q"][0]
    region = EagerRegion(
        **{w: four if four is not None else flat for w, (four, flat) in named.items()},
        output=after,
        softmax=sm,
        weights=path,
        merged=frozenset(w for w, (four, _) in named.items() if four is None),
        heads=_shape(q4)[:2] if q4 is not None else (shp[:2] if len(shp) == 4 else (1, shp[0])),
        why_not=(
            "it is written over [batch * heads, S, d] tensors, which no variant rewrites yet"
            if len(shp) == 3
            else "its scores pass through ops over [batch * heads, S, Sk] before their [B, H, S, Sk] view, "
            "which no variant rewrites yet"
        ),
    )
    (b, h, s, d), (bk, hk, sk, dk), (bv, hv, sv, _) = (region.shape4(w) for w in ("q", "k", "v"))
    if flat != (b * h, s, sk) or d != dk or sk != sv or (bk, hk) != (bv, hv) or bk != b:
        return None
    return region


def _score_mm(node: torch.fx.Node) -> torch.fx.Node | None:
    """The ``bmm``/``baddbmm`` whose ``[B*H, S, Sk]`` product the 4-D ``node`` is, as ``[B, H, S, Sk]``."""
    if node.op != "call_function" or node.target not in LAYOUT or len(_shape(node)) != 4:
        return None
    src = node.args[0]
    if isinstance(src, torch.fx.Node) and src.target in _SCORE_MM and node.target in _FLATTEN:
        return src if _shape(node)[2:] == _shape(src)[1:] else None
    mm = src
    for _ in range(16):  # einsum: unsqueeze, permute, view around the matmul
        if not isinstance(mm, torch.fx.Node) or mm.op != "call_function":
            return None
        if mm.target in _SCORE_MM:
            break
        if mm.target not in LAYOUT:
            return None
        mm = mm.args[0]
    chain = chain_between(mm, node) if isinstance(mm, torch.fx.Node) and mm.target in _SCORE_MM else None
    shape = _shape(node)
    return mm if chain and moves_like_reshape(mm, chain, shape) else None


def _back_to_scores(node: Any, shape: tuple, depth: int = 0) -> list[torch.fx.Node] | None:
    """``[scores, op, op, ...]``: the chain from the score matmul's 4-D view up to ``node``.

    At each op the score operand is the one of the scores' shape that itself leads back to a matmul
    (a mask may have the full shape too).
    """
    if not isinstance(node, torch.fx.Node) or node.op != "call_function" or depth > 16:
        return None
    if _score_mm(node) is not None:
        return [node] if _shape(node) == shape else None
    for arg in node.args:
        if isinstance(arg, torch.fx.Node) and _shape(arg) == shape:
            chain = _back_to_scores(arg, shape, depth + 1)
            if chain is not None:
                return [*chain, node]
    return None


_TO_WEIGHTS = {aten._to_copy.default, aten.native_dropout.default, operator.getitem} | _TO_BMM


def _forward_to_bmm(node: torch.fx.Node, path: list[torch.fx.Node]) -> tuple[torch.fx.Node, list] | None:
    """The ``bmm`` that multiplies the weights (``node`` after casts, dropout, layout ops) with v, and the path.

    The weights must reach it as ``softmax.reshape([B*H, S, Sk])``: with permutes on the way (einsum),
    checked on concrete sizes (``moves_like_reshape``); with symbolic ones only through the ops
    ``torch.matmul`` puts there.
    """
    if len(path) > 12:
        return None
    for user in live_users(node):
        if user.target is aten.bmm.default and user.args[0] is node:
            path = [*path, node]
            chain = chain_between(path[0], node, LAYOUT | ELEMENTWISE)
            if chain is None:
                continue
            if static(path[0]):
                ok = moves_like_reshape(path[0], chain, _shape(node))
            else:
                ok = all(n.target in _TO_WEIGHTS for n in chain)
            if ok:
                return user, path
            continue
        if (user.target in LAYOUT or user.target in ELEMENTWISE) and not (
            user.target is operator.getitem and user.args[1] != 0
        ):
            found = _forward_to_bmm(user, [*path, node])
            if found is not None:
                return found
    return None


def _sink(sm: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    """``(scores, kept)`` where the softmax takes ``cat([scores, sinks], -1)`` (through ops of its shape,
    such as subtracting the row's max) and only ``kept = probs[..., :Sk]`` is used: GPT-OSS's attention
    sinks, a logit per head that joins the keys in the softmax's denominator and is then dropped."""
    shape, node = _shape(sm), sm.args[0]
    for _ in range(8):
        if not isinstance(node, torch.fx.Node) or node.op != "call_function":
            return None
        if node.target is aten.cat.default:
            break
        node = next((a for a in node.args if isinstance(a, torch.fx.Node) and _shape(a) == shape), None)
    else:
        return None
    tensors, dim = node.args[0], node.args[1] if len(node.args) > 1 else 0
    if dim % 4 != 3 or len(tensors) != 2:
        return None
    scores, sinks = tensors
    sk = _shape(scores)[3] if len(_shape(scores)) == 4 else None
    users = live_users(sm)
    if sk is None or _shape(sinks)[:3] != shape[:3] or len(users) != 1:
        return None
    kept = users[0]
    if kept.target is not aten.slice.Tensor or kept.args[1] % 4 != 3 or _shape(kept) != _shape(scores):
        return None
    start = kept.args[2] if len(kept.args) > 2 else 0
    return (scores, kept) if start in (0, None) else None


def _region_at(sm: torch.fx.Node) -> EagerRegion | None:
    ndim = len(_shape(sm))
    if ndim != 4 or sm.args[1] % ndim != 3:
        return None
    sink = _sink(sm)
    chain = _back_to_scores(sm.args[0], _shape(sm)) if sink is None else _back_to_scores(sink[0], _shape(sink[0]))
    if chain is None:
        return None
    scores, ops = chain[0], chain[1:]
    mm = _score_mm(scores)
    found = _forward_to_bmm(sm if sink is None else sink[1], [])
    if mm is None or found is None:
        return None
    after, path = found
    dropout_p = next((float(n.args[1]) for n in path if n.target is aten.native_dropout.default and n.args[2]), 0.0)
    a, b = _operands(mm)
    # q, k, v and the output as 4-D tensors of the graph where it has them (its own layout kept), else
    # the matmuls' [B*H, ...] operands, which the rewrite views as [B, H, ...] (einsum's layouts).
    named = {"q": (_to_4d(a), a), "k": (_flat_kt_to_4d(b), b), "v": (_to_4d(after.args[1]), after.args[1])}
    out = _only_user(after)
    if out is None or out.target not in _FLATTEN or len(_shape(out)) != 4:
        out = None
    named["output"] = (out, after)
    merged = frozenset(w for w, (four, _) in named.items() if four is None)
    if merged and not all(static(n) for n in (a, b, after.args[1], after)):
        return None
    nodes = {w: four if four is not None else flat for w, (four, flat) in named.items()}
    region = EagerRegion(
        **nodes,
        softmax=sm,
        score_ops=ops,
        dropout_p=dropout_p,
        weights=path,
        scores=scores,
        merged=merged,
        heads=_shape(scores)[:2],
    )
    (b, h, s, sk), (bq, hq, sq, d), (bk, hk, skk, dk), (bv, hv, sv, dv) = (
        _shape(scores),
        *(region.shape4(w) for w in ("q", "k", "v")),
    )
    out_shape = (b * h, s, dv) if "output" in merged else (b, h, s, dv)
    if (bq, hq, sq) != (b, h, s) or (bk, bv, skk, sv) != (b, b, sk, sk) or d != dk or hk != hv:
        return None
    if _shape(region.output) != out_shape:
        return None
    _judge(region, scores)
    if sink is not None:
        # Found, so the graph shards its sequence; SDPA has no sinks, and no variant adds them yet.
        region.why_not = "its softmax also weighs a sink logit per head (GPT-OSS), which SDPA does not take"
    return region


def _judge(region: EagerRegion, scores: torch.fx.Node) -> None:
    """Fill ``scale``, or ``why_not`` when SDPA would compute something else."""
    if region.dropout_p:
        # Written out, the dropout draws the whole weights tensor (each rank keeps its rows, the
        # program's mask); SDPA's kernel would draw another mask.
        region.why_not = f"its dropout (p={region.dropout_p}) would draw other masks inside SDPA"
        return
    for node in [scores, *region.score_ops]:
        if len(live_users(node)) != 1:
            region.why_not = f"{node.name}: the attention scores are used outside the attention"
            return
    for node in region.weights:
        if len(live_users(node)) != 1:
            region.why_not = "the attention weights are used outside the attention (output_attentions?)"
            return
    roots = {region.q, region.k, region.v}
    s, scale = scores, 1.0
    mm = scores.args[0]
    if mm.target is aten.baddbmm.default:
        alpha, beta = _baddbmm_factors(mm)
        if alpha is None or alpha <= 0 or beta is None:
            region.why_not = f"{mm.name} scales its product or its bias by something other than a positive constant"
            return
        if beta and _depends_on(mm.args[0], roots):
            region.why_not = f"{mm.name} adds a bias computed from q, k or v"
            return
        scale = alpha
        # With beta 0 baddbmm ignores its bias, NaN and inf included.
        region.bias, region.beta = (mm.args[0], beta) if beta else (None, 1.0)
    for node in region.score_ops:
        factor, why = _score_op(node, s, roots)
        if why is not None:
            region.why_not = why
            return
        scale *= factor
        s = node
    dtypes = {_val(region.q).dtype, _val(region.k).dtype, _val(region.v).dtype}
    if len(dtypes) > 1:
        region.why_not = f"q, k and v have different dtypes ({sorted(str(d) for d in dtypes)})"
        return
    hk, h = region.shape4("k")[1], region.shape4("q")[1]
    if h % hk:
        region.why_not = f"{h} query heads over {hk} kv heads"
        return
    region.scale = scale


def _finite_huge(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and -math.inf < x <= _MASKED


def _holds_finite_huge(t: torch.Tensor) -> bool:
    if not t.is_floating_point() or not t.numel():
        return False
    finite = t.detach()[torch.isfinite(t.detach())]
    return bool(finite.numel()) and float(finite.min()) <= _MASKED


def _may_hold_finite_fill(gm: torch.fx.GraphModule, node: Any, state: dict[torch.fx.Node, torch.Tensor]) -> bool:
    """Whether ``node`` can hold a finite value <= -1e30: it is computed from such a constant, a
    parameter or buffer holding one (``state``: their values), or a floating-point input (a mask
    the caller passes: its values change from call to call)."""
    seen: set[torch.fx.Node] = set()
    stack = [node] if isinstance(node, torch.fx.Node) else []
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            v = state.get(n, _val(n))
            if isinstance(v, torch.Tensor) and (_holds_finite_huge(v) if n in state else v.is_floating_point()):
                return True
        elif n.op == "get_attr":
            c = getattr(gm, str(n.target), None)
            if isinstance(c, torch.Tensor) and _holds_finite_huge(c):
                return True
        else:
            constants: list[Any] = []
            torch.fx.node.map_aggregate((n.args, n.kwargs), constants.append)
            if any(_finite_huge(a) for a in constants):
                return True
        stack.extend(n.all_input_nodes)
        # A value written in place through a view (``pad[0, ..., -2:] = MIN`` where the graph is not
        # functionalized): the writes hang off its views' users.
        stack.extend(u for u in n.users if _is_view_or_write(u))
    return False


def _is_view_or_write(node: torch.fx.Node) -> bool:
    t = node.target
    if not isinstance(t, torch._ops.OpOverload):
        return False
    return t._schema.is_mutable or any(r.alias_info is not None for r in t._schema.returns)


def may_mask_rows_finitely(
    gm: torch.fx.GraphModule, region: EagerRegion, state: dict[torch.fx.Node, torch.Tensor]
) -> bool:
    """Whether a query row can have every key masked by a finite value (HF's ``finfo.min`` with padding).

    Written out, such a row's scores all round to that value, so it attends uniformly; SDPA's fused
    kernels recompute its weights in the backward from a log-sum-exp that has lost ``log(n)`` (each
    weight 1, not 1/n): its gradients would be n times the program's.
    """
    if region.bias is not None and _may_hold_finite_fill(gm, region.bias, state):
        return True
    for op, others in _others(region):
        if op.target in _MASK:
            fill = _mask_fill(op, _chain_input(op, region))
            if fill is not None and fill > -math.inf:
                return True
        if op.target in _ADD | _MASK and any(_may_hold_finite_fill(gm, a, state) for a in others):
            return True
    return False


def _others(region: EagerRegion) -> list[tuple[torch.fx.Node, list[torch.fx.Node]]]:
    """Each score op with its tensor operands other than the scores."""
    return [(op, [a for a in op.all_input_nodes if a is not _chain_input(op, region)]) for op in region.score_ops]


def _chain_input(op: torch.fx.Node, region: EagerRegion) -> torch.fx.Node:
    i = region.score_ops.index(op)
    if i:
        return region.score_ops[i - 1]
    assert region.scores is not None
    return region.scores


def _mask_shape(region: EagerRegion) -> list[int] | None:
    """Shape of the bias SDPA gets: 1 on batch or heads where every mask operand broadcasts."""
    masking = [others for op, others in _others(region) if op.target in _ADD | _MASK]
    if not masking and region.bias is None:
        return None
    lead = [1, 1]
    if region.bias is not None and math.prod(_shape(region.bias)[:-2]) != 1:
        # baddbmm's bias is over [batch * heads]: which of the two it varies along is not known.
        lead = list(region.heads or _shape(region.q)[:2])
    for others in masking:
        for a in others:
            padded = (1,) * (4 - len(_shape(a))) + _shape(a)
            if len(padded) == 4:
                lead = [max(lead[i], padded[i]) for i in range(2)]
    return [*lead, region.shape4("q")[2], region.shape4("k")[2]]


def region_site(region: EagerRegion) -> AttentionSite:
    """The SDPA site ``region`` becomes, for the variant to check before anything is rewritten."""
    b, h, s, d = region.shape4("q")
    mask = _mask_shape(region)
    return AttentionSite(
        name=region.softmax.name,
        spec=SDPA_SPEC,
        batch=b,
        heads=h,
        kv_heads=region.shape4("k")[1],
        seq_len=s,
        kv_seq_len=region.shape4("k")[2],
        head_dim=d,
        is_causal=False,
        mask_shape=tuple(mask) if mask is not None else None,
        dtype=_val(region.q).dtype,
    )


def _as_4d(g: torch.fx.Graph, region: EagerRegion, which: str) -> torch.fx.Node:
    """``q``, ``k`` or ``v`` as SDPA takes it: a merged operand viewed as [B, H, len, d] (k from k^T)."""
    node = getattr(region, which)
    if which not in region.merged:
        return node
    if which == "k":
        node = g.call_function(aten.transpose.int, (node, 1, 2))
    return g.call_function(aten.reshape.default, (node, list(region.shape4(which))))


def rewrite_region(gm: torch.fx.GraphModule, region: EagerRegion, leaf: Any) -> torch.fx.Node:
    """Put one SDPA call in place of ``region``; its mask is the score ops run on zeros."""
    g = gm.graph
    q_val = _val(region.q)
    h = region.shape4("q")[1]
    shape = _mask_shape(region)
    with g.inserting_before(region.output):
        q, k, v = (_as_4d(g, region, w) for w in ("q", "k", "v"))
        mask = None
        if shape is not None:
            assert region.scores is not None
            prev = region.scores
            dtype = _val(prev).dtype
            like = {"dtype": dtype, "device": q_val.device}
            if region.bias is None:
                cur = g.call_function(aten.zeros.default, (shape,), like)
            else:
                # baddbmm's bias as its output carries it: over [batch * heads] rows, then the 4-D view.
                flat = g.call_function(aten.zeros.default, ([shape[0] * shape[1], *shape[2:]],), like)
                flat = g.call_function(aten.add.Tensor, (flat, region.bias), {"alpha": region.beta})
                cur = g.call_function(aten.view.default, (flat, shape))
            for op in region.score_ops:
                args, kwargs = torch.fx.node.map_arg((op.args, op.kwargs), lambda a: cur if a is prev else a)
                prev, cur = op, g.call_function(op.target, args, kwargs)
            mask = cur
            if _val(prev).dtype != q_val.dtype:
                mask = g.call_function(aten._to_copy.default, (mask,), {"dtype": q_val.dtype})
        call = g.call_function(
            leaf,
            (q, k, v),
            {
                "attn_mask": mask,
                "dropout_p": region.dropout_p,
                "is_causal": False,
                "scale": region.scale,
                "enable_gqa": region.shape4("k")[1] != h,
            },
        )
        out = call
        if "output" in region.merged:  # what the weights' bmm gave: [B*H, S, dv]
            out = g.call_function(aten.reshape.default, (call, list(_shape(region.output))))
    call.meta["stack_trace"] = region.softmax.meta.get("stack_trace")
    region.output.replace_all_uses_with(out)
    g.eliminate_dead_code()
    gm.recompile()
    return call


__all__ = ["EagerRegion", "find_eager_regions", "may_mask_rows_finitely", "region_site", "rewrite_region"]
