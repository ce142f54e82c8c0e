"""autosp-rocm's hooks: AMD Instinct profiles, ROCm device detection, the GQA kernel pass."""

from __future__ import annotations

import torch

from autosp import hookimpl
from autosp.hardware import HardwareProfile
from autosp_rocm.detect import detect, match
from autosp_rocm.gqa import GQA_PASS, GQA_REPORT
from autosp_rocm.profiles import ROCM_PROFILES


@hookimpl
def autosp_register_hardware(register):
    for profile in ROCM_PROFILES:
        register(profile)


@hookimpl
def autosp_select_hardware(device: torch.device, profiles: tuple[HardwareProfile, ...]) -> HardwareProfile | None:
    dev = detect(device)
    if dev is None:
        return None
    return match(dev, profiles)  # an unknown architecture: core's generic "cuda" profile


@hookimpl
def autosp_register_passes(register):
    register(GQA_PASS)
    register(GQA_REPORT)
