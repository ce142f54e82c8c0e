"""FlexAttention's block mask cut to one rank's heads or query rows, with the mods' indices kept global.

A variant that gives a rank part of a FlexAttention call (its heads under Ulysses, its query rows
under ring) calls the same op on smaller tensors. Flex numbers heads and query rows from 0 in the
tensors it is given, so ``score_mod`` and ``mask_mod`` would see local indices where the program
meant global ones (a slope per head, a document id per position), and the block mask would
describe the wrong rows. These functions shift the mods' index arguments back to global ones and
cut the block mask's tensors to the rank's part; both give exactly the single-device call's values
for that part. Whatever they cannot place exactly (a field they do not know, rows not on block
boundaries) returns None, and the variant runs the call whole.

The block mask arrives as ``BlockMask.as_tuple()``: 2 lengths, 8 block tensors, 4 dq write-order
fields, 2 block sizes (query, key) and ``mask_mod``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from autosp.sharding.placement import Interval

BLOCK_TENSORS = range(2, 10)
_KV_FIELDS = ((2, 3), (4, 5))  # (num_blocks, indices) of partial and of full key blocks per query block
_Q_FIELDS = ((6, 7), (8, 9))  # the same, transposed: query blocks per key block (for the backward)
_DQ_ORDERS = range(10, 14)
Q_BLOCK, MASK_MOD = 14, 16
# Where each mod takes the head and the query index: score_mod(score, b, h, q_idx, kv_idx, *buffers),
# mask_mod(b, h, q_idx, kv_idx, *buffers).
SCORE_HEAD, SCORE_QUERY, MASK_HEAD, MASK_QUERY = 2, 3, 1, 2

Pieces = Sequence[Interval]  # a rank's intervals of the sequence, in the order it holds them


def shift_arg(fn: Callable[..., Any], index: int, to_global: Callable[[Any], Any]) -> Callable[..., Any]:
    """``fn`` with its argument at ``index`` (a head or a query index) mapped from local to global."""

    def shifted(*args: Any) -> Any:
        moved = list(args)
        moved[index] = to_global(moved[index])
        return fn(*moved)

    return shifted


def offset(by: int, heads: int | None = None) -> Callable[[Any], Any]:
    """Local -> global by adding ``by``. With ``heads`` (the real count, where a variant padded the
    heads to split them), a padding head maps to the last real one: a mod reading a per-head table
    stays in range, and the padding heads' results are cut, so what they read is never seen."""
    if heads is None:
        return lambda i: i + by
    return lambda i: torch.clamp(i + by, max=heads - 1)


def global_rows(pieces: Pieces) -> Callable[[Any], Any]:
    """Local query index -> global, for a rank holding ``pieces`` (intervals) in this order."""
    starts: list[tuple[Any, Any]] = []
    at: Any = 0
    for lo, hi in pieces:
        starts.append((at, lo - at))
        at += hi - lo

    def to_global(i: Any) -> Any:
        out = i + starts[0][1]
        for start, shift in starts[1:]:
            out = torch.where(i >= start, i + shift, out)
        return out

    return to_global


def _known(block: tuple) -> bool:
    # dq write orders are per (query block, key block) schedules: nothing here cuts them.
    return len(block) == 17 and all(block[i] is None for i in _DQ_ORDERS)


def heads_of(block: tuple, heads: int, lo: int, hi: int) -> tuple | None:
    """The block mask for heads ``[lo, hi)``, ``mask_mod`` seeing global heads; None when unknown.

    ``hi`` may pass ``heads`` where a variant padded the heads to split them: each padding head
    takes the last real head's blocks and index (``offset``), so its scores are finite and in range.
    """
    if not _known(block):
        return None
    out = list(block)
    for i in BLOCK_TENSORS:
        t = block[i]
        if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[1] == heads and heads > 1:
            out[i] = _take(t, 1, [min(h, heads - 1) for h in range(lo, hi)])
        elif isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[1] != 1:
            return None  # a head dim of another size: not a layout known here
    out[MASK_MOD] = shift_arg(block[MASK_MOD], MASK_HEAD, offset(lo, heads if hi > heads else None))
    return tuple(out)


def row_blocks(pieces: Pieces, length: int, size: int) -> list[tuple[int, int]] | None:
    """The query blocks (first, count) that hold ``pieces``, or None when a piece does not start on a
    block boundary or ends inside a block other than the sequence's last one (its block would mix
    rows of two pieces)."""
    spans = []
    for n, (lo, hi) in enumerate(pieces):
        if lo % size or (hi % size and (hi != length or n != len(pieces) - 1)):
            return None
        spans.append((lo // size, -(-hi // size) - lo // size))
    return spans


def _take(t: torch.Tensor, dim: int, index: list[int]) -> torch.Tensor:
    """``t``'s entries ``index`` along ``dim``, as a new tensor, never a view.

    Inductor's FlexAttention kernel (torch 2.13, CPU) read wrongly a block tensor that the graph cut
    with one ``narrow`` past the first query block (a silently wrong attention on the ranks whose rows
    start there; cut at block 0, or as a ``cat`` of pieces, it was right); a gather makes a tensor of
    its own, which it reads right.
    """
    return t.index_select(dim, torch.tensor(index, dtype=torch.long, device=t.device))


def _rows(t: torch.Tensor, dim: int, spans: list[tuple[int, int]]) -> torch.Tensor:
    return _take(t, dim, [i for first, count in spans for i in range(first, first + count)])


def _transpose(num: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks per row (ordered: count, then column indices) -> blocks per column, the same way."""
    cols = indices.shape[-1]
    valid = torch.arange(cols, device=indices.device) < num.unsqueeze(-1)
    # Indices past a row's count are padding: they write into a spare column that is dropped.
    target = torch.where(valid, indices.long(), cols)
    dense = torch.zeros(*indices.shape[:-1], cols + 1, dtype=torch.int32, device=indices.device)
    dense = dense.scatter(-1, target, 1)[..., :cols].transpose(-2, -1)
    order = torch.argsort(dense, dim=-1, descending=True, stable=True)
    return dense.sum(-1).to(torch.int32), order.to(torch.int32)


def rows_of(block: tuple, pieces: Pieces) -> tuple | None:
    """The block mask for query rows ``pieces`` (global intervals, held in this order), both mods
    seeing global query indices; None when unknown or when the rows are not whole query blocks."""
    if not _known(block) or not isinstance(block[0], int) or not isinstance(block[Q_BLOCK], int):
        return None
    spans = row_blocks(pieces, block[0], block[Q_BLOCK])
    if spans is None:
        return None
    out = list(block)
    out[0] = sum(hi - lo for lo, hi in pieces)
    for num_at, idx_at in _KV_FIELDS:
        if block[num_at] is not None:
            out[num_at] = _rows(block[num_at], -1, spans)
            out[idx_at] = _rows(block[idx_at], -2, spans)
    for (num_at, idx_at), (q_num_at, q_idx_at) in zip(_KV_FIELDS, _Q_FIELDS):
        if block[q_num_at] is not None and out[num_at] is not None:
            out[q_num_at], out[q_idx_at] = _transpose(out[num_at], out[idx_at])
        elif block[q_num_at] is not None:
            return None
    out[MASK_MOD] = shift_arg(block[MASK_MOD], MASK_QUERY, global_rows(pieces))
    return tuple(out)


__all__ = ["global_rows", "heads_of", "offset", "row_blocks", "rows_of", "shift_arg"]
