"""P ranks of an SP group as P threads of one process, joined by torch's threaded process group.

Collectives (and so AutoSP's collective ops, forward and backward) really exchange data
between the threads, so a rank's program runs unchanged.  Each rank's collectives are
logged (kind and shapes) to tell which ones the ranks disagreed on when they do.
"""

from __future__ import annotations

import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

T = TypeVar("T")

_BACKEND = "autosp_threaded"
_LOCK = threading.Lock()
_CALLS = threading.local()
_registered = False

# ProcessGroup method -> the collective it is, for the log.
_LOGGED = {
    "allreduce": "all_reduce",
    "allreduce_coalesced": "all_reduce",
    "allgather": "all_gather",
    "all_gather_single": "all_gather",
    "all_to_all_single": "all_to_all",
    "alltoall": "all_to_all",
    "reduce_scatter": "reduce_scatter",
    "reduce_scatter_single": "reduce_scatter",
    "broadcast": "broadcast",
}


class SimulationError(RuntimeError):
    """A rank raised, or the ranks did not finish or issued different collectives."""


def collectives_issued() -> list[str]:
    """The collectives this rank's thread issued so far in the running simulation."""
    return list(getattr(_CALLS, "log", None) or [])


def _logging_group_class() -> type:
    from torch.testing._internal.distributed.multi_threaded_pg import ProcessLocalGroup

    def logged(kind: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            log = getattr(_CALLS, "log", None)
            if log is not None:
                log.append(f"{kind}{[tuple(t.shape) for t in pytree.tree_leaves(args) if isinstance(t, torch.Tensor)]}")
            return method(self, *args, **kwargs)

        return call

    # Only the methods this torch's threaded group has (all_gather_single arrived in 2.13).
    body = {
        name: logged(kind, getattr(ProcessLocalGroup, name))
        for name, kind in _LOGGED.items()
        if hasattr(ProcessLocalGroup, name)
    }
    return type("LoggingThreadedGroup", (ProcessLocalGroup,), body)


def _register_backend() -> None:
    global _registered
    if _registered:
        return
    from torch.distributed.distributed_c10d import _store_based_barrier

    cls = _logging_group_class()

    def create(prefix_store: Any, rank: int, world_size: int, timeout: Any) -> Any:
        pg = cls(rank, world_size)
        _store_based_barrier(rank, prefix_store, "", world_size, timeout)
        return pg

    dist.Backend.register_backend(_BACKEND, create, devices=["cpu"])
    _registered = True


def simulate(fn: Callable[[int, str], T], world: int, *, timeout: float = 120.0) -> list[T]:
    """Run ``fn(rank, group_name)`` for every rank of a ``world``-rank group, one thread each.

    Returns the results in rank order.  Raises ``SimulationError`` naming the first rank that
    raised (with its traceback), or listing each rank's collectives when the ranks did not all
    finish within ``timeout`` seconds or issued different collectives: a real process group
    would hang or mix them up.  One simulation runs at a time in a process: the threaded
    process group swaps torch.distributed's world for a thread-local one while it runs.
    """
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    from torch.testing._internal.distributed import multi_threaded_pg as mtpg

    results: list[Any] = [None] * world
    errors: list[BaseException | None] = [None] * world
    tracebacks = [""] * world
    logs: list[list[str]] = [[] for _ in range(world)]
    with _LOCK:
        _register_backend()
        # init_process_group wraps sys.excepthook with a rank prefix on every call: keep the caller's.
        excepthook = sys.excepthook
        torch._C._distributed_c10d._set_thread_isolation_mode(True)
        mtpg._install_threaded_pg()
        store = dist.HashStore()

        def worker(rank: int) -> None:
            _CALLS.log = logs[rank]
            try:
                dist.init_process_group(_BACKEND, rank=rank, world_size=world, store=store)
                results[rank] = fn(rank, dist.group.WORLD.group_name)
            except BaseException as e:  # noqa: BLE001 - reported below with the rank; peers get SystemExit
                errors[rank] = e
                tracebacks[rank] = traceback.format_exc()
                mtpg.ProcessLocalGroup.exception_handle(e)  # wakes the peers waiting in a collective
            finally:
                _CALLS.log = None
                if dist.is_initialized():
                    dist.destroy_process_group()

        threads = [threading.Thread(target=worker, args=(r,), daemon=True, name=f"sp-rank-{r}") for r in range(world)]
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout)
            hung = [r for r, t in enumerate(threads) if t.is_alive()]
            if hung:
                mtpg.ProcessLocalGroup.exception_handle(TimeoutError())
                for t in threads:
                    t.join(5.0)
        finally:
            mtpg.ProcessLocalGroup.reset()
            mtpg._uninstall_threaded_pg()
            torch._C._distributed_c10d._set_thread_isolation_mode(False)
            sys.excepthook = excepthook

    calls = "\n".join(f"  rank {r}: {log}" for r, log in enumerate(logs))
    failed = [r for r, e in enumerate(errors) if e is not None and not isinstance(e, SystemExit)]
    if failed:
        r = failed[0]
        raise SimulationError(
            f"rank {r} of {world} raised {type(errors[r]).__name__}: {errors[r]}\n{tracebacks[r]}"
            f"collectives issued:\n{calls}"
        ) from errors[r]
    if hung or any(e is not None for e in errors):
        raise SimulationError(f"ranks {hung} did not finish in {timeout:.0f} s; collectives issued:\n{calls}")
    if any(log != logs[0] for log in logs):
        raise SimulationError(f"the ranks issued different collectives:\n{calls}")
    return results


__all__ = ["SimulationError", "collectives_issued", "simulate"]
