"""Process groups held weakly: AutoSP uses the user's groups but never keeps one alive.

``torch.distributed`` owns every group it made until ``destroy_process_group()``. If a compiled
program kept a strong reference, that call would no longer free the gloo or NCCL backend: it
would be torn down during interpreter finalization instead, where gloo aborts the process
(SIGABRT, "terminate called without an active exception") in a fraction of runs. So every
object of AutoSP that outlives a compile holds its groups through ``WeakGroup``. (Importing
``torch._dynamo`` keeps the default group's object alive by itself, so for that one group
``destroy_process_group`` is also checked by ``dist.is_initialized()``.)
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from autosp.errors import ConfigError


def _destroyed(owner: str, attr: str) -> ConfigError:
    return ConfigError(
        f"{owner}.{attr}: the process group it ran on was destroyed (torch.distributed.destroy_process_group): "
        "a program compiled by AutoSP runs only while its SP group exists. Call init_process_group() again "
        "and compile the model again (autosp.compile) before calling it."
    )


class WeakGroup:
    """A data descriptor: the attribute reads back the group while c10d keeps it, else raises.

    ``None`` (no SP group) is stored as it is; read through the class it is ``None`` too, which
    makes it a dataclass field's default.
    """

    def __set_name__(self, owner: type, name: str) -> None:
        self.name, self.slot, self.owner = name, f"_weak_{name}", owner.__name__

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return None
        ref = obj.__dict__.get(self.slot)
        if ref is None:
            return None
        group = ref()
        if group is None or _torn_down(ref):
            raise _destroyed(self.owner, self.name)
        return group

    def __set__(self, obj: Any, group: Any) -> None:
        obj.__dict__[self.slot] = None if group is None else _ref(group)


def _ref(group: Any) -> Callable[[], Any]:
    try:
        return weakref.ref(group)
    except TypeError:  # not a ProcessGroup (a test's stand-in): nothing of torch's to keep alive
        return lambda: group


def _torn_down(ref: Callable[[], Any]) -> bool:
    # torch itself keeps the default group's object alive past destroy_process_group.
    return isinstance(ref, weakref.ref) and not dist.is_initialized()


def weak_repr(obj: Any) -> str:
    """A dataclass's repr that reads a destroyed group as such instead of raising (a log line must not fail)."""
    parts = []
    for f in dataclasses.fields(obj):
        if not f.repr:
            continue
        try:
            value = repr(getattr(obj, f.name))
        except ConfigError:
            value = "<destroyed process group>"
        parts.append(f"{f.name}={value}")
    return f"{type(obj).__qualname__}({', '.join(parts)})"


__all__ = ["WeakGroup", "weak_repr"]
