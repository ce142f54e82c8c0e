"""The methods the benchmark compares, and how each one runs one training step.

A method is data (``Method``); ``FAMILIES`` maps its family to a builder that returns a
``Runner``. A new variant of ours (ring, hybrid) is one more ``Method`` entry in
``METHODS`` with ``family="autosp"`` and its ``autosp.compile`` options.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autosp_tools.bench.workload import Workload, build_model, make_batch


@dataclass(frozen=True)
class Method:
    name: str
    family: str  # "single" | "ds-ulysses" | "ds-autosp" | "autosp"
    distributed: bool  # runs on the SP group (else on one process)
    compiled: bool
    options: Mapping[str, Any] = field(default_factory=dict)
    label: str = ""


METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method("eager", "single", False, False, label="single device, eager"),
        Method("compiled", "single", False, True, label="single device, torch.compile"),
        Method("ulysses", "ds-ulysses", True, False, label="hand-written DeepSpeed-Ulysses, eager"),
        Method("ulysses-compiled", "ds-ulysses", True, True, label="hand-written DeepSpeed-Ulysses, torch.compile"),
        Method("ds-autosp", "ds-autosp", True, True, label="DeepSpeed AutoSP (deepcompile, inductor)"),
        Method("autosp-ulysses", "autosp", True, True, {"variant": "ulysses", "sac": False}, "ours: ulysses"),
        Method(
            "autosp-ulysses-sac",
            "autosp",
            True,
            True,
            {"variant": "ulysses", "sac": True},
            "ours: ulysses + SAC (MLPs tiled: tile_mlp='auto')",
        ),
        Method(
            "autosp-ulysses-sac-untiled",
            "autosp",
            True,
            True,
            {"variant": "ulysses", "sac": True, "tile_mlp": False},
            "ours: ulysses + SAC, MLPs whole",
        ),
        Method(
            "autosp-ulysses-sac-tiled",
            "autosp",
            True,
            True,
            {"variant": "ulysses", "sac": True, "tile_mlp": True},
            "ours: ulysses + SAC + tiled MLPs",
        ),
        Method(
            "autosp-ulysses-auto",
            "autosp",
            True,
            True,
            {"variant": "ulysses", "sac": "auto"},
            "ours: ulysses, SAC by cost model (the default)",
        ),
        Method("autosp-ring", "autosp", True, True, {"variant": "ring", "sac": False}, "ours: ring"),
        Method("autosp-ring-sac", "autosp", True, True, {"variant": "ring", "sac": True}, "ours: ring + SAC"),
    )
}
REFERENCE = "eager"  # its loss is the single-device loss the others are compared with
BASELINE = "ulysses"  # ratios in results.md are against this one


@dataclass
class StepEnv:
    workload: Workload
    rank: int
    world: int
    device: torch.device
    backend: str  # compiler behind torch.compile / autosp for compiled methods
    zero_stage: int = 0


class Runner:
    """One method, ready to step on the shared batch; ``forward`` returns (loss to backprop, reported loss)."""

    model: nn.Module
    notes: dict[str, Any]

    def forward(self) -> tuple[torch.Tensor, float]:
        raise NotImplementedError

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def zero_grad(self) -> None:
        for p in self.model.parameters():
            p.grad = None

    def finish(self) -> None:
        """Collect notes after the steps (reports exist only once compiled)."""


class SingleRunner(Runner):
    def __init__(self, m: Method, env: StepEnv) -> None:
        self.model = build_model(env.workload, env.device)
        self.fn: Callable[..., torch.Tensor] = (
            torch.compile(self.model, backend=env.backend) if m.compiled else self.model
        )  # type: ignore[assignment]
        self.ids, self.labels = make_batch(env.workload, env.device)
        self.notes = {}

    def forward(self) -> tuple[torch.Tensor, float]:
        loss = self.fn(self.ids, self.labels)
        return loss, float(loss.detach())


class AutoSPRunner(Runner):
    def __init__(self, m: Method, env: StepEnv) -> None:
        import autosp

        self.model = build_model(env.workload, env.device)
        self.fn = autosp.compile(self.model, sp_size=env.world, backend=env.backend, **dict(m.options))
        self.ids, self.labels = make_batch(env.workload, env.device)
        self.notes = {}

    def forward(self) -> tuple[torch.Tensor, float]:
        loss = self.fn(self.ids, self.labels)
        return loss, float(loss.detach())

    def finish(self) -> None:
        reports = getattr(self.fn, "autosp_reports", [])
        if reports:
            r = reports[0]
            self.notes = {
                "collectives": dict(r.collectives),
                "fallbacks": list(r.fallbacks),
                "sac": {k: str(v) for k, v in r.sac.items()},
                "sites": len(r.sites),
            }


class UlyssesRunner(Runner):
    def __init__(self, m: Method, env: StepEnv) -> None:
        from autosp_tools.bench.deepspeed_env import import_deepspeed
        from autosp_tools.bench.ulysses import UlyssesLM, shard_inputs

        import_deepspeed()
        self.group = dist.group.WORLD
        lm = build_model(env.workload, env.device)
        self.model = UlyssesLM(lm, self.group)
        self.fn = torch.compile(self.model, backend=env.backend) if m.compiled else self.model
        ids, labels = make_batch(env.workload, env.device)
        self.ids, self.targets, self.pos = shard_inputs(ids, labels, env.rank, env.world)
        self.notes = {}

    def forward(self) -> tuple[torch.Tensor, float]:
        from autosp_tools.bench.ulysses import global_loss

        loss_sum, count = self.fn(self.ids, self.targets, self.pos)
        return global_loss(loss_sum, count, self.group)

    def backward(self, loss: torch.Tensor) -> None:
        from autosp_tools.bench.ulysses import all_reduce_grads

        loss.backward()
        all_reduce_grads(self.model, self.group)


class DSAutoSPRunner(Runner):
    def __init__(self, m: Method, env: StepEnv) -> None:
        from autosp_tools.bench.ds_autosp import DeepSpeedAutoSP

        self.ds = DeepSpeedAutoSP(build_model(env.workload, env.device), env.workload.batch_size, env.zero_stage)
        self.model = self.ds.model
        self.ids, self.labels = make_batch(env.workload, env.device)
        self.notes = {"zero_stage": env.zero_stage}

    def forward(self) -> tuple[torch.Tensor, float]:
        return self.ds.forward(self.ids, self.labels)

    def backward(self, loss: torch.Tensor) -> None:
        self.ds.backward(loss)


FAMILIES: dict[str, Callable[[Method, StepEnv], Runner]] = {
    "single": SingleRunner,
    "autosp": AutoSPRunner,
    "ds-ulysses": UlyssesRunner,
    "ds-autosp": DSAutoSPRunner,
}


def build_runner(m: Method, env: StepEnv) -> Runner:
    return FAMILIES[m.family](m, env)


__all__ = ["BASELINE", "FAMILIES", "METHODS", "REFERENCE", "Method", "Runner", "StepEnv", "build_runner"]
