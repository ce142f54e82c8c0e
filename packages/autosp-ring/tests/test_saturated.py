"""Rows every key of which a finite mask value masks: the ring's merge gives the single-device mean."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from autosp.errors import AutoSPError
from autosp_ring import saturated
from autosp_ring.blocks import merge

MIN = torch.finfo(torch.float32).min
B, H, S, D = 1, 2, 12, 4


def _mask(fill: float) -> torch.Tensor:
    """Causal, with the first three query rows masked everywhere (left padding) by ``fill``."""
    allowed = torch.tril(torch.ones(S, S, dtype=torch.bool))
    allowed[:, :3] = False
    return torch.zeros(1, 1, S, S).masked_fill(~allowed, fill)


def test_blocks_of_unequal_size_merge_into_the_single_device_mean():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, generator=g) for _ in range(3))
    mask = _mask(MIN)
    whole = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    top = saturated.my_rows(mask.amax(-1), [(0, S, 0)], S)
    sat = saturated.is_saturated(top)
    assert sat[0, 0, :3].all() and not sat[0, 0, 3:].any()
    out = torch.zeros(B, H, S, D)
    lse = torch.full((B, H, S), float("-inf"))
    for lo, hi in ((0, 2), (2, 7), (7, S)):  # 2, 5 and 5 keys: plain lse weights would not average them
        tile = mask[..., lo:hi]
        o = F.scaled_dot_product_attention(q, k[:, :, lo:hi], v[:, :, lo:hi], attn_mask=tile)
        s = (q @ k[:, :, lo:hi].transpose(-1, -2)) * D**-0.5 + tile
        block_lse = torch.logsumexp(s, -1)
        block_lse = saturated.block_lse(block_lse, tile, top, sat)
        out, lse = merge(out, lse, o, block_lse)
    torch.testing.assert_close(out, whole, rtol=1e-5, atol=1e-6)
    restored = saturated.restore(lse, top, sat)
    assert (restored[..., :3] == MIN).all()  # as the single-device kernel holds it: M + log(n) rounds to M


@pytest.mark.parametrize(("fill", "refused"), [(MIN, False), (float("-inf"), False), (-1e4, True), (-1e9, True)])
def test_rows_fully_masked_by_a_moderate_finite_value_are_refused(fill: float, refused: bool):
    if refused:
        with pytest.raises(AutoSPError, match="every key masked by a finite value"):
            saturated.refuse_imprecise(_mask(fill).amax(-1))
    else:
        saturated.refuse_imprecise(_mask(fill).amax(-1))
    saturated.refuse_imprecise(_mask(-1e4)[..., 3:, :].amax(-1))  # rows that keep a key are never refused
