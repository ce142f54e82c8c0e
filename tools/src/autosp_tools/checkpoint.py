"""Checkpoints written by rank 0 and read by every rank, each verified by a SHA-256 checksum.

A checkpoint holds what the next step depends on: weights, optimizer state, the
step count and the RNG state. The data position is the step itself (see
``dataset.batch_at``). ``meta`` records the settings that shape the loss curve, so a
resume with different ones fails loudly instead of silently diverging.

``step_00000040.pt`` has its checksum beside it in ``step_00000040.pt.sha256``, in
``sha256sum`` format (``sha256sum -c`` checks it too). A truncated, empty or
bit-flipped file fails the check on load with an error that names the file and the
newest good checkpoint; torch's own loader would read flipped tensor bytes without a
word. Both files are written to temporaries, fsynced and renamed, the checksum
first, so a checkpoint file that exists always has its checksum; a crash mid-save
leaves only ``*.tmp`` files, which ``clean_stale`` removes at the next start.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

PREFIX = "step_"
SUFFIX = ".pt"
CHECKSUM_SUFFIX = ".sha256"
TMP_SUFFIX = ".tmp"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names it and the newest good one."""


def path_for(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"{PREFIX}{step:08d}{SUFFIX}"


def checksum_path(path: str | Path) -> Path:
    p = Path(path)
    return p.with_name(p.name + CHECKSUM_SUFFIX)


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(directory: Path) -> None:
    # The rename is durable only once the directory entry is on disk.
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durably(path: Path, write: Any) -> None:
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def save(directory: str | Path, state: dict[str, Any]) -> Path:
    """Write ``state`` for ``state['step']`` and its checksum; a crash never leaves a torn checkpoint."""
    path = path_for(directory, int(state["step"]))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}{TMP_SUFFIX}")
    tmp_sum = path.with_name(f"{path.name}{CHECKSUM_SUFFIX}.{os.getpid()}{TMP_SUFFIX}")
    try:
        _write_durably(tmp, lambda f: torch.save(state, f))
        # Hash what reached the file, not what we meant to write.
        line = f"{sha256_file(tmp)}  {path.name}\n".encode()
        _write_durably(tmp_sum, lambda f: f.write(line))
        os.replace(tmp_sum, checksum_path(path))
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)
        tmp_sum.unlink(missing_ok=True)
    return path


def problem(path: str | Path) -> str | None:
    """Why ``path`` is not a usable checkpoint, or None when its bytes match its checksum."""
    p = Path(path)
    if not p.is_file():
        return "does not exist" if not p.exists() else "is not a file"
    size = p.stat().st_size
    if size == 0:
        return "is empty (0 bytes)"
    sums = checksum_path(p)
    if not sums.is_file():
        return (
            f"has no checksum file {sums.name} (written by an older autosp-train, or copied without it; "
            f"if you trust the file, vouch for it with: sha256sum {p} > {sums})"
        )
    fields = sums.read_text(errors="replace").split()
    if not fields or len(fields[0]) != 64:
        return f"its checksum file {sums.name} is unreadable"
    actual = sha256_file(p)
    if actual != fields[0]:
        return (
            f"is corrupt: its SHA-256 is {actual[:12]}..., its checksum file says {fields[0][:12]}... "
            f"({size:,} bytes: truncated, overwritten or bit-flipped)"
        )
    return None


def checkpoints(directory: str | Path) -> list[Path]:
    """Every checkpoint file in ``directory``, oldest first."""
    d = Path(directory)
    return sorted(d.glob(f"{PREFIX}*{SUFFIX}")) if d.is_dir() else []


def latest(directory: str | Path) -> Path | None:
    found = checkpoints(directory)
    return found[-1] if found else None


def newest_good(directory: str | Path) -> Path | None:
    """The newest checkpoint in ``directory`` that passes its checksum."""
    for p in reversed(checkpoints(directory)):
        if problem(p) is None:
            return p
    return None


def _bad(path: Path, why: str) -> CheckpointError:
    good = newest_good(path.parent)
    hint = (
        f"the newest good checkpoint is {good}: resume from it with --resume {good}, or with --resume auto"
        if good is not None
        else f"there is no good checkpoint in {path.parent}"
    )
    return CheckpointError(f"checkpoint {path} {why}; {hint}")


