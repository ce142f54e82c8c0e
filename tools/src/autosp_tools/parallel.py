"""Data parallelism around an AutoSP program: a dp x sp mesh, DDP, FSDP2 and DeepSpeed ZeRO.

AutoSP already all-reduces gradients inside its SP group, so every wrapper here
reduces over the dp group only; reducing over the world would count each SP
rank's (identical) gradient again.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

DATA_PARALLEL = ("ddp", "fsdp")
DEEPSPEED_STAGES = (0, 1, 2, 3)
ZERO3_REFUSAL = (
    "ZeRO-3 is not supported with AutoSP yet: its per-submodule parameter gathering breaks the "
    "compiled graph into pieces, and AutoSP needs attention and the sequence in one graph; "
    "use --deepspeed 1 or 2, or --data-parallel fsdp to shard parameters"
)


@dataclass(frozen=True)
class Groups:
    """This rank's SP and dp groups; ``None`` when running on one process."""

    sp: Any
    dp: Any
    dp_rank: int
    dp_size: int
    mesh: Any


def make_groups(dp: int, sp: int, world: int) -> Groups:
    """The dp x sp mesh: consecutive ranks share a sequence, ranks ``i, i + sp, ...`` share a gradient."""
    if world == 1:
        return Groups(sp=None, dp=None, dp_rank=0, dp_size=1, mesh=None)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dp, sp), mesh_dim_names=("dp", "sp"))
    return Groups(
        sp=mesh["sp"].get_group(), dp=mesh["dp"].get_group(), dp_rank=mesh.get_local_rank("dp"), dp_size=dp, mesh=mesh
    )


def mean_over_dp(value: torch.Tensor, groups: Groups) -> torch.Tensor:
    """Each dp rank holds the mean over its equal share of rows; their mean is the global-batch loss."""
    if groups.dp is None or groups.dp_size == 1:
        return value
    value = value.detach().clone()
    dist.all_reduce(value, group=groups.dp)
    return value / groups.dp_size


class Trainer(Protocol):
    """One optimizer step on this rank's rows; returns this rank's (dp-local) loss.

    ``after_forward`` runs between the forward and the backward (fault injection in tests).
    """

    def step(self, ids: torch.Tensor, lr: float, after_forward: Callable[[], None] | None = None) -> torch.Tensor: ...


@dataclass
class TorchTrainer:
    """Eager optimizer loop around a (possibly DDP- or FSDP-wrapped) AutoSP program."""

    module: Any
    params: list[nn.Parameter]
    optimizer: torch.optim.Optimizer
    grad_clip: float

    def step(self, ids: torch.Tensor, lr: float, after_forward: Callable[[], None] | None = None) -> torch.Tensor:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        loss = self.module(ids, ids)
        if after_forward is not None:
            after_forward()
        loss.backward()
        if self.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()


def wrap_data_parallel(kind: str, program: Any, groups: Groups) -> Any:
    """DDP or FSDP2 over the dp group only, around (DDP) or under (FSDP2) the compiled program.

    DDP wraps the compiled program rather than being compiled itself: Dynamo's
    DDPOptimizer would split a compiled DDP module into buckets, and AutoSP wants
    the whole graph. FSDP2's hooks sit on ``model`` and run outside the compiled
    graph (Dynamo skips FSDP hooks), all-gathering before and reduce-scattering after.
    """
    if groups.dp_size == 1:
        return program
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(program, process_group=groups.dp)
    if kind == "fsdp":
        return program  # shard_model has put fully_shard on the model under the program
    raise ValueError(f"unknown data parallelism {kind!r}; use one of {DATA_PARALLEL}")


def shard_model(kind: str, model: nn.Module, groups: Groups) -> None:
    """FSDP2 must shard the parameters before the optimizer is built on them."""
    if kind == "fsdp" and groups.dp_size > 1:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=groups.mesh["dp"])


