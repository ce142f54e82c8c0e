"""Which hardware profile a compile uses, and why (the report says both)."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch
import torch.distributed as dist

from autosp.errors import ConfigError
from autosp.hardware import HardwareProfile, select_profile

HardwareOption = str | os.PathLike | HardwareProfile | None


def check_option(hardware: Any) -> None:
    """Type check for ``SPOptions.hardware`` (the file or name is resolved when the backend is made)."""
    if hardware is not None and not isinstance(hardware, (str, os.PathLike, HardwareProfile)):
        raise ConfigError(
            f"hardware={hardware!r}; give a profile name ('h100-80gb', 'mi300x', 'cpu'), the path of a JSON "
            "profile (autosp-profile writes one), an autosp.HardwareProfile, or None to detect the device"
        )


def describe_given(hardware: str | os.PathLike | HardwareProfile, profile: HardwareProfile) -> str:
    if isinstance(hardware, HardwareProfile):
        return f"{profile.name} (given as a HardwareProfile; {profile.source or 'no source given'})"
    text = os.fspath(hardware)
    if text.endswith(".json") or os.path.isfile(text):
        return f"{profile.name} (from {os.path.abspath(text)}; {profile.source or 'no source given'})"
    return f"{profile.name} (hardware={text!r}; {profile.source})"


def resolve(hardware: HardwareOption, device: torch.device, registry: Any) -> tuple[HardwareProfile, str]:
    """(profile, where it came from): the user's choice, else a plugin's detection, else the table."""
    profile, why = _choose(hardware, device, registry)
    return per_rank_share(profile, ranks_on_host(), why)


def _choose(hardware: HardwareOption, device: torch.device, registry: Any) -> tuple[HardwareProfile, str]:
    from autosp.hardware import load_profile

    if hardware is not None:
        profile = load_profile(hardware)
        return profile, describe_given(hardware, profile)
    profiles = tuple(registry.hardware.values())
    detected = registry.manager.hook.autosp_select_hardware(device=device, profiles=profiles)
    if detected is not None:
        return detected, f"{detected.name} (detected for {device.type}: {detected.source})"
    profile = select_profile(device, profiles)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" and torch.cuda.is_available() else device.type
    return profile, f"{profile.name} (detected for {name}: {profile.source})"


def ranks_on_host() -> int:
    """Processes of this job on this host: torchrun's LOCAL_WORLD_SIZE, else every rank of the job.

    Without torchrun, counting the whole job as local errs towards a smaller share of memory,
    which makes memory-driven choices (SAC's budget) recompute more, never run out.
    """
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    if local.isdigit() and int(local) > 0:
        return int(local)
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def per_rank_share(profile: HardwareProfile, ranks: int, why: str) -> tuple[HardwareProfile, str]:
    """A CPU profile's memory is the host's RAM, which every rank on the host draws on: each gets 1/n.

    A GPU's memory belongs to its one rank, so only CPU profiles are divided.
    """
    if profile.device_type != "cpu" or not profile.memory_bytes or ranks <= 1:
        return profile, why
    share = profile.memory_bytes // ranks
    divided = dataclasses.replace(profile, memory_bytes=share)
    return divided, f"{why}; memory {profile.memory_bytes / 2**30:.1f} GiB shared by {ranks} ranks on this host"


__all__ = ["HardwareOption", "check_option", "describe_given", "per_rank_share", "ranks_on_host", "resolve"]
