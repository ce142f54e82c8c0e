"""Checkpoints written by rank 0 and read by every rank.

A checkpoint holds what the next step depends on: weights, optimizer state, the
step count and the RNG state. The data position is the step itself (see
``dataset.batch_at``). ``meta`` records the settings that shape the loss curve, so a
resume with different ones fails loudly instead of silently diverging.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

PREFIX = "step_"
SUFFIX = ".pt"


def path_for(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"{PREFIX}{step:08d}{SUFFIX}"


def save(directory: str | Path, state: dict[str, Any]) -> Path:
    """Write ``state`` for ``state['step']`` atomically, so a crash never leaves a torn file."""
    path = path_for(directory, int(state["step"]))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)
    return path


def latest(directory: str | Path) -> Path | None:
    found = sorted(Path(directory).glob(f"{PREFIX}*{SUFFIX}"))
    return found[-1] if found else None


def resolve(resume: str, directory: str | None) -> Path:
    """``--resume latest`` (the newest in --checkpoint-dir), a checkpoint directory, or a file."""
    if resume == "latest":
        if directory is None:
            raise FileNotFoundError("--resume without a path needs --checkpoint-dir to look in")
        target: Path | None = latest(directory)
        if target is None:
            raise FileNotFoundError(f"--resume: no checkpoint ({PREFIX}*{SUFFIX}) in {directory}")
        return target
    p = Path(resume)
    if p.is_dir():
        target = latest(p)
        if target is None:
            raise FileNotFoundError(f"--resume: no checkpoint ({PREFIX}*{SUFFIX}) in {p}")
        return target
    if not p.is_file():
        raise FileNotFoundError(f"--resume: {p} does not exist")
    return p


def load(path: str | Path) -> dict[str, Any]:
    # Our own files hold optimizer state and RNG tensors, so weights_only loading suffices.
    return torch.load(path, map_location="cpu", weights_only=True)


def load_meta(path: str | Path) -> dict[str, Any]:
    # mmap reads only what ``meta`` needs, not every tensor in the file.
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)["meta"]


def meta_mismatch(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    keys = sorted(set(saved) | set(current))
    return [f"{k}: checkpoint {saved.get(k)!r} vs now {current.get(k)!r}" for k in keys if saved.get(k) != current.get(k)]


__all__ = ["latest", "load", "load_meta", "meta_mismatch", "path_for", "resolve", "save"]