class _DataParallelOnly:
    """A DeepSpeed ``mpu`` whose data-parallel group is the dp group, with no model parallelism.

    DeepSpeed averages gradients and shards ZeRO state over the data-parallel
    group. Without an mpu that group is the world, which would average over the
    SP ranks too; DeepSpeed's own ``sequence_parallel_size`` would make ZeRO
    shard over dp x sp. It has no ``get_sequence_parallel_*``, so DeepSpeed sees
    sequence parallelism of 1: AutoSP's SP is invisible to it.
    """

    def __init__(self, groups: Groups, solo: Any) -> None:
        self._dp = groups.dp
        self._solo = solo

    def get_data_parallel_group(self) -> Any:
        return self._dp

    def get_data_parallel_world_size(self) -> int:
        return dist.get_world_size(self._dp)

    def get_data_parallel_rank(self) -> int:
        return dist.get_rank(self._dp)

    def get_data_parallel_group_ranks(self) -> list[int]:
        return dist.get_process_group_ranks(self._dp)

    def get_model_parallel_group(self) -> Any:
        return self._solo

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_rank(self) -> int:
        return 0


def _quiet_deepspeed_comm() -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed.comm.torch  # noqa: F401 - loads the module patched below

    # The shared-memory all-reduce op is a g++ JIT build of minutes that gloo never uses.
    # ``deepspeed.comm.torch`` as an attribute is the torch module, hence sys.modules.
    comm_torch: Any = sys.modules["deepspeed.comm.torch"]
    comm_torch.build_shm_op = lambda: None


def deepspeed_config(stage: int, rows: int, lr: float, weight_decay: float, grad_clip: float) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": rows,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": grad_clip,
        "zero_optimization": {"stage": stage},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": weight_decay, "torch_adam": True},
        },
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


@dataclass
class DeepSpeedTrainer:
    engine: Any

    def step(self, ids: torch.Tensor, lr: float, after_forward: Callable[[], None] | None = None) -> torch.Tensor:
        for group in self.engine.optimizer.param_groups:
            group["lr"] = lr
        loss = self.engine(ids, ids)
        if after_forward is not None:
            after_forward()
        self.engine.backward(loss)
        self.engine.step()
        return loss.detach()


def deepspeed_trainer(program: Any, groups: Groups, config: dict[str, Any]) -> DeepSpeedTrainer:
    """A DeepSpeed engine that runs the AutoSP program, data-parallel over the dp group only."""
    if int(config.get("zero_optimization", {}).get("stage", 0)) == 3:
        raise ValueError(ZERO3_REFUSAL)  # before any process group or engine is made
    _quiet_deepspeed_comm()
    import deepspeed

    if not dist.is_initialized():
        # DeepSpeed needs a process group even for one process; an in-memory store needs no port.
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    # DeepSpeed reads the launcher's variables; spawned ranks all live on this machine.
    for name, value in (
        ("RANK", dist.get_rank()),
        ("LOCAL_RANK", dist.get_rank()),
        ("WORLD_SIZE", dist.get_world_size()),
    ):
        os.environ.setdefault(name, str(value))
    deepspeed.init_distributed(dist_backend="gloo")
    world = dist.get_world_size()
    if groups.dp is None:
        # One process: a world of one is both the dp group and the trivial model-parallel group.
        groups = Groups(sp=None, dp=dist.group.WORLD, dp_rank=0, dp_size=1, mesh=None)
    solo, _ = dist.new_subgroups(group_size=1) if world > 1 else (dist.group.WORLD, None)
    engine, *_ = deepspeed.initialize(model=program, config=config, mpu=_DataParallelOnly(groups, solo))
    return DeepSpeedTrainer(engine)


__all__ = [
    "DATA_PARALLEL",
    "DEEPSPEED_STAGES",
    "ZERO3_REFUSAL",
    "DeepSpeedTrainer",
    "Groups",
    "TorchTrainer",
    "Trainer",
    "deepspeed_config",
    "deepspeed_trainer",
    "make_groups",
    "mean_over_dp",
    "shard_model",
    "wrap_data_parallel",
]
