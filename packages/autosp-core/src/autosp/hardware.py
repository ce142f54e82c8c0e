"""Per-device numbers for cost models: a small table that plugins can extend."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class HardwareProfile:
    """Throughput of one device kind.

    Attributes:
        name: profile name ("cpu", "cuda-h100", ...).
        device_type: torch device type it applies to.
        flops: sustained matmul FLOP/s at the training dtype.
        comm_bandwidth: bytes/s one rank moves through the SP group's collectives.
        match: substring of ``torch.cuda.get_device_name()`` that selects it (GPU profiles).
    """

    name: str
    device_type: str
    flops: float
    comm_bandwidth: float
    match: str = ""


BUILTIN_PROFILES = (
    HardwareProfile("cpu", "cpu", flops=5e10, comm_bandwidth=2e9),
    HardwareProfile("cuda", "cuda", flops=1e14, comm_bandwidth=1e11),
    HardwareProfile("cuda-a100", "cuda", flops=3.1e14, comm_bandwidth=2.4e11, match="A100"),
    HardwareProfile("cuda-h100", "cuda", flops=9.9e14, comm_bandwidth=4.5e11, match="H100"),
    HardwareProfile("cuda-h200", "cuda", flops=9.9e14, comm_bandwidth=4.5e11, match="H200"),
)


def select_profile(device: torch.device, profiles: tuple[HardwareProfile, ...]) -> HardwareProfile:
    """The most specific profile for ``device``: a name match first, then the device type."""
    candidates = [p for p in profiles if p.device_type == device.type]
    if device.type == "cuda" and torch.cuda.is_available():
        name = torch.cuda.get_device_name(device)
        named = [p for p in candidates if p.match and p.match in name]
        if named:
            return named[-1]
    generic = [p for p in candidates if not p.match]
    if generic:
        return generic[-1]
    return HardwareProfile(device.type, device.type, flops=5e10, comm_bandwidth=2e9)


__all__ = ["BUILTIN_PROFILES", "HardwareProfile", "select_profile"]
