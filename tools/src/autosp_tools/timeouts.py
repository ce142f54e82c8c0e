"""How long a collective may wait for a peer, and how long a rank may go without a heartbeat.

``--timeout`` bounds every collective from the second step on. Setup and the first
step, which compiles, get ``COMPILE_GRACE_S`` more: ranks compile at different speeds
(one may hit a warm Inductor cache, another not), and a slow compile is not a fault.
Process groups made with ``dist.new_group`` or a device mesh do not inherit the
world's timeout (they get torch's 30-minute default), so ``apply`` sets it on every
group this rank belongs to.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch.distributed as dist

# Without --timeout (the benchmarks), a collective waits this long for a peer instead of gloo's 30 minutes.
DEFAULT_S = 600.0
COMPILE_GRACE_S = 600.0
# A rank may be this much slower than --timeout before the watchdog steps in, so that a
# collective timeout, which tells the waiting rank from the silent one, speaks first.
SLACK_S = 10.0


def of(cfg: Any) -> float:
    """``cfg.timeout`` in seconds, or the default for tools without the flag."""
    return float(getattr(cfg, "timeout", None) or DEFAULT_S)


def first_step(cfg: Any) -> datetime.timedelta:
    return datetime.timedelta(seconds=of(cfg) + COMPILE_GRACE_S)


def steady(cfg: Any) -> datetime.timedelta:
    return datetime.timedelta(seconds=of(cfg))


def apply(timeout: datetime.timedelta) -> int:
    """Set ``timeout`` on every process group this rank belongs to; return how many."""
    if not dist.is_initialized():
        return 0
    from torch.distributed import distributed_c10d as c10d

    groups = [g for g in list(c10d._world.pg_map) if not c10d._rank_not_in_group(g)]
    for g in groups:
        c10d._set_pg_timeout(timeout, g)
    return len(groups)


__all__ = ["COMPILE_GRACE_S", "DEFAULT_S", "SLACK_S", "apply", "first_step", "of", "steady"]
