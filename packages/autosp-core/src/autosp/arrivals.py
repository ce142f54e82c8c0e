"""How many calls of AutoSP's compiled programs each rank has begun, kept in the default store.

A rank that waits long in one of AutoSP's collectives cannot tell by itself a peer that is slow
(compiling, saving a checkpoint) from one that will never call (the compiled model evaluated on
rank 0 alone): both look like a collective that does not complete until the group's timeout,
gloo's default being 30 minutes. Each rank writes its count as it begins a call, so the waiting
rank can say which peers have not begun the call it is in (``behind``): in a warning once the wait
is long (``peer_failure``) and in the error at the timeout (``guards``).

The count is of every compiled call this process began, on any SP group: the ranks of one group
call the same programs at every step, so in a healthy run their counts are equal. It is a
fact to report, never a reason to fail: a group whose ranks once called apart (an error caught on
some ranks) keeps the difference, and the group's timeout still decides when a wait ends.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

# Global rank -> calls of compiled programs it has begun here: one rank per process, but a threaded
# group (the sharding rules' test harness) runs all of them in one.
_calls: dict[int, int] = {}


def _key(rank: int) -> str:
    return f"autosp/calls/{rank}"


def default_store() -> Any:
    """The default group's store, or ``None`` where there is none to read (a group of another world)."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # no default group, or torch changed: nothing to share
        return None


def arrive() -> None:
    """Count a call that this rank begins, where its peers can read it."""
    if not dist.is_initialized():  # compiled without a process group: no peers to wait for
        return
    me = dist.get_rank()
    _calls[me] = _calls.get(me, 0) + 1
    store = default_store()
    if store is None:
        return
    try:
        store.set(_key(me), str(_calls[me]))
    except Exception:  # the store went with a rank that exited: the next collective says so
        pass


def behind(group: Any) -> list[tuple[int, int]] | None:
    """The peers in ``group`` that have begun fewer calls than this rank: (global rank, their count);
    ``None`` where nothing is known (no store, or no call counted: ``autosp.backend`` used directly)."""
    store = default_store()
    me = dist.get_rank()
    mine = _calls.get(me, 0)
    if store is None or mine == 0:
        return None
    late = []
    for rank in dist.get_process_group_ranks(group):
        if rank == me:
            continue
        try:
            count = int(store.get(_key(rank))) if store.check([_key(rank)]) else 0
        except Exception:  # the store went with a rank that exited: nothing to add
            return None
        if count < mine:
            late.append((rank, count))
    return late


def not_begun(late: list[tuple[int, int]]) -> str:
    """``behind``'s answer as a sentence, for a message about a wait."""
    who = ", ".join(str(rank) for rank, _ in late)
    counts = ", ".join(f"global rank {rank} {count}" for rank, count in late)
    return (
        f"Global rank(s) {who} have not begun this call (calls of the compiled program begun so far: {counts}, "
        f"this rank {_calls.get(dist.get_rank(), 0)})."
    )


__all__ = ["arrive", "behind", "default_store", "not_begun"]