@dataclass(frozen=True)
class Resolved:
    """What ``--resume`` points at; ``path`` None means a fresh start (``auto`` with no checkpoint yet)."""

    path: Path | None
    skipped: list[tuple[Path, str]] = field(default_factory=list)
    note: str = ""

    def notes(self) -> list[str]:
        skipped = [f"--resume auto: skipping {p}: it {why}" for p, why in self.skipped]
        return skipped + ([self.note] if self.note else [])


def resolve(resume: str, directory: str | None) -> Resolved:
    """``--resume auto|latest|DIR|FILE`` to a checkpoint whose checksum holds; raise CheckpointError.

    ``auto`` takes the newest good checkpoint in ``directory`` and lists those it
    skipped; with no checkpoint there at all it means a fresh start. ``latest`` (a bare
    ``--resume``) and a directory take the newest, and refuse it if it is bad.
    """
    if resume in ("auto", "latest") and directory is None:
        raise CheckpointError(f"--resume {resume} needs --checkpoint-dir to look in (or give a checkpoint path)")
    if resume == "auto":
        assert directory is not None
        skipped: list[tuple[Path, str]] = []
        for p in reversed(checkpoints(directory)):
            why = problem(p)
            if why is None:
                return Resolved(p, skipped)
            skipped.append((p, why))
        if skipped:
            listing = "; ".join(f"{p.name} {why}" for p, why in skipped)
            raise CheckpointError(
                f"--resume auto: no good checkpoint in {directory}: {listing}; "
                "start afresh in an empty --checkpoint-dir"
            )
        return Resolved(None, note=f"--resume auto: no checkpoint in {directory} yet; starting at step 1")
    p = Path(directory) if resume == "latest" else Path(resume)  # type: ignore[arg-type]
    if p.is_dir():
        target = latest(p)
        if target is None:
            raise CheckpointError(f"--resume: no checkpoint ({PREFIX}*{SUFFIX}) in {p}")
        p = target
    elif not p.exists():
        raise CheckpointError(f"--resume: {p} does not exist")
    why = problem(p)
    if why is not None:
        raise _bad(p, why)
    return Resolved(p)


def clean_stale(directory: str | Path) -> list[Path]:
    """Remove what an interrupted save left: temporaries, and checksums whose checkpoint never landed."""
    d = Path(directory)
    if not d.is_dir():
        return []
    stale = [p for p in d.glob(f"{PREFIX}*{TMP_SUFFIX}") if p.is_file()]
    stale += [
        s
        for s in d.glob(f"{PREFIX}*{SUFFIX}{CHECKSUM_SUFFIX}")
        if not s.with_name(s.name[: -len(CHECKSUM_SUFFIX)]).exists()
    ]
    for p in stale:
        p.unlink(missing_ok=True)
    return sorted(stale)


def _torch_load(path: Path, **kwargs: Any) -> Any:
    why = problem(path)
    if why is not None:
        raise _bad(path, why)
    try:
        # Our own files hold only tensors, numbers and strings, so weights_only loading suffices.
        return torch.load(path, map_location="cpu", weights_only=True, **kwargs)
    except Exception as e:  # the checksum held, so the file is as written: another torch, or not ours
        raise _bad(path, f"passes its checksum but cannot be read ({type(e).__name__}: {e})") from e


def load(path: str | Path) -> dict[str, Any]:
    return _torch_load(Path(path))


def load_meta(path: str | Path) -> dict[str, Any]:
    # mmap reads only what ``meta`` needs, not every tensor in the file.
    return _torch_load(Path(path), mmap=True)["meta"]


def meta_mismatch(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    keys = sorted(set(saved) | set(current))
    return [
        f"{k}: checkpoint {saved.get(k)!r} vs now {current.get(k)!r}" for k in keys if saved.get(k) != current.get(k)
    ]


__all__ = [
    "CheckpointError",
    "Resolved",
    "checkpoints",
    "checksum_path",
    "clean_stale",
    "latest",
    "load",
    "load_meta",
    "meta_mismatch",
    "newest_good",
    "path_for",
    "problem",
    "resolve",
    "save",
    "sha256_file",
]
