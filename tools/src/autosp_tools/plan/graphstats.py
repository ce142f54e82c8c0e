"""Per-rank memory, communication and FLOPs of one partitioned forward/backward pair, as functions of S.

Sizes in the graphs are symbolic in the sequence length (one symbol). Every tensor's bytes is
an expression in it; the distinct expressions are few, so they are compiled once into one
function that evaluates all of them at a length.

Liveness walk: parameters (forward placeholders that are parameters) are resident and not
counted. A node allocates its value's bytes when it runs, unless it is a view (its schema
says the result aliases an input) or a ``getitem`` of a multi-output op: those keep their
base alive instead. A base is freed after its last use (any alias's), unless it is an output
of that graph. The forward's outputs beyond the user's are what the backward keeps (the
saved bytes); the walk carries them into the backward, where each is freed after its last
use there (what Inductor's code and eager autograd do), or when the backward returns (a
backward compiled by "aot_eager": see ``graph_stats``). Gradients, the backward's outputs,
stay allocated to the end of the step. AutoSP's collectives allocate more than their results
inside their ops (``collective_memory``), and so do attention kernels (``kernel_memory``); a
functional collective's wait is an alias.
"""

from __future__ import annotations

import operator
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch
from torch import fx

from autosp.sharding.collectives import COLLECTIVE_OPS
from autosp_tools.plan import collective_memory, kernel_memory
from autosp_tools.plan.runtime import GPU, Runtime
from autosp_tools.plan.sizes import expr as _expr
from autosp_tools.plan.sizes import shape_exprs, tensor_bytes

aten = torch.ops.aten
MATMULS = frozenset({aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default})
# A flash-style attention backward recomputes the scores and runs four more matmuls: about 2.5x the forward.
ATTENTION_BACKWARD_FACTOR = 2.5


def _shape(node: Any) -> list[sympy.Expr]:
    return shape_exprs(node.meta.get("val") if isinstance(node, fx.Node) else None)


def _is_view(node: fx.Node) -> bool:
    """Whether the result aliases its first input (a view op, an element of a view op's list, or a
    functional collective's wait, which returns the tensor it waited on)."""
    if collective_memory.is_alias(node):
        return True
    if node.target is operator.getitem:
        src = node.args[0]
        return isinstance(src, fx.Node) and src.op == "call_function" and _is_view(src)
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.returns:
        return False
    return any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


def _is_attention_forward(node: fx.Node) -> bool:
    name = str(node.target)
    return "attention" in name and "backward" not in name and name.startswith("aten.")


def _is_attention_backward(node: fx.Node) -> bool:
    name = str(node.target)
    return "attention" in name and "backward" in name and name.startswith("aten.")


def _causal(node: fx.Node) -> bool:
    return node.kwargs.get("is_causal") is True or any(a is True for a in node.args[3:9])


def attention_flops(node: fx.Node) -> sympy.Expr:
    """FLOPs of one attention forward from q ``[B, H, Sq, D]`` and k ``[B, H, Sk, D]``, halved when causal."""
    q_index = 1 if _is_attention_backward(node) else 0
    q, k = _shape(node.args[q_index]), _shape(node.args[q_index + 1])
    if len(q) != 4 or len(k) != 4:
        return sympy.Integer(0)
    flops = 4 * q[0] * q[1] * q[2] * k[2] * q[3]
    return flops / 2 if _causal(node) else flops


def matmul_flops(node: fx.Node) -> sympy.Expr:
    a = node.args[1] if node.target in (aten.addmm.default, aten.baddbmm.default) else node.args[0]
    out, lhs = _shape(node), _shape(a)
    if not out or not lhs:
        return sympy.Integer(0)
    return 2 * sympy.Mul(*out) * lhs[-1]


