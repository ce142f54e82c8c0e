"""``autosp.verify`` at sp=2: passes a correct program, catches a dropped collective, and the
``AUTOSP_VERIFY=1`` first-call check. One spawn of 2 ranks for all of it (about 6 compiles)."""

from __future__ import annotations

import pytest
import torch
import verify_workers
from harness import run_spmd


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_spmd(verify_workers.run_all, 2, fresh=True)


def test_correct_model_passes(ranks):
    for rank, out in enumerate(ranks):
        report = out["llama"]
        assert report.ok and report.rank == rank and report.sp_size == 2 and not report.failed_ranks
        assert report.tolerance_dtype == "float32" and (report.rtol, report.atol) == (1e-4, 1e-5)
        # Every parameter's gradient compared, the loss and the RoPE buffer checked, all inside tolerance.
        assert len(report.grads) == out["params"] and not report.grad_only_in_reference and not report.grad_only_in_sp
        assert [c.name for c in report.outputs] == ["output", "buffer:inv_freq"]
        assert report.worst_grad.ratio < 0.1, str(report)
        # What AutoSP did is in the report: the attention exchanges and the gradient all-reduce.
        assert report.graphs == 1 and report.collectives["all_to_all"] >= 1 and report.collectives["grad_all_reduce"]
        assert out["llama_untouched"] and out["rng_untouched"]


def test_inputs_or_parameters_that_differ_between_ranks_are_refused(ranks):
    for out in ranks:
        assert "input[0] differs between SP ranks" in out["different_inputs"], out["different_inputs"]
        assert "parameter embed.weight differs between SP ranks" in out["different_params"], out["different_params"]
        assert "seed the model identically" in out["different_params"]


def test_dropped_all_reduce_is_caught(ranks):
    params = {"embed.weight", "cls.weight", "cls.bias"} | {
        f"block.{n}"
        for n in (
            "ln1.weight",
            "ln1.bias",
            "ln2.weight",
            "ln2.bias",
            "qkv.weight",
            "qkv.bias",
            "proj.weight",
            "proj.bias",
            "fc.weight",
            "fc.bias",
            "out.weight",
            "out.bias",
        )
    }
    for out in ranks:
        broken = out["broken"]
        assert broken["hits"] > 0, "the patch never ran: the pooled mean no longer reaches collectives.all_reduce"
        error = broken["error"]
        assert not isinstance(error, str), f"verify did not raise: {error}"
        report = error.report
        assert not report.ok and report.failed_ranks == [0, 1]
        worst = report.worst_grad
        assert worst.name in params and worst.ratio > 1 and not worst.ok
        assert f"worst gradient: {worst.name}" in str(error)
        assert report.worst_output.name == "output" and not report.worst_output.ok  # the loss is wrong too
        # Under AUTOSP_VERIFY=1 the first call raises before the user's program runs, and stays armed.
        assert broken["armed"] == ["VerificationError", "VerificationError"]
        assert not broken["user_ran"] and broken["untouched"]


def test_autosp_verify_checks_the_first_call_only(ranks):
    for out in ranks:
        first = out["first_call"]
        assert first["calls"] == (1, 1)
        assert first["graphs"] == 1  # the user's calls reuse the graph verify compiled (same backend, guards)
        loss, ref_loss = first["loss"]
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        grads, ref_grads = first["grads"]
        assert grads.keys() == ref_grads.keys()
        for name, g in ref_grads.items():
            torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_sharded_outputs_are_compared_whole(ranks):
    for out in ranks:
        report = out["sharded"]
        assert report.ok, str(report)
        assert [c.name for c in report.outputs][:2] == ["output[0]", "output[1]"], str(report)
