"""The launcher's torchrun path keeps --timeout (the spawned path is exercised in integration_tests/test_faults.py)."""

from __future__ import annotations

import datetime
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from autosp_tools import timeouts
from autosp_tools.launch import launch


def test_torchrun_process_group_gets_the_collective_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    seen: dict[str, Any] = {}
    real = dist.init_process_group

    def spy(backend: str, **kwargs: Any) -> None:
        seen.update(kwargs, backend=backend)
        # torchrun's env:// rendezvous needs a port; an in-memory store stands in for it.
        real(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=kwargs["timeout"])

    monkeypatch.setattr(dist, "init_process_group", spy)

    def body(cfg: Any, rank: int, world: int) -> float:
        t = torch.ones(1)
        dist.all_reduce(t)
        return float(t)

    assert launch(body, SimpleNamespace(nproc=1, timeout=7.5)) == 1.0
    # Setup and the first step (compiling) get the compile grace; train() tightens it to --timeout after.
    grace = datetime.timedelta(seconds=7.5 + timeouts.COMPILE_GRACE_S)
    assert seen == {"backend": "gloo", "init_method": "env://", "timeout": grace}
    assert not dist.is_initialized()


def test_tools_without_a_timeout_get_the_default() -> None:
    assert timeouts.steady(SimpleNamespace(nproc=2)) == datetime.timedelta(seconds=timeouts.DEFAULT_S)
