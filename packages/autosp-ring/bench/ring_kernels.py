"""Ring attention on fused block kernels against the fp32 block math (the ring before them), side by side.

One compiled model per (backend, length) runs both: the block kernel is chosen inside the ring op at
run time, so ``set_block_kernel`` switches it between steps.  Steps alternate, so load on the machine
hits both alike.  Also the largest tensor any aten op makes inside one ring op, forward and backward:
a block's [B, H, Lq, Lk] fp32 scores for the math, O(S*D) for the fused kernel.

    python packages/autosp-ring/bench/ring_kernels.py --world 2 --seq 4096 8192 --backend aot_eager inductor
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "integration_tests"))


class Largest(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.bytes = max(self.bytes, t.numel() * t.element_size())
        return out


def _kernels():
    from autosp_ring.blocks import FUSED_KERNEL, REFERENCE_KERNEL

    return {"fused": FUSED_KERNEL, "fp32 math": REFERENCE_KERNEL}


def largest_tensor(seq: int, heads: int, head_dim: int) -> dict[str, int]:
    """Bytes of the largest tensor made in one ring op (forward and backward) on this rank's chunk."""
    from autosp_ring.blocks import set_block_kernel
    from autosp_ring.op import ring_attention, ring_attention_backward

    world, group = dist.get_world_size(), dist.group.WORLD.group_name
    q, k, v, dout = (torch.randn(1, heads, seq // world, head_dim) for _ in range(4))
    result = {}
    for name, kernel in _kernels().items():
        previous = set_block_kernel(kernel)
        with Largest() as seen:
            out, lse = ring_attention._init_fn(q, k, v, True, head_dim**-0.5, 0, True, group)
            ring_attention_backward._init_fn(dout, q, k, v, out, lse, True, head_dim**-0.5, 0, True, group)
        set_block_kernel(previous)
        result[name] = seen.bytes
    return result


def step_times(seq: int, backend: str, repeats: int, dim: int, heads: int) -> dict[str, float]:
    import autosp
    from autosp.testing import Config, LlamaLike
    from autosp_ring.blocks import set_block_kernel

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = LlamaLike(Config(dim=dim, heads=heads, kv_heads=heads // 2, hidden=2 * dim, max_len=seq))
    compiled = autosp.compile(model, sp_size=dist.get_world_size(), variant="ring", backend=backend, fullgraph=True)
    ids = torch.randint(0, 96, (1, seq), generator=torch.Generator().manual_seed(1))
    times: dict[str, list[float]] = {name: [] for name in _kernels()}
    for r in range(repeats + 1):  # the first round compiles and warms up
        for name, kernel in _kernels().items():
            previous = set_block_kernel(kernel)
            dist.barrier()
            t0 = time.perf_counter()
            compiled(ids, ids).backward()
            dist.barrier()
            elapsed = time.perf_counter() - t0
            set_block_kernel(previous)
            model.zero_grad(set_to_none=True)
            if r:
                times[name].append(elapsed)
    return {name: statistics.median(t) for name, t in times.items()}


def worker(rank: int, world: int, seqs: list[int], backends: list[str], repeats: int, dim: int, heads: int):
    rows = []
    for seq in seqs:
        mem = largest_tensor(seq, heads, dim // heads)
        for backend in backends:
            rows.append((seq, backend, step_times(seq, backend, repeats, dim, heads), mem))
    return rows


def main() -> None:
    from harness import run_spmd

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--seq", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--backend", nargs="+", default=["aot_eager", "inductor"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    a = p.parse_args()
    rows = run_spmd(worker, a.world, a.seq, a.backend, a.repeats, a.dim, a.heads)[0]
    print(f"ring, {a.world} ranks, LlamaLike dim={a.dim} heads={a.heads} (GQA {a.heads}:{a.heads // 2}), 2 layers, B=1")
    print(
        "seq    backend    step fused  step fp32 math  ratio (math/fused)  largest tensor in one ring op fused / math"
    )
    for seq, backend, t, mem in rows:
        print(
            f"{seq:<6} {backend:<10} {t['fused']:9.3f}s  {t['fp32 math']:12.3f}s  {t['fp32 math'] / t['fused']:12.2f}x"
            f"        {mem['fused'] / 2**20:7.2f} MiB / {mem['fp32 math'] / 2**20:7.2f} MiB"
        )


if __name__ == "__main__":
    main()
