"""Shared fixtures of the autosp-core unit tests."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parents[2]
# Helper modules (_core_helpers, _core_spmd_cases: names unique across the repo) and
# integration_tests/{harness,models}.py are imported by name, also in spawned processes.
for folder in (TESTS, ROOT / "integration_tests"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))


@pytest.fixture
def fresh_registry(monkeypatch):
    """A registry rebuilt from scratch for the test, forgotten again afterwards."""
    from autosp.registry import BLOCK_ENV, TRACE_ENV, reset_registry

    monkeypatch.delenv(BLOCK_ENV, raising=False)
    monkeypatch.delenv(TRACE_ENV, raising=False)
    reset_registry()
    yield
    reset_registry()


@pytest.fixture(autouse=True, scope="module")
def _dynamo_reset():
    """Each module starts with empty Dynamo caches (no recompile-limit surprises)."""
    torch._dynamo.reset()
    yield
