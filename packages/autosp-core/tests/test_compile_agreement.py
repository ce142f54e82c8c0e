"""agree_on_compile on threads joined by torch's threaded process group (real collectives)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
import torch.distributed as dist

from autosp.compile_agreement import CollectiveMismatch, CompileFailed, ProgramMismatch, agree_on_compile
from autosp.sharding.testing.threads import collectives_issued, simulate


def _outcome(fn: Any) -> tuple[str, str]:
    try:
        return "ok", str(fn())
    except Exception as e:  # noqa: BLE001 - the test asserts on it
        return type(e).__name__, str(e)


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_returns_when_every_rank_compiled(world: int) -> None:
    def rank_fn(rank: int, _: str) -> tuple[tuple[str, str], list[str]]:
        got = _outcome(lambda: agree_on_compile(lambda: f"graph of rank {rank}", dist.group.WORLD, "graph [0/0]"))
        return got, collectives_issued()

    for rank, (got, issued) in enumerate(simulate(rank_fn, world)):
        assert got == ("ok", f"graph of rank {rank}")
        # failed?, the program and captured digests, compiling?, the group ops' digest; nothing gathered
        assert issued == ["all_reduce[(10,)]"]


def test_a_failure_on_one_rank_is_raised_on_every_rank() -> None:
    def rank_fn(rank: int, _: str) -> tuple[str, str]:
        def compile_fn() -> str:
            if rank in (1, 2):
                raise RuntimeError(f"rank {rank}'s schedule check\nmore detail")
            return "compiled"

        return _outcome(lambda: agree_on_compile(compile_fn, dist.group.WORLD, "graph [0/1]"))

    r0, r1, r2, r3 = simulate(rank_fn, 4)
    assert r1 == ("RuntimeError", "rank 1's schedule check\nmore detail")  # its own error, as it was
    assert r2[0] == "RuntimeError"
    for kind, message in (r0, r3):
        assert kind == CompileFailed.__name__
        assert "graph [0/1] compiled on this rank" in message
        assert "global rank 1: RuntimeError: rank 1's schedule check;" in message
        assert "global rank 2: RuntimeError: rank 2's schedule check" in message
        assert "more detail" not in message and "global rank 0:" not in message


def test_ranks_that_compiled_different_programs_are_refused_on_every_rank() -> None:
    """A module attribute, train/eval or an option that differs per rank makes another graph: refused."""

    def rank_fn(rank: int, _: str) -> tuple[tuple[str, str], list[str]]:
        program = "view(2, 16, 4, 8)\nsdpa(is_causal=True)" if rank != 2 else "view(2, 16, 4, 8)\nsdpa(is_causal=False)"
        got = _outcome(lambda: agree_on_compile(lambda: "compiled", dist.group.WORLD, "graph [0/0]", program))
        return got, collectives_issued()

    results = simulate(rank_fn, 3)
    for (kind, message), issued in results:
        assert kind == ProgramMismatch.__name__, message
        assert "different programs for graph [0/0] (global ranks [0, 1]; global ranks [2])" in message
        assert "'sdpa(is_causal=True)' on global ranks [0, 1] against 'sdpa(is_causal=False)'" in message
        assert "train()/eval()" in message
        assert issued[0] == "all_reduce[(10,)]"
    assert len({m for (_, m), _ in results}) == 1  # the same error on every rank


EXCHANGE = ["all_to_all@g", "wait_exchange@g", "all_reduce@g"]


def test_ranks_whose_compiled_graphs_issue_other_collectives_are_refused_on_every_rank() -> None:
    """One program compiled into other group ops on one rank (a collective dropped or two merged there)
    would hang, or pair the wrong collectives: every rank raises, naming the first difference."""

    def rank_fn(rank: int, _: str) -> tuple[tuple[str, str], list[str]]:
        ops = EXCHANGE if rank != 1 else EXCHANGE[:2]  # rank 1's graph lost the all-reduce
        got = _outcome(lambda: agree_on_compile(lambda: "compiled", dist.group.WORLD, "graph [0/0]", "p", lambda: ops))
        return got, collectives_issued()

    results = simulate(rank_fn, 3)
    for (kind, message), issued in results:
        assert kind == CollectiveMismatch.__name__, message
        assert "global rank 0 issues 3, global rank 1 2; at position 2 'all_reduce@g' against '(no more)'" in message
        assert "bug in AutoSP" in message
        assert issued[0] == "all_reduce[(10,)]" and len(issued) == 3  # then the sequences gathered (pickled)
    assert len({m for (_, m), _ in results}) == 1


@pytest.mark.parametrize(
    ("ops", "expect"),
    [
        ([EXCHANGE, EXCHANGE], "ok"),
        ([EXCHANGE, None], "ok"),  # one rank took its graphs from AOT's cache: nothing to compare
        ([EXCHANGE, EXCHANGE[::-1]], CollectiveMismatch.__name__),  # the same ops, another order
    ],
)
def test_group_ops_are_compared_only_when_every_rank_knows_them(ops: list, expect: str) -> None:
    def rank_fn(rank: int, _: str) -> str:
        return _outcome(lambda: agree_on_compile(lambda: "c", dist.group.WORLD, "graph [0/0]", "p", lambda: ops[rank]))[
            0
        ]

    assert simulate(rank_fn, 2) == [expect, expect]


def test_a_program_mismatch_names_python_hashes_that_differ_between_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Set iteration order follows the process's string hashes: with a graph break in such a loop, the
    ranks compile the same code's pieces in other orders. The refusal says so when the hashes differ."""
    import threading

    from autosp import compile_agreement

    monkeypatch.setattr(compile_agreement, "string_hash", lambda: hash(threading.current_thread().name))

    def rank_fn(rank: int, _: str) -> tuple[str, str]:
        return _outcome(lambda: agree_on_compile(lambda: "c", dist.group.WORLD, "graph [10/0]", f"piece {rank}"))

    for kind, message in simulate(rank_fn, 2):
        assert kind == ProgramMismatch.__name__ and "PYTHONHASHSEED" in message, message


