"""The ring merge with kernels that return their lse in base e and in base 2 (AOTriton before 0.11)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

pytest.importorskip("autosp_ring", reason="autosp-ring (the ring variant) is not installed")
from autosp_ring import blocks  # noqa: E402
from autosp_ring.blocks import BlockKernel, set_block_kernel  # noqa: E402
from autosp_ring.op import ring_attention  # noqa: E402


def cpu_fused(q, k, v, scale, mask):
    """A real fused kernel returning a natural lse: aten's CPU flash attention."""
    bias = None if mask is None else torch.zeros(mask.shape, dtype=q.dtype).masked_fill(~mask, float("-inf"))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, False, attn_mask=bias, scale=scale
    )
    return out, lse


def base2(q, k, v, scale, mask):
    """The same kernel as AOTriton < 0.11 reports it: log2 of the softmax denominator."""
    out, lse = cpu_fused(q, k, v, scale, mask)
    return out, lse / math.log(2)


@pytest.fixture(scope="module")
def one_rank_group(tmp_path_factory):
    # One rank with the zigzag layout still merges blocks: its two half-chunks see each other.
    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "s"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield dist.group.WORLD.group_name
    dist.destroy_process_group()


@pytest.mark.parametrize(
    "kernel, exact",
    [
        (blocks.REFERENCE_KERNEL, True),
        (BlockKernel("cpu flash (lse base e)", cpu_fused), True),
        (BlockKernel("simulated AOTriton < 0.11 (lse base 2)", base2, lse_base=2.0), True),
        # The failure the conversion prevents: a base-2 lse trusted as natural weights blocks wrongly.
        (BlockKernel("base 2 taken for base e", base2), False),
    ],
)
def test_ring_merge_converts_the_kernels_lse_base(one_rank_group, kernel, exact):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8) for _ in range(3))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    ref_lse = torch.logsumexp(
        (q @ k.transpose(-1, -2) / math.sqrt(8)).masked_fill(
            torch.ones(16, 16, dtype=torch.bool).triu(1), float("-inf")
        ),
        -1,
    )
    previous = set_block_kernel(kernel)
    try:
        out, lse = ring_attention(q, k, v, True, 1 / math.sqrt(8), 0, True, one_rank_group)
    finally:
        set_block_kernel(previous)
    close = torch.allclose(out, ref, atol=1e-5) and torch.allclose(lse, ref_lse, atol=1e-5)
    assert close is exact, (out - ref).abs().max()
