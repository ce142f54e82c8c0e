"""Faults in autosp-train end the job quickly and name their cause; damaged checkpoints are refused or skipped.

One rank of two breaks in the middle of step 3 (after the forward, before the backward,
see ``autosp_tools.faults``): it raises, calls ``os._exit``, is interrupted, hangs, is
stopped (SIGSTOP: alive but silent) or gets SIGKILL. Each test asserts the launcher's
message (the broken rank and the step, not its peer's "connection reset") and the time
from the fault to the end of the job. Checkpoints are truncated, emptied, bit-flipped
inside tensor data, or lose their checksum; a killed run resumed with ``--resume auto``
continues with exactly the state saved.

Runs are small (tiny model, 64 tokens, 6 steps). The faults that only involve the
launcher use two data-parallel ranks without compiling; those where a peer must wait
inside AutoSP's compiled collectives (hang, stop, kill) use two SP ranks.
"""

from __future__ import annotations

import os
import re
import struct
import time
import zipfile
from pathlib import Path
from types import SimpleNamespace

import faults_workers
import pytest
import torch
from harness import run_spmd

from autosp_tools import checkpoint
from autosp_tools.launch import RankFailed, launch
from autosp_tools.train import TrainConfigError, run

TIMEOUT_S = 8
# The job must end within the collective timeout plus this, counted from the fault.
MARGIN_S = 30
BASE = [
    "--model-size",
    "tiny",
    "--model-impl",
    "builtin",
    "--seq-len",
    "64",
    "--batch-size",
    "2",
    "--steps",
    "6",
    "--seed",
    "5",
    "--quiet",
    "--timeout",
    str(TIMEOUT_S),
]
SP = BASE + ["--sp-size", "2", "--backend", "eager"]
DP = BASE + ["--sp-size", "1", "--nproc", "2", "--backend", "none"]
ONE = BASE + ["--sp-size", "1", "--nproc", "1", "--backend", "none"]


def run_with_fault(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str], fault: str, argv: list[str]
) -> tuple[str, float]:
    """The launcher's message, and seconds from the fault to the end of the job."""
    monkeypatch.setenv("AUTOSP_FAULT", fault)
    with pytest.raises(RankFailed) as info:
        run(argv)
    ended = time.time()
    monkeypatch.delenv("AUTOSP_FAULT")
    fired = re.search(r"AUTOSP_FAULT: \w+ on rank \d+ in step \d+ at unix time ([\d.]+)", capfd.readouterr().err)
    assert fired, "the fault never fired"
    return str(info.value), ended - float(fired.group(1))


# Gloo's own error, or AutoSP's naming the collective that waited (the backward's step check, say).
CONSEQUENCE = r"\nthen, as a consequence:\n  rank 0: (RuntimeError|CollectiveFailure): .*gloo"


