"""Tiled MLPs (``autosp.tile_mlp``) under SP: the single-device loss and gradients, the MLPs tiled on every rank.

The op's own exactness (every activation, gated or not, with and without biases) and what the pass
leaves as is are checked in one process (packages/autosp-core/tests/test_tile_mlp.py).
"""

from __future__ import annotations

import cases
import pytest
import tile_loss_workers as workers
import torch
from harness import run_spmd

SEQ = 64


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(0, 96, (2, SEQ), generator=g)
    return {"ids": ids, "labels": ids.clone()}


def _assert_matches(got: dict, ref: dict, what: str) -> None:
    torch.testing.assert_close(got["loss"], ref["loss"], rtol=1e-6, atol=1e-6, msg=f"{what}: loss")
    for pname, g in ref["grads"].items():
        torch.testing.assert_close(got["grads"][pname], g, rtol=1e-4, atol=1e-6, msg=f"{what}: grad of {pname}")


def _check(world: int, runs: list[tuple[str, str, str, dict]]) -> None:
    batch = _batch()
    refs = {name: cases.reference(name, batch) for name in {r[0] for r in runs}}
    per_rank = run_spmd(workers.run_tile_mlp, world, runs, batch)
    for rank, results in enumerate(per_rank):
        for (name, backend, variant, options), got in zip(runs, results):
            what = f"{name} {variant} {backend} {options} P={world} rank {rank}"
            _assert_matches(got, refs[name], what)
            tiled = [n for n in got["notes"] if n.startswith("tile_mlp: tiled")]
            # Every layer's MLP, on this rank's tokens (2 x 64 / P rows) in chunks of 16 rows.
            assert len(tiled) == 2 and f"[{2 * SEQ // world}," in tiled[0], f"{what}: {got['notes']}"
            assert not any("MLP weight" in f for f in got["fallbacks"]), f"{what}: {got['fallbacks']}"


def test_two_ranks_ulysses_ring_sac_and_inductor():
    _check(
        2,
        [
            ("llama", "aot_eager", "ulysses", {"tile_mlp": 16, "sac": True}),
            ("llama", "inductor", "ulysses", {"tile_mlp": 16, "sac": True}),
            ("gpt2", "aot_eager", "ring", {"tile_mlp": 16}),
        ],
    )


@pytest.mark.extended(covered_by="test_two_ranks_ulysses_ring_sac_and_inductor")
def test_two_ranks_without_sac_and_hf():
    _check(
        2,
        [("llama", "aot_eager", "ulysses", {"tile_mlp": 16}), ("hf-llama", "aot_eager", "ulysses", {"tile_mlp": 16})],
    )


@pytest.mark.extended(covered_by="test_two_ranks_ulysses_ring_sac_and_inductor")
def test_four_ranks():
    hybrid = {"tile_mlp": 16, "variant_options": {"ulysses_degree": 2}}
    _check(
        4,
        [
            ("llama", "aot_eager", "ulysses", {"tile_mlp": 16}),
            ("llama", "inductor", "ulysses", {"tile_mlp": 16}),
            ("gpt2", "aot_eager", "hybrid", hybrid),
        ],
    )