def test_the_same_program_agrees() -> None:
    def rank_fn(rank: int, _: str) -> tuple[str, str]:
        return _outcome(lambda: agree_on_compile(lambda: rank, dist.group.WORLD, "graph [1/0]", "same code"))

    assert simulate(rank_fn, 2) == [("ok", "0"), ("ok", "1")]


def test_each_run_compares_the_tensors_a_graph_reads_besides_parameters_and_inputs() -> None:
    """A plain tensor attribute or a global (``captured``): apart on the ranks, every rank raises,
    naming it; alike, the graph runs, and a tensor is fingerprinted again only when it changed."""
    from autosp.compile_agreement import CapturedDigest, SameProgramOnEveryRun
    from autosp.param_check import ParameterMismatch

    def rank_fn(rank: int, _: str) -> list[tuple[str, str]]:
        table = torch.ones(4)
        run = SameProgramOnEveryRun(
            lambda t, x: x + t, dist.group.WORLD, "graph [0/0]", "prog", CapturedDigest([(0, "table")])
        )
        got = [_outcome(lambda: run(table, torch.zeros(4)).sum().item())]
        table.fill_(1.0 + rank)  # in place, on one rank: its version moves, so it is fingerprinted again
        got.append(_outcome(lambda: run(table, torch.zeros(4))))
        got.append(("issued", " ".join(collectives_issued())))
        return got

    for first, second, issued in simulate(rank_fn, 2):
        assert first == ("ok", "4.0")
        assert second[0] == ParameterMismatch.__name__
        assert "hold different tensors, 1 of 1 that graph [0/0] reads besides parameters" in second[1]
        assert "  table: rank 0 / rank 1\n" in second[1]
        assert issued[1].startswith("all_reduce[(10,)] all_reduce[(10,)]")


def test_a_rank_that_recompiles_the_same_program_stays_in_step_with_the_running_ranks() -> None:
    """Dynamo recompiles on rank 0 only (a hook that only records), into the same program: its
    agreement meets rank 1's run exchange, so it skips its own first one and both run in step."""
    from autosp.compile_agreement import SameProgramOnEveryRun, agree_on_compile_joining_runs

    def rank_fn(rank: int, _: str) -> tuple[bool, list[str], list[str]]:
        joined = False
        if rank == 0:
            fn, joined = agree_on_compile_joining_runs(lambda: lambda x: x * 2, dist.group.WORLD, "graph [0/1]", "prog")
            run = SameProgramOnEveryRun(fn, dist.group.WORLD, "graph [0/1]", "prog", skip_first=joined)
        else:
            run = SameProgramOnEveryRun(lambda x: x * 2, dist.group.WORLD, "graph [0/0]", "prog")
        got = [_outcome(lambda: run(torch.ones(2)).sum().item()) for _ in range(2)]
        got.append(_outcome(lambda: dist.all_reduce(torch.ones(1)) or "in step"))
        return joined, [g[1] for g in got], collectives_issued()

    (joined0, got0, issued0), (joined1, got1, issued1) = simulate(rank_fn, 2)
    assert joined0 and not joined1
    assert got0 == got1 == ["4.0", "4.0", "in step"]
    assert len(issued0) == len(issued1) == 3, (issued0, issued1)  # agreement or run exchange, a run exchange, ours


def test_the_program_text_covers_subgraphs() -> None:
    """A constant that differs inside a checkpointed layer (a higher-order op's body) parts the programs."""
    import torch.utils.checkpoint

    from autosp.compile_agreement import program_text
    from autosp.options import SPOptions

    def graph_of(scale: float) -> torch.fx.GraphModule:
        graphs = []

        def backend(gm, example_inputs):
            graphs.append(gm)
            return gm

        def layer(x):
            return torch.tanh(x) * scale

        def fn(x):
            return torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False).sum()

        torch._dynamo.reset()
        torch.compile(fn, backend=backend, fullgraph=True)(torch.randn(3, requires_grad=True))
        return graphs[0]

    a, b = graph_of(2.0), graph_of(3.0)
    assert a.code == b.code  # the top level alike: only the body holds the constant
    x = torch.randn(3, requires_grad=True)
    assert program_text(a, [x], SPOptions()) != program_text(b, [x], SPOptions())
    assert program_text(a, [x], SPOptions()) == program_text(graph_of(2.0), [x], SPOptions())


def test_each_program_text_is_hashed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every run of a graph exchanges its program's digest: a large model's text is megabytes (12 ms
    to hash 2.8 MB here), so it is hashed when the graph is made, not at each run."""
    from autosp import compile_agreement
    from autosp.compile_agreement import SameProgramOnEveryRun

    text = "graph inputs: []\n" * 100
    hashed: list[str] = []
    real = compile_agreement.digest_bytes
    monkeypatch.setattr(
        compile_agreement, "digest_bytes", lambda data: hashed.append(threading.current_thread().name) or real(data)
    )

    def rank_fn(rank: int, _: str) -> list[float]:
        run = SameProgramOnEveryRun(lambda x: x * 2, dist.group.WORLD, "graph [0/0]", text)
        return [run(torch.ones(2)).sum().item() for _ in range(3)]

    assert simulate(rank_fn, 2) == [[4.0] * 3] * 2
    assert len(hashed) == 2  # once per rank
