"""What is live at a training step's memory peak, per rank: each buffer, its size, the op that made it.

``profile_peak(step)`` runs ``step`` under ``torch.profiler`` with ``profile_memory=True``: every
allocation and free of the PyTorch allocator, inside Inductor-compiled code too, arrives as a
``[memory]`` event with its address, size and time. Replaying them gives the bytes held at each
moment (counted from the step's start, so parameters and inputs that already exist are not in it)
and, at the highest moment, the buffers then live. Each buffer is named by the innermost op whose
time span holds its allocation; Inductor allocates a kernel's output in its Python wrapper just
before the kernel, so an allocation whose innermost op is a whole compiled graph is named by the
next op that graph runs (``torch._inductor.config.cpp.enable_kernel_profile`` makes its C++
kernels appear as ops). Allocations outside the allocator (gloo's own buffers, malloc in
extensions) are not seen; the process's resident high-water mark covers them (``hwm_delta``).
"""

from __future__ import annotations

import bisect
import gc
import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MiB = 2**20
# Ops that only contain others: an allocation directly inside one belongs to the op that follows.
_CONTAINERS = ("## Call CompiledFxGraph", "Torch-Compiled Region", "CompiledFunction", "autograd::engine")
_BACKWARD = ("CompiledFunctionBackward", "autograd::engine::evaluate_function")


@dataclass(frozen=True)
class Buffer:
    nbytes: int
    op: str
    phase: str  # "forward" | "backward"
    t: float  # allocation time, microseconds from the step's start
    kept: bool  # still allocated when the step ended (gradients, outputs)


@dataclass
class Peak:
    peak: int  # bytes above the step's start at the highest moment
    at: float  # its time, microseconds from the step's start
    phase: str  # where the peak falls
    op: str  # the op allocating when the peak was reached
    live: list[Buffer]  # buffers allocated in the step and live at the peak, largest first
    end: int  # bytes above the start when the step ended (what the step keeps)
    phase_peaks: dict[str, int] = field(default_factory=dict)  # highest moment within each phase

    def by_op(self) -> list[tuple[str, str, int, int]]:
        """(phase, op, count, bytes) of the live buffers, grouped, largest first."""
        groups: dict[tuple[str, str], list[int]] = {}
        for b in self.live:
            groups.setdefault((b.phase, _short(b.op)), []).append(b.nbytes)
        rows = [(ph, op, len(v), sum(v)) for (ph, op), v in groups.items()]
        return sorted(rows, key=lambda r: -r[3])

    def describe(self, top: int = 12) -> str:
        kept = sum(b.nbytes for b in self.live if b.kept)
        lines = [
            f"peak {self.peak / MiB:.1f} MiB in the {self.phase} at {self.op!r} "
            f"({len(self.live)} live buffers, {kept / MiB:.1f} MiB of them kept after the step); "
            f"forward peak {self.phase_peaks.get('forward', 0) / MiB:.1f}, "
            f"backward {self.phase_peaks.get('backward', 0) / MiB:.1f}, step ends at {self.end / MiB:.1f} MiB"
        ]
        for phase, op, n, nbytes in self.by_op()[:top]:
            lines.append(f"  {nbytes / MiB:8.2f} MiB  {n:3d} x  {phase:8s}  {op}")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return {
            "peak": self.peak,
            "phase": self.phase,
            "op": self.op,
            "end": self.end,
            "phase_peaks": self.phase_peaks,
            "by_op": self.by_op(),
        }


def _short(op: str) -> str:
    # Inductor's kernel names carry a per-graph prefix and a serial number; the rest names the ops fused.
    if op.startswith("graph_") and "_cpp_" in op:
        op = op[op.index("_cpp_") + 1 :]
    return op.rstrip("0123456789").rstrip("_") if op.startswith("cpp_") else op


@dataclass(frozen=True)
class _Op:
    name: str
    start: float
    end: float


class _Ops:
    """The main thread's ops by start time, to find what holds or follows a moment."""

    def __init__(self, ops: list[_Op]) -> None:
        self.ops = sorted(ops, key=lambda o: (o.start, -o.end))
        self.starts = [o.start for o in self.ops]

    def enclosing(self, t: float) -> list[_Op]:
        i = bisect.bisect_right(self.starts, t)
        return [o for o in self.ops[:i] if o.end >= t]

    def name(self, t: float) -> str:
        chain = self.enclosing(t)
        if not chain:
            return self._next(t, float("inf"))
        inner = chain[-1]
        if inner.name.startswith(_CONTAINERS):
            return self._next(t, inner.end, fallback=inner.name)
        return inner.name

    def _next(self, t: float, until: float, fallback: str = "?") -> str:
        for o in self.ops[bisect.bisect_right(self.starts, t) :]:
            if o.start > until:
                break
            if not o.name.startswith(_CONTAINERS):
                return o.name
        return fallback

    def phase(self, t: float) -> str:
        return "backward" if any(o.name.startswith(_BACKWARD) for o in self.enclosing(t)) else "forward"