def collective_kind(node: fx.Node) -> str | None:
    """``all_to_all``, ``all_gather``, ... for AutoSP's and the functional collectives; waits are not."""
    if node.op != "call_function":
        return None
    if node.target in COLLECTIVE_OPS:
        return node.target._opname  # type: ignore[union-attr]
    name = str(node.target)
    if name.startswith("_c10d_functional.") and "wait_tensor" not in name:
        base = name.split(".")[1]
        return {
            "all_gather_into_tensor": "all_gather",
            "reduce_scatter_tensor": "reduce_scatter",
            "all_to_all_single": "all_to_all",
        }.get(base, base.removesuffix("_"))
    return None


@dataclass
class Timeline:
    """Allocation (+) and free (-) events of one graph, as indices into an expression table."""

    events: list[tuple[int, int, bool]] = field(default_factory=list)  # (sign, expression index, is a gradient)
    labels: list[str] = field(default_factory=list)  # the node of each event, for explaining a peak


class ExprTable:
    """Distinct byte expressions, evaluated together at one length."""

    def __init__(self, symbol: sympy.Symbol | None) -> None:
        self.symbol = symbol
        self.exprs: list[sympy.Expr] = []
        self.index: dict[sympy.Expr, int] = {}
        self._fn: Callable[[int], list[float]] | None = None
        self._cache: dict[int, list[float]] = {}

    def __getstate__(self) -> dict[str, Any]:
        # Compiled functions do not pickle; they are rebuilt on first use.
        return {**self.__dict__, "_fn": None}

    def add(self, e: sympy.Expr) -> int:
        if e not in self.index:
            self.index[e] = len(self.exprs)
            self.exprs.append(e)
            self._fn = None
        return self.index[e]

    def values(self, seq: int) -> list[float]:
        if seq not in self._cache:
            if self._fn is None:
                self._fn = compile_exprs(self.exprs, self.symbol)
            self._cache[seq] = self._fn(seq)
        return self._cache[seq]


