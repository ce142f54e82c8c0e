"""GQA on a simulated ROCm profile: the local SDPA call is one a fused ROCm kernel takes."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from autosp_rocm.gqa import RepeatKVForKernel
from torch.fx.experimental.proxy_tensor import make_fx

import autosp
from autosp.hardware import builtin_profile

aten = torch.ops.aten


def _local_attention(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def _sdpa_inputs(dtype):
    q = torch.randn(1, 4, 16, 8, dtype=dtype)
    k, v = (torch.randn(1, 2, 16, 8, dtype=dtype) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize(
    "dtype, profile, repeated",
    [
        (torch.float32, "mi300x", True),  # flash takes no fp32; efficient takes no GQA: repeat
        (torch.bfloat16, "mi300x", False),  # flash takes it as is
        # The mode follows any profile's kernel facts (the pass that installs it is ROCm's).
        (torch.float32, "h100-80gb", True),
        (torch.float32, "cpu", False),  # CPU flash takes GQA in fp32
    ],
)
def test_the_mode_repeats_kv_only_where_the_kernels_need_it(dtype, profile, repeated):
    hw = builtin_profile(profile)
    counts: Counter = Counter()
    q, k, v = _sdpa_inputs(dtype)
    with RepeatKVForKernel(hw, counts):
        gm = make_fx(_local_attention)(q, k, v)
    assert counts["repeated"] == int(repeated)
    kernels = [n for n in gm.graph.nodes if n.op == "call_function" and "scaled_dot_product" in str(n.target)]
    assert kernels
    assert kernels[0].args[1].meta["val"].shape[1] == (4 if repeated else 2)
    with RepeatKVForKernel(hw, Counter()):
        out = _local_attention(q, k, v)
    torch.testing.assert_close(out, _local_attention(q, k, v))  # the same values either way


class GQAAttention(torch.nn.Module):
    """Llama-style: 4 query heads, 2 kv heads, repeat_kv before SDPA."""

    def __init__(self, dim=32, heads=4, kv=2):
        super().__init__()
        self.h, self.kv, self.d = heads, kv, dim // heads
        self.q = torch.nn.Linear(dim, dim, bias=False)
        self.kvp = torch.nn.Linear(dim, 2 * kv * self.d, bias=False)
        self.o = torch.nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.h, self.d).transpose(1, 2)
        k, v = self.kvp(x).view(b, s, 2, self.kv, self.d).permute(2, 0, 3, 1, 4)
        rep = self.h // self.kv
        k = k[:, :, None].expand(b, self.kv, rep, s, self.d).reshape(b, self.h, s, self.d)
        v = v[:, :, None].expand(b, self.kv, rep, s, self.d).reshape(b, self.h, s, self.d)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(b, s, -1)).float().pow(2).mean()


@pytest.fixture
def fake_two_ranks():
    # One rank of a 2-rank program, without peers: enough to compile and inspect the rewrite.
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("dtype, note", [(torch.float32, True), (torch.bfloat16, False)])
def test_gqa_model_on_simulated_mi300x_reaches_a_fused_kernel(fake_two_ranks, dtype, note):
    torch._dynamo.reset()
    model = GQAAttention().to(dtype)
    compiled = autosp.compile(model, sp_size=2, hardware="mi300x", backend="aot_eager", sac=False, check_inputs=False)
    compiled(torch.randn(1, 16, 32, dtype=dtype))
    report = str(compiled.autosp_reports[0])
    assert "hardware profile: mi300x (hardware='mi300x'" in report
    assert "exchange k/v before repeat" in report  # k/v still cross with 2 heads
    assert ("rocm: 1 attention call(s) get k/v repeated after the exchange" in report) is note, report