def analyse(trace: dict[str, Any]) -> Peak:
    """The peak and its live buffers from a Chrome trace written by ``torch.profiler``."""
    events = trace["traceEvents"]
    mem = sorted(
        (e for e in events if e.get("name") == "[memory]" and e.get("args", {}).get("Device Type") == 0),
        key=lambda e: e["ts"],
    )
    ops = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    # The step's own thread runs the compiled forward and (on CPU) the backward; others (gloo's) do not.
    steps = [e["tid"] for e in ops if e["name"].startswith("CompiledFunction")]
    tids = [e["tid"] for e in ops]
    main_tid = steps[0] if steps else max(set(tids), key=tids.count) if tids else None
    index = _Ops([_Op(e["name"], e["ts"], e["ts"] + e["dur"]) for e in ops if e["tid"] == main_tid])
    t0 = min([e["ts"] for e in mem] + [o.start for o in index.ops] or [0.0])
    live: dict[int, tuple[int, float]] = {}  # address -> (bytes, allocation time)
    total = best = 0
    best_i = -1
    best_live: dict[int, tuple[int, float]] = {}
    phase_peaks = {"forward": 0, "backward": 0}
    for i, e in enumerate(mem):
        a = e["args"]
        nbytes, addr = int(a["Bytes"]), int(a["Addr"])
        total += nbytes
        if nbytes > 0:
            live[addr] = (nbytes, e["ts"])
        else:
            live.pop(addr, None)
        phase = index.phase(e["ts"])
        phase_peaks[phase] = max(phase_peaks[phase], total)
        if total > best:
            best, best_i, best_live = total, i, dict(live)
    at = mem[best_i]["ts"] if best_i >= 0 else t0
    buffers = [
        Buffer(n, index.name(ts), index.phase(ts), ts - t0, live.get(addr) == (n, ts))
        for addr, (n, ts) in best_live.items()
    ]
    buffers.sort(key=lambda b: -b.nbytes)
    return Peak(best, at - t0, index.phase(at), index.name(at), buffers, total, phase_peaks)


def profile_peak(step: Callable[[], Any]) -> Peak:
    """Run ``step`` once under the memory profiler; what was live at its peak."""
    from torch.profiler import ProfilerActivity, profile

    # Garbage of earlier steps freed by a collection inside this one would lower its peak by
    # chance (peaks moved by 20-40 MiB between runs): collect first, and not during the step.
    gc.collect()
    gc.disable()
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step()
    finally:
        gc.enable()
    with tempfile.TemporaryDirectory(prefix="autosp-peak-") as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        trace = json.loads(Path(path).read_text())
    return analyse(trace)


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


def hwm_delta(step: Callable[[], Any]) -> int | None:
    """The resident set's high-water mark during ``step`` above the resident set before it (Linux)."""
    try:
        before = _status("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    except OSError:
        return None
    step()
    return _status("VmHWM") - before


@dataclass(frozen=True)
class ModelShape:
    """The Llama the peak is measured on (the bench's presets lack the shapes asked for)."""

    dim: int = 256
    layers: int = 4
    heads: int = 8
    kv_heads: int = 2
    hidden: int = 688
    vocab: int = 264  # autosp_tools.bench.workload.VOCAB: the batch draws ids below it


PROFILED_STEPS = 3


def measure_method(
    name: str, shape: ModelShape, seq: int, backend: str, rank: int, world: int, inductor: dict[str, Any] | None = None
) -> dict[str, Any]:
    """One method of ``autosp_tools.bench.methods`` on this rank: compile and warm-up steps, then
    one step under the memory profiler and one unprofiled for the resident high-water mark.
    ``inductor``: Inductor settings for this process (to measure what one would change)."""
    import torch

    from autosp_tools.bench.methods import METHODS, StepEnv, build_runner
    from autosp_tools.bench.workload import Workload
    from autosp_tools.model import ModelConfig

    class _Workload(Workload):
        def model_config(self) -> ModelConfig:
            return ModelConfig(
                vocab=shape.vocab,
                dim=shape.dim,
                layers=shape.layers,
                heads=shape.heads,
                kv_heads=shape.kv_heads,
                hidden=shape.hidden,
                max_len=seq,
                impl="builtin",
            )

    import torch._inductor.config as inductor_config

    inductor_config.cpp.enable_kernel_profile = True  # Inductor's kernels become named ops in the trace
    for key, value in (inductor or {}).items():
        setattr(inductor_config, key, value)
    env = StepEnv(_Workload("custom", seq, 1), rank, world, torch.device("cpu"), backend)
    runner = build_runner(METHODS[name], env)
    losses: list[float] = []

    def step() -> None:
        runner.zero_grad()
        loss, reported = runner.forward()
        runner.backward(loss)
        losses.append(reported)

    for _ in range(2):  # compile, then one step with everything warm
        step()
    # The median of three profiled steps: gloo's background threads allocate at times that vary
    # between steps, which moved a single step's peak by 30-40 MiB here.
    peaks = sorted((profile_peak(step) for _ in range(PROFILED_STEPS)), key=lambda p: p.peak)
    peak = peaks[len(peaks) // 2]
    spread = (peaks[0].peak, peaks[-1].peak)
    hwm = hwm_delta(step)
    grads = {n: p.grad for n, p in runner.model.named_parameters() if p.grad is not None}
    return {
        "method": name,
        "rank": rank,
        "peak": peak,
        "peak_spread": spread,
        "hwm": hwm,
        "loss": losses[-1],
        "grad_norms": {n: float(g.double().norm()) for n, g in grads.items()},
    }


__all__ = ["Buffer", "MiB", "ModelShape", "Peak", "analyse", "hwm_delta", "measure_method", "profile_peak"]
