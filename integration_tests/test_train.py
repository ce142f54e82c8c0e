"""autosp-train end to end: 20-step loss curves on 2 and 4 processes match one process; resume matches; bad flags fail early."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from autosp_tools import checkpoint
from autosp_tools.dataset import VOCAB_SIZE, batch_at, load_tokens
from autosp_tools.train import TrainConfigError, run

TINY = ["--model-size", "tiny", "--seq-len", "128", "--batch-size", "2", "--steps", "20", "--seed", "3", "--quiet"]
RTOL = 1e-4


def assert_curves_close(a: list[float], b: list[float]) -> None:
    assert len(a) == len(b)
    for step, (x, y) in enumerate(zip(a, b), start=1):
        assert math.isclose(x, y, rel_tol=RTOL), f"step {step}: {x} vs {y}\n{a}\n{b}"


BUILTIN = TINY + ["--model-impl", "builtin"]


@pytest.fixture(scope="module")
def single() -> list[float]:
    return run(TINY + ["--sp-size", "1", "--nproc", "1"]).losses


@pytest.fixture(scope="module")
def single_builtin() -> list[float]:
    return run(BUILTIN + ["--sp-size", "1", "--nproc", "1"]).losses


def test_two_sp_ranks_match_one(single: list[float]) -> None:
    # The default model (HF Llama when transformers is installed), one SP group of two ranks.
    result = run(TINY + ["--sp-size", "2", "--nproc", "2"])
    assert_curves_close(result.losses, single)
    assert len(result.peak_rss_mb) == 2
    assert single[-1] < single[0]  # it learns


@pytest.mark.extended(covered_by="test_two_sp_ranks_match_one")
def test_four_sp_ranks_match_one(single: list[float]) -> None:
    # Four ranks share each sequence; 2 kv heads on 4 ranks are replicated rather than split.
    result = run(TINY + ["--sp-size", "4", "--nproc", "4"])
    assert_curves_close(result.losses, single)


@pytest.mark.extended(covered_by="test_two_sp_ranks_match_one")
def test_two_sp_groups_match_one(single_builtin: list[float]) -> None:
    # Two SP groups of one rank each split the batch and average gradients.
    result = run(BUILTIN + ["--sp-size", "1", "--nproc", "2"])
    assert_curves_close(result.losses, single_builtin)


@pytest.mark.extended(
    covered_by="tools/tests/test_checkpoint.py::test_resolve_auto_starts_fresh_only_when_there_is_nothing"
)
def test_resume_reproduces_uninterrupted_curve(single_builtin: list[float], tmp_path: Path) -> None:
    # The built-in model keeps this test quick; the HF one is covered above.
    ckpt = str(tmp_path / "ckpt")
    first = run(BUILTIN + ["--sp-size", "2", "--checkpoint-dir", ckpt, "--stop-at", "3"])
    assert (first.start_step, first.end_step) == (0, 3)
    assert checkpoint.latest(ckpt) == checkpoint.path_for(ckpt, 3)
    second = run(BUILTIN + ["--sp-size", "2", "--checkpoint-dir", ckpt, "--resume"])
    assert (second.start_step, second.end_step) == (3, 20)
    assert_curves_close(first.losses + second.losses, single_builtin)


def test_resume_with_other_settings_is_refused(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    run(BUILTIN + ["--sp-size", "1", "--steps", "1", "--checkpoint-dir", ckpt])
    with pytest.raises(TrainConfigError, match="lr: checkpoint 0.003 vs now 0.01"):
        run(BUILTIN + ["--sp-size", "1", "--steps", "1", "--lr", "1e-2", "--resume", ckpt])


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--sp-size", "2", "--nproc", "3"], r"--nproc 3 is not a multiple of --sp-size 2"),
        (["--sp-size", "2", "--backend", "none"], r"--backend none .* --sp-size 1"),
        (["--heads", "3"], r"--dim 64 must be divisible by --heads 3"),
        (["--stop-at", "2"], r"--checkpoint-dir"),
        (["--data", "/nonexistent/file.txt"], r"no such file"),
        (["--sp-size", "2", "--variant", "nope"], r"unknown SP variant 'nope'"),
        (["--resume", "/nonexistent/ckpt.pt", "--sp-size", "1"], r"does not exist"),
    ],
)
def test_bad_flags_fail_clearly(flags: list[str], message: str) -> None:
    with pytest.raises(TrainConfigError, match=message):
        run(TINY + flags)


def test_cli_reports_bad_flags_as_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    from autosp_tools.train import main

    with pytest.raises(SystemExit) as exit_info:
        main(TINY + ["--sp-size", "2", "--nproc", "3"])
    assert exit_info.value.code == 2
    assert "--nproc 3 is not a multiple of --sp-size 2" in capsys.readouterr().err


def test_batches_are_a_function_of_seed_and_step() -> None:
    tokens = load_tokens(None)
    assert 100_000 < tokens.numel() <= 2_000_000
    a = batch_at(tokens, 5, seed=1, batch_size=2, seq_len=64)
    assert torch.equal(a, batch_at(tokens, 5, seed=1, batch_size=2, seq_len=64))
    assert not torch.equal(a, batch_at(tokens, 6, seed=1, batch_size=2, seq_len=64))
    assert a.shape == (2, 64) and int(a.max()) < VOCAB_SIZE
