"""AutoSP's collective ops return fresh tensors: Inductor assumes a custom op's output is an aligned allocation."""

from __future__ import annotations

import pytest
import torch

from autosp.sharding import collectives as C
from autosp.sharding.testing.threads import simulate


def _calls(x: torch.Tensor, dim: int, group: str) -> dict[str, torch.Tensor]:
    return {
        "all_gather": C.all_gather(x, dim, [x.shape[dim]] * 2, group, False),
        "reduce_scatter": C.reduce_scatter(x, dim, [x.shape[dim] // 2] * 2, group),
        "all_reduce": C.all_reduce(x, group, False),
        "all_to_all": C.all_to_all(x, dim, 1 - dim, group),
    }


@pytest.mark.parametrize("dim", [0, 1])
def test_outputs_own_their_storage(dim: int) -> None:
    def rank_fn(rank: int, group: str) -> dict[str, tuple[int, bool]]:
        x = torch.arange(4 * 6, dtype=torch.float32).reshape(4, 6) + rank
        return {
            name: (out.storage_offset(), out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr())
            for name, out in _calls(x, dim, group).items()
        }

    for rank, results in enumerate(simulate(rank_fn, 2)):
        for name, (offset, aliases) in results.items():
            assert offset == 0, f"{name} on rank {rank} returned a view at storage offset {offset}"
            assert not aliases, f"{name} on rank {rank} returned its input's storage"


def test_reduce_scatter_values() -> None:
    def rank_fn(rank: int, group: str) -> torch.Tensor:
        x = torch.arange(8, dtype=torch.float32).reshape(4, 2) * (rank + 1)
        return C.reduce_scatter(x, 0, [1, 3], group)

    r0, r1 = simulate(rank_fn, 2)
    total = torch.arange(8, dtype=torch.float32).reshape(4, 2) * 3
    torch.testing.assert_close(r0, total[:1])
    torch.testing.assert_close(r1, total[1:])
