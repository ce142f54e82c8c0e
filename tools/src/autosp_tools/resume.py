"""Before any rank starts: refuse a resume that would change the loss curve, tidy --checkpoint-dir."""

from __future__ import annotations

import os
import sys

from autosp_tools import checkpoint
from autosp_tools.config import TrainConfig, TrainConfigError


def check_resume(cfg: TrainConfig) -> None:
    """Refuse a resume whose settings would give another loss curve, before starting ranks."""
    assert cfg.resume is not None
    try:
        saved = checkpoint.load_meta(cfg.resume)
    except checkpoint.CheckpointError as e:
        raise TrainConfigError(str(e)) from e
    diff = checkpoint.meta_mismatch(saved, cfg.curve_meta())
    if diff:
        raise TrainConfigError(
            f"--resume {cfg.resume}: the run's settings differ from the checkpoint's:\n  " + "\n  ".join(diff)
        )


def prepare_checkpoint_dir(cfg: TrainConfig) -> None:
    """Create --checkpoint-dir and clear what an interrupted save left there (rank 0 only under torchrun)."""
    if not cfg.checkpoint_dir or int(os.environ.get("RANK", "0")) != 0:
        return
    os.makedirs(cfg.checkpoint_dir, exist_ok=True)
    for stale in checkpoint.clean_stale(cfg.checkpoint_dir):
        print(f"removed {stale}, left by an interrupted save", file=sys.stderr, flush=True)


__all__ = ["check_resume", "prepare_checkpoint_dir"]
