"""``autosp_tools.hf.AutoSPTrainer``: Hugging Face ``Trainer`` fine-tuning a tiny Llama with AutoSP.

sp=2 on 2 gloo processes (gradient accumulation 1 and 2) and dp=2 x sp=2 on 4 must give, at every
logged step, the loss of a 1-process plain ``Trainer`` on the same global batch, and the same final
weights, on every rank. Three spawns: the 1-process reference, sp=2, dp2 x sp2.
"""

from __future__ import annotations

import pytest
import torch
from harness import run_spmd

pytest.importorskip("transformers", reason="the Trainer integration needs transformers")
pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate")

import hf_trainer_workers as workers  # noqa: E402 - after the skips: it imports nothing heavy, its workers do

# (gradient_accumulation_steps, per-device batch); the 1-process reference takes the dp x batch rows at once.
SP_RUNS = [(1, 2), (2, 1)]
MESH_RUN = (1, 2)


@pytest.fixture(scope="module")
def reference() -> dict:
    runs = [*SP_RUNS, (MESH_RUN[0], MESH_RUN[1] * 2)]
    return run_spmd(workers.fine_tune, 1, runs, None, fresh=True)[0]


@pytest.fixture(scope="module")
def sp2() -> list[dict]:
    return run_spmd(workers.fine_tune, 2, SP_RUNS, 2, fresh=True)


@pytest.fixture(scope="module")
def mesh() -> list[dict]:
    return run_spmd(workers.fine_tune, 4, [MESH_RUN], 2, fresh=True)


def _check(ranks: list[dict], run: str, ref: dict, world: int) -> None:
    assert len(ref["losses"]) == 4 and ref["losses"][-1] < ref["losses"][0] - 0.1, "the reference did not learn"
    for rank, out in enumerate(ranks):
        got = out[run]
        # AutoSP really ran: its attention exchange and gradient all-reduce are in the program.
        assert got["report"]["world"] == world and got["report"]["sites"] == 1
        assert got["report"]["collectives"]["all_to_all"] >= 1 and got["report"]["collectives"]["grad_all_reduce"]
        torch.testing.assert_close(
            torch.tensor(got["losses"]),
            torch.tensor(ref["losses"]),
            rtol=1e-4,
            atol=0,
            msg=lambda m, r=rank: f"rank {r}, {run}: logged losses differ from 1 process: {m}",
        )
        for name, w in got["weights"].items():
            # 4 AdamW steps at lr 1e-2 turn last-bit gradient differences into weight differences
            # up to ~1e-5 where a gradient is near zero (Adam normalises it); a wrong gradient is off by ~lr.
            torch.testing.assert_close(
                w,
                ref["weights"][name],
                rtol=1e-3,
                atol=1e-4,
                msg=lambda m, r=rank, n=name: f"rank {r}, {run}, {n}: {m}",
            )
            assert torch.equal(w, ranks[0][run]["weights"][name]), f"rank {rank}, {run}: {name} differs from rank 0"


# HF Trainer's own loop takes a minute here; CI checks its argument errors (tools/tests/
# test_hf_trainer_checks.py) and an HF model under DDP x SP (test_compositions.py).
@pytest.mark.extended(covered_by="integration_tests/test_compositions.py::test_dp2_sp2_matches_one_process")
@pytest.mark.parametrize("run", [workers.key(*r) for r in SP_RUNS])
def test_sp2_matches_one_process(sp2, reference, run):
    _check(sp2, run, reference[run], world=2)


@pytest.mark.extended(covered_by="integration_tests/test_compositions.py::test_dp2_sp2_matches_one_process")
def test_dp2_sp2_matches_one_process(mesh, reference):
    """Each SP group reads its own rows; DDP averages over the dp group only; the logged loss is global."""
    ga, rows = MESH_RUN
    _check(mesh, workers.key(ga, rows), reference[workers.key(ga, rows * 2)], world=4)
