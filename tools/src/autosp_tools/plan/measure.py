"""Real runs to check the plan against: bytes saved for backward and the step's memory peak, per rank.

Each rank compiles the shipped Llama-style model (``autosp_tools.model``, built-in implementation)
with AutoSP and runs a step to compile, then one step under ``saved_tensors_hooks`` (distinct
storages saved for backward, parameters excluded, as ``autosp-bench`` measures) and one whose peak
is read from the allocator: the most bytes it held during the step above what it held when the
step began (activations, temporaries, buffers inside custom ops and collectives, and the gradients
as they appear; not the parameters or inputs, which existed before). On CUDA that is
``torch.cuda.max_memory_allocated`` minus ``memory_allocated`` before the step; on the CPU the same
quantity replayed from the profiler's allocation and free events. Both mean what the plan's step
peak means.

(The CPU peak was once read by PyTorch's ``MemTracker``, which disagrees with both: it counts the
storage of any tensor an op returns, so parameters appear when a view of them (``aten.t`` of a
weight) is taken and the token ids when sliced, while tensors allocated inside a custom op, such
as a collective's send buffer, are never seen.)
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from autosp_tools.model import ModelConfig, build_model

# The model autosp-sac-bench measures: dim 128, 8 heads, 2 kv heads, 4 layers.
SHIPPED = ModelConfig(vocab=256, dim=128, layers=4, heads=8, kv_heads=2, hidden=384, max_len=1 << 20, impl="builtin")
TINY = ModelConfig(vocab=256, dim=64, layers=2, heads=4, kv_heads=2, hidden=128, max_len=1 << 20, impl="builtin")


@dataclass(frozen=True)
class Case:
    """One real run: ``sp`` ranks (spawned gloo processes when > 1) at length ``seq``."""

    model: ModelConfig
    seq: int
    sp: int
    sac: bool
    device: str = "cpu"
    backend: str = "aot_eager"
    dtype: str = "fp32"
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def nproc(self) -> int:
        return self.sp


def shipped_model(layers: int = SHIPPED.layers, config: ModelConfig = SHIPPED) -> torch.nn.Module:
    """The shipped model with ``layers`` layers, in the default dtype (what ``autosp-plan`` compiles on fakes).

    Its floating buffers (RoPE frequencies, made in fp32 on purpose) follow the parameters, as
    ``model.to(dtype)`` would do; ``.to`` itself cannot swap fake parameters.
    """
    from dataclasses import replace

    model = build_model(replace(config, layers=layers))
    dtype = torch.get_default_dtype()
    for module in model.modules():
        for name, buf in list(module.named_buffers(recurse=False)):
            if buf is not None and buf.is_floating_point() and buf.dtype != dtype:
                setattr(module, name, buf.to(dtype))
    return model


def cpu_peak(step: Any) -> int:
    """Most bytes the CPU allocator held during ``step()`` above what it held before it.

    Replayed from ``torch.profiler``'s memory events (every allocation and free of the allocator,
    in order), as ``torch.cuda.max_memory_allocated`` counts on CUDA.
    """
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = [
        e
        for e in prof.profiler.kineto_results.events()  # type: ignore[union-attr]
        if e.name() == "[memory]" and e.device_type() == DeviceType.CPU
    ]
    held = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        held += e.nbytes()
        peak = max(peak, held)
    return peak


def _saved_bytes(step: Any, params: list[torch.Tensor]) -> int:
    from autosp_tools.bench.measure import SavedBytes

    saved = SavedBytes(params)
    with saved.record():
        loss = step(backward=False)
    loss.backward()
    return saved.total


def measure(case: Case, rank: int, world: int) -> dict[str, Any]:
    """Per-rank saved bytes and step peak of the real program (rank 0's values are returned by ``launch``)."""
    import autosp
    from autosp_tools.plan.api import DTYPES

    torch._dynamo.reset()
    device = (
        torch.device(case.device, rank if case.device == "cuda" and torch.cuda.device_count() > 1 else 0)
        if case.device == "cuda"
        else torch.device("cpu")
    )
    torch.manual_seed(0)
    dtype = DTYPES[case.dtype]
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = shipped_model(case.model.layers, case.model).to(device)
    finally:
        torch.set_default_dtype(before)
    opts: dict[str, Any] = {"sp_size": world} if world > 1 else {}
    if case.extra.get("fake_world"):
        opts["check_inputs"] = False  # a fake group's all-gather returns no real values to compare
    compiled = autosp.compile(model, sac=case.sac, backend=case.backend, **opts)
    ids = torch.randint(0, case.model.vocab, (1, case.seq), generator=torch.Generator().manual_seed(1)).to(device)

    def step(backward: bool = True) -> torch.Tensor:
        loss = compiled(ids, ids)
        if backward:
            loss.backward()
        return loss

    step()
    model.zero_grad(set_to_none=True)
    times = []
    for _ in range(int(case.extra.get("time_steps", 0))):
        _sync(device)
        start = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    saved = _saved_bytes(step, list(model.parameters()))
    model.zero_grad(set_to_none=True)
    result: dict[str, Any] = {"saved_bytes": saved, "threads": torch.get_num_threads()}
    if times:
        result["step_s"] = statistics.median(times)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        result["peak_bytes"] = torch.cuda.max_memory_allocated(device) - base
        model.zero_grad(set_to_none=True)
    else:
        result["peak_bytes"] = cpu_peak(step)
        model.zero_grad(set_to_none=True)
    return result


def measure_fake_world(case: Case) -> dict[str, Any]:
    """Rank 0 of a ``case.sp``-rank program run for real in this process, the other ranks a fake group."""
    from dataclasses import replace

    from autosp_tools.plan.capture import fake_group

    with fake_group(case.sp):
        return measure(replace(case, extra={**case.extra, "fake_world": True}), 0, case.sp)


@dataclass(frozen=True)
class CollectiveCase:
    """AutoSP's collectives called one by one on ``nproc`` real ranks (see ``collective_peaks``)."""

    nproc: int = 2
    repeats: int = 20


def collective_peaks(case: CollectiveCase, rank: int, world: int) -> dict[str, tuple[int, int]]:
    """Per collective call, (the walk's peak, the allocator's peak) of running it alone on real tensors.

    Each call is traced with ``make_fx`` on fake tensors and walked as the plan walks a graph (its
    inputs exist before, its result and what its implementation allocates besides are counted);
    then it runs for real under ``cpu_peak``. A difference means ``collective_memory`` no longer
    describes ``autosp.sharding.collectives``.
    """
    import torch.distributed as dist
    from torch.fx.experimental.proxy_tensor import make_fx

    from autosp_tools.plan.graphstats import ExprTable, _timeline
    from autosp_tools.plan.runtime import Runtime

    ops = torch.ops.autosp
    group = dist.group.WORLD
    assert group is not None
    name = group.group_name
    x = torch.randn(3, 8 * world, 4, 16)  # [B, S, H, D] with a leading dim > 1: moving dims copies
    sizes = [8] * world

    def exchange(t: torch.Tensor) -> torch.Tensor:
        from autosp.sharding.collectives import all_to_all

        return all_to_all(t, 2 if t.shape[2] % world == 0 else 1, 1, name)

    def functional(t: torch.Tensor) -> torch.Tensor:
        c10d = torch.ops._c10d_functional
        return c10d.wait_tensor(c10d.all_reduce(t, "sum", name))

    calls: dict[str, tuple[Any, tuple[Any, ...]]] = {
        "all_gather dim 1": (lambda t: ops.all_gather(t, 1, sizes, name, False), (x[:, :8].contiguous(),)),
        "all_gather dim 0": (lambda t: ops.all_gather(t, 0, [3] * world, name, False), (x,)),
        "reduce_scatter dim 1": (lambda t: ops.reduce_scatter(t, 1, sizes, name), (x,)),
        "all_reduce strided": (lambda t: ops.all_reduce(t, name, False), (x.transpose(1, 2),)),
        "all_to_all start and wait": (exchange, (torch.randn(1, 8 * world, 4 * world, 16),)),
        "functional all_reduce and wait": (functional, (x,)),
    }
    out: dict[str, tuple[int, int]] = {}
    for label, (fn, args) in calls.items():
        gm = make_fx(fn, tracing_mode="fake")(*args)
        table = ExprTable(None)
        held = walked = 0.0
        values = table.values
        timeline = _timeline(gm, table, lambda n: False, {}, runtime=Runtime("cpu", torch.get_num_threads()))
        for sign, i, _ in timeline.events:
            held += sign * values(0)[i]
            walked = max(walked, held)
        # The most of several runs: a buffer freed late on some runs only (a race with gloo's
        # worker thread) is a peak the plan misses, and must fail here, not now and then.
        measured = 0
        for _ in range(case.repeats):
            dist.barrier()
            measured = max(measured, cpu_peak(lambda fn=fn, args=args: fn(*args)))
        out[label] = (int(walked), measured)
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def predict(case: Case, threads: int = 1) -> dict[str, Any]:
    """What ``autosp-plan`` predicts for the same program (the whole model compiled, no scaling).

    ``threads``: intra-op threads of each CPU rank, as ``measure`` reports them (CPU kernels keep
    per-thread scratch).
    """
    from autosp_tools.plan.api import DTYPES
    from autosp_tools.plan.capture import Mode
    from autosp_tools.plan.models import ModelSource
    from autosp_tools.plan.planner import build_models
    from autosp_tools.plan.runtime import GPU, Runtime

    source = ModelSource(
        f"shipped/{case.model.dim}",
        case.model.layers,
        lambda n: shipped_model(n, case.model),
        scalable=False,
        heads=case.model.heads,
    )
    mode = Mode("case", "ulysses", case.sac, backend=case.backend)
    models, _, _ = build_models(
        source,
        [mode],
        sp=case.sp,
        dtype=DTYPES[case.dtype],
        batch=1,
        seq_hint=case.seq,
        runtime=GPU if case.device == "cuda" else Runtime("cpu", threads),
    )
    m = models[0]
    if m.error:
        raise RuntimeError(f"the plan could not compile the case: {m.error}")
    return {"saved_bytes": m.scaled(lambda s: s.evaluate(s.saved, case.seq)), "peak_bytes": m.peak(case.seq)}


__all__ = [
    "SHIPPED",
    "TINY",
    "Case",
    "CollectiveCase",
    "collective_peaks",
    "cpu_peak",
    "measure",
    "measure_fake_world",
    "predict",
    "shipped_model",
]
