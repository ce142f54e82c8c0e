"""Start the ranks: in this process (1 rank), under torchrun (env://), or spawned (gloo + FileStore).

Spawned ranks meet through a FileStore in a temporary directory, so no port is
needed. Rank 0 sends its result back through a file; a rank that fails writes what
it raised (see ``failures``) and exits at once, so that its peers' collectives fail
within a second instead of waiting for their timeout.

The launcher watches the ranks while they run: the moment one fails it ends the
others and reports the first failure (not the lowest rank's "connection reset"), and
a step watchdog ends a job whose ranks stopped sending heartbeats (see ``heartbeat``).
Every collective gives up after ``cfg.timeout`` seconds (the first step after 10 more
minutes, see ``timeouts``), spawned or under torchrun.
"""

from __future__ import annotations

import os
import pickle
import random
import sys
import tempfile
import time
from collections.abc import Callable
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from autosp_tools import failures, heartbeat, timeouts

R = TypeVar("R")
# After a first communication error, how long to let the real cause show (a peer's
# exception or death) before calling the silent ranks stuck.
SETTLE_S = 3.0
POLL_S = 0.25


class RankFailed(RuntimeError):
    """A spawned rank failed or stopped responding; the message names it and the step."""


def launch(fn: Callable[[Any, int, int], R], cfg: Any, *, always_spawn: bool = False) -> R:
    """``fn(cfg, rank, world)`` on every rank; returns rank 0's result.

    One rank runs in this process without a process group unless ``always_spawn``
    (for code that needs a group even of one, such as DeepSpeed).
    """
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _torchrun(fn, cfg)
    if cfg.nproc == 1 and not always_spawn:
        return fn(cfg, 0, 1)
    return _spawn(fn, cfg)


def _torchrun(fn: Callable[[Any, int, int], R], cfg: Any) -> R:
    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group("gloo", init_method="env://", timeout=timeouts.first_step(cfg))
    try:
        return fn(cfg, dist.get_rank(), dist.get_world_size())
    finally:
        if owns:
            dist.destroy_process_group()


def _worker(
    rank: int,
    world: int,
    store_path: str,
    out_dir: str,
    fn: Callable[[Any, int, int], Any],
    cfg: Any,
    threads: int,
    beats: Any,
) -> None:
    torch.set_num_threads(threads)
    beat = heartbeat.Heartbeat(beats, rank)
    heartbeat.install(beat)
    try:
        store = dist.FileStore(store_path, world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeouts.first_step(cfg))
        result = fn(cfg, rank, world)
        if rank == 0:
            tmp = Path(out_dir, "result.tmp")
            tmp.write_bytes(pickle.dumps(result))
            os.replace(tmp, Path(out_dir, "result.pkl"))
    except BaseException as e:  # noqa: BLE001 - reported to the launcher
        failures.write_record(out_dir, rank, e)
        sys.stdout.flush()
        sys.stderr.flush()
        # Exiting now closes this rank's sockets, so its peers fail at once rather than at their timeout;
        # a clean shutdown could itself wait on them.
        os._exit(1)
    beat.done(0)
    dist.destroy_process_group()
    # Importing torch._dynamo keeps the default group's object alive past destroy_process_group
    # (torch 2.13): gloo would be torn down during interpreter finalization, where it aborts now and
    # then (SIGABRT, "terminate called without an active exception") after the work is done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _spawn(fn: Callable[[Any, int, int], R], cfg: Any) -> R:
    threads = max(1, (os.cpu_count() or 1) // cfg.nproc)
    # Children read OMP_NUM_THREADS at import; without it each rank would use every core.
    # And PYTHONHASHSEED at start: one seed for all ranks (drawn per job, so hashes stay random),
    # else a loop over a set of strings (HF Gemma-3's rotary tables) runs in another order on each
    # rank, which AutoSP compiles as one program only where no graph break or random draw sits inside.
    given = {name: os.environ.get(name) for name in ("OMP_NUM_THREADS", "PYTHONHASHSEED")}
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    os.environ.setdefault("PYTHONHASHSEED", str(random.SystemRandom().randrange(1, 2**32)))
    try:
        return _spawn_ranks(fn, cfg, threads)
    finally:
        for name, value in given.items():
            if value is None:
                os.environ.pop(name, None)


def _spawn_ranks(fn: Callable[[Any, int, int], R], cfg: Any, threads: int) -> R:
    ctx = mp.get_context("spawn")
    world = int(cfg.nproc)
    with tempfile.TemporaryDirectory(prefix="autosp-train-") as tmp:
        board = heartbeat.Board(ctx, world)
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_worker, args=(r, world, store, tmp, fn, cfg, threads, board.array), name=f"autosp-rank-{r}"
            )
            for r in range(world)
        ]
        try:
            for p in procs:
                p.start()
            _watch(procs, board, tmp, timeouts.of(cfg))
        finally:
            _stop(procs)
        return pickle.loads(Path(tmp, "result.pkl").read_bytes())


def _watch(procs: list[Any], board: heartbeat.Board, out_dir: str, timeout_s: float) -> None:
    """Return when every rank has finished; raise RankFailed at the first failure or stall."""
    failed_at: float | None = None
    while True:
        now = time.monotonic()
        exits = {r: p.exitcode for r, p in enumerate(procs)}
        records = failures.read_records(out_dir)
        beats = board.read()
        if failed_at is None and (records or any(failures.gone(c, beats[r]) for r, c in exits.items())):
            failed_at = now
        if failed_at is not None:
            # Let the ranks a failure takes down report too: only then can cause be told from consequence.
            settle = 0.5 if failures.conclusive(records, exits, beats) else SETTLE_S
            if now - failed_at >= settle or all(c is not None for c in exits.values()):
                raise RankFailed(failures.diagnose(records, exits, beats, timeout_s, now))
        elif all(c == 0 for c in exits.values()):
            return
        else:
            verdict = failures.stalled(beats, exits, timeout_s, now)
            if verdict is not None:
                raise RankFailed(verdict)
        alive = [p.sentinel for p in procs if p.exitcode is None]
        if alive:
            wait(alive, timeout=POLL_S)
        else:
            time.sleep(POLL_S)


def _stop(procs: list[Any]) -> None:
    # SIGKILL: a stuck or stopped (SIGSTOP) rank ignores anything gentler.
    for p in procs:
        if p.pid is not None and p.exitcode is None:
            p.kill()
    for p in procs:
        if p.pid is not None:
            p.join()


__all__ = ["RankFailed", "launch"]
