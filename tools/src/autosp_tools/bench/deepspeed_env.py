"""Import DeepSpeed quietly and quickly, on top of a process group that is already up."""

from __future__ import annotations

import os
import sys
from typing import Any


def import_deepspeed() -> Any:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed.comm.torch  # patched below, before the backend is made

    # The CPU backend JIT-builds a shared-memory op with g++ at init (minutes); gloo does not need it.
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # type: ignore[attr-defined]
    import deepspeed
    import deepspeed.comm as ds_dist

    if not ds_dist.is_initialized():
        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    return deepspeed


__all__ = ["import_deepspeed"]
