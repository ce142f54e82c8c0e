"""The suite's two tiers: conftest.py's check that every extended test names a first-tier test."""

from __future__ import annotations

import importlib.util
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
_spec = importlib.util.spec_from_file_location("root_conftest", ROOT / "conftest.py")
assert _spec is not None and _spec.loader is not None
conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(conftest)


def first_tier_test() -> None: ...


def repeated_test() -> None: ...


def _item(function: object) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        module=types.SimpleNamespace(**{f.__name__: f for f in (first_tier_test, repeated_test)}), function=function
    )


@pytest.mark.parametrize(
    ("name", "first_tier", "ok"),
    [
        ("first_tier_test", {first_tier_test}, True),
        ("no_such_test", {first_tier_test}, False),
        (None, {first_tier_test}, False),
        ("repeated_test", {first_tier_test}, False),  # collected, extended in all its cases
        ("repeated_test", {first_tier_test, repeated_test}, True),  # some parameter sets run in CI
        ("integration_tests/test_train.py::test_two_sp_ranks_match_one", set(), True),
        ("integration_tests/test_train.py::test_no_such_test", set(), False),
        ("integration_tests/no_such_file.py::test_x", set(), False),
    ],
)
def test_covered_by_must_name_a_first_tier_test(name: object, first_tier: set, ok: bool) -> None:
    collected = {first_tier_test, repeated_test}
    assert conftest._names_a_test(_item(repeated_test), name, collected, first_tier) is ok
