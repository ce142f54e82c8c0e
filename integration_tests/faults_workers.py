"""Rank functions for test_faults.py, run by harness.run_spmd (spawned workers import them by name)."""

from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

from autosp_tools import timeouts


def subgroup_timeout(rank: int, world: int, late_s: float) -> tuple[str, float] | None:
    """Rank 0 all-reduces on a new subgroup; rank 1 joins ``late_s`` seconds late.

    ``dist.new_group`` gives a subgroup torch's 30-minute default, not the world's
    timeout; after ``timeouts.apply(2 s)`` rank 0 must give up long before rank 1 arrives.
    Returns rank 0's error and how long it waited (None if the all-reduce completed).
    """
    group = dist.new_group(list(range(world)))
    timeouts.apply(datetime.timedelta(seconds=2))
    if rank != 0:
        time.sleep(late_s)
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1), group=group)
    except RuntimeError as e:
        return str(e), time.monotonic() - start
    return None


def string_hashes(cfg: object, rank: int, world: int) -> list[int]:
    """Every rank's ``hash`` of one string (it differs between processes unless PYTHONHASHSEED is alike)."""
    hashes: list[object] = [None] * world
    dist.all_gather_object(hashes, hash("autosp"))
    return [int(h) for h in hashes]  # type: ignore[call-overload]
