"""The few torch internals whose names moved between the releases AutoSP meets.

The packages pin torch 2.13 (what CI runs); the GPU images this project is checked on ship
older releases, and a renamed helper must not keep the whole CUDA path from importing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch.fx.experimental import symbolic_shapes as _shapes

# torch < 2.13 calls the same guard-free size hint `hint_int`.
optimization_hint: Callable[..., int] = vars(_shapes).get("optimization_hint") or vars(_shapes)["hint_int"]

try:
    from torch._inductor.custom_graph_pass import CustomSchedulerPass
except ImportError:  # torch < 2.13 takes any callable as a scheduler hook; this only names the interface

    class CustomSchedulerPass:  # type: ignore[no-redef]
        def __call__(self, nodes: list[Any]) -> list[Any]:
            raise NotImplementedError

        def uuid(self) -> Any:
            raise NotImplementedError


# torch 2.13 renamed all_gather_into_tensor; the old name is what older releases have.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

__all__ = ["CustomSchedulerPass", "all_gather_single", "optimization_hint"]
