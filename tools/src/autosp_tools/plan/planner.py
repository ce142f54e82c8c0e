"""The plan: per rank memory, communication, FLOPs and step time of each mode, at any length.

A model with L layers is compiled with 1 and 2 layers (fake tensors, symbolic length) and every
quantity is scaled to L as ``Q(L) = Q(2) + (L - 2) * (Q(2) - Q(1))``: exact when the layers are
alike, which is what decoder stacks are. The length stays a symbol, so any S is evaluated from
the same graphs; ``max_seq`` searches the longest S that fits.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from autosp.errors import ConfigError
from autosp_tools.plan.capture import Captured, Mode, fake_group, trace_modes
from autosp_tools.plan.graphstats import GraphStats, graph_stats
from autosp_tools.plan.hardware import Device
from autosp_tools.plan.layout import Layout, StateBytes
from autosp_tools.plan.models import ModelSource
from autosp_tools.plan.modes import seq_unit
from autosp_tools.plan.runtime import GPU, Runtime

# A collective's per-rank input from its output bytes (what the cost models take).
_INPUT_FROM_OUTPUT = {"all_gather": lambda b, p: b / p, "reduce_scatter": lambda b, p: b * p}


@dataclass
class Estimate:
    """One mode at one length, per rank. Bytes are bytes; ``total_bytes`` is what must fit."""

    mode: str
    seq: int
    saved_bytes: float
    step_peak_bytes: float
    total_bytes: float
    comm_bytes: dict[str, float]
    matmul_flops: float
    attention_flops: float
    compute_s: float
    comm_s: float
    step_s: float
    fits: bool
    note: str = ""

    @property
    def flops(self) -> float:
        return self.matmul_flops + self.attention_flops

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "flops": self.flops}


@dataclass
class ModeModel:
    """A mode's graph statistics at the compiled layer counts, scaled to the model's layers."""

    mode: Mode
    stats: list[tuple[int, GraphStats]]
    layers: int
    sp: int
    unit: int
    error: str | None = None

    def scaled(self, f: Callable[[GraphStats], float]) -> float:
        if len(self.stats) == 1:
            return f(self.stats[0][1])
        (l1, a), (l2, b) = self.stats
        fa, fb = f(a), f(b)
        return fb + (self.layers - l2) * (fb - fa) / (l2 - l1)

    def peak(self, seq: int) -> float:
        """The step's peak at ``seq`` (see ``PeakParts`` for how it scales with layers)."""
        if len(self.stats) == 1:
            return self.stats[0][1].peak_parts(seq).peak
        (l1, a), (l2, b) = self.stats
        pa, pb = a.peak_parts(seq), b.peak_parts(seq)

        def lin(f: Callable[[Any], float]) -> float:
            return f(pb) + (self.layers - l2) * (f(pb) - f(pa)) / (l2 - l1)

        return max(
            lin(lambda p: p.forward),
            lin(lambda p: p.backward_activations) + pb.gradients_then,
            lin(lambda p: p.gradients) + pb.activations_at_end,
        )

    def comm(self, seq: int) -> dict[str, list[float]]:
        """Output bytes of every collective call, by kind, at ``seq``."""
        kinds = set().union(*(s.comm for _, s in self.stats))
        out: dict[str, list[float]] = {}
        for kind in sorted(kinds):
            per_layer_count = [len(s.comm.get(kind, [])) for _, s in self.stats]
            totals = self.scaled(lambda s: sum(s.evaluate(e, seq) for e in s.comm.get(kind, [])))
            calls = max(
                1, round(self.scaled(lambda s: float(len(s.comm.get(kind, []))))) if max(per_layer_count) else 0
            )
            out[kind] = [totals / calls] * calls if calls else []
        return out


