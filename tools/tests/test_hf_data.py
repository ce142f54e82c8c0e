"""``autosp_tools.hf``: dp x sp data sharding of accelerate's loaders, and the trainer's refusals.

The loaders are built as ``accelerator.prepare`` builds them for each of 4 processes, in this
process (no process group needed): what matters is which rows each rank would read.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

pytest.importorskip("accelerate", reason="the Trainer integration needs accelerate")
from accelerate.data_loader import prepare_data_loader  # noqa: E402

from autosp_tools.hf import UnsupportedLoader, shard_over_dp  # noqa: E402

WORLD, SP = 4, 2
DP = WORLD // SP


def _rows(loader: DataLoader) -> list[list[int]]:
    return [batch.tolist() for batch in loader]


def _prepared(rank: int, dataset: object, **kwargs: object) -> DataLoader:
    base = DataLoader(dataset, batch_size=2, **kwargs)  # type: ignore[arg-type]
    return prepare_data_loader(
        base, num_processes=WORLD, process_index=rank, put_on_device=False, use_seedable_sampler=True, data_seed=3
    )


class Stream(IterableDataset):
    def __iter__(self):
        return iter(torch.arange(24))


@pytest.mark.parametrize("kind", ["map", "map-shuffled", "iterable"])
def test_sp_ranks_read_the_same_rows_and_dp_replicas_split_them(kind):
    if kind == "iterable":
        loaders = [_prepared(r, Stream()) for r in range(WORLD)]
    else:
        loaders = [_prepared(r, torch.arange(24), shuffle=kind == "map-shuffled") for r in range(WORLD)]
    before = [_rows(loader) for loader in loaders]
    assert before[0] != before[1], "accelerate gives every process its own rows"
    # Consecutive ranks share a sequence (autosp_tools.parallel.make_groups): rank r is dp replica r // SP.
    after = [_rows(shard_over_dp(loader, r // SP, DP)) for r, loader in enumerate(loaders)]
    for dp in range(DP):
        group = after[dp * SP : (dp + 1) * SP]
        assert all(rows == group[0] for rows in group), f"SP group {dp} read different rows"
    seen = [sorted(i for batch in after[dp * SP] for i in batch) for dp in range(DP)]
    assert not set(seen[0]) & set(seen[1]), "two dp replicas read the same rows"
    assert sorted(seen[0] + seen[1]) == list(range(24))
    assert len(after[0][0]) == 2  # per_device_train_batch_size stays the batch of one SP group


def test_dispatching_loader_is_refused_with_what_to_set():
    # Trainer's default for an iterable dataset: rank 0 reads and scatters slices over all processes.
    base = DataLoader(Stream(), batch_size=2)
    loader = prepare_data_loader(
        base, device=torch.device("cpu"), num_processes=1, process_index=0, put_on_device=True, dispatch_batches=True
    )
    with pytest.raises(UnsupportedLoader, match="dispatch_batches': False"):
        shard_over_dp(loader, 0, 1)


def test_dp_rank_outside_the_group_is_refused():
    with pytest.raises(ValueError, match="outside a data-parallel group of 2"):
        shard_over_dp(_prepared(0, torch.arange(8)), 2, 2)
