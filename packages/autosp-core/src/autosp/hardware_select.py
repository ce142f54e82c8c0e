"""Which hardware profile a compile uses, and why (the report says both)."""

from __future__ import annotations

import os
from typing import Any

import torch

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


__all__ = ["HardwareOption", "check_option", "describe_given", "resolve"]
