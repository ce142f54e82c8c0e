"""``outputs="sharded"``: sequence-sharded outputs handed back as DTensors instead of gathered whole.

The SP rewrite returns such an output as this rank's contiguous piece in ``torch.chunk``'s layout,
which is a DTensor ``Shard``'s, even where the ranks do not split the length evenly (``finish``);
this wrapper of the compiled graph makes it a ``DTensor`` with ``Shard(dim)`` over a mesh of the SP
group, so ``.full_tensor()`` gathers it only when asked and its backward sends each rank the
gradient of its own piece, as the compiled backward expects.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

_MESHES: dict[tuple[str, str], Any] = {}


def _mesh(group: dist.ProcessGroup, device_type: str) -> Any:
    from torch.distributed.device_mesh import DeviceMesh

    key = (group.group_name, device_type)
    if key not in _MESHES:
        _MESHES[key] = DeviceMesh.from_group(group, device_type)
    return _MESHES[key]


def as_dtensor(local: torch.Tensor, dim: int, group: dist.ProcessGroup, length: Any = None) -> Any:
    """This rank's piece of a tensor chunked along ``dim`` over ``group``, as a ``DTensor``.

    ``length``: the whole tensor's size along ``dim`` when known at compile time (an int); a
    symbolic one splits evenly, so it is this rank's piece times the ranks.
    """
    from torch.distributed.tensor import DTensor, Shard

    shape = list(local.shape)
    shape[dim] = length if isinstance(length, int) else shape[dim] * dist.get_world_size(group)
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(
        local, _mesh(group, local.device.type), [Shard(dim)], run_check=False, shape=torch.Size(shape), stride=stride
    )


def wrap_outputs(fn: Callable[..., Any], shards: Sequence[tuple[int, Any] | None], group: Any) -> Callable[..., Any]:
    """``fn`` whose outputs marked in ``shards`` come back as DTensors; ``fn`` itself if none is."""
    if not any(s is not None for s in shards):
        return fn

    @functools.wraps(fn)
    def run(*args: Any) -> Any:
        outs = fn(*args)
        wrapped = [
            as_dtensor(o, s[0], group, s[1]) if s is not None and isinstance(o, torch.Tensor) else o
            for o, s in zip(outs, shards)
        ]
        return type(outs)(wrapped) if isinstance(outs, tuple) else wrapped

    return run


def refuse_dtensor_inputs(example_inputs: Sequence[Any]) -> None:
    """A DTensor reaching a compiled graph came from ``outputs="sharded"`` across a graph break."""
    from torch.distributed.tensor import DTensor

    from autosp.errors import AutoSPError

    if any(isinstance(x, DTensor) for x in example_inputs):
        raise AutoSPError("a compiled graph got a DTensor input: " + SHARDED_ACROSS_BREAK)


SHARDED_ACROSS_BREAK = (
    "with outputs='sharded' an output of one graph crossed a graph break into the code after it; remove the "
    "break (torch._dynamo.explain shows where) or use outputs='whole'"
)


__all__ = ["SHARDED_ACROSS_BREAK", "as_dtensor", "refuse_dtensor_inputs", "wrap_outputs"]
