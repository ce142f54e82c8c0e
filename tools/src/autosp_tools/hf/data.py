"""Batches for a dp x sp mesh: the ranks of one SP group read the same rows.

``accelerate`` shards a Trainer's dataloader over every process, so two ranks of one
SP group would get different rows and AutoSP's input check would refuse the call.
Here the shard is re-pointed at the data-parallel replica: ``num_processes`` becomes
the dp size and ``process_index`` this rank's dp index. ``Trainer`` itself does the
same to accelerate's wrapper for its ``BatchRebalanceSampler``.
"""

from __future__ import annotations

from typing import Any


class UnsupportedLoader(TypeError):
    """A dataloader whose sharding cannot be re-pointed at the dp group."""


def shard_over_dp(loader: Any, dp_rank: int, dp_size: int) -> Any:
    """Make ``loader`` (as ``accelerator.prepare`` returned it) yield dp replica ``dp_rank``'s rows.

    Map-style datasets (a ``BatchSamplerShard`` under the loader) and iterable ones read by
    every rank (an ``IterableDatasetShard``) are re-pointed in place; a loader with neither
    is not sharded (one process) and is returned as is. ``DataLoaderDispatcher`` (rank 0
    reads and scatters slices) is refused: it has no per-replica shard to re-point.
    """
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} is outside a data-parallel group of {dp_size}")
    from accelerate.data_loader import BatchSamplerShard, DataLoaderDispatcher, IterableDatasetShard

    if isinstance(loader, DataLoaderDispatcher):
        raise UnsupportedLoader(
            "AutoSP needs every rank of an SP group to read the same rows, and accelerate's dispatching "
            "dataloader scatters one batch over all processes; pass "
            "TrainingArguments(accelerator_config={'dispatch_batches': False})"
        )
    shards = [
        s
        for s in (getattr(loader, "batch_sampler", None), getattr(loader, "dataset", None))
        if isinstance(s, (BatchSamplerShard, IterableDatasetShard))
    ]
    for shard in shards:
        # With split_batches the shard slices each batch num_processes ways: now dp ways.
        shard.num_processes = dp_size
        shard.process_index = dp_rank
    return loader


__all__ = ["UnsupportedLoader", "shard_over_dp"]
