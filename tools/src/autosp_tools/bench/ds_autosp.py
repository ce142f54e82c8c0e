"""DeepSpeed's own AutoSP (deepcompile pass "autosp") driving the built-in Llama, for side-by-side runs.

Used by ``autosp-bench`` and ``autosp-sac-bench``; the process group must already be up.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from autosp_tools.bench.deepspeed_env import import_deepspeed
from autosp_tools.bench.workload import PositionIdsLM
from autosp_tools.model import LlamaLM


class DeepSpeedAutoSP:
    """One DeepSpeed engine with ``sequence_parallel_size`` = the world, ZeRO ``zero_stage``, Inductor."""

    def __init__(self, lm: LlamaLM, batch_size: int, zero_stage: int = 0) -> None:
        rank, world = dist.get_rank(), dist.get_world_size()
        # DeepSpeed reads these (its launcher or torchrun would set them).
        for key, value in (("RANK", rank), ("LOCAL_RANK", rank), ("WORLD_SIZE", world), ("LOCAL_WORLD_SIZE", world)):
            os.environ.setdefault(key, str(value))
        deepspeed = import_deepspeed()
        self.model = PositionIdsLM(lm)
        self.world = world
        config = {
            "train_micro_batch_size_per_gpu": batch_size,
            "sequence_parallel_size": world,
            "compile": {"deepcompile": True, "passes": ["autosp"]},
            "zero_optimization": {"stage": zero_stage},
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }
        # engine.backward insists on an optimizer; lr=0 and no step keeps the weights fixed.
        opt = torch.optim.SGD(self.model.parameters(), lr=0.0)
        self.engine, *_ = deepspeed.initialize(model=self.model, optimizer=opt, config=config)
        self.engine.compile()

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, float]:
        """This rank's loss (to backprop) and the mean over ranks (what DeepSpeed's users report)."""
        from deepspeed.compile.passes.sp_compile import prepare_autosp_inputs

        pos = torch.arange(ids.shape[1], device=ids.device)[None].expand_as(ids).contiguous()
        # prepare_autosp_inputs tags the tensors it is given; fresh clones keep each step alike.
        ids, labels, pos, _ = prepare_autosp_inputs(ids.clone(), labels.clone(), pos, attention_mask=None, seq_dim=1)
        loss = self.engine(ids, labels, pos)
        local = loss.detach().float().clone()
        dist.all_reduce(local)
        return loss, float(local) / self.world

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)


__all__ = ["DeepSpeedAutoSP"]
