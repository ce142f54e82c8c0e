"""Errors AutoSP raises for input it cannot handle; every one says what to do."""

from __future__ import annotations


class AutoSPError(RuntimeError):
    """A program or configuration that AutoSP cannot make sequence-parallel as asked."""


class ConfigError(AutoSPError, ValueError):
    """Options that do not fit the process group or the installed packages."""


__all__ = ["AutoSPError", "ConfigError"]
