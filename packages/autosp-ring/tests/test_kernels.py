"""Ring blocks on fused kernels: each block kind against the fp32 math, the ring backward identity,
the one-time check that keeps a wrong kernel out, and no [Lq, Lk] scores on the fused path."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from autosp_ring import BLOCK_COUNTS, kernels
from autosp_ring.blocks import REFERENCE_KERNEL, block_backward, block_forward, merge, set_block_kernel
from autosp_ring.hybrid import _fusable
from autosp_ring.kernels import CPU_FLASH, FusedKernel, Tile
from autosp_ring.op import ring_attention, ring_attention_backward

L, D = 24, 8


def _qkv(seed: int, heads: int = 4, kv_heads: int = 2, dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, heads, L, D, generator=gen)
    k, v = (torch.randn(2, kv_heads, L, D, generator=gen) for _ in range(2))
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _tiles() -> dict[str, Tile]:
    gen = torch.Generator().manual_seed(7)
    keep = torch.rand(2, 1, L, L, generator=gen) < 0.6
    keep[0, 0, 3] = False  # a query row with no key in this block
    bias = torch.randn(1, 4, L, L, generator=gen).masked_fill(~keep[1:], float("-inf"))
    return {"none": Tile(), "causal": Tile(causal=True), "bool": Tile(mask=keep), "additive": Tile(mask=bias)}


@pytest.mark.parametrize("kind", ["none", "causal", "bool", "additive"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_matches_fp32_math_with_the_final_out_and_lse(kind, dtype):
    # Two blocks of keys merged, then each block's backward from the merged (out, lse): their sum is
    # the gradient of attention over both, as the fp32 math computes it (GQA 4:2 throughout).
    tile = _tiles()[kind]
    q, k1, v1 = _qkv(0, dtype=dtype)
    _, k2, v2 = _qkv(1, dtype=dtype)
    dout = _qkv(2, dtype=dtype)[0]
    dense = tile.dense(L, q.device)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    outs = []
    for k, v in ((k1, v1), (k2, v2)):
        got, ref = kernels.forward(CPU_FLASH, q, k, v, 0.3, tile), block_forward(q, k, v, 0.3, dense)
        live = ~torch.isinf(ref[1])
        assert torch.equal(torch.isinf(got[1]), ~live)  # rows with no key: lse -inf, not the kernel's 0
        torch.testing.assert_close(got[0].float(), ref[0], atol=tol, rtol=tol)
        torch.testing.assert_close(got[1][live], ref[1][live], atol=tol, rtol=tol)
        outs.append(ref)
    out, lse = merge(*outs[0], *outs[1])
    delta = (dout.float() * out).sum(-1)
    for k, v in ((k1, v1), (k2, v2)):
        got = kernels.backward(CPU_FLASH, dout, q, k, v, out.to(dtype), lse, 0.3, tile)
        ref = block_backward(q, k, v, dout.float(), lse, delta, 0.3, dense)
        for g, r in zip(got, ref):
            assert g.shape == r.shape
            torch.testing.assert_close(g.float(), r, atol=4 * tol, rtol=4 * tol)


def test_a_kernel_that_disagrees_is_not_used():
    # A kernel reporting a base-2 lse as natural would weight blocks wrongly: the check keeps it out.
    def base2(q, k, v, scale, causal, bias):
        out, lse = CPU_FLASH.forward(q, k, v, scale, causal, bias)
        return out, lse / math.log(2)

    wrong = FusedKernel("mislabelled base 2", base2, CPU_FLASH.backward, gqa=True)
    declared = FusedKernel("declared base 2", base2, _base2_backward, gqa=True, lse_base=2.0)
    with pytest.warns(UserWarning, match="mislabelled base 2 kernel is not used"):
        assert not kernels.check(wrong, torch.device("cpu"), torch.float32, D, False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kernels.check(declared, torch.device("cpu"), torch.float32, D, True)
        assert kernels.check(CPU_FLASH, torch.device("cpu"), torch.float32, D, True)


def _base2_backward(dout, q, k, v, out, lse, scale, causal, bias):
    return CPU_FLASH.backward(dout, q, k, v, out, lse * math.log(2), scale, causal, bias)


def test_choice_by_device_and_dtype():
    cpu = torch.device("cpu")
    assert kernels.candidate(cpu, torch.float32, 64, True) is CPU_FLASH
    assert kernels.candidate(cpu, torch.float64, 64, False) is None  # fp32 math
    cuda = torch.device("cuda")
    assert kernels.candidate(cuda, torch.bfloat16, 128, False).name == "cuda flash"
    assert kernels.candidate(cuda, torch.bfloat16, 128, True).name == "cuda efficient"  # a mask tile
    assert kernels.candidate(cuda, torch.float32, 128, False).name == "cuda efficient"
    assert kernels.candidate(cuda, torch.float16, 512, False).name == "cuda efficient"


def test_hybrid_fuses_only_alike_tensors():
    q, k, v = (torch.zeros(1, h, 8, 4) for h in (4, 2, 2))
    assert _fusable(q, k, v, 2)
    assert not _fusable(q, k[:, :1], v[:, :1], 2)  # one kv head for 2 ranks: gathered instead
    assert not _fusable(q, k, v.double(), 2)
    assert not _fusable(q, k, torch.zeros(1, 2, 8, 6), 2)  # another value head dim


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    # One rank with the zigzag layout still has three blocks: two diagonal, one whole.
    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "s"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield dist.group.WORLD.group_name
    dist.destroy_process_group()


class _Largest(TorchDispatchMode):
    """The largest tensor any aten op makes (what the fp32 math's [B, H, Lq, Lk] scores would be)."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


@pytest.mark.parametrize("reference", [False, True])
def test_fused_blocks_hold_no_scores(group, reference):
    b, h, s, d = 1, 2, 256, 16
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(b, h, s, d, generator=gen) for _ in range(4))
    previous = set_block_kernel(REFERENCE_KERNEL) if reference else None
    BLOCK_COUNTS.clear()
    try:
        with _Largest() as fwd:
            out, lse = ring_attention._init_fn(q, k, v, True, d**-0.5, 0, True, group)
        with _Largest() as bwd:
            dq, dk, dv, _ = ring_attention_backward._init_fn(dout, q, k, v, out, lse, True, d**-0.5, 0, True, group)
    finally:
        if previous is not None:
            set_block_kernel(previous)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(qr, kr, vr, is_causal=True)
    ref.backward(dout)
    for got, want in ((out, ref), (dq, qr.grad), (dk, kr.grad), (dv, vr.grad)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    scores = b * h * (s // 2) * (s // 2)  # one half-chunk block's scores
    if reference:
        assert fwd.numel >= scores and bwd.numel >= scores
        assert BLOCK_COUNTS["forward", "fp32 reference"] == 3 and BLOCK_COUNTS["backward", "fp32 math"] == 3
    else:
        # The largest tensors are O(S * D) (q; k and v packed to travel), never a block's scores.
        assert fwd.numel <= 2 * b * h * s * d < scores and bwd.numel <= 2 * b * h * s * d, (fwd.numel, bwd.numel)
        assert BLOCK_COUNTS["forward", "cpu flash"] == 3 and BLOCK_COUNTS["backward", "cpu flash"] == 3


def test_value_heads_wider_than_query_heads_take_the_fp32_block_math():
    """MLA-style attention: the fused kernels take one head size (they raised on this once)."""
    q, k = torch.randn(1, 2, 8, 8), torch.randn(1, 2, 8, 8)
    assert kernels.choose(q, k, torch.randn(1, 2, 8, 8), masked=False) is CPU_FLASH
    assert kernels.choose(q, k, torch.randn(1, 2, 8, 16), masked=False) is None
