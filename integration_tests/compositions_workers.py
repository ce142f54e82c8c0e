"""Spawned workers for test_compositions (module level, so spawn can import them by name)."""

from __future__ import annotations

import torch.distributed as dist

from autosp_tools.model import ModelConfig, build_model
from autosp_tools.parallel import deepspeed_config, deepspeed_trainer, make_groups


def deepspeed_group_sizes(rank: int, world: int, sp: int, stage: int) -> dict[str, int]:
    """What DeepSpeed takes for its data-parallel world when AutoSP's SP group sits inside it."""
    groups = make_groups(world // sp, sp, world)
    model = build_model(ModelConfig(264, 32, 1, 2, 2, 64, 16, "builtin"))
    engine = deepspeed_trainer(model, groups, deepspeed_config(stage, 1, 1e-3, 0.0, 1.0)).engine
    return {
        "dp_world_size": engine.dp_world_size,
        "seq_dp_world_size": engine.seq_dp_world_size,
        "sequence_parallel_size": engine.sequence_parallel_size,
        "zero_group": dist.get_world_size(engine.optimizer.dp_process_group),
    }
