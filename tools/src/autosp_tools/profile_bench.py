"""The measurements of ``autosp-profile``: collectives over message sizes, matmul and attention throughput.

Every timing is the slowest rank's (an all-reduce of MAX), median over repeats, after a warm-up,
with the device synchronised around it: what a step waits for.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from autosp.hardware import COLLECTIVES, CollectiveKind


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device, repeats: int, group: dist.ProcessGroup | None) -> float:
    """Median seconds of ``fn`` over ``repeats`` runs, each the slowest rank's."""
    fn()  # warm-up: first-call allocation, communicator set-up, kernel selection
    times = []
    for _ in range(repeats):
        if group is not None:
            dist.barrier(group)
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        if group is not None:
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
        times.append(float(elapsed))
    return statistics.median(times)


def collective(
    kind: CollectiveKind, nbytes: int, device: torch.device, group: dist.ProcessGroup
) -> Callable[[], object]:
    """One ``kind`` collective with ``nbytes`` in each rank's input (as ``HardwareProfile`` counts them)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    n = max(world, nbytes // 4 // world * world)  # float32 elements, divisible by the group
    x = torch.ones(n, dtype=torch.float32, device=device)
    if kind == "all_to_all":
        out = torch.empty_like(x)
        return lambda: dist.all_to_all_single(out, x, group=group)
    if kind == "all_gather":
        out = torch.empty(n * world, dtype=torch.float32, device=device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
        return lambda: gather(out, x, group=group)
    if kind == "p2p":
        # One ring hop, as ring attention makes it: send to the next rank, receive from the previous.
        recv = torch.empty_like(x)
        nxt = dist.get_global_rank(group, (rank + 1) % world)
        prv = dist.get_global_rank(group, (rank - 1) % world)

        def hop() -> None:
            ops = [dist.P2POp(dist.isend, x, nxt, group), dist.P2POp(dist.irecv, recv, prv, group)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()

        return hop
    raise ValueError(f"unknown collective {kind!r}; one of {COLLECTIVES}")


def matmul_flops(
    dtype: torch.dtype, n: int, device: torch.device, repeats: int, group: dist.ProcessGroup | None
) -> float:
    """Dense [n, n] @ [n, n] FLOP/s at ``dtype``, every rank at once (as in training)."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    seconds = timed(lambda: a @ b, device, repeats, group)
    return 2.0 * n**3 / seconds


def attention_flops(
    dtype: torch.dtype,
    seq: int,
    heads: int,
    head_dim: int,
    device: torch.device,
    repeats: int,
    group: dist.ProcessGroup | None,
) -> float:
    """Causal SDPA FLOP/s at ``dtype``, forward and backward: 3.5x the forward's 2*H*S*S*D over their time."""
    q, k, v = (torch.randn(1, heads, seq, head_dim, device=device).to(dtype).requires_grad_() for _ in range(3))

    def step() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    seconds = timed(step, device, repeats, group)
    return 3.5 * 2.0 * heads * seq * seq * head_dim / seconds


def ring_block_flops(
    seq: int, heads: int, head_dim: int, device: torch.device, repeats: int, group: dist.ProcessGroup | None
) -> float | None:
    """FLOP/s of autosp-ring's fp32 blocks (forward and backward, 3.5x the forward's 4*H*L*L*D); None without it."""
    try:
        from autosp_ring.blocks import block_backward, block_forward
    except ImportError:
        return None
    q, k, v = (torch.randn(1, heads, seq, head_dim, device=device) for _ in range(3))
    scale = head_dim**-0.5

    def block() -> None:
        out, lse = block_forward(q, k, v, scale, None)
        block_backward(q, k, v, out, lse, (out * out).sum(-1), scale, None)

    seconds = timed(block, device, repeats, group)
    return 3.5 * 4.0 * heads * seq * seq * head_dim / seconds


__all__ = ["attention_flops", "collective", "matmul_flops", "ring_block_flops", "timed"]
