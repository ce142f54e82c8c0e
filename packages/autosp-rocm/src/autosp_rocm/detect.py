"""Which AMD GPU this is. ROCm builds of PyTorch report device type "cuda"; ``torch.version.hip`` tells them apart.

The architecture comes from ``torch.cuda.get_device_properties(i).gcnArchName`` ("gfx942:sramecc+:xnack-"):
gfx90a is MI210/MI250/MI250X (each GCD of an MI250X is one device), gfx942 is MI300X/MI325X
(and MI300A), gfx950 is MI350X/MI355X. Devices of one architecture are told apart by name,
then by memory size (MI300X 192 GB, MI325X 256 GB).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from autosp.hardware import HardwareProfile


@dataclass(frozen=True)
class RocmDevice:
    """What PyTorch says about one ROCm device."""

    index: int
    arch: str  # "gfx942", without the feature flags
    name: str  # "AMD Instinct MI300X"
    total_memory: int  # bytes


def is_rocm_build() -> bool:
    return getattr(torch.version, "hip", None) is not None


def detect(device: torch.device) -> RocmDevice | None:
    """The ROCm device behind ``device``, or None on CUDA/CPU builds and non-GPU devices."""
    if device.type != "cuda" or not is_rocm_build() or not torch.cuda.is_available():
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    arch = str(getattr(props, "gcnArchName", "") or "").split(":")[0]
    return RocmDevice(index, arch, str(props.name), int(props.total_memory))


def match(dev: RocmDevice, profiles: tuple[HardwareProfile, ...]) -> HardwareProfile | None:
    """The profile of ``dev``'s architecture whose name it carries, else the one nearest in memory size."""
    same_arch = [p for p in profiles if p.arch and p.arch == dev.arch]
    if not same_arch:
        return None
    named = [p for p in same_arch if any(m and m in dev.name for m in p.match)]
    if named:
        return max(named, key=lambda p: max(len(m) for m in p.match if m in dev.name))
    # Some ROCm releases name every device "AMD Radeon Graphics"; memory still tells MI300X from MI325X.
    return min(same_arch, key=lambda p: abs(p.memory_bytes - dev.total_memory))


__all__ = ["RocmDevice", "detect", "is_rocm_build", "match"]
