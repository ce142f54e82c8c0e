"""Sample fingerprints of many tensors at once, read afresh at every call.

The weight checks (``param_check``) compare, for each parameter and buffer, an evenly spread
sample of at most ``SAMPLE`` elements and one element of every row (at most ``ROWS``), bitwise.
They used to keep each tensor's fingerprint until its version counter moved; but a write through
``.data`` (``p.data.add_(...)`` in a hand-written optimizer, ``p.data.copy_(state)``) moves no
version counter of ``p``, so ranks parted that way ran on with other weights, silently. So the
fingerprints are read afresh at every call, and batched to make that cheap: the spread sample is
a strided view, a row sample one ``take`` per tensor with a cached index, and the rest a few
kernels per device and word size, whatever the number of tensors. Only the layout (indices,
weights, segment bounds) is cached, keyed by the tensors' shapes and dtypes, never their values.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from autosp.input_check import spread_sample

SAMPLE = 4096
ROWS = 1 << 20
_MULT = 0x5851F42D4C957F2D  # odd 64-bit constants (PCG's multiplier and increment)
_ADD = 0x14057B7EF767814F
_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _as_words(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as integer words of their width (a view: no copy, no kernel)."""
    x = t.detach()
    if x.is_complex():
        x = torch.view_as_real(x)
    if x.dtype == torch.bool:
        x = x.view(torch.uint8)
    return x.view(_WORDS[x.element_size()])


_row_index: dict[tuple[int, int, torch.device], torch.Tensor] = {}


def _rows(shape: Sequence[int], numel: int, device: torch.device) -> torch.Tensor | None:
    """Flat positions of one element per row (its column moving), or None where the spread covers it."""
    if len(shape) < 2 or shape[0] <= 1 or numel <= SAMPLE:
        return None
    rows, cols = shape[0], numel // shape[0]
    key = (rows, cols, device)
    index = _row_index.get(key)
    if index is None:
        r = torch.arange(0, rows, -(-rows // ROWS), device=device)
        index = _row_index[key] = r * cols + (r * 7919 + 13) % cols
        if len(_row_index) > 256:  # shapes come and go with models: keep the cache bounded
            _row_index.pop(next(iter(_row_index)))
    return index


def sample_parts(t: torch.Tensor) -> list[torch.Tensor]:
    """What of ``t`` is compared, as integer words: its spread sample, then a row sample where it has one."""
    words = _as_words(t)
    parts = [spread_sample(words, SAMPLE)]  # a strided view of a contiguous tensor
    index = _rows(t.shape, words.numel(), t.device)
    if index is not None:
        parts.append(words.reshape(-1).take(index))
    return parts


def sample(t: torch.Tensor) -> torch.Tensor:
    """The elements of ``t`` that are compared, as integer words."""
    return torch.cat(sample_parts(t))


_layouts: dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _layout(spans: Sequence[tuple[int, int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-position odd weights (from each sample's own start, so a tensor's fingerprint does not
    depend on its neighbours), and where each sample starts and ends in the concatenation."""
    key = (tuple(spans), device)
    held = _layouts.pop(key, None)  # taken out and put back last: the least recently used goes first
    if held is not None:
        _layouts[key] = held
    else:
        starts = torch.tensor([s for s, _ in spans], dtype=torch.int64, device=device)
        lengths = torch.tensor([n for _, n in spans], dtype=torch.int64, device=device)
        total = sum(n for _, n in spans)
        pos = torch.arange(total, dtype=torch.int64, device=device) - starts.repeat_interleave(
            lengths, output_size=total
        )
        w = pos * _MULT + _ADD
        held = _layouts[key] = ((w ^ (w >> 29)) | 1, starts, starts + lengths)
        # A layout's weights are as long as its samples (17 MB for a 2.3B-parameter Llama): keep the
        # model's per-call one and one more (each graph's first-run check is another, used once).
        if len(_layouts) > 2:
            _layouts.pop(next(iter(_layouts)))
    return held


def sample_fingerprints(tensors: Sequence[torch.Tensor]) -> list[int]:
    """A 64-bit fingerprint of each tensor's sample, all of one device's tensors in a few kernels.

    Each is the wrapping sum of its sample's words times position weights, plus its element count:
    a changed element always changes it, and a swap almost always does.
    """
    out: list[int] = [0] * len(tensors)
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    for device, members in by_device.items():
        for i, fp in zip(members, _fingerprints_on([tensors[i] for i in members], device)):
            out[i] = fp
    return out


def _fingerprints_on(tensors: Sequence[torch.Tensor], device: torch.device) -> list[int]:
    groups: dict[torch.dtype, list[tuple[int, list[torch.Tensor]]]] = {}  # word type -> (tensor, its parts)
    for i, t in enumerate(tensors):
        parts = sample_parts(t)
        groups.setdefault(parts[0].dtype, []).append((i, parts))
    # One concatenation per word type, then one of those: samples in an order of their own.
    order = [(i, parts) for members in groups.values() for i, parts in members]
    spans, offset = [], 0
    for _, parts in order:
        n = sum(p.numel() for p in parts)
        spans.append((offset, n))
        offset += n
    weights, starts, ends = _layout(spans, device)
    words = torch.cat(
        [torch.cat([p for _, parts in members for p in parts]).to(torch.int64) for members in groups.values()]
    )
    sums = torch.cat([words.new_zeros(1), (words * weights).cumsum(0)])
    per_sample = (sums[ends] - sums[starts]).tolist()  # wrapping int64: each sample's sum
    out = [0] * len(tensors)
    for (i, _), fp in zip(order, per_sample):
        out[i] = fp + tensors[i].numel()
    return out


__all__ = ["ROWS", "SAMPLE", "sample", "sample_fingerprints", "sample_parts"]
