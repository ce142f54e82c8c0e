"""Settings for every test process pytest starts, and through the environment for every process they spawn."""

import functools
import os
from pathlib import Path

# Scalar Inductor kernels, without probing the vector ISAs (see integration_tests/spmd_pool.py,
# quick_inductor_kernels). Set in the environment too, so that ranks the tools spawn (autosp-bench,
# autosp-sac-bench's DeepSpeed run, autosp-train) compile the same way.
os.environ["TORCHINDUCTOR_VEC_ISA_OK"] = "0"

import torch._inductor.config as inductor_config  # noqa: E402 - reads the variable above

inductor_config.cpp.simdlen = 1
inductor_config.cpp.vec_isa_ok = False

import pytest  # noqa: E402

# Two tiers. `hatch run test` (the README's test command, what CI runs) leaves out the tests marked
# `extended`; `hatch run test-all` runs every test. An extended test repeats, at another world size,
# backend or over more programs, a behaviour that a first-tier test checks already, and names that
# test, so that no behaviour is left to test-all alone.
EXTENDED = (
    "extended(covered_by): run by `hatch run test-all`, not by `hatch run test` (CI); covered_by names the "
    "first-tier test that checks the same behaviour: a test function of the same module, or path::function"
)
ROOT = Path(__file__).parent


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", EXTENDED)


@functools.cache
def _defines(path: str, function: str) -> bool:
    return (ROOT / path).is_file() and f"def {function}(" in (ROOT / path).read_text()


def _names_a_test(item: pytest.Item, name: object, collected: set, first_tier: set) -> bool:
    if not isinstance(name, str):
        return False
    if "::" in name:  # another file's test: it must exist there (its tier is that file's marks)
        path, function = name.split("::")
        return _defines(path, function)
    target = getattr(getattr(item, "module", None), name, None)
    # One collected here must have a first-tier case (not checked when one test is run by its id).
    return target is not None and (target not in collected or target in first_tier)


@pytest.hookimpl(tryfirst=True)  # before -m and -k deselect anything
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    collected = {getattr(i, "function", None) for i in items}
    first_tier = {getattr(i, "function", None) for i in items if i.get_closest_marker("extended") is None}
    wrong = [
        f"{item.nodeid}: covered_by={mark.kwargs.get('covered_by')!r}"
        for item in items
        if (mark := item.get_closest_marker("extended")) is not None
        and not _names_a_test(item, mark.kwargs.get("covered_by"), collected, first_tier)
    ]
    if wrong:
        raise pytest.UsageError(
            "a test marked extended must name, as covered_by=, a first-tier test of its module (or "
            "path::function) that checks the same behaviour:\n  " + "\n  ".join(wrong)
        )