@pytest.mark.parametrize(
    ("kind", "argv", "message"),
    [
        pytest.param(
            "raise",
            DP,
            r"^rank 1 failed in step 3: InjectedFault: AUTOSP_FAULT: injected exception on "
            r"rank 1 in step 3\nTraceback",
            id="raise",
        ),
        pytest.param(
            "exit",
            DP,
            r"^rank 1 exited with code 13 without raising a Python exception \(os._exit, or a "
            r"crash in native code\), in step 3",
            id="exit",
        ),
        # Today's complaint: one rank interrupted, and the lowest rank's "peer closed" was blamed.
        pytest.param("interrupt", DP, r"^rank 1 failed in step 3: KeyboardInterrupt", id="interrupt"),
        pytest.param(
            "hang",
            SP,
            r"^rank 1 stopped responding in step 3: it is alive but has sent no heartbeat for "
            rf"\d+ s, and rank\(s\) 0 gave up waiting for it in a collective \(--timeout "
            rf"{TIMEOUT_S} s\)",
            id="hang",
            marks=pytest.mark.extended(covered_by="test_a_broken_rank_ends_the_job_and_is_named"),
        ),
        pytest.param(
            "stop",
            SP,
            r"^rank 1 stopped responding in step 3: it is alive but has sent no heartbeat for "
            r"\d+ s",
            id="stop",
            marks=pytest.mark.extended(covered_by="test_a_broken_rank_ends_the_job_and_is_named"),
        ),
    ],
)
def test_a_broken_rank_ends_the_job_and_is_named(
    kind: str, argv: list[str], message: str, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    text, took = run_with_fault(monkeypatch, capfd, f"1:3:{kind}", argv)
    assert re.search(message, text, re.S), text
    assert re.search(CONSEQUENCE, text), text
    assert took < TIMEOUT_S + MARGIN_S, f"the job took {took:.0f} s to end after the fault"


def test_watchdog_ends_a_job_whose_ranks_all_hang(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    # No rank waits in a collective, so no collective timeout fires: only the step watchdog can end it.
    text, took = run_with_fault(monkeypatch, capfd, "*:3:hang", DP)
    assert re.search(
        r"^no progress: rank 0 in step 3, \d+ s after its last heartbeat; rank 1 in step 3, \d+ s after "
        rf"its last heartbeat\. Each step must end within --timeout {TIMEOUT_S} s plus",
        text,
    ), text
    assert "raise --timeout" in text
    assert took < TIMEOUT_S + MARGIN_S, f"the job took {took:.0f} s to end after the fault"


@pytest.mark.extended(
    covered_by="tools/tests/test_checkpoint.py::test_resolve_auto_starts_fresh_only_when_there_is_nothing"
)
def test_killed_rank_then_resume_auto_loses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    ckpt = tmp_path / "ckpt"
    text, took = run_with_fault(
        monkeypatch, capfd, "1:5:kill", SP + ["--checkpoint-dir", str(ckpt), "--save-every", "2"]
    )
    assert re.search(
        r"^rank 1 was killed by SIGKILL \(the kernel's out-of-memory killer sends SIGKILL: check "
        r"memory\), in step 5" + CONSEQUENCE,
        text,
    ), text
    assert took < TIMEOUT_S + MARGIN_S, f"the job took {took:.0f} s to end after the fault"
    assert [p.name for p in checkpoint.checkpoints(ckpt)] == ["step_00000002.pt", "step_00000004.pt"]
    # What a crash in the middle of a save leaves behind.
    stale = ckpt / "step_00000006.pt.4242.tmp"
    stale.write_bytes(b"half a checkpoint")

    resumed = run(SP + ["--checkpoint-dir", str(ckpt), "--resume", "auto"])
    assert "removed " + str(stale) in capfd.readouterr().err
    assert not stale.exists()
    assert (resumed.start_step, resumed.end_step) == (4, 6)
    whole = run(SP)
    # Exactly the state saved: the same floats, not merely close ones.
    assert resumed.losses == whole.losses[4:]
    assert checkpoint.load(checkpoint.path_for(ckpt, 6))["losses"] == whole.losses


def test_spawned_ranks_hash_strings_alike_and_the_launcher_environment_is_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A set of strings is iterated in one order on every rank (AutoSP compiles a graph break inside
    such a loop, or random draws in it, only so), and the launcher leaves its own environment as it was."""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)  # as torchrun and most shells leave it
    hashes = launch(faults_workers.string_hashes, SimpleNamespace(nproc=2, timeout=60.0))
    assert len(set(hashes)) == 1, hashes
    assert "PYTHONHASHSEED" not in os.environ


def test_timeout_reaches_subgroups_made_without_one() -> None:
    # The dp and sp groups of a device mesh are such subgroups.
    late_s = 7.0
    results = run_spmd(faults_workers.subgroup_timeout, 2, late_s, fresh=True)
    assert results[0] is not None, "rank 0 waited for the late rank: the subgroup kept the 30-minute default"
    error, waited = results[0]
    assert "Timed out" in error and waited < late_s - 2, (error, waited)


def _largest_tensor_offset(path: Path) -> tuple[int, int]:
    """Where the largest tensor's bytes start in a torch.save file, and how many there are."""
    with zipfile.ZipFile(path) as z:
        info = max(z.infolist(), key=lambda i: i.file_size)
    with open(path, "rb") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = struct.unpack("<HH", f.read(4))
    return info.header_offset + 30 + name_len + extra_len, info.file_size


def _flip(path: Path) -> None:
    start, size = _largest_tensor_offset(path)
    data = bytearray(path.read_bytes())
    middle = start + size // 2
    data[middle : middle + 64] = bytes(b ^ 0xFF for b in data[middle : middle + 64])
    path.write_bytes(bytes(data))


DAMAGE = {
    "truncated": (lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 3]), r"is corrupt: its SHA-256"),
    "empty": (lambda p: p.write_bytes(b""), r"is empty \(0 bytes\)"),
    "bit-flipped": (_flip, r"is corrupt: its SHA-256"),
    "unchecked": (lambda p: checkpoint.checksum_path(p).unlink(), r"has no checksum file step_00000003.pt.sha256"),
}


