"""Property-based whole-program fuzzing: random small programs, AutoSP against single-device eager.

Each example is a program from ``fuzz_programs`` (token-wise ops, attention with and without
masks, shifts and slices, reductions and selections along the sequence, losses over tokens
and over the batch), compiled with every installed variant at P=2 and P=4 on a persistent
pool of gloo ranks, called twice (new inputs, same graph), and compared with single-device eager
for both losses and every accumulated parameter gradient on every rank (rtol = atol = 1e-4).
A clear ``AutoSPError`` on every rank counts as a refusal, reported apart; anything else
that is not a match fails, and hypothesis shrinks it to a minimal program.

The examples are fixed (a seed per configuration, no example database): CI runs the same
programs every time, and different configurations different programs.
``AUTOSP_FUZZ_EXAMPLES=N`` runs N per configuration instead of the CI budget;
``AUTOSP_FUZZ_SEED=K`` shifts every configuration's seed (to explore beyond the CI programs);
``AUTOSP_FUZZ_BACKEND`` (default ``aot_eager``) and ``AUTOSP_FUZZ_SAC`` (``auto``, ``true`` or
``false``; default ``auto``) choose the compile options.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterator

import fuzz_programs as fp
import pytest
from fuzz_check import FuzzFailure, Stats, check_program
from hypothesis import HealthCheck, Phase, given, seed, settings
from spmd_pool import PoolTimeout, SPMDPool, sleep_on

# Examples per configuration in CI (4 configurations, at P = 2; an example took 15-30 s on 2 loaded cores in
# the suite's slowest runs, and the CI's 25-minute budget holds everything else too). Explore
# further with AUTOSP_FUZZ_EXAMPLES and AUTOSP_FUZZ_SEED.
CI_EXAMPLES = 3
EXAMPLES = int(os.environ.get("AUTOSP_FUZZ_EXAMPLES", CI_EXAMPLES))
SEED_SHIFT = int(os.environ.get("AUTOSP_FUZZ_SEED", 0))
COMPILE_OPTIONS = {
    "backend": os.environ.get("AUTOSP_FUZZ_BACKEND", "aot_eager"),
    "sac": {"true": True, "false": False}.get(os.environ.get("AUTOSP_FUZZ_SAC", "auto").lower(), "auto"),
}

CONFIGS = [  # (P, variant, variant_options, lengths P does not divide)
    (2, "ulysses", {}, False),
    (2, "ring", {}, False),
    (2, "ulysses", {}, True),
    (2, "ring", {}, True),
    (4, "ulysses", {}, False),
    # Ring balances query rows by a model-built mask in chunks of >= 128 tokens by default: more
    # than these programs hold. At P=4 every chunk size is allowed, so the plan (rows moved, or finer
    # tiles only) meets every mask kind; at P=2 the program's layout does.
    (4, "ring", {"balance_chunk": 1}, False),
    (4, "hybrid", {"ulysses_degree": 2, "balance_chunk": 1}, False),
    (3, "ring", {}, True),
    (3, "ulysses", {}, True),  # heads 4 and 8 padded to multiples of 3
    (3, "hybrid", {"ulysses_degree": 3}, False),  # the same padding inside hybrid's ulysses group
    (4, "ulysses", {}, True),
    (4, "hybrid", {"ulysses_degree": 2, "balance_chunk": 1}, True),
]
# Four ranks: in `hatch run test-all` (CI runs P=2).
EXTENDED = pytest.mark.extended(covered_by="test_random_programs_match_single_device")

# Ring-based variants take every mask too (a model-built mask is tiled block by block).
RING_MASKS = fp.MASKS


def installed_variants() -> set[str]:
    from autosp.registry import get_registry

    return set(get_registry().variants)


@pytest.fixture(scope="module")
def pools() -> Iterator[dict[int, SPMDPool]]:
    started: dict[int, SPMDPool] = {}
    yield started
    for pool in started.values():
        pool.close()


def pool_for(pools: dict[int, SPMDPool], world: int) -> SPMDPool:
    """The pool of ``world`` ranks; one pool at a time, so that idle ranks do not hold memory."""
    for other in [w for w in pools if w != world]:
        pools.pop(other).close()
    if world not in pools:
        pools[world] = SPMDPool(world)
    return pools[world]


# A causal LM: loss over tokens, labels shifted inside.
LM = {
    "seed": 3,
    "batch": 2,
    "seq": 8,
    "dim": 16,
    "heads": 4,
    "input": "ids",
    "body": [
        {
            "op": "attention",
            "mask": "causal",
            "kv_heads": 4,
            "residual": True,
            "norm": "rms",
            "rope": True,
            "fused": False,
        }
    ],
    "losses": [{"kind": "lm", "reduction": "mean", "tap": -1, "coef": 1.0}],
}


def test_check_catches_a_missing_gradient_all_reduce(pools: dict[int, SPMDPool]) -> None:
    # The fuzzer must see a real SP bug: without the gradient all-reduce each rank keeps only its tokens' share.
    pool = pool_for(pools, 2)
    assert check_program(pool, LM, "ulysses") == "ok"
    with pytest.raises(FuzzFailure, match="grad of"):
        check_program(pool, LM, "ulysses", disable_passes=("autosp.sync_grads",))


def test_pool_reports_a_hang_and_recovers(pools: dict[int, SPMDPool]) -> None:
    pool = pool_for(pools, 2)
    with pytest.raises(PoolTimeout, match=r"ranks \[1\] of 2: no answer"):
        pool.run(sleep_on, [1], 600.0, timeout_s=3.0)
    assert pool.run(sleep_on, [], 0.0) == [0, 1]


@pytest.mark.parametrize(
    ("world", "variant", "options", "uneven"),
    [
        pytest.param(p, v, o, u, id=f"{v}-P{p}" + ("-uneven" if u else ""), marks=[EXTENDED] if p > 2 else [])
        for p, v, o, u in CONFIGS
    ],
)
def test_random_programs_match_single_device(
    pools: dict[int, SPMDPool],
    world: int,
    variant: str,
    options: dict,
    uneven: bool,
    record_property: pytest.RecordProperty,
) -> None:
    if variant not in installed_variants():
        pytest.skip(f"variant {variant!r} is not installed (its package provides it)")
    pool = pool_for(pools, world)
    stats = Stats()
    masks = fp.MASKS if variant == "ulysses" else RING_MASKS

    @seed(zlib.crc32(f"{variant}-P{world}{'-uneven' if uneven else ''}".encode()) + SEED_SHIFT)
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        phases=[Phase.explicit, Phase.generate, Phase.shrink],
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    @given(fp.programs(world, masks=masks, uneven=uneven))
    def check(spec: fp.Spec) -> None:
        check_program(pool, spec, variant, options, stats, **COMPILE_OPTIONS)

    try:
        check()
    finally:
        summary = stats.summary(f"{variant} P={world}")
        print(summary)
        record_property("fuzz", summary)
    # A fuzzer whose programs are mostly refused checks little.
    assert 3 * stats.ok >= stats.ok + stats.refused, summary
