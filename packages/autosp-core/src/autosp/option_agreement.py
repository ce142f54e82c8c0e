"""Every rank calls ``autosp.compile`` with the options that decide its groups and exchanges alike.

AutoSP makes its process groups when it compiles (``new_group``, ``new_subgroups``), and torch
makes a group with every rank of the parent taking part, in the same order. Ranks given another
``sp_size`` (2 on one rank, 1 on another) make other groups: torch's store barrier waited until
the world's timeout and said ``Wait timeout``, or, where one side made no group at all, the ranks
met in their first collective and waited there. Ranks given another ``timeout=`` or
``check_inputs=`` exchange different collectives at every call, with the same outcome.

So, before it makes any group, each rank writes those options in the parent group's store under
the number of this compile and reads its peers': every rank raises the same ``ConfigError``,
naming the option and the ranks, when they differ. The store, not a collective: a rank that
never calls ``autosp.compile`` leaves the others to the world's timeout either way, and then the
error names it.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist

from autosp.errors import ConfigError

_calls: dict[tuple[int, ...], int] = {}  # parent group's ranks -> compiles that agreed over it so far
_DEFAULT_WAIT = timedelta(minutes=30)  # gloo's default, for a parent group that does not say


def agree(ranks: list[int], options: dict[str, str], wait: timedelta | None) -> None:
    """Raise ``ConfigError`` on every rank of ``ranks`` (global ranks) whose ``options`` differ.

    ``wait``: how long to wait for the slowest rank to call (its parent group's timeout).
    """
    if dist.get_backend() == "fake":  # one rank simulated alone (planning, tests): no peer to agree with
        return
    store = dist.distributed_c10d._get_default_store()
    key = tuple(ranks)
    n = _calls.get(key, 0)
    _calls[key] = n + 1
    prefix = f"autosp/options/{'-'.join(map(str, ranks))}/{n}"
    text = "\n".join(f"{k}={v}" for k, v in options.items())
    store.set(f"{prefix}/{dist.get_rank()}", text)
    keys = [f"{prefix}/{r}" for r in ranks]
    try:
        store.wait(keys, wait or _DEFAULT_WAIT)
    except Exception as e:  # the store's timeout; which ranks never came is what matters
        missing = [r for r, k in zip(ranks, keys) if not store.check([k])]
        raise ConfigError(
            f"global ranks {missing} did not call autosp.compile (call {n + 1} on global rank {dist.get_rank()}) "
            f"within the process group's timeout ({(wait or _DEFAULT_WAIT).total_seconds():g} s): every rank of "
            f"the group ({ranks}) must call autosp.compile for each model, in the same order, since its process "
            "groups are made by all of them together."
        ) from e
    got = {r: store.get(k).decode() for r, k in zip(ranks, keys)}
    if len(set(got.values())) == 1:
        return
    parsed = {r: dict(line.split("=", 1) for line in t.splitlines()) for r, t in got.items()}
    differing = [name for name in options if len({p.get(name) for p in parsed.values()}) > 1]
    lines = [f"  {name}: " + "; ".join(f"rank {r}: {parsed[r].get(name)}" for r in ranks) for name in differing]
    raise ConfigError(
        "autosp.compile was called with different options on the ranks of the process group (global ranks):\n"
        + "\n".join(lines)
        + "\nEvery rank must call autosp.compile with the same sp_size, group, timeout= and check_inputs=: the "
        "ranks make AutoSP's process groups together and exchange the same checks at every call."
    )


def options_of(sp_size: Any, group: Any, timeout: Any, check_inputs: Any) -> dict[str, str]:
    """What ``agree`` compares: the options that decide the groups and the per-call exchanges."""
    given = "none" if group is None else f"ranks {dist.get_process_group_ranks(group)}"
    return {"sp_size": repr(sp_size), "group": given, "timeout": repr(timeout), "check_inputs": repr(check_inputs)}


__all__ = ["agree", "options_of"]
