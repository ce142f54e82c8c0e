"""Reductions and selections along the sequence, then batch-level math: exact at every P and variant.

Pooling classifiers, a reward model's last token with a margin loss, DPO's per-sequence
log-probability sums, a [CLS] token prepended inside forward, cumsum positions: each once
silently wrong (a sharding rule computed on one rank's partial sum while claiming the whole).
"""

from __future__ import annotations

import pytest
import torch
from harness import run_spmd
from reduction_models import NAMES
from reduction_workers import reference, run

REFS: dict[tuple[str, int], dict] = {}


def check(
    world: int, backend: str, variant: str, names: list[str] = NAMES, options: dict | None = None, seq: int = 16
) -> None:
    for name in names:
        if (name, seq) not in REFS:
            REFS[name, seq] = reference(name, seq)
    per_rank = run_spmd(run, world, names, backend, variant, options or {}, seq)
    for rank, results in enumerate(per_rank):
        for name in names:
            got, ref = results[name], REFS[name, seq]
            where = f"{name} {variant} P={world} {backend} rank {rank}"
            torch.testing.assert_close(got["loss"], ref["loss"], rtol=1e-5, atol=1e-6, msg=f"{where}: loss")
            for pname, g in ref["grads"].items():
                torch.testing.assert_close(
                    got["grads"][pname], g, rtol=1e-4, atol=1e-6, msg=f"{where}: grad of {pname}"
                )


def test_two_ranks_aot_eager_ulysses():
    check(2, "aot_eager", "ulysses")


@pytest.mark.extended(covered_by="test_two_ranks_aot_eager_ulysses")
def test_two_ranks_aot_eager_ring():
    check(2, "aot_eager", "ring")  # the padded model's mask tiled block by block


@pytest.mark.extended(covered_by="test_two_ranks_aot_eager_ulysses")
def test_three_ranks_ring():
    check(3, "aot_eager", "ring", ["pool-mean", "pool-last", "reward", "dpo"], seq=24)


# Four processes on the CI's two cores cost the most: every family once per variant, split among them.
FOUR = {
    "ulysses": ["pool-mean", "pool-max", "pool-last", "pool-weighted", "reward", "dpo", "cls-token", "cumsum"],
    "ring": ["pool-sum", "pool-max", "pool-first", "pool-norm", "reward", "dpo", "cls-token"],
    "hybrid": ["pool-mean", "pool-last", "pool-logsumexp", "pool-weighted", "dpo"],
}


@pytest.mark.extended(covered_by="test_two_ranks_aot_eager_ulysses")
@pytest.mark.parametrize("variant,options", [("ulysses", {}), ("ring", {}), ("hybrid", {"ulysses_degree": 2})])
def test_four_ranks_aot_eager(variant, options):
    check(4, "aot_eager", variant, FOUR[variant], options=options)


# Under Inductor, one family each of reductions (a mean pool), selections (the last token's
# reward) and tokens added inside forward (a [CLS] token): the rules are the same as above.
@pytest.mark.extended(covered_by="test_two_ranks_aot_eager_ulysses")
def test_two_ranks_inductor():
    check(2, "inductor", "ulysses", ["pool-mean", "cls-token"])


@pytest.mark.extended(covered_by="test_two_ranks_aot_eager_ulysses")
def test_four_ranks_inductor_ring():
    check(4, "inductor", "ring", ["reward"])
