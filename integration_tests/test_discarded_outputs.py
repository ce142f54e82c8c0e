"""A parameter reached only through outputs the caller gives no gradient keeps ``.grad`` None, as in eager.

A backbone's pooler whose ``pooler_output`` the caller ignores, an auxiliary head not trained this
step, an integer output: eager leaves those parameters' ``.grad`` None, which optimizers read as
"skip" (AdamW neither decays nor steps them). AOT autograd gives them zeros; AutoSP must not.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from discarded_workers import run_discarded
from harness import run_spmd
from spmd_pool import RankError, SPMDPool


@pytest.fixture(scope="module")
def pool() -> Iterator[SPMDPool]:
    with SPMDPool(2, pg_timeout_s=240.0) as p:
        yield p


def _differences(record: dict) -> list[str]:
    problems = []
    for step, (got, ref) in enumerate(zip(record["got"], record["ref"], strict=True)):
        if not torch.allclose(got["loss"], ref["loss"], rtol=1e-4):
            problems.append(f"step {step}: loss {float(got['loss'])} vs {float(ref['loss'])}")
        scale = max((g.abs().max().item() for g in ref["grads"].values() if g is not None), default=1.0)
        for name, want in ref["grads"].items():
            have = got["grads"][name]
            if (have is None) != (want is None):
                problems.append(
                    f"step {step}: {name} has {'no ' if have is None else 'a '}gradient, eager the opposite"
                )
            elif want is not None and not torch.allclose(have, want, rtol=1e-4, atol=1e-5 * scale):
                problems.append(f"step {step}: {name} differs by {(have - want).abs().max().item():.3g}")
    return problems


def _check(per_rank: list[dict], where: str) -> None:
    for rank, results in enumerate(per_rank):
        assert not isinstance(results, RankError), results.traceback
        for program, record in results.items():
            assert record["sites"] >= 1, f"{where} {program}: no attention made sequence-parallel"
            # The plans make some parameters' gradients None in eager: the check is not vacuous.
            assert any(g is None for step in record["ref"] for g in step["grads"].values())
            problems = _differences(record)
            assert not problems, f"{where} rank {rank} {program}: " + "; ".join(problems)


@pytest.mark.parametrize(
    ("backend", "outputs"), [("aot_eager", "whole"), ("inductor", "whole"), ("aot_eager", "sharded")]
)
def test_unreached_parameters_keep_no_gradient(pool: SPMDPool, backend: str, outputs: str) -> None:
    where = f"ulysses {backend} outputs={outputs} P=2"
    _check(pool.run(run_discarded, "ulysses", backend, outputs, timeout_s=600), where)


@pytest.mark.parametrize(
    ("variant", "world", "backend"), [("ring", 3, "aot_eager"), ("hybrid", 4, "aot_eager"), ("ulysses", 4, "inductor")]
)
@pytest.mark.extended(covered_by="test_unreached_parameters_keep_no_gradient")
def test_unreached_parameters_keep_no_gradient_on_more_ranks(variant: str, world: int, backend: str) -> None:
    _check(run_spmd(run_discarded, world, variant, backend), f"{variant} {backend} P={world}")
