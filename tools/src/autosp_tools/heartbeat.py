"""Each rank's progress, in memory shared with the launcher: which step it is in, and since when.

The training loop calls ``step_started``/``step_finished``; they do nothing unless the
launcher installed a ``Heartbeat`` in this process (spawned ranks only: under torchrun
or on one in-process rank nobody watches). The launcher reads the ``Board`` to name
the step a failed rank was in and to end a job whose ranks stopped making progress.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

# What a rank is doing; the step is the 1-based number of the step it is in or last finished.
SETUP, IN_STEP, BETWEEN, DONE = 0.0, 1.0, 2.0, 3.0
_SLOTS = 5  # step, phase, time of the last beat, longest step so far, steps finished in this run


@dataclass(frozen=True)
class RankBeat:
    step: int
    phase: float
    since: float  # time.monotonic() of the last beat; monotonic clocks are system-wide on Linux and macOS
    longest_step_s: float
    finished: int

    def doing(self) -> str:
        if self.phase == SETUP:
            return "setting up (before its first step)"
        if self.phase == IN_STEP:
            return f"in step {self.step}"
        if self.phase == BETWEEN:
            return f"after step {self.step} (logging or writing a checkpoint)"
        return "after training (shutting down)"


class Heartbeat:
    """This rank's slots in the shared array."""

    def __init__(self, array: Any, rank: int) -> None:
        self._array = array
        self._base = rank * _SLOTS
        self._started = 0.0
        self._longest = 0.0
        self._finished = 0
        self._write(0, SETUP)

    def _write(self, step: int, phase: float) -> None:
        # No lock: a reader that catches a write halfway sees the previous beat's time at worst,
        # and a lock held by a rank that is then killed would block the launcher.
        b = self._base
        self._array[b : b + _SLOTS] = [float(step), phase, time.monotonic(), self._longest, float(self._finished)]

    def started(self, step: int) -> None:
        self._started = time.monotonic()
        self._write(step, IN_STEP)

    def finished(self, step: int) -> None:
        self._finished += 1
        # The first step compiles; it says nothing about how long the next ones take.
        if self._finished > 1:
            self._longest = max(self._longest, time.monotonic() - self._started)
        self._write(step, BETWEEN)

    def done(self, step: int) -> None:
        self._write(step, DONE)


class Board:
    """The launcher's view of every rank's heartbeat."""

    def __init__(self, ctx: Any, world: int) -> None:
        self.array = ctx.RawArray("d", world * _SLOTS)
        self.world = world
        now = time.monotonic()
        for r in range(world):
            self.array[r * _SLOTS + 2] = now

    def read(self) -> list[RankBeat]:
        raw = list(self.array[:])
        return [
            RankBeat(int(raw[i]), raw[i + 1], raw[i + 2], raw[i + 3], int(raw[i + 4]))
            for i in range(0, len(raw), _SLOTS)
        ]


_current: Heartbeat | None = None


def install(beat: Heartbeat | None) -> None:
    global _current
    _current = beat


def step_started(step: int) -> None:
    if _current is not None:
        _current.started(step)


def step_finished(step: int) -> None:
    if _current is not None:
        _current.finished(step)


def training_done(step: int) -> None:
    if _current is not None:
        _current.done(step)


__all__ = [
    "BETWEEN",
    "DONE",
    "IN_STEP",
    "SETUP",
    "Board",
    "Heartbeat",
    "RankBeat",
    "install",
    "step_finished",
    "step_started",
    "training_done",
]
