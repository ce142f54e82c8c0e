"""FlexAttention under SP: no variant rewrites it yet, so it runs whole on every rank, exactly, and the report says so.

The SDPA layer before it is still sequence-parallel. Forward only: torch 2.13 has no FlexAttention
backward on CPU (single-device eager raises the same error), so gradients are checked on a GPU.
"""

from __future__ import annotations

import pytest
import torch
from flex_workers import run
from harness import run_spmd


@pytest.mark.parametrize(("world", "variant"), [(2, "ulysses"), (2, "ring"), (4, "ulysses")])
def test_flex_attention_is_exact(world, variant):
    for rank, got in enumerate(run_spmd(run, world, variant, 96)):
        where = f"{variant} P={world} rank {rank}"
        torch.testing.assert_close(got["loss"], got["reference"], rtol=1e-5, atol=1e-6, msg=where)
        assert got["shard_start"] >= 1, f"{where}: nothing was sequence-parallel"
        assert any(n.startswith("FlexAttention (") and "computed whole" in n for n in got["notes"]), got["notes"]
