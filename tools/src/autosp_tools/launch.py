"""Start the ranks: in this process (1 rank), under torchrun (env://), or spawned (gloo + FileStore).

Spawned ranks meet through a FileStore in a temporary directory, so no port is
needed. Rank 0 sends its result back through a file; a rank that fails writes its
traceback, and the parent raises it.
"""

from __future__ import annotations

import datetime
import os
import pickle
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

R = TypeVar("R")
# A rank stuck in a collective after a peer died gives up after this long instead of gloo's 30 minutes.
TIMEOUT = datetime.timedelta(minutes=10)


class RankFailed(RuntimeError):
    """A spawned rank raised; the message carries its traceback."""


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
        dist.init_process_group("gloo", init_method="env://", timeout=TIMEOUT)
    try:
        return fn(cfg, dist.get_rank(), dist.get_world_size())
    finally:
        if owns:
            dist.destroy_process_group()


def _worker(rank: int, world: int, store_path: str, out_dir: str, fn: Callable[[Any, int, int], Any], cfg: Any,
            threads: int) -> None:
    torch.set_num_threads(threads)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=TIMEOUT)
    try:
        result = fn(cfg, rank, world)
        if rank == 0:
            Path(out_dir, "result.pkl").write_bytes(pickle.dumps(result))
    except BaseException as e:
        Path(out_dir, f"error{rank}.txt").write_text(f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        # A non-zero exit makes the parent stop the other ranks rather than wait on them.
        raise
    finally:
        dist.destroy_process_group()


def _spawn(fn: Callable[[Any, int, int], R], cfg: Any) -> R:
    threads = max(1, (os.cpu_count() or 1) // cfg.nproc)
    # Children read OMP_NUM_THREADS at import; without it each rank would use every core.
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    try:
        return _spawn_ranks(fn, cfg, threads)
    finally:
        if saved is None:
            os.environ.pop("OMP_NUM_THREADS", None)


def _spawn_ranks(fn: Callable[[Any, int, int], R], cfg: Any, threads: int) -> R:
    with tempfile.TemporaryDirectory(prefix="autosp-train-") as tmp:
        store = os.path.join(tmp, "store")
        try:
            mp.start_processes(_worker, args=(cfg.nproc, store, tmp, fn, cfg, threads), nprocs=cfg.nproc,
                               start_method="spawn", join=True)
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
            errors = sorted(Path(tmp).glob("error*.txt"))
            if errors:
                first = errors[0]
                raise RankFailed(f"rank {first.stem[5:]} failed: {first.read_text()}") from e
            raise
        return pickle.loads(Path(tmp, "result.pkl").read_bytes())


__all__ = ["RankFailed", "launch"]
