"""Bytes autograd saves for backward: the activation-memory number the SAC and bench tools report."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch


class SavedBytes:
    """Counts what autograd saves for backward while :meth:`record` is active, parameters excluded.

    ``distinct=True`` sums each distinct storage once (a tensor saved by several ops, or
    views of one buffer, count once, as they do in memory); ``distinct=False`` sums
    ``numel * element_size`` of every saved tensor, repeats included, which is what each
    op asks autograd to keep.
    """

    def __init__(self, params: Iterable[torch.Tensor], *, distinct: bool = True) -> None:
        self.distinct = distinct
        params = list(params)
        self._skip_storages = {p.untyped_storage().data_ptr() for p in params} if distinct else set()
        self._skip_ptrs = {p.data_ptr() for p in params}
        self._storages: dict[int, int] = {}
        self._tensors: list[int] = []

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if not self.distinct:
            if t.data_ptr() not in self._skip_ptrs:
                self._tensors.append(t.numel() * t.element_size())
            return t
        try:
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in self._skip_storages and ptr != 0:
                self._storages[ptr] = storage.nbytes()
        except (RuntimeError, NotImplementedError):
            pass  # tensors without storage (subclasses, meta) hold no memory here
        return t

    @contextmanager
    def record(self) -> Iterator[SavedBytes]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            yield self

    @property
    def total(self) -> int:
        return sum(self._storages.values()) if self.distinct else sum(self._tensors)


__all__ = ["SavedBytes"]