@dataclass
class Plan:
    """Everything ``autosp-plan`` reports."""

    model: str
    layers: int
    compiled_layers: list[int]
    params: int
    dtype: str
    layout: Layout
    device: str
    memory_bytes: float
    reserve_bytes: float
    state: StateBytes
    modes: list[ModeModel]
    estimates: list[Estimate] = field(default_factory=list)
    max_seq: dict[str, dict[str, Any]] = field(default_factory=dict)
    curves: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    compile_s: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def budget_bytes(self) -> float:
        return self.memory_bytes - self.reserve_bytes

    def as_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "layers": self.layers,
            "compiled_layers": self.compiled_layers,
            "params": self.params,
            "dtype": self.dtype,
            "layout": asdict(self.layout),
            "device": self.device,
            "memory_bytes": self.memory_bytes,
            "reserve_bytes": self.reserve_bytes,
            "state_bytes": {**asdict(self.state), "total": self.state.total},
            "modes": {m.mode.name: {"error": m.error, "unit": m.unit} for m in self.modes},
            "estimates": [e.as_dict() for e in self.estimates],
            "max_seq": self.max_seq,
            "curves": {k: [list(p) for p in v] for k, v in self.curves.items()},
            "compile_s": self.compile_s,
            "notes": self.notes,
        }


def _stats(c: Captured, sp: int, runtime: Runtime) -> GraphStats:
    assert c.forward is not None and c.backward is not None
    u = dict(c.mode.variant_options).get("ulysses_degree", 1) if c.mode.variant == "hybrid" else 1
    return graph_stats(
        c.forward,
        c.backward,
        c.num_user_outputs,
        c.param_inputs,
        ring=sp // u,
        hold_backward_inputs=c.mode.holds_backward_inputs,
        runtime=runtime,
    )


def trace_stats(
    source: ModelSource,
    layers: int,
    modes: Sequence[Mode],
    *,
    sp: int,
    group: Any,
    dtype: torch.dtype,
    batch: int,
    seq_hint: int,
    runtime: Runtime = GPU,
) -> tuple[int, dict[str, GraphStats | str]]:
    """Parameter count, and per mode its statistics or why it failed, at ``layers`` layers."""
    traced = trace_modes(source.build, layers, modes, sp=sp, group=group, dtype=dtype, batch=batch, seq_hint=seq_hint)
    return traced.param_count, {
        name: (c.error if c.error else _stats(c, sp, runtime)) for name, c in traced.captured.items()
    }


