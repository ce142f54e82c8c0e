"""Document-aware load balance of ring attention: query rows placed by the model's mask, at run time.

The zigzag layout balances plain causal attention. With a mask the model builds (documents packed
into a row: a block-diagonal causal mask) a query row's work depends on its document, and zigzag
can leave one rank far more than the mean (documents of 3/4 and 1/4 of the row: 1.25x at P=2,
1.4x at P=4; up to 2x on random documents at P=8).
The layout of the program is fixed at compile time, but the mask is whole and alike on every rank,
so every rank computes the same plan from it, with no communication:

* each rank's pieces of the sequence are cut into chunks of ``chunk`` tokens;
* a (query chunk, key chunk) tile costs its area when the mask leaves any pair in it, nothing
  otherwise (a fused kernel computes a tile whole, whatever the mask keeps of it);
* the query chunks are dealt to the ranks, as many to each as it holds now, heaviest first to the
  lightest rank with room, then improved by swaps out of the heaviest rank.

Only queries move: one all-to-all brings each rank its planned query rows, one takes (out, lse)
back, and the backward does the same with (q, out, lse, dout) and dq. k and v travel the ring in
the program's layout as before, so the ring's traffic and its dk/dv accumulation do not change.
A plan that would not cut the slowest rank's work enough (``GAIN``, ``MOVE_GAIN``) is not used.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.distributed as dist
from torch import Tensor

from autosp import peer_failure
from autosp_ring.blocks import block_mask

Piece = tuple[int, int, int]  # (global offset, length, local offset)

# A plan runs when it brings the slowest rank's work below GAIN x what whole pieces cost; its rows
# move when that brings it below MOVE_GAIN x what finer tiles alone cost. At long context a query
# row's attention costs far more than sending it (S flops per byte), so small gains pay.
GAIN = 0.95
MOVE_GAIN = 0.97
MAX_SPLIT = 8  # chunks per piece at most: more, smaller kernel calls past this buy little balance


def split(pieces: list[Piece], chunk: int) -> list[Piece]:
    """``pieces`` cut into chunks of ``chunk`` tokens (each piece's length is a multiple of it)."""
    return [(g + i, chunk, s + i) for g, n, s in pieces for i in range(0, n, chunk)]


def chunk_size(pieces: list[Piece], smallest: int) -> int:
    """The finest cut of every piece into equal chunks of at least ``smallest`` tokens; 0 for none.

    ``pieces``: every rank's pieces (they have one length under zigzag and contiguous layouts).
    """
    length = pieces[0][1]
    if smallest <= 0 or any(n != length for _, n, _ in pieces):
        return 0
    for parts in range(MAX_SPLIT, 0, -1):
        if length % parts == 0 and length // parts >= smallest:
            return length // parts
    return 0


def tile_grid(mask: Tensor, causal: bool, window: int, chunk: int) -> Tensor:
    """``[n, n]`` bool on the CPU: whether the mask (with the causal/window pattern) leaves any pair in
    the tile of query chunk i and key chunk j; chunks of ``chunk`` tokens in global order.

    ``mask``: the whole ``[Bm, Hm, S, S]`` mask, boolean (keep where True) or additive (-inf drops).
    Row blocks keep the temporary at ``chunk x S`` per mask row and head.
    """
    seq = mask.shape[-1]
    n = seq // chunk
    rows = []
    for i in range(n):
        lo = i * chunk
        tile = mask[:, :, lo : lo + chunk]
        keep = tile if tile.dtype == torch.bool else ~torch.isneginf(tile)
        pattern = block_mask(lo, chunk, 0, seq, causal, window, mask.device)
        if pattern is not None:
            keep = keep & pattern
        rows.append(keep.reshape(-1, chunk, n, chunk).any(dim=(0, 1, 3)))
    return torch.stack(rows).cpu()


def deal(work: list[int], world: int) -> list[list[int]]:
    """Chunk indices per rank, ``len(work) // world`` each, the heaviest rank's work made small:
    heaviest chunk first to the lightest rank with room, then swaps out of the heaviest rank.

    Deterministic (ties go to the lower index and rank): every rank computes the same deal.
    """
    per = len(work) // world
    owned: list[list[int]] = [[] for _ in range(world)]
    load = [0] * world
    for i in sorted(range(len(work)), key=lambda i: (-work[i], i)):
        r = min((r for r in range(world) if len(owned[r]) < per), key=lambda r: (load[r], r))
        owned[r].append(i)
        load[r] += work[i]
    for _ in range(len(work) * world):
        hi = max(range(world), key=lambda r: (load[r], -r))
        # The swap with any other rank that lowers the pair's larger load the most (each one lowers
        # the sum of squared loads, so this ends).
        best = min(
            (
                (max(load[hi] - d, load[lo] + d), lo, x, y)
                for lo in range(world)
                if lo != hi
                for x in owned[hi]
                for y in owned[lo]
                if 0 < (d := work[x] - work[y]) and load[lo] + d < load[hi]
            ),
            default=None,
        )
        if best is None:
            break
        _, lo, x, y = best
        owned[hi][owned[hi].index(x)], owned[lo][owned[lo].index(y)] = y, x
        load[hi] += work[y] - work[x]
        load[lo] += work[x] - work[y]
    return [sorted(o) for o in owned]


def piece_work(grid: Tensor, chunk: int, q_pieces: list[Piece], k_pieces: list[Piece]) -> int:
    """Tile area a fused kernel computes for query pieces against key pieces (skipping empty tiles)."""
    total = 0
    for qo, ql, _ in q_pieces:
        for ko, kl, _ in k_pieces:
            if grid[qo // chunk : (qo + ql) // chunk, ko // chunk : (ko + kl) // chunk].any():
                total += ql * kl
    return total


@dataclass
class Plan:
    """This rank's query rows under the balanced deal, and how rows move there and back."""

    chunk: int
    grid: Tensor  # [n, n] non-empty tiles
    q_pieces: list[Piece]  # this rank's query chunks in the plan: (global, length, local)
    moves: bool  # False: finer tiles only, every query row stays where the program put it
    send_rows: Tensor  # local rows (program layout) in the order they are sent
    send_counts: list[int]
    recv_counts: list[int]
    recv_order: Tensor  # received row i goes to plan row recv_order[i]
    work: tuple[list[int], list[int]]  # per rank: (program layout, plan)

    def k_runs(self, q_piece: Piece, k_pieces: list[Piece]) -> list[Piece]:
        """Runs of key chunks of ``k_pieces`` that the query chunk meets (empty tiles left out)."""
        row = self._kept[q_piece[0] // self.chunk]
        runs: list[Piece] = []
        for g, n, s in split(k_pieces, self.chunk):
            if not row[g // self.chunk]:
                continue
            if runs and runs[-1][0] + runs[-1][1] == g and runs[-1][2] + runs[-1][1] == s:
                last = runs.pop()
                runs.append((last[0], last[1] + n, last[2]))
            else:
                runs.append((g, n, s))
        return runs

    @cached_property
    def _kept(self) -> list[list[bool]]:
        # The grid as lists: read per tile, every ring step, forward and backward.
        return self.grid.tolist()

    def to_plan(self, group: dist.ProcessGroup, *xs: Tensor) -> list[Tensor]:
        """``[B, H, L, ...]`` tensors from the program's layout to the plan's (rows along dim 2)."""
        return self._move(group, xs, self.send_rows, self.recv_order, self.recv_counts, self.send_counts)

    def from_plan(self, group: dist.ProcessGroup, *xs: Tensor) -> list[Tensor]:
        """The inverse of ``to_plan``."""
        return self._move(group, xs, self.recv_order, self.send_rows, self.send_counts, self.recv_counts)

    def _move(
        self,
        group: dist.ProcessGroup,
        xs: tuple[Tensor, ...],
        take: Tensor,
        put: Tensor,
        into: list[int],
        out: list[int],
    ) -> list[Tensor]:
        """Rows ``take`` of ``xs`` sent (``out`` to each rank), received (``into`` from each) at rows ``put``."""
        if not self.moves:
            return list(xs)
        rows = _rows(xs)
        take, put = take.to(rows.device), put.to(rows.device)
        moved = _exchange(group, rows.index_select(0, take), into, out)
        placed = torch.empty_like(moved)
        placed[put] = moved
        return _unrows(placed, xs)


def _exchange(group: dist.ProcessGroup, rows: Tensor, received: list[int], sent: list[int]) -> Tensor:
    """One all-to-all of ``rows`` (``sent[r]`` of them to rank r, in order): ``received[r]`` from each."""
    from autosp_ring.op import host_staged  # the op imports this module

    device = rows.device
    if host_staged(str(dist.get_backend(group)), device):
        rows = rows.cpu()
    out = torch.empty_like(rows)
    work = dist.all_to_all_single(out, rows, received, sent, group=group, async_op=True)
    peer_failure.wait(work, group, out.device)
    return out.to(device)


def _rows(xs: tuple[Tensor, ...]) -> Tensor:
    """Tensors with rows on dim 2, as one ``[L, F]`` block in the widest dtype among them."""
    dtype = xs[0].dtype
    for x in xs[1:]:
        dtype = torch.promote_types(dtype, x.dtype)  # bf16/fp16 -> fp32 and back is exact
    return torch.cat([x.movedim(2, 0).reshape(x.shape[2], -1).to(dtype) for x in xs], dim=1)


def _unrows(rows: Tensor, like: tuple[Tensor, ...]) -> list[Tensor]:
    out, at = [], 0
    for x in like:
        shape = (x.shape[2], *x.shape[:2], *x.shape[3:])
        width = x[:, :, 0].numel()
        out.append(rows[:, at : at + width].reshape(shape).movedim(0, 2).to(x.dtype).contiguous())
        at += width
    return out


def plan(
    mask: Tensor,
    causal: bool,
    window: int,
    layout: list[list[Piece]],
    rank: int,
    smallest: int,
) -> Plan | None:
    """The balanced plan for this rank, or None when it would not pay (see ``GAIN``).

    ``layout``: every rank's pieces in the program's layout, which the keys keep.
    """
    chunk = chunk_size([p for pieces in layout for p in pieces], smallest)
    if chunk == 0:
        return None
    grid = tile_grid(mask, causal, window, chunk)
    # Every layer gets the model's one mask (and the backward the forward's): plan each grid once.
    key = (grid.numpy().tobytes(), grid.shape[0], chunk, tuple(map(tuple, layout)), rank)
    if key not in _PLANS:
        _PLANS[key] = _plan(grid, chunk, layout, rank)
        while len(_PLANS) > _PLANS_KEPT:
            _PLANS.pop(next(iter(_PLANS)))
    return _PLANS[key]


_PLANS: dict[tuple, Plan | None] = {}
_PLANS_KEPT = 16


def _plan(grid: Tensor, chunk: int, layout: list[list[Piece]], rank: int) -> Plan | None:
    world = len(layout)
    all_keys = [p for pieces in layout for p in pieces]
    # What the op computes without a plan: whole pieces against whole pieces.
    before = [piece_work(grid, chunk, pieces, all_keys) for pieces in layout]
    work = (grid.sum(dim=1) * chunk * chunk).tolist()
    held = [[g // chunk for g, _, _ in split(pieces, chunk)] for pieces in layout]
    dealt = deal(work, world)

    def load(owned: list[list[int]]) -> list[int]:
        return [sum(work[i] for i in o) for o in owned]

    # Finer tiles alone may be enough: rows move only when that cuts the slowest rank's work again.
    moves = max(load(dealt)) < MOVE_GAIN * max(load(held))
    chosen = dealt if moves else held
    if max(load(chosen)) > GAIN * max(before):
        return None
    mine = split(layout[rank], chunk)  # chunks this rank holds now, in local order
    if not moves:
        empty = torch.empty(0, dtype=torch.long)
        return Plan(chunk, grid, mine, False, empty, [], [], empty, (before, load(chosen)))
    owner = {i: r for r, owned in enumerate(chosen) for i in owned}
    send = sorted(mine, key=lambda p: (owner[p[0] // chunk], p[0]))
    send_rows = torch.cat([torch.arange(s, s + n) for _, n, s in send])
    send_counts = [sum(n for g, n, _ in mine if owner[g // chunk] == d) for d in range(world)]
    q_pieces = [(i * chunk, chunk, at * chunk) for at, i in enumerate(chosen[rank])]
    plan_row = {g: s for g, _, s in q_pieces}
    # Each source sends its rows for this rank in global order (``send`` above, on that rank).
    arriving = [
        sorted((g, n) for g, n, _ in split(layout[src], chunk) if owner[g // chunk] == rank) for src in range(world)
    ]
    recv_counts = [sum(n for _, n in rows) for rows in arriving]
    recv_order = torch.cat([torch.arange(plan_row[g], plan_row[g] + n) for rows in arriving for g, n in rows])
    return Plan(chunk, grid, q_pieces, True, send_rows, send_counts, recv_counts, recv_order, (before, load(chosen)))


__all__ = ["GAIN", "MOVE_GAIN", "Plan", "chunk_size", "deal", "piece_work", "plan", "split", "tile_grid"]
