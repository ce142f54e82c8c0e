"""The longest sequence that trains under a per-rank memory budget.

Lengths double from a start until one does not fit (fails, or its memory metric is over
the budget), then ``refine`` bisection steps narrow the gap. Every attempt is a fresh
set of processes; attempts already run (the sweep) are reused, not repeated.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

METRICS = ("saved", "rss", "cuda")


def metric_bytes(run: dict[str, Any], metric: str) -> int | None:
    """The largest per-rank value of ``metric`` in a finished attempt."""
    ranks = run.get("ranks") or []
    if not ranks:
        return None
    if metric == "saved":
        return max(r["saved_bytes"] for r in ranks)
    if metric == "rss":
        return int(max(r["peak_rss_delta_mb"] for r in ranks) * 2**20)
    vals = [r["cuda_max_allocated"] for r in ranks if r["cuda_max_allocated"] is not None]
    return max(vals) if vals else None


@dataclass(frozen=True)
class Budget:
    metric: str
    bytes: int

    def fits(self, run: dict[str, Any]) -> bool:
        used = metric_bytes(run, self.metric)
        return bool(run["ok"]) and used is not None and used <= self.bytes


def longest(
    attempt: Callable[[int], dict[str, Any]], budget: Budget, start: int, stop: int, multiple: int, refine: int
) -> dict[str, Any]:
    """``{"seq_len": longest fitting length or None, "capped": bool, "attempts": [...]}``."""
    tried: list[dict[str, Any]] = []

    def fits(n: int) -> bool:
        run = attempt(n)
        ok = budget.fits(run)
        tried.append(
            {
                "seq_len": n,
                "fits": ok,
                "bytes": metric_bytes(run, budget.metric),
                "error": None if run["ok"] else (run["error"] or "")[-300:],
            }
        )
        return ok

    best, bad, n = None, None, start
    while n <= stop:
        if not fits(n):
            bad = n
            break
        best, n = n, n * 2
    for _ in range(refine):
        if best is None or bad is None:
            break
        mid = (best + bad) // 2 // multiple * multiple
        if mid in (best, bad):
            break
        if fits(mid):
            best = mid
        else:
            bad = mid
    return {"seq_len": best, "capped": bad is None and best is not None, "attempts": tried}


__all__ = ["METRICS", "Budget", "longest", "metric_bytes"]
