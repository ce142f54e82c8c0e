"""The device a plan is for: a hardware profile, with its memory, FLOP/s and collective costs.

Profiles come from ``autosp.hardware`` (built-in names such as ``h100-80gb``, plugins' names,
or an ``autosp-profile`` JSON). The planner needs ``memory_bytes``; a profile without it
(a CPU one, or a JSON written before the field existed) needs ``--memory-gb``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from autosp.errors import ConfigError


@dataclass(frozen=True)
class Device:
    """What the plan uses of a profile."""

    name: str
    memory_bytes: float
    profile: Any

    def matmul_flops(self, dtype: torch.dtype) -> float:
        fn = getattr(self.profile, "matmul", None)
        return float(fn(dtype)) if callable(fn) else float(self.profile.flops)

    def attention_flops(self, dtype: torch.dtype) -> float:
        fn = getattr(self.profile, "attention", None)
        return float(fn(dtype)) if callable(fn) else self.matmul_flops(dtype)

    def collective_seconds(self, kind: str, nbytes: float, world: int) -> float:
        if world <= 1 or nbytes <= 0:
            return 0.0
        if kind == "ring_p2p":  # point-to-point hops inside ring attention: bytes over one link
            return nbytes / float(self.profile.comm_bandwidth)
        fn = getattr(self.profile, "collective_seconds", None)
        if callable(fn):
            return float(fn(kind, nbytes, world))
        return nbytes / float(self.profile.comm_bandwidth)


def resolve_device(name_or_path: str, memory_gb: float | None = None) -> Device:
    """The profile by name or JSON path; ``memory_gb`` (GiB) overrides or supplies its memory."""
    try:
        from autosp.hardware import load_profile
    except ImportError as e:  # an autosp-core without profile files
        raise ConfigError(f"this autosp-core has no hardware profiles to load ({e}); upgrade autosp-core") from e
    try:
        profile = load_profile(name_or_path)
    except (KeyError, ValueError, FileNotFoundError, OSError) as e:
        raise ConfigError(f"hardware {name_or_path!r}: {e}") from e
    memory = memory_gb * 2**30 if memory_gb is not None else float(getattr(profile, "memory_bytes", 0) or 0)
    if memory <= 0:
        raise ConfigError(
            f"hardware profile {profile.name!r} does not say how much device memory it has; give --memory-gb"
        )
    return Device(profile.name, memory, profile)


__all__ = ["Device", "resolve_device"]
