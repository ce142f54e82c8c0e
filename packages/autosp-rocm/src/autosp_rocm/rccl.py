"""RCCL settings that matter for the all-to-alls and ring hops of sequence parallelism.

Never applied on import or by ``autosp.compile``: call ``apply_rccl_settings()`` before the first
collective (before ``init_process_group`` is safest), or export them yourself (``python -m
autosp_rocm.rccl`` prints them). A variable you already set is never overwritten.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class RcclSetting:
    name: str
    value: str
    archs: tuple[str, ...]  # gcnArchName prefixes it applies to; () for all
    reason: str


RCCL_SETTINGS = (
    RcclSetting(
        "NCCL_MIN_NCHANNELS",
        "112",
        ("gfx942",),
        "MI300X/MI325X: one all-to-all drives 7 xGMI links at once; RCCL's default channel count "
        "leaves links idle at SP-sized messages. 112 is what AMD's MI300X workload-tuning guide "
        "suggests, and what RCCL 2.26 (ROCm 7.0) made the default for 8 x gfx950.",
    ),
    RcclSetting(
        "TORCH_NCCL_HIGH_PRIORITY",
        "1",
        (),
        "Runs PyTorch's RCCL streams at high priority, so the all-to-alls on the critical path of "
        "every attention layer are not queued behind compute kernels.",
    ),
    RcclSetting(
        "HSA_FORCE_FINE_GRAIN_PCIE",
        "1",
        (),
        "Lets RCCL use peer-to-peer transfers between GPUs connected over PCIe instead of staging through "
        "host memory (RCCL usage tips); harmless on xGMI-connected nodes.",
    ),
)


def recommended(arch: str = "") -> list[RcclSetting]:
    return [s for s in RCCL_SETTINGS if not s.archs or any(arch.startswith(a) for a in s.archs)]


def apply_rccl_settings(arch: str = "", *, environ: dict[str, str] | None = None) -> dict[str, str]:
    """Set the recommended variables that are not set yet; return what was set.

    Args:
        arch: gcnArchName of the devices ("gfx942"); "" applies only the settings for every arch.
        environ: the environment to change (``os.environ`` by default).
    """
    env = os.environ if environ is None else environ
    if environ is None and dist.is_available() and dist.is_initialized():
        print(
            "autosp-rocm: RCCL settings applied after init_process_group reach only communicators created "
            "later; apply them before it",
            file=sys.stderr,
        )
    applied = {}
    for s in recommended(arch):
        if s.name not in env:
            env[s.name] = s.value
            applied[s.name] = s.value
    return applied


def main() -> None:
    arch = sys.argv[1] if len(sys.argv) > 1 else ""
    for s in recommended(arch):
        print(f"# {s.reason}\nexport {s.name}={s.value}")


if __name__ == "__main__":
    main()

__all__ = ["RCCL_SETTINGS", "RcclSetting", "apply_rccl_settings", "recommended"]
