"""A graph whose AutoSP compile raises runs whole, compiled by torch alone, exact (``autosp.whole``).

A pass registered for the run raises on the graphs and ranks each case names. Against single-device
eager on every rank: a program whose second graph (after a graph break) runs whole while the first
stays sequence-parallel, the activations and their gradients crossing the break; a program run
whole entirely (``NotSequenceParallel`` names the failure as its cause); ``CompiledWhole`` as an
error (every rank raises ``CompileCrashed``); a failure on one rank only (every rank raises
``CompileFailed`` at the compile, none hangs in a collective); and ``torch.cond``, which AutoSP's
lowering fails to trace (torch's own error about its branches' strides) and so runs whole.
"""

from __future__ import annotations

import pytest
from harness import run_spmd
from whole_workers import run_failing, run_train_step


def _cases(world: int) -> list[tuple[str, str, frozenset[tuple[int, int]], bool]]:
    second = frozenset((r, 1) for r in range(world))
    both = frozenset((r, g) for r in range(world) for g in (0, 1))
    return [
        ("second-whole", "two-graphs", second, False),
        ("all-whole", "two-graphs", both, False),
        ("strict", "two-graphs", second, True),
        ("rank-0-only", "two-graphs", frozenset({(0, 0)}), False),
        ("cond", "cond", frozenset(), False),
    ]


def test_graphs_autosp_fails_to_compile_run_whole_and_exact() -> None:
    per_rank = run_spmd(run_failing, 2, _cases(2), "ulysses", "aot_eager")
    for rank, results in enumerate(per_rank):
        second = results["second-whole"]
        assert not second["problems"], second
        assert second["sharded"] == [16, None], second
        assert second["whole"] == [None, f"RuntimeError: pass failed on rank {rank}, graph 1"]
        ((kind, message),) = second["warned"]
        assert kind == "CompiledWhole" and "in AutoSP pass test.fail" in message, message

        every = results["all-whole"]
        assert not every["problems"] and every["sharded"] == [None, None], every
        assert [kind for kind, _ in every["warned"]] == ["CompiledWhole", "CompiledWhole", "NotSequenceParallel"]
        assert "AutoSP failed to compile them (RuntimeError: pass failed" in every["warned"][-1][1]

        strict = results["strict"]["error"]
        assert strict.startswith("CompileCrashed: AutoSP failed to compile graph [1/0] (RuntimeError"), strict

        one = results["rank-0-only"]["error"]
        assert one.startswith("CompileFailed: AutoSP failed to compile graph [0/0] on global ranks [0]"), one
        assert "compiled it on global ranks [1]" in one

        cond = results["cond"]
        assert not cond["problems"], cond


def test_a_whole_training_step_compiled_with_its_optimizer() -> None:
    """``autosp.compile`` of a step that runs forward, backward and SGD with momentum: the optimizer's
    graph holds the parameters and momentum buffers as attributes and writes them in place. AutoSP's
    lowering ran those writes on the real buffers at compile time (its compile then failed, and the
    graph ran again compiled by torch): a momentum buffer updated twice, every parameter off by 2e-4
    after two steps, silently. Such a graph goes to torch without AutoSP's lowering, and says so."""
    per_rank = run_spmd(run_train_step, 2, 3, "ulysses", "aot_eager")
    for result in per_rank:
        for eager, compiled in result["losses"]:
            assert abs(eager - compiled) < 1e-5 * abs(eager), result["losses"]
        name, error = result["worst"]
        assert error < 1e-6, (name, error)
        assert 16 in result["sharded"], result["sharded"]  # the model's graphs are sequence-parallel
        assert result["notes"] and "param_groups" in " ".join(result["notes"]), result["notes"]


@pytest.mark.extended(covered_by="test_graphs_autosp_fails_to_compile_run_whole_and_exact")
def test_a_graph_run_whole_beside_ring_graphs_under_inductor_on_four_ranks() -> None:
    cases = [c for c in _cases(4) if c[0] in ("second-whole", "cond")]
    per_rank = run_spmd(run_failing, 4, cases, "ring", "inductor")
    for results in per_rank:
        assert not results["second-whole"]["problems"] and results["second-whole"]["sharded"] == [16, None]
        assert not results["cond"]["problems"], results["cond"]


@pytest.mark.extended(covered_by="test_a_whole_training_step_compiled_with_its_optimizer")
def test_a_whole_training_step_on_four_ranks_under_inductor() -> None:
    for result in run_spmd(run_train_step, 4, 3, "hybrid", "inductor"):
        for eager, compiled in result["losses"]:
            assert abs(eager - compiled) < 1e-5 * abs(eager), result["losses"]
        assert result["worst"][1] < 1e-6, result["worst"]
        assert 16 in result["sharded"], result["sharded"]
