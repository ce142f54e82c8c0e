"""The few torch internals whose names moved between the releases AutoSP meets.

The packages pin torch 2.13 (what CI runs); the GPU images this project is checked on ship
older releases, and a renamed helper must not keep the whole CUDA path from importing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch._dynamo.utils as _dynamo_utils
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

# While set, autograd applies no saved-tensor hooks (torch.utils.checkpoint's, save_on_cpu's): AOT
# autograd sets it around its own tracing. Older releases have no such switch.
saved_tensor_hooks_off: Callable[[], contextlib.AbstractContextManager[Any]] = getattr(
    _dynamo_utils, "_disable_saved_tensors_hooks_during_tracing", contextlib.nullcontext
)

__all__ = ["CustomSchedulerPass", "all_gather_single", "optimization_hint", "saved_tensor_hooks_off"]
