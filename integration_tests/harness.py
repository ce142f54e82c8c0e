"""Run a function on N gloo processes (FileStore, no ports) and collect what each rank returns."""

from __future__ import annotations

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


def _worker(rank: int, world: int, store_path: str, out_dir: str, fn: Callable[..., Any], args: tuple) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    # A collective that one rank skips must fail the test, not hang it.
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    result: Any
    try:
        result = ("ok", fn(rank, world, *args))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        result = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"{rank}.pkl").write_bytes(pickle.dumps(result))


def run_spmd(fn: Callable[..., Any], world: int, *args: Any) -> list[Any]:
    """``fn(rank, world, *args)`` on every rank; returns the results, or raises the first error."""
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        mp.start_processes(_worker, args=(world, store, tmp, fn, args), nprocs=world, start_method="spawn", join=True)
        results = [pickle.loads(Path(tmp, f"{r}.pkl").read_bytes()) for r in range(world)]
    errors = [f"rank {r}: {msg}" for r, (status, msg) in enumerate(results) if status == "error"]
    if errors:
        raise RuntimeError("\n".join(errors))
    return [value for _, value in results]


if __name__ == "__main__":
    sys.exit("import run_spmd from this module")
