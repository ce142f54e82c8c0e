"""Run one attempt (a method at one sequence length) in fresh processes and collect per-rank results.

Fresh processes make peak RSS and peak device memory belong to this attempt alone. Ranks
meet through a FileStore (no ports). A rank that raises, dies or runs past the deadline
turns into an error string in the result rather than an exception here.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import pickle
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from autosp_tools.bench.methods import Method, StepEnv
from autosp_tools.bench.workload import Workload


@dataclass(frozen=True)
class Attempt:
    method: Method
    workload: Workload
    world: int
    backend: str
    warmup: int
    steps: int
    zero_stage: int = 0
    # One thread per rank on CPU: the same compute per rank for every method, and no OpenMP
    # oversubscription (two-thread ranks on a busy 2-core machine run many times slower).
    threads: int = 1


def _device(rank: int) -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(rank % torch.cuda.device_count())
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


def _worker(rank: int, a: Attempt, store_path: str, out_dir: str, threads: int, timeout_s: float) -> None:
    torch.set_num_threads(threads)
    # DeepSpeed reads these (torchrun would set them); harmless for the other methods.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(a.world), LOCAL_WORLD_SIZE=str(a.world))
    result: tuple[str, Any]
    try:
        from autosp_tools.bench.measure import measure

        device = _device(rank)
        if a.world > 1:
            store = dist.FileStore(store_path, a.world)
            backend = "nccl" if device.type == "cuda" else "gloo"
            dist.init_process_group(
                backend, store=store, rank=rank, world_size=a.world, timeout=datetime.timedelta(seconds=timeout_s)
            )
        env = StepEnv(a.workload, rank, a.world, device, a.backend, a.zero_stage)
        result = ("ok", measure(a.method, env, a.warmup, a.steps).as_dict())
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which records it
        result = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=-8)}")
    Path(out_dir, f"{rank}.pkl").write_bytes(pickle.dumps(result))
    if dist.is_initialized():
        # A peer that failed never reaches a barrier; exit without one.
        os._exit(0)


def run_attempt(a: Attempt, timeout_s: float = 600.0) -> dict[str, Any]:
    """``{"ok": bool, "error": str | None, "ranks": [per-rank dict], "wall_s": float}``."""
    world = a.world if a.method.distributed else 1
    a = dataclasses.replace(a, world=world)
    threads = a.threads
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(threads)  # read by children at import
    t0 = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="autosp-bench-") as tmp:
            ctx = mp.start_processes(
                _worker,
                args=(a, os.path.join(tmp, "store"), tmp, threads, timeout_s),
                nprocs=world,
                start_method="spawn",
                join=False,
            )
            error = _wait(ctx, time.monotonic() + timeout_s)
            results = []
            for r in range(world):
                f = Path(tmp, f"{r}.pkl")
                results.append(pickle.loads(f.read_bytes()) if f.exists() else ("error", "no result"))
    finally:
        if saved is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved
    errors = [f"rank {r}: {msg}" for r, (status, msg) in enumerate(results) if status == "error"]
    if error and not errors:
        errors = [error]
    return {
        "ok": not errors,
        "error": "\n".join(errors) or None,
        "ranks": [v for s, v in results if s == "ok"],
        "wall_s": time.perf_counter() - t0,
    }


def _wait(ctx: Any, deadline: float) -> str | None:
    while True:
        try:
            if ctx.join(timeout=1.0):
                return None
        except Exception as e:  # noqa: BLE001 - a rank died (killed for memory, segfault)
            _kill(ctx)
            return f"{type(e).__name__}: {e}"
        if time.monotonic() > deadline:
            _kill(ctx)
            return "timed out"


def _kill(ctx: Any) -> None:
    for p in ctx.processes:
        if p.is_alive():
            p.kill()
    for p in ctx.processes:
        p.join(5)


__all__ = ["Attempt", "run_attempt"]