@pytest.fixture(scope="module")
def three_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    ckpt = tmp_path_factory.mktemp("good") / "ckpt"
    run(ONE + ["--steps", "4", "--stop-at", "3", "--save-every", "1", "--checkpoint-dir", str(ckpt)])
    return ckpt


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_checkpoint_is_named_with_the_newest_good_one(
    damage: str, three_checkpoints: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for p in three_checkpoints.iterdir():
        (ckpt / p.name).write_bytes(p.read_bytes())
    bad = checkpoint.path_for(ckpt, 3)
    harm, why = DAMAGE[damage]
    harm(bad)
    if damage == "bit-flipped":
        # torch itself reads the flipped bytes without a word: only the checksum notices.
        good = torch.load(checkpoint.path_for(three_checkpoints, 3), weights_only=True)["model"]
        flipped = torch.load(bad, weights_only=True)["model"]
        assert any(not torch.equal(good[k], flipped[k]) for k in good)

    start = time.monotonic()
    for resume in (["--resume"], ["--resume", str(bad)]):
        with pytest.raises(
            TrainConfigError,
            match=rf"checkpoint {re.escape(str(bad))} {why}.*; the newest good "
            rf"checkpoint is {re.escape(str(checkpoint.path_for(ckpt, 2)))}: resume from it",
        ):
            run(ONE + ["--steps", "4", "--checkpoint-dir", str(ckpt)] + resume)
    assert time.monotonic() - start < 30  # refused before any rank starts

    resumed = run(ONE + ["--steps", "4", "--checkpoint-dir", str(ckpt), "--resume", "auto"])
    assert re.search(rf"--resume auto: skipping {re.escape(str(bad))}: it {why}", capfd.readouterr().err)
    assert (resumed.start_step, resumed.end_step) == (2, 4)


def test_resume_auto_with_nothing_to_resume(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    ckpt = tmp_path / "empty"
    result = run(ONE + ["--steps", "1", "--checkpoint-dir", str(ckpt), "--resume", "auto"])
    assert result.start_step == 0
    assert "no checkpoint in" in capfd.readouterr().err
    for p in checkpoint.checkpoints(ckpt) + [checkpoint.path_for(ckpt, 9)]:
        p.write_bytes(b"")
    checkpoint.checksum_path(checkpoint.path_for(ckpt, 9)).write_text("0" * 64 + "  step_00000009.pt\n")
    with pytest.raises(TrainConfigError, match=r"--resume auto: no good checkpoint in .*step_00000009.pt is empty"):
        run(ONE + ["--steps", "1", "--checkpoint-dir", str(ckpt), "--resume", "auto"])
