"""Hardware profiles: the schema, the built-in table, JSON round trips, and hardware= in a compile."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

import autosp
from autosp.errors import ConfigError
from autosp.hardware import (
    AttentionKernel,
    CommModel,
    HardwareProfile,
    Interconnect,
    builtin_profile,
    load_profile,
    select_profile,
)
from autosp.hardware_io import from_dict, save, to_dict


def test_builtin_nvidia_profiles_are_dense_figures():
    h100 = builtin_profile("h100-80gb")
    # Data sheet: 1,979 TF BF16 with sparsity; dense is half.
    assert h100.matmul("bfloat16") == pytest.approx(989.5e12)
    assert h100.matmul(torch.float16) == h100.matmul("bfloat16")
    assert h100.memory_bytes == 80 * 10**9 and h100.memory_bandwidth == pytest.approx(3.35e12)
    assert builtin_profile("h200").memory_bytes == 141 * 10**9
    assert builtin_profile("b200").matmul("bfloat16") == pytest.approx(2.25e15)
    assert builtin_profile("a100-80gb").matmul("tf32") == pytest.approx(156e12)
    for name in ("a100-80gb", "a100-40gb", "h100-80gb", "h200", "b200", "cpu"):
        p = builtin_profile(name)
        assert p.source and p.flops > 0 and p.comm_bandwidth > 0


def test_old_constructor_and_aliases_still_work():
    p = HardwareProfile("toy", "cpu", flops=1e11, comm_bandwidth=1e9)
    assert p.flops == 1e11 and p.comm_bandwidth == 1e9 and p.matmul("bfloat16") == 1e11
    assert builtin_profile("cuda-h100").name == "h100-80gb"
    with pytest.raises(ConfigError, match="autosp-rocm"):
        builtin_profile("mi999x")
    with pytest.raises(ValueError, match="flops"):
        HardwareProfile("empty", "cpu", comm_bandwidth=1.0)


def test_device_name_selects_the_most_specific_profile(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    profiles = tuple(p for p in autosp.hardware.BUILTIN_PROFILES)
    for device_name, expected in [
        ("NVIDIA H100 80GB HBM3", "h100-80gb"),
        ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
        ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA B200", "b200"),
        ("NVIDIA GeForce RTX 4090", "cuda"),
    ]:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None, n=device_name: n)
        assert select_profile(torch.device("cuda", 0), profiles).name == expected
    assert select_profile(torch.device("cpu"), profiles).name == "cpu"


def test_collective_times_follow_topology():
    switch = Interconnect("switch", 100e9, "switch", latency=0.0)
    mesh = Interconnect("mesh", 448e9, "mesh", link_bandwidth=64e9, latency=0.0)
    n = 64 * 2**20
    # A switch: all-to-all at the full rate; a mesh drives P-1 links at once, a ring hop uses one.
    assert switch.all_to_all_bandwidth(8) == 100e9 and switch.ring_bandwidth(8) == 100e9
    assert mesh.all_to_all_bandwidth(8) == pytest.approx(448e9)
    assert mesh.all_to_all_bandwidth(2) == pytest.approx(64e9) and mesh.ring_bandwidth(8) == pytest.approx(64e9)
    p = HardwareProfile("m", "cuda", flops=1e15, interconnect=mesh)
    assert p.collective_seconds("all_to_all", n, 8) == pytest.approx(n * 7 / 8 / 448e9)
    assert p.collective_seconds("p2p", n, 8) == pytest.approx(n / 64e9)
    assert p.collective_seconds("all_gather", n, 1) == 0.0


def test_measured_table_interpolates_and_extends():
    pts = [(1e3, 1e-4), (1e6, 2e-4), (1e7, 1.1e-3)]
    m = CommModel.fit(pts, 2, "p2p")
    assert m.bandwidth == pytest.approx(1e10, rel=0.05)
    assert m.seconds(1e6, 2, "p2p") == pytest.approx(2e-4)
    assert m.seconds(5.5e6, 2, "p2p") == pytest.approx(6.5e-4)
    assert m.seconds(2e7, 2, "p2p") == pytest.approx(1.1e-3 + 1e7 / m.bandwidth)
    p = HardwareProfile("x", "cpu", flops=1.0, comm={"p2p": m})
    assert p.comm_bandwidth == p.interconnect.bandwidth  # no measured all-to-all: the links'


def test_json_round_trip_and_partial_profiles(tmp_path):
    h100 = builtin_profile("h100-80gb")
    assert from_dict(json.loads(json.dumps(to_dict(h100)))) == h100
    path = tmp_path / "node.json"
    a2a = CommModel(5e-5, 2e11, ((1e6, 5.5e-5), (1e8, 5.5e-4)), 8)
    save(
        {
            "format": "autosp-hardware/1",
            "name": "my-node",
            "base": "h100-80gb",
            "matmul_flops": {"bfloat16": 6e14},
            "comm": {
                "all_to_all": to_dict(HardwareProfile("t", "cpu", flops=1.0, comm={"all_to_all": a2a}))["comm"][
                    "all_to_all"
                ]
            },
        },
        path,
    )
    p = load_profile(str(path))
    assert p.name == "my-node" and p.flops == 6e14 and p.matmul("float32") == h100.matmul("float32")
    assert p.comm_bandwidth == 2e11 and p.comm["all_to_all"] == a2a and p.memory_bytes == h100.memory_bytes
    assert load_profile(path) == p  # a Path works too


@pytest.mark.parametrize(
    "content, match",
    [
        ('{"name": "x", "flops": 1, "comm_bandwidth": 1, "wings": 2}', "unknown keys.*wings"),
        ('{"format": "autosp-hardware/9", "name": "x"}', "autosp-hardware/1"),
        ("[1, 2]", "JSON object"),
        ('{"name": "x", "base": "h100-80gb", "comm": {"broadcast": {}}}', "all_to_all, all_gather, p2p"),
        ('{"name": x', "not valid JSON"),
    ],
)
def test_bad_json_profiles_say_what_to_do(tmp_path, content, match):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match=match):
        load_profile(path)


def test_missing_file_and_bad_type_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="autosp-profile"):
        autosp.compile(torch.nn.Linear(2, 2), hardware=str(tmp_path / "none.json"))
    with pytest.raises(ConfigError, match="profile name"):
        autosp.SPOptions(hardware=3.5)


def test_kernel_facts():
    k = AttentionKernel("efficient", gqa=False, max_head_dim=128, dtypes=("float16",), lse_base=2.0)
    assert k.accepts(128, "float16", False) and not k.accepts(128, "float16", True)
    assert not k.accepts(256, "float16", False) and not k.accepts(64, "float32", False)
    h100 = builtin_profile("h100-80gb")
    assert h100.kernel_for(128, torch.bfloat16, gqa=True).name == "flash"
    assert h100.kernel_for(512, torch.bfloat16, gqa=False).name == "efficient"
    assert h100.kernel_for(512, torch.bfloat16, gqa=True) is None
    assert math.isclose(builtin_profile("cpu").attention_kernels[0].lse_base, math.e)


class _Attn(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        q = self.proj(x).view(1, -1, 2, 4).transpose(1, 2)
        return F.scaled_dot_product_attention(q, q, q, is_causal=True).sum()


def test_report_names_the_profile_and_its_source(tmp_path):
    text = autosp.explain(_Attn(), torch.randn(1, 8, 8), sp_size=1, hardware="h100-80gb")
    assert "hardware profile: h100-80gb (hardware='h100-80gb'; NVIDIA H100" in text
    path = tmp_path / "p.json"
    save(HardwareProfile("measured-box", "cpu", flops=3e10, comm_bandwidth=1e9, source="autosp-profile"), path)
    text = autosp.explain(_Attn(), torch.randn(1, 8, 8), sp_size=1, hardware=str(path))
    assert f"hardware profile: measured-box (from {path}; autosp-profile)" in text
    assert "hardware profile: cpu (detected for cpu" in autosp.explain(_Attn(), torch.randn(1, 8, 8), sp_size=1)


def test_cpu_memory_is_shared_by_the_ranks_on_the_host(monkeypatch):
    """Every rank on a host draws on one RAM: memory-driven choices must see 1/n of it, GPUs keep theirs."""
    from autosp.hardware import builtin_profile
    from autosp.hardware_select import per_rank_share, ranks_on_host

    cpu = builtin_profile("cpu")
    assert cpu.memory_bytes > 0
    shared, why = per_rank_share(cpu, 4, "cpu (detected)")
    assert shared.memory_bytes == cpu.memory_bytes // 4
    assert shared.matmul_flops == cpu.matmul_flops and "shared by 4 ranks" in why
    assert per_rank_share(cpu, 1, "x")[0] is cpu
    gpu = builtin_profile("h100-80gb")
    assert per_rank_share(gpu, 8, "x")[0] is gpu
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert ranks_on_host() == 3
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert ranks_on_host() == 1  # no process group here: this process alone
