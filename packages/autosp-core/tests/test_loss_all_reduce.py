"""A mean token loss crosses the SP group in one all-reduce (sum and count packed), exactly."""

from __future__ import annotations

import pytest
import torch

from autosp.sharding.placement import Replicate, SeqAxis
from autosp.sharding.testing import check_op, shard

aten = torch.ops.aten
S, C = 24, 5


def _args(g: torch.Generator) -> tuple:
    logp = torch.randn(S, C, generator=g, dtype=torch.float64).log_softmax(-1)
    target = torch.randint(0, C, (S,), generator=g)
    target[torch.rand(S, generator=g) < 0.3] = -100
    return logp, target, None, 1, -100


@pytest.mark.parametrize("world", [2, 3])
def test_mean_loss_is_one_all_reduce(world: int) -> None:
    report = check_op(
        aten.nll_loss_forward.default,
        _args(torch.Generator().manual_seed(0)),
        placements=[shard(0, "zigzag"), Replicate(SeqAxis(0, S))],
        world=world,
        trace=False,
    )
    # check_op compared values and gradients with the unsharded op. Collectives, forward then
    # backward: sum and count packed in one all-reduce, and its gradient in one (was 2 + 1 scalars).
    assert report.collectives == ["all_reduce[(2,)]", "all_reduce[(2,)]"], report.collectives
