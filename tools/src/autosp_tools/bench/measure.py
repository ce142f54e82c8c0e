"""What one rank measures while a method trains: bytes saved for backward, memory, step times."""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from autosp.testing import SavedBytes
from autosp_tools.bench.methods import Method, StepEnv, build_runner
from autosp_tools.memory import peak_rss_mb, rss_mb


@dataclass
class RankResult:
    rank: int
    loss: float
    step_s: list[float]
    first_step_s: float
    compile_s: float
    saved_bytes: int
    peak_rss_mb: float
    peak_rss_delta_mb: float
    cuda_max_allocated: int | None
    notes: dict[str, Any] = field(default_factory=dict)

    @property
    def median_step_s(self) -> float:
        return statistics.median(self.step_s) if self.step_s else self.first_step_s

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["median_step_s"] = self.median_step_s
        return d


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p for p in model.parameters()]


def measure(m: Method, env: StepEnv, warmup: int, steps: int) -> RankResult:
    """Build the method, take ``1 + warmup + steps`` steps, and a separate step for saved bytes."""
    cuda = env.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(env.device)
    rss0 = rss_mb()
    runner = build_runner(m, env)

    def step() -> tuple[float, float]:
        runner.zero_grad()
        _sync(env.device)
        t0 = time.perf_counter()
        loss, reported = runner.forward()
        runner.backward(loss)
        _sync(env.device)
        return time.perf_counter() - t0, reported

    first_s, loss = step()
    for _ in range(warmup):
        step()
    times = [step()[0] for _ in range(steps)]
    # Measured apart from the timed steps: the hooks cost time, and compiling under them could differ.
    saved = SavedBytes(_params(runner.model))
    runner.zero_grad()
    with saved.record():
        out, _ = runner.forward()
    runner.backward(out)
    del out
    runner.finish()
    median = statistics.median(times) if times else first_s
    return RankResult(
        rank=env.rank,
        loss=loss,
        step_s=times,
        first_step_s=first_s,
        compile_s=max(0.0, first_s - median) if m.compiled else 0.0,
        saved_bytes=saved.total,
        peak_rss_mb=peak_rss_mb(),
        peak_rss_delta_mb=peak_rss_mb() - rss0,
        cuda_max_allocated=torch.cuda.max_memory_allocated(env.device) if cuda else None,
        notes=runner.notes,
    )


__all__ = ["RankResult", "SavedBytes", "measure"]
