"""Fault injection, for testing only: ``AUTOSP_FAULT=rank:step:kind`` breaks one rank mid-step.

The fault fires on rank ``rank`` (``*``: every rank) in step ``step`` (1-based) after the forward and
before the backward, so the other ranks are inside the step's collectives when it
happens. Kinds:

- ``raise``: raise ``InjectedFault`` (a rank that fails with an exception)
- ``exit``: ``os._exit(13)`` (a rank that vanishes without a word)
- ``kill``: SIGKILL to itself (what the out-of-memory killer does)
- ``interrupt``: SIGINT to itself (one rank interrupted: KeyboardInterrupt)
- ``hang``: sleep forever (a rank stuck inside a step)
- ``stop``: SIGSTOP to itself (a half-dead rank: alive, sockets open, never answering)

Before it fires, the rank prints one line to stderr with the wall-clock time, from
which the tests measure how long the job takes to end. The tests in
``integration_tests/test_faults.py`` use it; nothing else should.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

ENV = "AUTOSP_FAULT"
KINDS = ("raise", "exit", "kill", "interrupt", "hang", "stop")
EXIT_CODE = 13


class InjectedFault(RuntimeError):
    """The exception of ``AUTOSP_FAULT=...:raise``."""


@dataclass(frozen=True)
class Fault:
    rank: int | None  # None: every rank
    step: int
    kind: str

    def hook(self, rank: int, step: int) -> Callable[[], None] | None:
        """What the trainer calls between forward and backward on this rank and step, if anything."""
        if step != self.step or self.rank not in (None, rank):
            return None
        return lambda: self.fire(rank)

    def fire(self, rank: int) -> None:
        print(
            f"{ENV}: {self.kind} on rank {rank} in step {self.step} at unix time {time.time():.3f}",
            file=sys.stderr,
            flush=True,
        )
        if self.kind == "raise":
            raise InjectedFault(f"{ENV}: injected exception on rank {rank} in step {self.step}")
        if self.kind == "exit":
            os._exit(EXIT_CODE)
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.kind == "interrupt":
            # A job started in the background by a script (`cmd &` without job control) inherits SIGINT
            # ignored, and the signal would be lost: the fault is a Ctrl-C that reaches Python.
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.raise_signal(signal.SIGINT)  # KeyboardInterrupt at the next bytecode
            return
        if self.kind == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        while True:  # "hang", and "stop" if someone sends SIGCONT
            time.sleep(3600)


def parse(value: str) -> Fault:
    """``rank:step:kind``; raise ValueError saying what is wrong."""
    parts = value.split(":")
    if (
        len(parts) != 3
        or not (parts[0].isdigit() or parts[0] == "*")
        or not parts[1].isdigit()
        or parts[2] not in KINDS
    ):
        raise ValueError(
            f"{ENV}={value!r} must be rank:step:kind with rank a number or *, kind one of "
            f"{', '.join(KINDS)} (for example 1:3:raise); unset it for normal training"
        )
    fault = Fault(None if parts[0] == "*" else int(parts[0]), int(parts[1]), parts[2])
    if fault.step < 1:
        raise ValueError(f"{ENV}={value!r}: steps count from 1")
    return fault


def from_env() -> Fault | None:
    value = os.environ.get(ENV, "")
    return parse(value) if value else None


__all__ = ["ENV", "EXIT_CODE", "KINDS", "Fault", "InjectedFault", "from_env", "parse"]
