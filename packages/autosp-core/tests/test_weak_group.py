"""``WeakGroup``: AutoSP's objects never keep a process group alive (a group left to interpreter exit can abort gloo)."""

from __future__ import annotations

import dataclasses
import gc
from typing import Any

import pytest
import torch.distributed as dist

from autosp.errors import ConfigError
from autosp.options import SPOptions
from autosp.weak_group import WeakGroup


class _Group:
    """Stands in for a ProcessGroup: weakly referable, like one."""


class _Holder:
    group = WeakGroup()

    def __init__(self, group: Any) -> None:
        self.group = group


@pytest.fixture
def initialized(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dist, "is_initialized", lambda: True)


def test_reads_back_the_group_and_does_not_own_it(initialized: None) -> None:
    group = _Group()
    holder = _Holder(group)
    assert holder.group is group
    del group
    gc.collect()
    with pytest.raises(ConfigError, match=r"_Holder.group: the process group it ran on was destroyed"):
        holder.group  # noqa: B018 - the read is what raises


def test_a_live_object_of_a_destroyed_default_group_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # Dynamo keeps the default group's object alive; dist.is_initialized() says it is gone.
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    group = _Group()
    with pytest.raises(ConfigError, match="destroy_process_group"):
        _Holder(group).group  # noqa: B018


def test_none_and_objects_without_weak_references_are_kept_as_they_are() -> None:
    assert _Holder(None).group is None
    marker = object()  # not weakly referable, so not a ProcessGroup: held as it is
    assert _Holder(marker).group is marker


def test_a_dataclass_field_defaults_to_none_and_compares_by_the_group(initialized: None) -> None:
    group = _Group()
    assert SPOptions().group is None
    options = SPOptions(group=group)
    assert options.group is group and options == SPOptions(group=group)
    assert dataclasses.replace(options, sp_size=2).group is group
    assert "group" not in vars(options)  # only the weak reference is stored


def test_repr_names_a_destroyed_group_instead_of_raising(initialized: None) -> None:
    group = _Group()
    options = SPOptions(sp_size=2, group=group)
    assert "sp_size=2" in repr(options) and "_Group object" in repr(options)
    del group
    gc.collect()
    text = repr(options)  # a log line or a debugger must not raise
    assert text.startswith("SPOptions(sp_size=2, variant='ulysses'") and "group=<destroyed process group>" in text
    assert "timeout=None" in text
