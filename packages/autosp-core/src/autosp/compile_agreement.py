"""The SP ranks agree that each graph compiled before any rank runs it.

Each rank compiles its own graph, and the graphs differ in rank-dependent sizes, so a compile can
fail on one rank only (Inductor's schedule check, a rank whose piece is empty). Left alone, that
rank raises while its peers run the graph and wait in its first collective until the group's
timeout: a hang, its cause only in another process's log. So every compile of an SP graph ends
with one all-reduce of "did it fail" over the SP ranks, and if any rank failed, every rank raises:
the failed ones their own error, the others ``CompileFailed`` with the failed ranks' first lines.

The all-reduce runs on the compile-sync group when ``timeout=`` made one (the SP ranks with the
world's timeout), so a rank that compiles slower never trips the SP group's short timeout; that
is also why the backward compiles with the forward under SP (``force_non_lazy_backward_lowering``):
its compile, and its failures, then happen here too, not in a backward the peers already run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from autosp.errors import AutoSPError
from autosp.guards import CollectiveFailure, comm_failure_message, is_comm_failure
from autosp.input_check import collective_device

T = TypeVar("T")


class CompileFailed(AutoSPError):
    """Another SP rank failed to compile a graph this rank compiled; no rank runs it."""


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"


def agree_on_compile(compile_fn: Callable[[], T], group: Any, what: str) -> T:
    """``compile_fn()`` on this rank; it returns only if it returned on every rank of ``group``."""
    error: Exception | None = None
    result: Any = None
    try:
        result = compile_fn()
    except Exception as e:  # a KeyboardInterrupt is not a compile failure: it ends this rank
        error = e
    failed = torch.tensor([int(error is not None)], dtype=torch.int64, device=collective_device(group))
    try:
        dist.all_reduce(failed, group=group)
    except Exception as e:
        if is_comm_failure(e):
            raise CollectiveFailure(
                comm_failure_message(f"waiting for every SP rank to compile {what}", group, e)
            ) from (error or e)
        raise
    if int(failed.item()) == 0:
        return result
    lines: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(lines, None if error is None else _first_line(error), group=group)
    if error is not None:
        raise error
    ranks = dist.get_process_group_ranks(group)
    failures = "; ".join(f"global rank {ranks[i]}: {line}" for i, line in enumerate(lines) if line is not None)
    raise CompileFailed(
        f"{what} compiled on this rank (global rank {dist.get_rank()}) but not on every SP rank ({failures}), "
        "so no rank runs it: its collectives need every SP rank. The failed rank's log holds the whole error."
    )


__all__ = ["CompileFailed", "agree_on_compile"]
