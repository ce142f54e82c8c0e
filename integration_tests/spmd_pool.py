"""A persistent pool of P gloo processes that run one task after another.

``harness.run_spmd`` starts P processes per call; a fuzzer running hundreds of small programs
would spend most of its time importing torch. Here the ranks start once (spawn + FileStore, as
in the harness) and take tasks ``fn(rank, world, *args)`` from a queue. A task that does not
finish on every rank within its timeout, or that fails on some ranks only, may leave the
process group out of step: the pool then kills its processes and starts fresh ones.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import re
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class RankError:
    """An exception a rank raised, as the parent sees it (exception objects need not pickle)."""

    type_name: str
    classes: tuple[str, ...]  # class names, most derived first: "AutoSPError" in it means a refusal
    message: str
    traceback: str

    def is_a(self, name: str) -> bool:
        return name in self.classes


class PoolTimeout(RuntimeError):
    """Some ranks did not answer within the task's timeout (a hang, or a very slow compile)."""


def fallback_is_an_error() -> None:
    """A graph AutoSP fails to compile runs whole for users (``autosp.CompiledWhole``); here, a test fails.

    Tests of the fallback itself say so with their own ``warnings.catch_warnings``.
    """
    import autosp

    warnings.filterwarnings("error", category=autosp.CompiledWhole)


def quick_inductor_kernels() -> None:
    """Scalar C++ kernels from Inductor in the test processes: they compile in about half the time.

    g++ on Inductor's vectorized kernels is half of a cold Inductor test here (and CI starts
    cold). The passes under test run before Inductor generates kernels, so the suite checks the
    same programs; users' compiles keep the vectorized kernels.
    """
    import torch._inductor.config as inductor_config

    inductor_config.cpp.simdlen = 1  # no vector ISA has 1-bit lanes: Inductor emits scalar loops
    # Nor probe the vector ISAs: each process would build and dlopen-test three of them in
    # subprocesses (0.7 s warm, 4 s cold) to find none of 1-bit lanes anyway.
    inductor_config.cpp.vec_isa_ok = False


def _worker(rank: int, world: int, store_path: str, pg_timeout_s: float, inbox: Any, outbox: Any) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    quick_inductor_kernels()
    fallback_is_an_error()
    # A collective that another rank skipped fails after pg_timeout_s instead of hanging the pool.
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store_path, world),
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=pg_timeout_s),
    )
    try:
        while (task := inbox.get()) is not None:
            task_id, fn, args = task
            try:
                outbox.put((task_id, rank, fn(rank, world, *args)))
            except BaseException as e:  # noqa: BLE001 - reported to the parent
                # Object addresses differ between ranks; without them equal errors compare equal.
                message = re.sub(r"0x[0-9a-f]+", "0x..", str(e))
                err = RankError(
                    type(e).__name__, tuple(c.__name__ for c in type(e).__mro__), message, traceback.format_exc()
                )
                outbox.put((task_id, rank, err))
    finally:
        dist.destroy_process_group()


class SPMDPool:
    """P ranks of one gloo group, started once; ``run`` sends every rank the same task."""

    def __init__(self, world: int, *, pg_timeout_s: float = 90.0) -> None:
        self.world, self.pg_timeout_s = world, pg_timeout_s
        self.restarts = 0
        self._ctx = mp.get_context("spawn")
        self._procs: list[Any] = []
        self._task_id = 0
        self._start()

    def _start(self) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="spmd_pool_")
        store = os.path.join(self._tmp.name, "store")
        self._outbox = self._ctx.Queue()
        self._inboxes = [self._ctx.Queue() for _ in range(self.world)]
        self._procs = [
            self._ctx.Process(
                target=_worker,
                daemon=True,
                args=(r, self.world, store, self.pg_timeout_s, self._inboxes[r], self._outbox),
            )
            for r in range(self.world)
        ]
        for p in self._procs:
            p.start()

    def _kill(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=10)
        for q in [*self._inboxes, self._outbox]:
            q.close()
            q.cancel_join_thread()
        self._procs = []
        self._tmp.cleanup()

    def restart(self) -> None:
        self._kill()
        self.restarts += 1
        self._start()

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float = 180.0) -> list[Any]:
        """``fn(rank, world, *args)`` on every rank; per rank its result or a ``RankError``.

        Raises ``PoolTimeout`` (after restarting the pool) when some rank does not answer in time.
        Errors that differ between ranks also restart the pool before returning.
        """
        self._task_id += 1
        for inbox in self._inboxes:
            inbox.put((self._task_id, fn, args))
        results: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        while len(results) < self.world:
            left = deadline - time.monotonic()
            dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in results]
            if left <= 0 or dead:
                missing = sorted(set(range(self.world)) - set(results))
                self.restart()
                why = f"ranks {dead} died" if dead else f"no answer within {timeout_s:.0f} s"
                answered = {r: v.message[:300] if isinstance(v, RankError) else "ok" for r, v in results.items()}
                raise PoolTimeout(f"ranks {missing} of {self.world}: {why}; the others answered {answered}")
            try:
                task_id, rank, value = self._outbox.get(timeout=min(left, 5.0))
            except queue.Empty:
                continue
            if task_id == self._task_id:
                results[rank] = value
        out = [results[r] for r in range(self.world)]
        errors = {(v.type_name, v.message) for v in out if isinstance(v, RankError)}
        # The same error on every rank is a decision all ranks took before communicating;
        # anything else may have left a collective half done.
        consistent = not errors or (len(errors) == 1 and all(isinstance(v, RankError) for v in out))
        if not consistent:
            self.restart()
        return out

    def close(self) -> None:
        for inbox in self._inboxes:
            inbox.put(None)
        for p in self._procs:
            p.join(timeout=30)
        self._kill()

    def __enter__(self) -> SPMDPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def sleep_on(rank: int, world: int, ranks: list[int], seconds: float) -> int:
    """A probe task: the given ranks sleep (a stand-in for a hang), every rank returns its rank."""
    if rank in ranks:
        time.sleep(seconds)
    return rank


__all__ = ["PoolTimeout", "RankError", "SPMDPool", "sleep_on"]
