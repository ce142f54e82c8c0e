"""Run a function on N gloo processes (FileStore, no ports) and collect what each rank returns.

Starting P processes costs P imports of torch and AutoSP (3-4 s of CPU each), as much as some
tests' own work; by default the tasks run on a pool of ranks kept per pytest worker
(``spmd_pool.SPMDPool``, one world size at a time), each task on freshly reset compile caches,
seed and environment. ``fresh=True`` starts new processes for the call, for tasks that leave
state behind that a reset does not clear (DeepSpeed's and Accelerate's globals, killed ranks,
a rank left waiting in a collective).
"""

from __future__ import annotations

import atexit
import datetime
import os
import pickle
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from spmd_pool import RankError, SPMDPool, fallback_is_an_error, quick_inductor_kernels

PG_TIMEOUT_S = 120.0  # a collective that one rank skips must fail the test, not hang it
TASK_TIMEOUT_S = 1500.0

_pool: SPMDPool | None = None


def _worker(rank: int, world: int, store_path: str, out_dir: str, fn: Callable[..., Any], args: tuple) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    quick_inductor_kernels()
    fallback_is_an_error()
    store = dist.FileStore(store_path, world)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=PG_TIMEOUT_S)
    )
    result: Any
    try:
        result = ("ok", fn(rank, world, *args))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        result = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    finally:
        if dist.is_initialized():  # a task may destroy the group itself
            dist.destroy_process_group()
    Path(out_dir, f"{rank}.pkl").write_bytes(pickle.dumps(result))


_FRESH_SEED = torch.initial_seed()  # a new process's default seed: the same on every rank


def _as_if_fresh(rank: int, world: int, fn: Callable[..., Any], args: tuple) -> Any:
    """``fn`` on a pooled rank, with what a previous task could have changed put back."""
    environ, dtype = dict(os.environ), torch.get_default_dtype()
    torch._dynamo.reset()
    torch.manual_seed(_FRESH_SEED)
    try:
        with torch.enable_grad():
            return fn(rank, world, *args)
    finally:
        torch._dynamo.reset()
        torch.set_default_dtype(dtype)
        os.environ.clear()
        os.environ.update(environ)


def _pooled(world: int) -> SPMDPool:
    global _pool
    if _pool is not None and _pool.world != world:
        _pool.close()  # one size at a time: idle ranks hold their memory
        _pool = None
    if _pool is None:
        _pool = SPMDPool(world, pg_timeout_s=PG_TIMEOUT_S)
    return _pool


@atexit.register
def _close_pool() -> None:
    if _pool is not None:
        _pool.close()


def _run_fresh(fn: Callable[..., Any], world: int, args: tuple) -> list[tuple[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        mp.start_processes(_worker, args=(world, store, tmp, fn, args), nprocs=world, start_method="spawn", join=True)
        return [pickle.loads(Path(tmp, f"{r}.pkl").read_bytes()) for r in range(world)]


def run_spmd(fn: Callable[..., Any], world: int, *args: Any, fresh: bool = False) -> list[Any]:
    """``fn(rank, world, *args)`` on every rank; returns the results, or raises the first error."""
    if fresh:
        results = _run_fresh(fn, world, args)
    else:
        per_rank = _pooled(world).run(_as_if_fresh, fn, args, timeout_s=TASK_TIMEOUT_S)
        results = [
            ("error", f"{v.type_name}: {v.message}\n{v.traceback}") if isinstance(v, RankError) else ("ok", v)
            for v in per_rank
        ]
    errors = [f"rank {r}: {msg}" for r, (status, msg) in enumerate(results) if status == "error"]
    if errors:
        raise RuntimeError("\n".join(errors))
    return [value for _, value in results]


if __name__ == "__main__":
    sys.exit("import run_spmd from this module")
