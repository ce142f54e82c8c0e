"""The calls each rank has begun (``autosp.arrivals``): what a rank waiting in a collective can say of its peers."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from autosp import arrivals
from autosp.sharding.testing.threads import simulate


@pytest.fixture(autouse=True)
def _no_calls_yet(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(arrivals, "_calls", {})


def test_peers_that_began_fewer_calls_are_named_with_their_counts() -> None:
    def rank_fn(rank: int, group: str) -> tuple:
        before = arrivals.behind(dist.group.WORLD)
        for _ in range(rank + 1):
            arrivals.arrive()
        dist.all_reduce(torch.zeros(1))  # every rank has written its count
        late = arrivals.behind(dist.group.WORLD)
        return before, late, arrivals.not_begun(late) if late else None

    (b0, l0, s0), (b1, l1, s1), (b2, l2, s2) = simulate(rank_fn, 3)
    assert b0 is b1 is b2 is None  # nothing counted: nothing known
    assert l0 == [] and s0 is None
    assert l1 == [(0, 1)]
    assert l2 == [(0, 1), (1, 2)]
    assert s2 == (
        "Global rank(s) 0, 1 have not begun this call (calls of the compiled program begun so far: global rank 0 1, "
        "global rank 1 2, this rank 3)."
    )


def test_a_peer_that_never_called_counts_zero() -> None:
    def rank_fn(rank: int, group: str) -> list | None:
        if rank == 0:
            arrivals.arrive()
        dist.all_reduce(torch.zeros(1))
        return arrivals.behind(dist.group.WORLD)

    assert simulate(rank_fn, 2) == [[(1, 0)], None]


def test_without_a_process_group_nothing_is_counted() -> None:
    arrivals.arrive()
    assert arrivals._calls == {}


def test_the_late_warning_says_what_is_known_of_the_peers() -> None:
    from autosp.peer_failure import late_message

    def rank_fn(rank: int, group: str) -> tuple[str, str, str]:
        unknown = late_message(dist.group.WORLD, 130)
        arrivals.arrive()
        dist.all_reduce(torch.zeros(1))
        in_call = late_message(dist.group.WORLD, 130)
        if rank == 0:
            arrivals.arrive()
        dist.all_reduce(torch.zeros(1))
        return unknown, in_call, late_message(dist.group.WORLD, 130)

    (unknown, in_call, ahead), (_, _, behind) = simulate(rank_fn, 2)
    assert unknown.startswith("global rank 0 has waited 130 s in a collective of AutoSP's compiled program for the ")
    assert "One of them is slow inside the call" in unknown and "will not call" in unknown
    assert "Each of them has begun this call too: one is slow inside it" in in_call
    assert "Global rank(s) 1 have not begun this call" in ahead and "call the uncompiled model there" in ahead
    assert "Each of them has begun this call too" in behind  # rank 1 is the one behind: its peer is in the call
