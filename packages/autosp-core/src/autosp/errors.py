"""Errors AutoSP raises for input it cannot handle; every one says what to do."""

from __future__ import annotations

from typing import Any

from torch._dynamo.exc import ShortenTraceback


def first_line(error: BaseException) -> str:
    """``"Type: first line of the message"``: an error as one line, for messages that name several."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def add_note(error: BaseException, note: str) -> None:
    """``error.add_note(note)``, on Python 3.10 too (which keeps ``__notes__`` but does not print them)."""
    notes = getattr(error, "__notes__", None)
    if notes is None:
        try:
            error.__notes__ = notes = []  # type: ignore[attr-defined]
        except AttributeError:
            return
    notes.append(note)


class AutoSPError(ShortenTraceback):
    """A program or configuration that AutoSP cannot make sequence-parallel as asked.

    It derives from Dynamo's ``ShortenTraceback`` only so that Dynamo re-raises it as
    is, instead of wrapping it in ``BackendCompilerFailed``: callers can catch it.
    """

    def __init__(self, *args: object) -> None:
        super().__init__(*args, first_useful_frame=None)


class ConfigError(AutoSPError, ValueError):
    """Options that do not fit the process group or the installed packages."""


class CollectiveFailure(AutoSPError):
    """A collective of AutoSP did not complete: another SP rank raised, exited or hangs."""


class PeerFailed(CollectiveFailure):
    """Another SP rank's program raised, so this rank's collective can never complete (``autosp.peer_failure``)."""


class VerificationError(AutoSPError):
    """``autosp.verify`` found the SP program differs from the single-device program.

    ``report`` is the ``VerifyReport`` (every output and gradient error, the worst parameter).
    """

    def __init__(self, report: Any) -> None:
        super().__init__(
            f"{report}\nThe sequence-parallel program does not compute what the model computes on one device: "
            "do not train with it (if the model draws random numbers, verify with them switched off)."
        )
        self.report = report

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.report,)


__all__ = ["AutoSPError", "ConfigError", "VerificationError"]
