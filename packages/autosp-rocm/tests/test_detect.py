"""ROCm detection, profiles and kernel facts, on CPU with the device simulated."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from autosp_rocm import MI250X, MI300X, MI325X, MI355X, apply_rccl_settings, lse_base, rocm_kernels
from autosp_rocm.kernels import LSE_BASE_ENV
from autosp_rocm.rccl import recommended

from autosp.hardware import builtin_profile
from autosp.hardware_select import resolve
from autosp.registry import get_registry

GiB = 2**30


def simulate(monkeypatch, *, hip: str | None, name: str, arch: str = "", memory: int = 0) -> None:
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: name)
    props = SimpleNamespace(name=name, gcnArchName=arch, total_memory=memory)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d=None: props)


@pytest.mark.parametrize(
    "name, arch, memory, expected",
    [
        ("AMD Instinct MI250X", "gfx90a:sramecc+:xnack-", 64 * GiB, "mi250x"),
        ("AMD Instinct MI300X", "gfx942:sramecc+:xnack-", 192 * GiB, "mi300x"),
        ("AMD Instinct MI325X", "gfx942:sramecc+:xnack-", 256 * GiB, "mi325x"),
        # Some ROCm releases name every device alike: the memory size tells MI300X from MI325X.
        ("AMD Radeon Graphics", "gfx942:sramecc+:xnack-", 256 * GiB, "mi325x"),
        ("AMD Radeon Graphics", "gfx942:sramecc+:xnack-", 192 * GiB, "mi300x"),
        ("AMD Instinct MI355X", "gfx950:sramecc+:xnack-", 288 * GiB, "mi355x"),
        ("AMD Radeon RX 7900 XTX", "gfx1100", 24 * GiB, "cuda"),  # an unknown arch: the generic GPU profile
    ],
)
def test_simulated_rocm_devices_select_their_profile(monkeypatch, name, arch, memory, expected):
    simulate(monkeypatch, hip="6.4.43482", name=name, arch=arch, memory=memory)
    profile, where = resolve(None, torch.device("cuda", 0), get_registry())
    assert profile.name == expected
    assert where.startswith(f"{expected} (detected")


def test_simulated_h100_on_a_cuda_build_is_not_taken_for_amd(monkeypatch):
    simulate(monkeypatch, hip=None, name="NVIDIA H100 80GB HBM3", memory=80 * GiB)
    profile, _ = resolve(None, torch.device("cuda", 0), get_registry())
    assert profile.name == "h100-80gb" and profile.vendor == "nvidia"
    # Its kernels take GQA in bf16 (flash); on MI300X fp32 GQA has no fused kernel that takes it.
    assert profile.kernel_for(128, "bfloat16", gqa=True).name == "flash"
    assert MI300X.kernel_for(128, "float32", gqa=True) is None
    assert MI300X.kernel_for(128, "float32", gqa=False).name == "efficient"
    assert MI300X.kernel_for(128, "bfloat16", gqa=True).name == "flash"
    assert MI300X.kernel_for(512, "bfloat16", gqa=False) is None  # head dim over AOTriton's 256
    for amd in (MI250X, MI325X, MI355X):  # the same AOTriton rules on every Instinct generation
        assert [k.name for k in amd.attention_kernels] == ["flash", "efficient"]
        assert amd.kernel_for(64, "float32", gqa=True) is None and amd.kernel_for(64, "float32", gqa=False)


def test_profiles_carry_data_sheet_figures_and_topology():
    assert builtin_profile("mi300x") is MI300X
    assert MI300X.matmul("bfloat16") == pytest.approx(1307.4e12) and MI300X.memory_bytes == 192 * 10**9
    assert MI325X.memory_bytes == 256 * 10**9 and MI355X.matmul("bfloat16") > MI300X.matmul("bfloat16")
    assert MI250X.memory_bytes == 64 * 10**9  # one GCD
    # MI250X: the two GCDs of a package have 4 links; a ring across packages waits on a single one.
    link = MI250X.interconnect
    assert link.ring_bandwidth(2) == pytest.approx(200e9)
    assert link.ring_bandwidth(4) == pytest.approx(50e9)
    assert link.all_to_all_bandwidth(4) == pytest.approx(150e9)
    # MI300X: a mesh; an all-to-all drives a link per peer, a ring hop one link.
    assert MI300X.interconnect.all_to_all_bandwidth(8) == pytest.approx(448e9)
    assert MI300X.interconnect.ring_bandwidth(8) == pytest.approx(64e9)
    for p in (MI250X, MI300X, MI325X, MI355X):
        assert "data sheet" in p.source and p.arch.startswith("gfx")


def test_lse_base_follows_the_aotriton_release(monkeypatch):
    monkeypatch.delenv(LSE_BASE_ENV, raising=False)
    assert lse_base("2.8.0+rocm6.4") == 2.0
    assert lse_base("2.9.1+rocm6.4") == math.e and lse_base("2.13.0") == math.e
    assert all(k.lse_base == 2.0 for k in rocm_kernels("2.7.1"))
    monkeypatch.setenv(LSE_BASE_ENV, "2")
    assert lse_base("2.13.0") == 2.0
    monkeypatch.setenv(LSE_BASE_ENV, "ten")
    with pytest.raises(ValueError, match="use 2 or e"):
        lse_base()


def test_rccl_settings_only_on_request_and_never_overwrite():
    env = {"TORCH_NCCL_HIGH_PRIORITY": "0"}
    applied = apply_rccl_settings("gfx942", environ=env)
    assert applied == {"NCCL_MIN_NCHANNELS": "112", "HSA_FORCE_FINE_GRAIN_PCIE": "1"}
    assert env["TORCH_NCCL_HIGH_PRIORITY"] == "0"  # the user's value stays
    assert "NCCL_MIN_NCHANNELS" not in {s.name for s in recommended("gfx90a")}
    assert all(s.reason for s in recommended("gfx942"))


def test_importing_the_plugin_changes_no_environment():
    import importlib
    import os

    import autosp_rocm.plugin

    before = dict(os.environ)
    importlib.reload(autosp_rocm.plugin)
    get_registry()
    assert dict(os.environ) == before
