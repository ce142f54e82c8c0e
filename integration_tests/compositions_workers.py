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


def ddp_inside(rank: int, world: int) -> dict[str, object]:
    """``autosp.compile(DDP(model))`` with several gradient buckets, against single-device eager; and
    ``torch.compile(DDP(model), backend=autosp.backend())``, which Dynamo's DDPOptimizer would split."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import autosp
    from autosp.testing.models import Config, LlamaLike

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        return LlamaLike(Config(dim=256, hidden=1024))  # 1 MiB matrices: several 1 MiB buckets

    ids = torch.randint(0, Config().vocab, (2, 16), generator=torch.Generator().manual_seed(3))
    ref = build()
    ref_loss = ref(ids, ids)
    ref_loss.backward()
    model = build()
    ddp = DDP(model, bucket_cap_mb=1)  # DDP over the SP ranks: the same gradients on both
    compiled = autosp.compile(ddp, backend="aot_eager", sac=False)
    loss = compiled(ids, ids)
    loss.backward()
    worst = max((p.grad - r.grad).abs().max().item() for p, r in zip(model.parameters(), ref.parameters()))
    refused = ""
    try:
        torch._dynamo.reset()
        torch.compile(DDP(build(), bucket_cap_mb=1), backend=autosp.backend(backend="aot_eager"))(ids, ids)
    except Exception as e:  # noqa: BLE001 - the test reads the message
        refused = f"{type(e).__name__}: {e}"
    return {
        "loss": (loss.item(), ref_loss.item()),
        "worst_grad": worst,
        "refused": refused,
    }