# Integer functions torch's symbolic shapes use, for lambdify (sizes of multiples of P divide exactly).
_SYMPY_FUNCTIONS = {
    "FloorDiv": lambda a, b: a // b,
    "CleanDiv": lambda a, b: a // b,
    "CeilDiv": lambda a, b: -(-a // b),
    "IntTrueDiv": lambda a, b: a / b,
    "Mod": lambda a, b: a % b,
    "PythonMod": lambda a, b: a % b,
    "ModularIndexing": lambda a, b, c: (a // b) % c,
    "Max": max,
    "Min": min,
}


def compile_exprs(exprs: list[sympy.Expr], symbol: sympy.Symbol | None) -> Callable[[int], list[float]]:
    """One function evaluating every expression at a length (exact integer arithmetic where sizes are ints)."""
    if symbol is None:
        values = [float(e) for e in exprs]
        return lambda seq: values
    try:
        fn = sympy.lambdify([symbol], list(exprs), modules=[_SYMPY_FUNCTIONS, "math"])
        fn(2**20)  # fails here, not mid-search, on a function lambdify cannot print
        return lambda seq: [float(v) for v in fn(seq)]
    except Exception:  # noqa: BLE001 - fall back to exact sympy evaluation
        return lambda seq: [float(e.xreplace({symbol: sympy.Integer(seq)}).doit()) for e in exprs]


@dataclass
class GraphStats:
    """What one mode's forward and backward graphs hold, symbolic in the length."""

    table: ExprTable
    saved: sympy.Expr
    forward: Timeline
    backward: Timeline
    comm: dict[str, list[sympy.Expr]]
    matmul_flops: sympy.Expr
    attention_flops: sympy.Expr
    forward_matmul_flops: sympy.Expr
    forward_attention_flops: sympy.Expr
    forward_all_to_all: sympy.Expr

    _fns: dict[sympy.Expr, Callable[[int], list[float]]] = field(default_factory=dict)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fns": {}}

    def evaluate(self, e: sympy.Expr, seq: int) -> float:
        if e not in self._fns:
            self._fns[e] = compile_exprs([e], self.table.symbol)
        return self._fns[e](seq)[0]

    def peak_parts(self, seq: int) -> PeakParts:
        """The walk's peak, and the parts a homogeneous layer stack scales linearly (see ``PeakParts``)."""
        values = self.table.values(seq)
        act = grad = peak = fwd_peak = bwd_act_peak = grad_at = 0.0
        for sign, i, _ in self.forward.events:
            act += sign * values[i]
            fwd_peak = max(fwd_peak, act)
        peak = fwd_peak
        for sign, i, is_grad in self.backward.events:
            if is_grad:
                grad += sign * values[i]
            else:
                act += sign * values[i]
            if act > bwd_act_peak:
                bwd_act_peak, grad_at = act, grad
            peak = max(peak, act + grad)
        return PeakParts(peak, fwd_peak, bwd_act_peak, grad_at, grad, act)

    def peak(self, seq: int) -> float:
        """Most bytes live at once over the forward then the backward (parameters excluded)."""
        return self.peak_parts(seq).peak


@dataclass(frozen=True)
class PeakParts:
    """Candidates for the step's peak in an L-layer stack, each linear in L.

    Within the backward, activations fall by one layer's saved bytes per layer while
    gradients grow by one layer's parameters, so the sum peaks near an end: where the
    activations peak (plus the gradients made by then), or at the end (all gradients).
    """

    peak: float
    forward: float
    backward_activations: float
    gradients_then: float
    gradients: float
    activations_at_end: float


def _bases(gm: fx.GraphModule) -> dict[fx.Node, fx.Node]:
    base: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and _is_view(node) and node.args and isinstance(node.args[0], fx.Node):
            src = node.args[0]
            if node.target is operator.getitem:  # an element of a view op's list aliases that op's input
                src = src.args[0]
            base[node] = base.get(src, src)
        else:
            base[node] = node
    return base


def _reads_size_only(node: fx.Node) -> bool:
    return node.op == "call_function" and str(node.target).startswith(
        ("aten.sym_size", "aten.sym_stride", "aten.sym_numel")
    )


def _timeline(
    gm: fx.GraphModule,
    table: ExprTable,
    counted: Callable[[fx.Node], bool],
    carried: dict[fx.Node, int],
    grads: bool = False,
    hold_inputs: bool = False,
    runtime: Runtime = GPU,
) -> Timeline:
    """Events of one graph. ``counted`` says which placeholders hold bytes of this step; ``carried`` maps
    those already live (allocated by the forward) to their expression index: freed here, never allocated.
    ``hold_inputs``: the graph's inputs stay referenced until it returns (see ``graph_stats``)."""
    nodes = list(gm.graph.nodes)
    base = _bases(gm)
    outputs = {base[o] for o in gm.graph.output_node().all_input_nodes}
    last: dict[fx.Node, int] = {}
    for i, node in enumerate(nodes):
        if _reads_size_only(node):
            # Traced with the length symbolic, the graph reads sizes off tensors (aten.sym_size) where
            # the real, static-shape graph has constants: such a read keeps no tensor alive there.
            continue
        for arg in node.all_input_nodes:
            last[base[arg]] = max(last.get(base[arg], -1), i)
    frees: dict[int, list[fx.Node]] = defaultdict(list)
    for b, i in last.items():
        if b in outputs or (hold_inputs and b.op == "placeholder"):
            continue
        frees[i].append(b)
    owned: dict[fx.Node, int] = {}
    at_wait: dict[fx.Node, list[int]] = defaultdict(list)  # buffers a start keeps until this wait
    t = Timeline()

    def event(sign: int, index: int, node: fx.Node, is_grad: bool = False) -> None:
        t.events.append((sign, index, is_grad))
        t.labels.append(node.name)

    for i, node in enumerate(nodes):
        if node.op == "placeholder" and counted(node):
            owned[node] = carried[node] if node in carried else table.add(tensor_bytes(node.meta.get("val")))
            if node not in carried:
                event(1, owned[node], node)
        elif node.op == "call_function" and isinstance(node.meta.get("val"), (tuple, list)):
            # A multi-output op's tensors are allocated by its getitems: outputs nobody reads are not counted.
            # Its scratch is live while it runs, with all its outputs.
            extra = kernel_memory.scratch(node, runtime)
            if extra != 0:
                moment = table.add(extra + tensor_bytes(node.meta.get("val")))
                event(1, moment, node)
                event(-1, moment, node)
        elif node.op == "call_function" and base[node] is node:
            inside = collective_memory.buffers(node, runtime.comm_backend)
            # A wait drops the send copy its start kept before it lays out its result.
            for held in at_wait.pop(node, ()):
                event(-1, held, node)
            extra = inside.transient + kernel_memory.scratch(node, runtime)
            transient = table.add(extra) if extra != 0 else None
            if transient is not None:
                event(1, transient, node)
            owned[node] = table.add(tensor_bytes(node.meta.get("val")))
            # The backward's outputs are the gradients: they stay to the end of the step.
            event(1, owned[node], node, grads and node in outputs)
            if transient is not None:
                event(-1, transient, node)
            waits = [u for u in node.users if u.target in collective_memory.WAIT_OPS]
            if inside.held != 0 and waits:
                at_wait[waits[0]].append(table.add(inside.held))
                event(1, at_wait[waits[0]][-1], node)
            if node not in last and node not in outputs:  # nothing reads it (a size read does not count)
                event(-1, owned[node], node)
        for b in frees.get(i, ()):
            if b in owned:
                event(-1, owned[b], b)
    if hold_inputs:
        for node in nodes:
            if node.op == "placeholder" and node in owned and node not in outputs:
                event(-1, owned[node], node)
    return t


def _seq_symbol(gm: fx.GraphModule) -> sympy.Symbol | None:
    symbols: set[sympy.Symbol] = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            symbols |= tensor_bytes(node.meta.get("val")).free_symbols
            val = node.meta.get("val")
            if isinstance(val, torch.SymInt):
                symbols |= _expr(val).free_symbols
    if len(symbols) > 1:
        raise ValueError(
            f"the graph has several symbolic sizes ({sorted(map(str, symbols))}); expected only the length"
        )
    return next(iter(symbols), None)


RING_P2P = "ring_p2p"


def ring_bytes(node: fx.Node, ring: int) -> sympy.Expr:
    """Bytes one rank sends inside autosp-ring's opaque op (its P2P traffic is not in the graph).

    Forward: k and v travel ring-1 hops. Backward: k and v again, and fp32 dk/dv accumulators
    ring hops, back to their owner.
    """
    backward = "backward" in str(node.target)
    k, v = (node.args[2], node.args[3]) if backward else (node.args[1], node.args[2])
    kv = tensor_bytes(k.meta.get("val")) + tensor_bytes(v.meta.get("val"))
    if not backward:
        return (ring - 1) * kv
    kv_numel = kv / k.meta["val"].element_size()
    return (ring - 1) * kv + ring * 4 * kv_numel


def ring_flops(node: fx.Node, ring: int) -> sympy.Expr:
    """Attention FLOPs inside autosp-ring's op: local queries against every rank's keys."""
    backward = "backward" in str(node.target)
    q, k = _shape(node.args[1 if backward else 0]), _shape(node.args[2 if backward else 1])
    if len(q) != 4 or len(k) != 4:
        return sympy.Integer(0)
    causal = node.args[6 if backward else 3] is True
    flops = 4 * q[0] * q[1] * q[2] * k[2] * ring * q[3] / (2 if causal else 1)
    return ATTENTION_BACKWARD_FACTOR * flops if backward else flops


def graph_stats(
    forward: fx.GraphModule,
    backward: fx.GraphModule,
    num_user_outputs: int,
    param_inputs: set[int],
    ring: int = 1,
    *,
    hold_backward_inputs: bool = False,
    runtime: Runtime = GPU,
) -> GraphStats:
    """Statistics of one partitioned pair. ``param_inputs``: forward placeholder positions that are
    parameters; ``ring``: ranks in a ring-attention group (its traffic is inside an opaque op).

    ``hold_backward_inputs``: the saved tensors stay allocated until the backward returns instead of
    after their last use. AOT calls a backward compiled by "aot_eager" through ``make_boxed_func``,
    whose argument list references every input for the whole call; Inductor's code clears that list
    and frees each input after its last use, and eager autograd frees a node's saved tensors once
    it has run. ``runtime``: the device and threads the program runs with, which buffers inside
    collectives and kernels depend on (see ``collective_memory`` and ``kernel_memory``).
    """
    table = ExprTable(_seq_symbol(forward))
    fwd_placeholders = [n for n in forward.graph.nodes if n.op == "placeholder"]
    params = {fwd_placeholders[i] for i in param_inputs if i < len(fwd_placeholders)}
    if table.symbol is not None:
        # AOT may add or drop size placeholders, shifting positions: with the length symbolic, a floating
        # input whose size does not depend on it is a parameter or buffer (sequence inputs always do).
        params |= {
            n
            for n in fwd_placeholders
            if isinstance(n.meta.get("val"), torch.Tensor)
            and n.meta["val"].is_floating_point()
            and not tensor_bytes(n.meta["val"]).free_symbols
        }
    fwd_t = _timeline(forward, table, lambda n: False, {}, runtime=runtime)
    fwd_base = _bases(forward)
    outs = forward.graph.output_node().args[0]
    saved_nodes = [o for o in outs[num_user_outputs:] if isinstance(o, fx.Node)]
    bwd_placeholders = [n for n in backward.graph.nodes if n.op == "placeholder"]
    # The backward's leading placeholders are the saved values, in the forward's output order.
    carried: dict[fx.Node, int] = {}
    seen_bases: set[fx.Node] = set()
    saved = sympy.Integer(0)
    for fwd_node, bwd_node in zip(saved_nodes, bwd_placeholders):
        b = fwd_base[fwd_node]
        if b in params or b in seen_bases:
            continue  # parameters are resident; a storage saved twice is held once
        seen_bases.add(b)
        bytes_ = tensor_bytes(b.meta.get("val"))
        saved += bytes_
        if b.op != "placeholder":  # inputs (token ids) were never allocated by the walk
            carried[bwd_node] = table.add(bytes_)
    bwd_t = _timeline(
        backward,
        table,
        lambda n: n in carried,
        carried,
        grads=True,
        hold_inputs=hold_backward_inputs,
        runtime=runtime,
    )
    comm: dict[str, list[sympy.Expr]] = defaultdict(list)
    mm = attn = sympy.Integer(0)
    fwd_mm = fwd_attn = fwd_a2a = sympy.Integer(0)
    for gm, is_forward in ((forward, True), (backward, False)):
        for node in gm.graph.nodes:
            if node.op != "call_function":
                continue
            kind = collective_kind(node)
            if str(node.target).startswith("autosp_ring.ring_attention"):
                comm[RING_P2P].append(ring_bytes(node, ring)) if ring > 1 else None
                f = ring_flops(node, ring)
                attn += f
                fwd_attn += f if is_forward else 0
                continue
            if kind is not None:
                comm[kind].append(tensor_bytes(node.meta.get("val")))
                if is_forward and kind == "all_to_all":
                    fwd_a2a += tensor_bytes(node.meta.get("val"))
            elif node.target in MATMULS:
                f = matmul_flops(node)
                mm += f
                fwd_mm += f if is_forward else 0
            elif _is_attention_backward(node):
                attn += ATTENTION_BACKWARD_FACTOR * attention_flops(node)
            elif _is_attention_forward(node):
                f = attention_flops(node)
                attn += f
                fwd_attn += f if is_forward else 0
    return GraphStats(table, saved, fwd_t, bwd_t, dict(comm), mm, attn, fwd_mm, fwd_attn, fwd_a2a)


__all__ = ["GraphStats", "attention_flops", "collective_kind", "graph_stats", "matmul_flops", "tensor_bytes"]
