"""Ring attention as one opaque custom op with a hand-written ring backward.

Rank ``c`` of the ring group holds query chunk ``c`` (positions ``[c*L, (c+1)*L)``) and its own
k/v chunk.  k/v travel one hop per step (P2P isend/irecv; on gloo CPU an all-to-all in which only
neighbours send, whose wait can be polled for a failed peer; the next hop overlapping this block's
compute); each block's partial result merges into fp32 (out, lse), fp64 for fp64 inputs
(``blocks.acc_dtype``).  The backward makes the same trip: k/v travel again with dk/dv
accumulators in that dtype, which end up back at their owner.  Every rank
keeps O(S/P) activations: its q, k, v, out and lse.

Each block runs on a fused attention kernel (``autosp_ring.kernels``: CPU flash, CUDA flash or
memory-efficient) that returns its lse and never holds the block's [Lq, Lk] scores; its backward is
the kernel's own, called with the final merged (out, lse).  A diagonal causal block runs with the
kernel's ``is_causal``, a fully allowed one without mask, a partial one (sliding window, the model's
mask, zigzag pieces) with an additive mask tile; fully masked blocks are skipped.  The block math of
``autosp_ring.blocks`` (O(Lq*Lk) scores per block) computes what no kernel can: dtypes and devices
without a kernel, a kernel that fails its one-time check against that math, and the whole backward
when the model's mask needs a gradient (a learned bias: the kernels give none for the mask).

With the model's mask and ``balance`` > 0, the query rows may first move to a layout planned from
the mask (``autosp_ring.balance``: the same plan on every rank, in finer tiles, each rank computing
the same tile area) and (out, lse) move back at the end; k/v, their ring and dk/dv do not change.

The op is opaque to make_fx/AOT autograd (``custom_op``), so its traffic is never traced; all
ranks run the same number of steps, so every send has its receive.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.distributed_c10d import _resolve_process_group

from autosp import peer_failure
from autosp_ring import balance as balancing
from autosp_ring import kernels, saturated
from autosp_ring.blocks import (
    FUSED_KERNEL,
    acc_dtype,
    allowed_pairs,
    block_backward,
    block_kernel,
    block_mask,
    merge,
    natural_lse,
    tile_mask,
    tile_needed,
)
from autosp_ring.kernels import Tile

# Blocks computed by this process: ("forward"|"backward", "computed"|"skipped") -> count. Lets
# callers measure causal imbalance (rank 0 skips most blocks, the last rank none).  Also
# ("forward"|"backward", kernel name) -> blocks that kernel computed ("fp32 math" for the fallback).
BLOCK_COUNTS: Counter = Counter()

_KV_TAG, _GRAD_TAG = 0, 1


def host_staged(backend: str, device: torch.device) -> bool:
    """Whether ``backend`` (``dist.get_backend``'s string) moves ``device`` tensors point to point
    only through host memory.

    gloo stages CUDA tensors itself inside its collectives (the all-to-alls of Ulysses), but its
    send/recv hand the device pointer to the socket: the transfer fails ("writev: Bad address")
    or aborts the process. A group of several backends names one per device type
    (``cpu:gloo,cuda:nccl``).
    """
    if device.type == "cpu":
        return False
    return _backend_of(backend, device.type) == "gloo"


def _backend_of(backend: str, device_type: str) -> str:
    """The backend that a group (``dist.get_backend``'s string) uses for ``device_type`` tensors."""
    per_device = dict(part.split(":", 1) for part in backend.split(",")) if ":" in backend else {}
    return per_device.get(device_type, backend)


class _Ring:
    """This rank's place in the ring group, and one-hop exchanges along it."""

    def __init__(self, group_name: str) -> None:
        self.group = _resolve_process_group(group_name)
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        self.backend = str(dist.get_backend(self.group))

    def _global(self, r: int) -> int:
        return dist.get_global_rank(self.group, r % self.world)

    def start(self, buf: Tensor, offset: int, tag: int) -> Any:
        """Send ``buf`` to rank+offset and receive the same-sized buffer from rank-offset."""
        device = buf.device
        if host_staged(self.backend, device):
            buf = buf.cpu()  # the copy syncs with the kernels that wrote buf
        recv = torch.empty_like(buf)
        if buf.device.type == "cpu" and _backend_of(self.backend, "cpu") == "gloo":
            # gloo's point-to-point waits cannot be polled (a wait that times out closes the pair),
            # its collectives' can: the hop is an all-to-all in which only the two neighbours send
            # bytes, so that a peer whose program raised ends this wait (autosp.peer_failure).
            sends, recvs = [0] * self.world, [0] * self.world
            sends[(self.rank + offset) % self.world] = recvs[(self.rank - offset) % self.world] = buf.numel()
            work = dist.all_to_all_single(recv.view(-1), buf.reshape(-1), recvs, sends, group=self.group, async_op=True)
            return [work], recv, device, buf
        ops = [
            dist.P2POp(dist.isend, buf, self._global(self.rank + offset), self.group, tag),
            dist.P2POp(dist.irecv, recv, self._global(self.rank - offset), self.group, tag),
        ]
        return dist.batch_isend_irecv(ops), recv, device, buf  # buf: the send stays alive until finish

    def finish(self, pending: Any) -> Tensor:
        works, recv, device, _ = pending
        for w in works:
            peer_failure.wait(w, self.group, recv.device)
        return recv.to(device)


def num_steps(world: int, chunk: int, window: int) -> int:
    """Ring steps needed: all P, or fewer when a sliding window never reaches that far back."""
    if window <= 0:
        return world
    return min(world, 1 + (window - 1 + chunk - 1) // chunk)


def _chunk_shape(x: Tensor, length: int) -> tuple[int, ...]:
    """``x``'s shape (BHSD) with ``length`` sequence positions."""
    return (*x.shape[:2], length, *x.shape[3:])


def _pack(k: Tensor, v: Tensor, longest: int) -> Tensor:
    """k and v in one flat buffer sized for the longest chunk: every hop moves equal buffers."""
    flat = torch.cat([k.reshape(-1), v.reshape(-1)])
    size = sum(math.prod(_chunk_shape(x, longest)) for x in (k, v))
    return torch.cat([flat, flat.new_zeros(size - flat.numel())]) if size > flat.numel() else flat


def _unpack(buf: Tensor, like: tuple[Tensor, ...], length: int) -> list[Tensor]:
    """Views of ``buf`` shaped as ``like`` with ``length`` sequence positions (chunk j's k and v)."""
    out, at = [], 0
    for x in like:
        shape = _chunk_shape(x, length)
        out.append(buf[at : at + math.prod(shape)].view(shape))
        at += math.prod(shape)
    return out


def _length(rank: int, chunk: int, sizes: list[int] | None) -> int:
    return chunk if sizes is None else sizes[rank]


def segments(
    rank: int, chunk: int, world: int, zigzag: bool, sizes: list[int] | None = None
) -> list[tuple[int, int, int]]:
    """(global offset, length, local offset) of each contiguous piece a rank holds.

    ``sizes``: every rank's contiguous piece when they differ (a length the ranks do not split
    evenly); else each holds ``chunk`` tokens.
    """
    if sizes is not None:
        return [(sum(sizes[:rank]), sizes[rank], 0)]
    if not zigzag:
        return [(rank * chunk, chunk, 0)]
    half = chunk // 2
    return [(rank * half, half, 0), ((2 * world - 1 - rank) * half, half, half)]


def _steps(world: int, chunk: int, window: int, zigzag: bool) -> int:
    # The window shortcut assumes contiguous chunks; zigzag pieces sit at both ends.
    return world if zigzag else num_steps(world, chunk, window)


@torch.library.custom_op("autosp_ring::ring_attention", mutates_args=())
def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    is_causal: bool,
    scale: float,
    window: int,
    zigzag: bool,
    group_name: str,
    mask: Tensor | None = None,
    balance: int = 0,
    sizes: list[int] | None = None,
) -> tuple[Tensor, Tensor]:
    """Attention of this rank's query pieces over the whole sequence: (out [B,H,L,Dv], lse [B,H,L] in ``acc_dtype``).

    ``mask``: the model's whole ``[B or 1, H or 1, S, S]`` mask (boolean: keep where True; float: added
    to the scores), the same on every rank; each block takes its tile by global positions.
    ``balance``: with a mask, the smallest chunk (tokens) that query rows may be balanced in
    (``autosp_ring.balance``); 0 keeps the program's layout and whole-piece tiles.
    ``sizes``: every rank's contiguous chunk when the ranks' chunks differ in length (no zigzag);
    k/v then travel in buffers sized for the longest.
    """
    ring = _Ring(group_name)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    chunk, c, world = q.shape[2], ring.rank, ring.world
    b, h = q.shape[0], q.shape[1]
    acc = acc_dtype(q.dtype)
    out = q.new_zeros((b, h, chunk, v.shape[-1]), dtype=acc)
    lse = q.new_full((b, h, chunk), float("-inf"), dtype=acc)
    longest = max(sizes) if sizes else chunk
    buf = _pack(k, v, longest)
    kernel = block_kernel()
    top = sat = None
    if mask is not None and mask.dtype != torch.bool:
        whole_top = mask.amax(-1)  # every row's largest mask value, alike on every rank
        saturated.refuse_imprecise(whole_top)  # before the first transfer
    layout, plan = _layout(ring, chunk, zigzag, mask, is_causal, window, balance, "forward", sizes)
    if plan is not None:
        (q,) = plan.to_plan(ring.group, q)
    q_pieces = plan.q_pieces if plan is not None else layout[c]
    steps = world if plan is not None else _steps(world, min(sizes) if sizes else chunk, window, zigzag)
    if mask is not None and mask.dtype != torch.bool:
        top = saturated.my_rows(whole_top, q_pieces, chunk)
        sat = saturated.is_saturated(top)
        if not bool(sat.any()):
            top = sat = None
    for s in range(steps):
        pending = ring.start(buf, 1, _KV_TAG) if s < steps - 1 else None
        j = (c - s) % world
        kj, vj = _unpack(buf, (k, v), _length(j, chunk, sizes))
        for qo, ql, qs in q_pieces:
            for ko, kl, ks in _keys(plan, (qo, ql, qs), layout[j]):
                tile = _block(mask, qo, ql, ko, kl, is_causal, window, q.device)
                if tile is None:
                    BLOCK_COUNTS["forward", "skipped"] += 1
                    continue
                rows = slice(qs, qs + ql)
                qb, kb, vb = _pieces(q, kj, vj, rows, slice(ks, ks + kl))
                fused = kernels.choose(qb, kb, vb, tile.mask is not None) if kernel is FUSED_KERNEL else None
                if fused is not None:
                    o, block_lse = kernels.forward(fused, qb, kb, vb, scale, tile)
                else:
                    o, block_lse = kernel.forward(qb, kb, vb, scale, tile.dense(ql, q.device))
                    block_lse = natural_lse(block_lse.to(acc), kernel.lse_base)
                if sat is not None and top is not None and tile.mask is not None:
                    block_lse = saturated.block_lse(block_lse, tile.mask, top[:, :, rows], sat[:, :, rows])
                out[:, :, rows], lse[:, :, rows] = merge(out[:, :, rows], lse[:, :, rows], o.to(acc), block_lse)
                BLOCK_COUNTS["forward", "computed"] += 1
                BLOCK_COUNTS["forward", "area"] += ql * kl
                BLOCK_COUNTS["forward", _name(fused, kernel)] += 1
        if pending is not None:
            buf = ring.finish(pending)
    if sat is not None and top is not None:
        lse = saturated.restore(lse, top, sat)
    if plan is not None:
        return tuple(plan.from_plan(ring.group, out.to(q.dtype), lse))  # type: ignore[return-value]
    return out.to(q.dtype), lse


@ring_attention.register_fake
def _(q, k, v, is_causal, scale, window, zigzag, group_name, mask=None, balance=0, sizes=None):
    b, h, chunk = q.shape[0], q.shape[1], q.shape[2]
    return q.new_empty((b, h, chunk, v.shape[-1])), q.new_empty((b, h, chunk), dtype=acc_dtype(q.dtype))


@torch.library.custom_op("autosp_ring::ring_attention_backward", mutates_args=())
def ring_attention_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    is_causal: bool,
    scale: float,
    window: int,
    zigzag: bool,
    group_name: str,
    mask: Tensor | None = None,
    mask_grad: bool = False,
    balance: int = 0,
    sizes: list[int] | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dmask) of this rank's pieces; dk/dv sum the contributions of every rank's queries.

    ``dmask`` (with ``mask_grad``; else empty) holds the rows of this rank's queries only: summed
    over the ranks it is the mask's gradient, as for any value every rank holds whole.
    """
    ring = _Ring(group_name)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    chunk, c, world = q.shape[2], ring.rank, ring.world
    acc = acc_dtype(q.dtype)
    # The forward's plan again (the mask is the same): queries, their output and lse, and dout move.
    layout, plan = _layout(ring, chunk, zigzag, mask, is_causal, window, balance, "backward", sizes)
    if plan is not None:
        q, out, lse, dout = plan.to_plan(ring.group, q, out, lse, dout)
    q_pieces = plan.q_pieces if plan is not None else layout[c]
    dout32 = dout.to(acc)
    delta = (dout32 * out.to(acc)).sum(-1)
    dout, out = dout.to(q.dtype), out.to(q.dtype)
    # The kernels give no gradient for the mask: a mask that needs one takes the block math throughout.
    fused_ok = block_kernel() is FUSED_KERNEL and not mask_grad
    dq = torch.zeros_like(q, dtype=acc)
    buf = _pack(k, v, max(sizes) if sizes else chunk)
    grads = torch.zeros(buf.numel(), dtype=acc, device=q.device)
    dmask = torch.zeros_like(mask, dtype=acc_dtype(mask.dtype)) if mask_grad and mask is not None else None
    steps = world if plan is not None else _steps(world, min(sizes) if sizes else chunk, window, zigzag)
    for s in range(steps):
        pending_kv = ring.start(buf, 1, _KV_TAG) if s < steps - 1 else None
        j = (c - s) % world
        kj, vj = _unpack(buf, (k, v), _length(j, chunk, sizes))
        dk_acc, dv_acc = _unpack(grads, (k, v), _length(j, chunk, sizes))
        for qo, ql, qs in q_pieces:
            for ko, kl, ks in _keys(plan, (qo, ql, qs), layout[j]):
                tile = _block(mask, qo, ql, ko, kl, is_causal, window, q.device)
                if tile is None:
                    BLOCK_COUNTS["backward", "skipped"] += 1
                    continue
                rows, cols = slice(qs, qs + ql), slice(ks, ks + kl)
                qb, kb, vb = _pieces(q, kj, vj, rows, cols)
                fused = kernels.choose(qb, kb, vb, tile.mask is not None) if fused_ok else None
                if fused is not None:
                    dq_b, dk_b, dv_b = kernels.backward(
                        fused,
                        dout[:, :, rows].contiguous(),
                        qb,
                        kb,
                        vb,
                        out[:, :, rows].contiguous(),
                        lse[:, :, rows].contiguous(),
                        scale,
                        tile,
                    )
                else:
                    dq_b, dk_b, dv_b, *ds = block_backward(
                        qb,
                        kb,
                        vb,
                        dout32[:, :, rows],
                        lse[:, :, rows],
                        delta[:, :, rows],
                        scale,
                        tile.dense(ql, q.device),
                        return_ds=dmask is not None,
                    )
                    if dmask is not None:
                        dmask[:, :, qo : qo + ql, ko : ko + kl] += _unbroadcast(ds[0], dmask.shape)
                dq[:, :, rows] += dq_b
                dk_acc[:, :, cols] += dk_b
                dv_acc[:, :, cols] += dv_b
                BLOCK_COUNTS["backward", "computed"] += 1
                BLOCK_COUNTS["backward", "area"] += ql * kl
                BLOCK_COUNTS["backward", _name(fused, None)] += 1
        if pending_kv is not None:
            # The accumulator of chunk j follows chunk j around the ring.
            grads = ring.finish(ring.start(grads, 1, _GRAD_TAG))
            buf = ring.finish(pending_kv)
    back = (steps - 1) % world
    if back:
        # This rank now holds chunk c-(steps-1)'s accumulator: hand it to its owner.
        grads = ring.finish(ring.start(grads, -back, _GRAD_TAG))
    dk, dv = _unpack(grads, (k, v), chunk)
    if plan is not None:
        (dq,) = plan.from_plan(ring.group, dq)
    dm = dmask.to(mask.dtype) if dmask is not None else q.new_empty(0)
    # dk and dv are views of one buffer: copies, since custom op outputs may not alias.
    return dq.to(q.dtype), dk.to(k.dtype, copy=True), dv.to(v.dtype, copy=True), dm


@ring_attention_backward.register_fake
def _(
    dout,
    q,
    k,
    v,
    out,
    lse,
    is_causal,
    scale,
    window,
    zigzag,
    group_name,
    mask=None,
    mask_grad=False,
    balance=0,
    sizes=None,
):
    dm = torch.empty_like(mask) if mask_grad and mask is not None else q.new_empty(0)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dm


def _layout(
    ring: _Ring,
    chunk: int,
    zigzag: bool,
    mask: Tensor | None,
    causal: bool,
    window: int,
    balance: int,
    phase: str,
    sizes: list[int] | None,
) -> tuple[list[list[tuple[int, int, int]]], balancing.Plan | None]:
    """Every rank's pieces in the program's layout, and this rank's balanced plan when one pays."""
    layout = [segments(r, chunk, ring.world, zigzag, sizes) for r in range(ring.world)]
    if mask is None or balance <= 0:
        return layout, None
    plan = balancing.plan(mask, causal, window, layout, ring.rank, balance)
    if plan is not None:
        BLOCK_COUNTS[phase, "balanced" if plan.moves else "finer tiles"] += 1
    return layout, plan


def _keys(
    plan: balancing.Plan | None, q_piece: tuple[int, int, int], k_pieces: list[tuple[int, int, int]]
) -> list[tuple[int, int, int]]:
    # With a plan, only the key chunks the query chunk meets, in runs: empty tiles cost no call.
    return k_pieces if plan is None else plan.k_runs(q_piece, k_pieces)


def _block(
    mask: Tensor | None, qo: int, ql: int, ko: int, kl: int, is_causal: bool, window: int, device: torch.device
) -> Tile | None:
    """How block (query rows [qo, qo+ql), keys [ko, ko+kl)) is masked; None when no pair is left.

    A mask tile joins the causal/window pattern with the model mask's tile at those global positions;
    a block the pattern leaves whole takes none, a diagonal one the kernel's own causal masking.
    """
    tile = None if mask is None else mask[:, :, qo : qo + ql, ko : ko + kl]
    pairs = allowed_pairs(qo, ql, ko, kl, is_causal, window)
    if pairs == 0 or not tile_needed(tile):
        return None
    if pairs == ql * kl:
        return Tile(mask=tile)
    if tile is None and qo == ko and ql == kl and pairs == ql * (ql + 1) // 2:
        return Tile(causal=True)  # the window, if any, reaches past the block: plain causal
    return Tile(mask=tile_mask(block_mask(qo, ql, ko, kl, is_causal, window, device), tile))


def _pieces(q: Tensor, k: Tensor, v: Tensor, rows: slice, cols: slice) -> tuple[Tensor, Tensor, Tensor]:
    # Zigzag pieces are strided views; copies cost O(L*D), nothing next to a block's O(L*L*D).
    return q[:, :, rows].contiguous(), k[:, :, cols].contiguous(), v[:, :, cols].contiguous()


def _name(fused: kernels.FusedKernel | None, kernel: Any) -> str:
    if fused is not None:
        return fused.name
    return "fp32 math" if kernel is None or kernel is FUSED_KERNEL else kernel.name


def _unbroadcast(grad: Tensor, shape: torch.Size) -> Tensor:
    """Sum a [B, H, ...] block gradient over the axes where the mask has size 1."""
    dims = [d for d in (0, 1) if shape[d] == 1 and grad.shape[d] != 1]
    return grad.sum(dims, keepdim=True) if dims else grad


def _setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    q, k, v, ctx.is_causal, ctx.scale, ctx.window, ctx.zigzag, ctx.group_name, mask, ctx.balance, ctx.sizes = inputs
    ctx.has_mask = mask is not None
    ctx.save_for_backward(q, k, v, *output, *([mask] if mask is not None else []))


def _backward(ctx: Any, dout: Tensor, dlse: Tensor | None):
    # lse is an auxiliary output for merging; AutoSP never differentiates through it.
    q, k, v, out, lse, *rest = ctx.saved_tensors
    mask = rest[0] if ctx.has_mask else None
    # A bias computed from parameters (ALiBi slopes, T5 buckets) needs its gradient; a constant mask not.
    mask_grad = bool(mask is not None and mask.is_floating_point() and ctx.needs_input_grad[8])
    dq, dk, dv, dmask = torch.ops.autosp_ring.ring_attention_backward(
        dout.contiguous(),
        q,
        k,
        v,
        out,
        lse,
        ctx.is_causal,
        ctx.scale,
        ctx.window,
        ctx.zigzag,
        ctx.group_name,
        mask,
        mask_grad,
        ctx.balance,
        ctx.sizes,
    )
    return dq, dk, dv, None, None, None, None, None, dmask if mask_grad else None, None, None


ring_attention.register_autograd(_backward, setup_context=_setup)

__all__ = ["BLOCK_COUNTS", "num_steps", "ring_attention", "ring_attention_backward", "segments"]
