"""Checkpoint files: checksummed, written durably and atomically, and every kind of damage named."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

import pytest
import torch

from autosp_tools import checkpoint


def state(step: int) -> dict[str, object]:
    return {"step": step, "model": {"w": torch.full((64, 64), float(step))}, "meta": {"lr": 0.1}}


@pytest.fixture
def three(tmp_path: Path) -> Path:
    for step in (1, 2, 3):
        checkpoint.save(tmp_path, state(step))
    return tmp_path


def test_round_trip_with_a_sha256sum_checksum(tmp_path: Path) -> None:
    path = checkpoint.save(tmp_path, state(7))
    assert path == tmp_path / "step_00000007.pt"
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert checkpoint.checksum_path(path).read_text() == f"{digest}  step_00000007.pt\n"  # sha256sum -c format
    assert torch.equal(checkpoint.load(path)["model"]["w"], torch.full((64, 64), 7.0))
    assert checkpoint.load_meta(path) == {"lr": 0.1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000007.pt", "step_00000007.pt.sha256"]


def test_save_fsyncs_both_files_and_the_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[str] = []
    real = os.fsync

    def spy(fd: int) -> None:
        synced.append("dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    checkpoint.save(tmp_path, state(1))
    assert synced == ["file", "file", "dir"]


def test_a_save_that_fails_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(obj: object, f: object) -> None:
        f.write(b"half")  # type: ignore[attr-defined]
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken)
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save(tmp_path, state(1))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("harm", "why"),
    [
        (lambda p: p.write_bytes(p.read_bytes()[:100]), r"is corrupt: its SHA-256 is \w+\.\.\., its checksum file"),
        (lambda p: p.write_bytes(b""), r"is empty \(0 bytes\)"),
        (lambda p: p.write_bytes(p.read_bytes()[:-9] + b"x" + p.read_bytes()[-8:]), r"is corrupt"),
        (lambda p: checkpoint.checksum_path(p).unlink(), r"has no checksum file step_00000003.pt.sha256"),
        (lambda p: checkpoint.checksum_path(p).write_text("nonsense\n"), r"its checksum file .* is unreadable"),
    ],
    ids=["truncated", "empty", "one-byte", "no-checksum", "bad-checksum"],
)
def test_damage_is_named_with_the_newest_good(three: Path, harm, why: str) -> None:  # noqa: ANN001
    bad = checkpoint.path_for(three, 3)
    harm(bad)
    assert checkpoint.problem(checkpoint.path_for(three, 2)) is None
    assert checkpoint.newest_good(three) == checkpoint.path_for(three, 2)
    expected = rf"checkpoint {bad} {why}.*the newest good checkpoint is {checkpoint.path_for(three, 2)}"
    for attempt in (
        lambda: checkpoint.load(bad),
        lambda: checkpoint.load_meta(bad),
        lambda: checkpoint.resolve("latest", str(three)),
        lambda: checkpoint.resolve(str(three), None),
    ):
        with pytest.raises(checkpoint.CheckpointError, match=expected):
            attempt()
    resolved = checkpoint.resolve("auto", str(three))
    assert resolved.path == checkpoint.path_for(three, 2)
    assert [p for p, _ in resolved.skipped] == [bad]
    assert resolved.notes()[0].startswith(f"--resume auto: skipping {bad}: it ")


def test_resolve_auto_starts_fresh_only_when_there_is_nothing(tmp_path: Path) -> None:
    fresh = checkpoint.resolve("auto", str(tmp_path / "new"))
    assert fresh.path is None and "starting at step 1" in fresh.notes()[0]
    checkpoint.save(tmp_path, state(1)).write_bytes(b"")
    with pytest.raises(checkpoint.CheckpointError, match=r"no good checkpoint in .*step_00000001.pt is empty"):
        checkpoint.resolve("auto", str(tmp_path))
    with pytest.raises(checkpoint.CheckpointError, match=r"needs --checkpoint-dir"):
        checkpoint.resolve("auto", None)
    with pytest.raises(checkpoint.CheckpointError, match=r"does not exist"):
        checkpoint.resolve(str(tmp_path / "nope.pt"), None)


def test_clean_stale_removes_what_an_interrupted_save_left(three: Path) -> None:
    leftovers = [
        three / "step_00000004.pt.123.tmp",
        three / "step_00000004.pt.sha256.123.tmp",
        three / "step_00000005.pt.sha256",
    ]
    for p in leftovers:
        p.write_text("x")
    mine = three / "notes.tmp"  # not ours: kept
    mine.write_text("x")
    assert checkpoint.clean_stale(three) == sorted(leftovers)
    assert [p.name for p in checkpoint.checkpoints(three)] == [f"step_0000000{i}.pt" for i in (1, 2, 3)]
    assert all(checkpoint.problem(p) is None for p in checkpoint.checkpoints(three))
    assert mine.exists()


def test_a_checkpoint_without_checksum_can_be_vouched_for(tmp_path: Path) -> None:
    path = checkpoint.save(tmp_path, state(4))
    checkpoint.checksum_path(path).unlink()  # as an older autosp-train wrote it
    why = checkpoint.problem(path)
    assert why is not None and f"sha256sum {path} > {path}.sha256" in why
    # What that command writes: the digest and the path as given.
    checkpoint.checksum_path(path).write_text(f"{hashlib.sha256(path.read_bytes()).hexdigest()}  {path}\n")
    assert checkpoint.problem(path) is None
