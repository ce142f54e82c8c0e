"""autosp-train's flags: every value range-checked before any process starts, nothing replaced silently."""

from __future__ import annotations

from pathlib import Path

import pytest

from autosp_tools.config import TrainConfigError, build_parser, config_from_args

TINY = ["--model-size", "tiny", "--model-impl", "builtin", "--seq-len", "64", "--steps", "10"]


def config(argv: list[str]):  # noqa: ANN201 - TrainConfig
    return config_from_args(build_parser().parse_args(TINY + argv))


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        # Each was silently replaced by the preset before.
        (["--heads", "0"], r"--heads 0 must be a positive integer \(leave it out for the tiny preset's 4\)"),
        (["--dim", "0"], r"--dim 0 must be a positive integer"),
        (["--layers", "0"], r"--layers 0 must be a positive integer"),
        (["--kv-heads", "0"], r"--kv-heads 0 must be a positive integer"),
        (["--hidden", "-3"], r"--hidden -3 must be a positive integer"),
        (["--nproc", "0"], r"--nproc 0 must be positive \(leave it out for --dp x --sp-size\)"),
        # Each trained before: a negative learning rate, or meaningless settings.
        (["--min-lr-ratio", "-1"], r"--min-lr-ratio -1.0 must be between 0 and 1: .*negative learning rate"),
        (["--min-lr-ratio", "1.5"], r"--min-lr-ratio 1.5 must be between 0 and 1"),
        (["--warmup", "-5"], r"--warmup -5 must be between 0 and --steps 10"),
        (["--warmup", "11"], r"--warmup 11 must be between 0 and --steps 10"),
        (["--grad-clip", "-1"], r"--grad-clip -1.0 must be >= 0 \(0 disables clipping\)"),
        (["--weight-decay", "-0.1"], r"--weight-decay -0.1 must be >= 0"),
        (["--lr", "nan"], r"--lr nan must be a finite number"),
        (["--lr", "0"], r"--lr 0.0 must be positive"),
        (["--timeout", "0"], r"--timeout 0.0 must be a positive number of seconds"),
        (["--timeout", "inf"], r"--timeout inf must be a finite number"),
        (["--seed", "-1"], r"--seed -1 must be between 0 and 2\*\*63 - 1"),
        (["--steps", "0"], r"--steps 0 must be positive"),
        (["--batch-size", "0"], r"--batch-size 0 must be positive"),
        (["--log-every", "0"], r"--log-every 0 must be >= 1"),
        (["--save-every", "-1"], r"--save-every -1 must be >= 0"),
        (["--sp-size", "0"], r"--sp-size 0 must be positive"),
        (["--dp", "0"], r"--dp 0 must be positive"),
        (["--dim", "60"], r"--dim 60 must be divisible by --heads 4 with an even head size"),
        (["--heads", "4", "--kv-heads", "3"], r"--heads 4 must be a multiple of --kv-heads 3"),
        (["--backend", "none", "--sp-size", "1", "--show-report"], r"--show-report prints AutoSP's report"),
        (["--stop-at", "11"], r"--stop-at 11 must be between 1 and --steps 10"),
    ],
)
def test_bad_values_are_refused(flags: list[str], message: str) -> None:
    with pytest.raises(TrainConfigError, match=message):
        config(flags)


def test_data_and_checkpoint_paths_are_checked_before_training(tmp_path: Path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(TrainConfigError, match=r"--data .*empty.txt is empty; give a file with text"):
        config(["--data", str(empty)])
    short = tmp_path / "short.txt"
    short.write_bytes(b"x" * 40)
    with pytest.raises(TrainConfigError, match=r"--data .*short.txt has 40 bytes; each sequence of --seq-len 64"):
        config(["--data", str(short)])
    with pytest.raises(TrainConfigError, match=r"--data .*: not a readable file"):
        config(["--data", str(tmp_path)])
    # A file where the checkpoint directory should be: refused now, not at the first save after training.
    with pytest.raises(TrainConfigError, match=r"--checkpoint-dir .*empty.txt is a file, not a directory"):
        config(["--checkpoint-dir", str(empty)])
    with pytest.raises(TrainConfigError, match=r"--checkpoint-dir .*sub: .*empty.txt is a file, so the directory"):
        config(["--checkpoint-dir", str(empty / "sub")])


def test_every_problem_is_listed_at_once() -> None:
    with pytest.raises(TrainConfigError) as info:
        config(["--heads", "0", "--warmup", "-5", "--grad-clip", "-1"])
    assert len(str(info.value).splitlines()) == 3


@pytest.mark.parametrize("variant", ["ulysses", "ring", "hybrid"])
def test_a_length_the_ranks_split_unevenly_is_taken(variant: str) -> None:
    # Once refused under hybrid; every built-in variant takes pieces one token apart now.
    cfg = config(["--seq-len", "63", "--sp-size", "4", "--variant", variant])
    assert (cfg.seq_len, cfg.sp_size) == (63, 4)


@pytest.mark.parametrize("variant", ["ulysses", "hybrid"])
def test_heads_the_ranks_do_not_split_are_taken(variant: str) -> None:
    # Once refused under Ulysses: SDPA's heads travel padded to a multiple of the ranks now.
    cfg = config(["--sp-size", "4", "--heads", "2", "--dim", "64", "--variant", variant])
    assert (cfg.sp_size, cfg.model.heads) == (4, 2)


def test_given_values_are_kept() -> None:
    cfg = config(
        [
            "--sp-size",
            "1",
            "--heads",
            "2",
            "--kv-heads",
            "1",
            "--dim",
            "32",
            "--layers",
            "1",
            "--hidden",
            "48",
            "--warmup",
            "0",
            "--grad-clip",
            "0",
            "--min-lr-ratio",
            "0",
            "--timeout",
            "2.5",
        ]
    )
    m = cfg.model
    assert (m.dim, m.layers, m.heads, m.kv_heads, m.hidden) == (32, 1, 2, 1, 48)
    assert (cfg.warmup, cfg.grad_clip, cfg.min_lr_ratio, cfg.timeout) == (0, 0.0, 0.0, 2.5)
    assert (cfg.nproc, cfg.sp_size) == (1, 1)


def test_torchrun_world_must_agree_with_nproc(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert config([]).nproc == 2
    with pytest.raises(TrainConfigError, match=r"--nproc 4 differs from the torchrun world size 2"):
        config(["--nproc", "4", "--dp", "2"])


def test_fault_injection_that_cannot_fire_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AUTOSP_FAULT", "3:2:raise")
    with pytest.raises(TrainConfigError, match=r"AUTOSP_FAULT=3:2:raise would never fire: this run has 2 rank"):
        config([])
    monkeypatch.setenv("AUTOSP_FAULT", "1:2:boom")
    with pytest.raises(TrainConfigError, match=r"AUTOSP_FAULT='1:2:boom' must be rank:step:kind"):
        config([])


def test_zero3_is_refused_by_the_library_too() -> None:
    """Not only autosp-train's flag: a script calling the helper gets the same refusal, before
    DeepSpeed's hooks fail inside the first forward."""
    from autosp_tools.parallel import ZERO3_REFUSAL, Groups, deepspeed_config, deepspeed_trainer

    groups = Groups(sp=None, dp=None, dp_rank=0, dp_size=1, mesh=None)
    with pytest.raises(ValueError, match="ZeRO-3 is not supported with AutoSP yet"):
        deepspeed_trainer(object(), groups, deepspeed_config(3, 1, 1e-3, 0.0, 1.0))
    assert "--data-parallel fsdp" in ZERO3_REFUSAL
