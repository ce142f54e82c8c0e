"""Real runs to check the plan against: bytes saved for backward and the step's memory peak, per rank.

Each rank compiles the shipped Llama-style model (``autosp_tools.model``, built-in implementation)
with AutoSP and runs a step to compile, then one step under ``saved_tensors_hooks`` (distinct
storages saved for backward, parameters excluded, as ``autosp-bench`` measures) and one under
PyTorch's ``MemTracker`` (peak bytes allocated during the step beyond what existed before it:
activations, temporaries and the gradients as they appear). On CUDA the peak is also read from
``torch.cuda.max_memory_allocated`` minus what was allocated before the step.
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


def _tracker() -> Any:
    """PyTorch's MemTracker, declared an infrastructure mode: Dynamo runs compiled code only when no
    user dispatch mode is active, and the tracker must see the compiled graphs' own allocations."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class CompiledMemTracker(MemTracker):
        @classmethod
        def is_infra_mode(cls) -> bool:
            return True

    return CompiledMemTracker()


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
    result: dict[str, Any] = {"saved_bytes": saved}
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
        tracker = _tracker()
        with tracker:
            step()
        result["peak_bytes"] = tracker.get_tracker_snapshot("peak")[device]["Total"]
    return result


def measure_fake_world(case: Case) -> dict[str, Any]:
    """Rank 0 of a ``case.sp``-rank program run for real in this process, the other ranks a fake group."""
    from dataclasses import replace

    from autosp_tools.plan.capture import fake_group

    with fake_group(case.sp):
        return measure(replace(case, extra={**case.extra, "fake_world": True}), 0, case.sp)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def predict(case: Case) -> dict[str, Any]:
    """What ``autosp-plan`` predicts for the same program (the whole model compiled, no scaling)."""
    from autosp_tools.plan.api import DTYPES
    from autosp_tools.plan.capture import Mode
    from autosp_tools.plan.models import ModelSource
    from autosp_tools.plan.planner import build_models

    source = ModelSource(
        f"shipped/{case.model.dim}",
        case.model.layers,
        lambda n: shipped_model(n, case.model),
        scalable=False,
        heads=case.model.heads,
    )
    mode = Mode("case", "ulysses", case.sac, backend=case.backend)
    models, _, _ = build_models(source, [mode], sp=case.sp, dtype=DTYPES[case.dtype], batch=1, seq_hint=case.seq)
    m = models[0]
    if m.error:
        raise RuntimeError(f"the plan could not compile the case: {m.error}")
    return {"saved_bytes": m.scaled(lambda s: s.evaluate(s.saved, case.seq)), "peak_bytes": m.peak(case.seq)}


__all__ = ["SHIPPED", "TINY", "Case", "measure", "measure_fake_world", "predict", "shipped_model"]
