"""autosp-profile on 2 gloo ranks: the JSON it writes loads as a profile and drives a compile."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

import autosp
from autosp.hardware import builtin_profile, load_profile
from autosp_tools.profile import main, parse_size

QUICK = ["--sizes", "4K,64K", "--repeats", "2", "--matmul-n", "64", "--attention", "128,2,16"]


def test_two_ranks_write_a_profile_that_compiles_use(tmp_path, capsys):
    out = tmp_path / "node.json"
    assert main(["--nproc", "2", "--out", str(out), "--name", "this-box", *QUICK]) == 0
    printed = capsys.readouterr().out
    assert "all_to_all: latency" in printed and f"wrote {out}" in printed
    data = json.loads(out.read_text())
    assert data["base"] == "cpu" and "2 ranks" in data["source"]
    for kind in ("all_to_all", "all_gather", "p2p"):
        c = data["comm"][kind]
        assert c["world"] == 2 and [b for b, _ in c["points"]] == [4096, 65536]
        assert all(t > 0 for _, t in c["points"]) and c["bandwidth"] > 0 and c["latency"] >= 0
    profile = load_profile(out)
    assert profile.name == "this-box" and profile.matmul("float32") == data["matmul_flops"]["float32"] > 0
    assert profile.attention("float32") == data["attention_flops"]["float32"] > 0
    assert profile.kernel_flops["ring-block/float32"] == data["kernel_flops"]["ring-block/float32"] > 0
    assert profile.comm_bandwidth == data["comm"]["all_to_all"]["bandwidth"]
    assert profile.memory_bytes == builtin_profile("cpu").memory_bytes  # from the base
    assert profile.collective_seconds("p2p", 65536, 2) == pytest.approx(data["comm"]["p2p"]["points"][1][1])

    class Attn(torch.nn.Module):
        def forward(self, x):
            return F.scaled_dot_product_attention(x, x, x, is_causal=True).sum()

    text = autosp.explain(Attn(), torch.randn(1, 2, 8, 4), sp_size=1, hardware=str(out))
    assert f"hardware profile: this-box (from {out}; autosp-profile on" in text


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--nproc", "0"], "--nproc 0: must be >= 1"),
        (["--sizes", "4Q"], "give bytes like 4096, 64K, 1M"),
        (["--dtypes", "int8"], "not a floating torch dtype"),
        (["--attention", "128,2"], "three positive ints"),
        (["--device", "cuda"], None),
    ],
)
def test_bad_flags_are_usage_errors(argv, message, capsys):
    if argv == ["--device", "cuda"] and torch.cuda.is_available():
        pytest.skip("a GPU is visible, so --device cuda is valid here")
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert (message or "no GPU is visible") in capsys.readouterr().err


def test_sizes():
    assert parse_size("4K") == 4096 and parse_size("1MB") == 2**20 and parse_size("512") == 512
