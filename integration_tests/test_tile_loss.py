"""Tiled logits and loss (``autosp.tile_loss``) under SP: the single-device loss and gradients, one all-reduce."""

from __future__ import annotations

import cases
import tile_loss_workers as workers
import torch
from harness import run_spmd

SEQ = 64


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 96, (2, SEQ), generator=g)
    labels = ids.clone()
    labels[0, 2:20] = -100  # ignored tokens, on rank 0's side only
    return {"ids": ids, "labels": labels}


def _assert_matches(got: dict, ref: dict, what: str) -> None:
    torch.testing.assert_close(got["loss"], ref["loss"], rtol=1e-6, atol=1e-6, msg=f"{what}: loss")
    for pname, g in ref["grads"].items():
        torch.testing.assert_close(got["grads"][pname], g, rtol=1e-4, atol=1e-6, msg=f"{what}: grad of {pname}")


def test_sp2_tiled_loss_matches_single_device():
    batch = _batch()
    # Inductor and the untiled path are checked in one process (packages/autosp-core/tests/test_tile_loss.py).
    runs = [("llama", "aot_eager", 8), ("gpt2", "aot_eager", 8)]
    per_rank = run_spmd(workers.run, 2, runs, batch)
    refs = {name: cases.reference(name, batch) for name in ("llama", "gpt2")}
    for rank, results in enumerate(per_rank):
        for (name, backend, tile), got in zip(runs, results):
            _assert_matches(got, refs[name], f"{name} {backend} tile_loss={tile} rank {rank}")
        tiled, gpt2 = results
        # 63 tokens per rank after the shift, chunks of 8 rows: the [63, 96] logits are never whole.
        assert len(tiled["notes"]) == 1 and tiled["notes"][0].startswith("tile_loss: tiled"), tiled["notes"]
        # The loss's sum and count cross in one all-reduce; the LM head's input is not gathered.
        assert tiled["collectives"]["all_reduce"] == 1, tiled["collectives"]
        assert "all_gather" not in tiled["collectives"], tiled["collectives"]
        # GPT-2 returns its logits: they are live anyway, so the pass leaves the graph as is, and says why.
        assert len(gpt2["notes"]) == 1 and "used elsewhere" in gpt2["notes"][0], gpt2["notes"]
