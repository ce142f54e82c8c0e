"""outputs='sharded': sequence-shaped outputs come back as DTensors, exact when gathered, with exact gradients."""

from __future__ import annotations

import pytest
import torch
from harness import run_spmd
from sharded_outputs_workers import SEQ, reference, run, run_uneven


@pytest.mark.parametrize(
    ("variant", "world", "backend"),
    [
        ("ulysses", 2, "aot_eager"),
        ("ring", 2, "aot_eager"),
        pytest.param("ring", 4, "aot_eager", marks=pytest.mark.extended(covered_by="test_logits_as_dtensor")),
        pytest.param("ulysses", 2, "inductor", marks=pytest.mark.extended(covered_by="test_logits_as_dtensor")),
    ],
)
def test_logits_as_dtensor(variant: str, world: int, backend: str) -> None:
    ref = reference()
    for rank, got in enumerate(run_spmd(run, world, variant, backend)):
        where = f"{variant} P={world} {backend} rank {rank}"
        assert got["dtensor"] and got["placements"] == ["S(1)"], (where, got["placements"])
        assert got["local_shape"] == (2, SEQ // world, ref["logits"].shape[-1]), where
        assert not got["loss_is_dtensor"], where  # a loss is whole, as ever
        torch.testing.assert_close(got["loss"], ref["loss"], rtol=1e-5, atol=1e-6, msg=f"{where}: loss")
        torch.testing.assert_close(got["logits"], ref["logits"], rtol=1e-5, atol=1e-5, msg=f"{where}: logits")
        for name, g in ref["grads"].items():
            torch.testing.assert_close(got["grads"][name], g, rtol=1e-4, atol=1e-6, msg=f"{where}: grad {name}")
        assert any("outputs='sharded'" in o for o in got["outputs"]), got["outputs"]
        assert any("outputs gathered whole" in n and "outputs='sharded'" in n for n in got["whole_notes"]), got[
            "whole_notes"
        ]


_UNEVEN_MORE = pytest.mark.extended(covered_by="test_uneven_lengths_as_dtensor")


@pytest.mark.parametrize(
    ("world", "variant", "backend"),
    [
        (2, "ulysses", "aot_eager"),
        pytest.param(4, "ring", "aot_eager", marks=_UNEVEN_MORE),
        pytest.param(4, "hybrid", "inductor", marks=_UNEVEN_MORE),
        pytest.param(2, "ulysses", "inductor", marks=_UNEVEN_MORE),
    ],
)
def test_uneven_lengths_as_dtensor(world: int, variant: str, backend: str) -> None:
    # A sequence output whose length the ranks do not split evenly (logits[:, 1:], or an input of 15
    # tokens) comes back in torch.chunk's pieces, a DTensor Shard's layout (an empty last rank too):
    # once each rank claimed its piece times P as the global length, and gathering it aborted gloo.
    # A symbolic such length comes back whole (the note says why); a symbolic even one, a DTensor.
    cases = [(16, 1, False), (15, 0, False), (6, 1, False), (16, 1, True), (16, 0, True)]
    for rank, got in enumerate(run_spmd(run_uneven, world, cases, variant, backend)):
        for (seq, cut, dynamic), r in got.items():
            where = f"{variant} P={world} rank {rank}: length {seq - cut}, dynamic {dynamic}"
            assert r["error"] < 1e-5 and r["grad_error"] < 1e-5, (where, r)
            if dynamic and (seq - cut) % world:
                assert not r["dtensor"] and any("gathered whole" in n for n in r["notes"]), (where, r)
                continue
            assert r["dtensor"], where
            size = -(-(seq - cut) // world)
            assert r["local"] == max(0, min(size, seq - cut - rank * size)), (where, r["local"])
