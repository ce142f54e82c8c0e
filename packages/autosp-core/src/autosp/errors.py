"""Errors AutoSP raises for input it cannot handle; every one says what to do."""

from __future__ import annotations

from torch._dynamo.exc import ShortenTraceback


class AutoSPError(ShortenTraceback):
    """A program or configuration that AutoSP cannot make sequence-parallel as asked.

    It derives from Dynamo's ``ShortenTraceback`` only so that Dynamo re-raises it as
    is, instead of wrapping it in ``BackendCompilerFailed``: callers can catch it.
    """

    def __init__(self, *args: object) -> None:
        super().__init__(*args, first_useful_frame=None)


class ConfigError(AutoSPError, ValueError):
    """Options that do not fit the process group or the installed packages."""


__all__ = ["AutoSPError", "ConfigError"]