def _trace_in_child(spec: str, layers: int, modes: Sequence[Mode], kw: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    from autosp_tools.plan.models import resolve_model

    with fake_group(kw["sp"]) as group:
        return trace_stats(resolve_model(spec), layers, modes, group=group, **kw)


def build_models(
    source: ModelSource,
    modes: Sequence[Mode],
    *,
    sp: int,
    dtype: torch.dtype,
    batch: int,
    seq_hint: int,
    spec: str | None = None,
    runtime: Runtime = GPU,
) -> tuple[list[ModeModel], int, list[int]]:
    """Trace at 1 and 2 layers (or the whole model when it cannot be scaled); returns models, params, layer counts.

    With a model given by name (``spec``), the two traces run in two spawned processes at once.
    ``runtime``: where the planned program runs (GPUs by default; CPU ranks for checks against real runs).
    """
    counts = [1, 2] if source.scalable and source.layers > 2 else [source.layers]
    kw = dict(sp=sp, dtype=dtype, batch=batch, seq_hint=seq_hint, runtime=runtime)
    if spec is not None and len(counts) == 2:
        import concurrent.futures
        import multiprocessing

        with concurrent.futures.ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = [pool.submit(_trace_in_child, spec, n, list(modes), kw) for n in counts]
            traced = [f.result() for f in futures]
    else:
        # One fake group for both traces: variants cache subgroups they make in it.
        with fake_group(sp) as group:
            traced = [trace_stats(source, n, modes, group=group, **kw) for n in counts]
    if len(counts) == 2:
        p1, p2 = traced[0][0], traced[1][0]
        params = p2 + (source.layers - 2) * (p2 - p1)
    else:
        params = traced[0][0]
    models = []
    for mode in modes:
        results = [t[1][mode.name] for t in traced]
        error = next((r for r in results if isinstance(r, str)), None)
        stats = [] if error else list(zip(counts, results))
        models.append(ModeModel(mode, stats, source.layers, sp, seq_unit(mode, sp), error))
    return models, params, counts


def estimate(plan: Plan, m: ModeModel, seq: int, dtype: torch.dtype, device: Device, note: str = "") -> Estimate:
    saved = m.scaled(lambda s: s.evaluate(s.saved, seq))
    peak = m.peak(seq)
    mm = m.scaled(lambda s: s.evaluate(s.matmul_flops, seq))
    attn = m.scaled(lambda s: s.evaluate(s.attention_flops, seq))
    comm_calls = m.comm(seq)
    comm_s = 0.0
    for kind, calls in comm_calls.items():
        for out_bytes in calls:
            nbytes = _INPUT_FROM_OUTPUT.get(kind, lambda b, p: b)(out_bytes, m.sp)
            comm_s += device.collective_seconds(kind, nbytes, m.sp)
    comm_bytes = {k: sum(v) for k, v in comm_calls.items()}
    dp_kind, dp_bytes = _dp_sync(plan, dtype)
    if dp_bytes:
        comm_bytes[f"{dp_kind} (dp)"] = dp_bytes
        comm_s += device.collective_seconds(dp_kind, dp_bytes, plan.layout.dp)
    compute_s = mm / device.matmul_flops(dtype) + attn / device.attention_flops(dtype)
    # Parameters, optimizer state and the step's peak (activations, and gradients as the backward makes them).
    total = plan.state.params + plan.state.optimizer + peak
    return Estimate(
        m.mode.name,
        seq,
        saved,
        peak,
        total,
        comm_bytes,
        mm,
        attn,
        compute_s,
        comm_s,
        compute_s + comm_s,
        total <= plan.budget_bytes,
        note,
    )


def _dp_sync(plan: Plan, dtype: torch.dtype) -> tuple[str, float]:
    """The data-parallel gradient reduction of one step (not in the SP graphs): kind and per-rank input bytes."""
    if plan.layout.dp <= 1:
        return "all_reduce", 0.0
    grad_bytes = plan.params * torch.empty((), dtype=dtype).element_size()
    return ("reduce_scatter" if plan.layout.zero >= 2 else "all_reduce"), grad_bytes


def derive_auto(
    plan: Plan, off: ModeModel, on: ModeModel, seq: int, dtype: torch.dtype, device: Device, name: str
) -> Estimate:
    """SAC "auto": autosp-sac's own cost model decides at this length (recompute when overhead <= threshold)."""
    from autosp_sac.cost import OVERHEAD_THRESHOLD, Costs

    mm = off.scaled(lambda s: s.evaluate(s.forward_matmul_flops, seq))
    attn = off.scaled(lambda s: s.evaluate(s.forward_attention_flops, seq))
    a2a = off.scaled(lambda s: s.evaluate(s.forward_all_to_all, seq))
    overhead = Costs(mm, attn, a2a).overhead(device.profile)
    chosen = on if overhead <= OVERHEAD_THRESHOLD else off
    e = estimate(
        plan,
        chosen,
        seq,
        dtype,
        device,
        note=f"auto: {'recompute' if chosen is on else 'default'} (overhead {overhead:.1%})",
    )
    e.mode = name
    return e


def search_max_seq(fits: Callable[[int], bool], unit: int, cap: int) -> tuple[int, bool]:
    """Longest multiple of ``unit`` for which ``fits``: doubling, then bisection. Returns (length, hit the cap)."""
    if not fits(unit):
        return 0, False
    lo = unit
    while lo * 2 <= cap and fits(lo * 2):
        lo *= 2
    if lo * 2 > cap:
        hi = cap // unit * unit + unit
        if fits(hi - unit):
            return hi - unit, True
    else:
        hi = lo * 2
    # lo fits, hi does not; both multiples of unit.
    while hi - lo > unit:
        mid = (lo + hi) // 2 // unit * unit
        if mid <= lo:
            break
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo, False


def timed_models(
    source: ModelSource, modes: Sequence[Mode], **kw: Any
) -> tuple[list[ModeModel], int, list[int], float]:
    start = time.perf_counter()
    models, params, counts = build_models(source, modes, **kw)
    return models, params, counts, time.perf_counter() - start


def check_seq(seq: int, layout: Layout) -> None:
    if seq < 1 or seq % layout.sp:
        raise ConfigError(f"--seq {seq}: give a positive multiple of sp={layout.sp}")


__all__ = ["Estimate", "ModeModel", "Plan", "build_models", "derive_auto", "estimate", "search_max_seq", "timed_models"]
