"""Ring attention's work per rank on packed documents: the program's zigzag layout against the plan
that balances query rows by the mask (``autosp_ring.balance``).

    python tools/scripts/ring_balance.py [--seq 8192] [--worlds 2 4 8] [--rows 20] [--chunk 512]
    python tools/scripts/ring_balance.py --measure [--seq 8192] [--sp 2] [--chunk 512]

The first form counts, for rows of documents with exponentially distributed lengths (several
means), the tile area each rank's kernels compute (the mask leaves a pair in the tile: computed
whole; else skipped), and prints max/mean over ranks: mean and worst over the rows.

``--measure`` times the ring op itself (forward and backward, fp32, CPU flash kernel, 8 heads of 64)
on ``--sp`` gloo processes (FileStore, no ports), with a skewed row (causal documents of 3/4 and 1/4
of it), plan off and on, alternating, and prints each rank's median time and the loss of precision (max |diff|
between the two outputs and gradients). Each rank should have a core of its own.
"""

from __future__ import annotations

import argparse
import datetime
import os
import random
import statistics
import sys
import tempfile
import time


def spread(work: list[int]) -> float:
    return max(work) / (sum(work) / len(work))


def model_table(args: argparse.Namespace) -> None:
    from autosp_ring import balance as B
    from autosp_ring.op import segments
    from autosp_ring.work import document_mask, random_documents

    rng = random.Random(0)
    print(f"S={args.seq}, chunks of >= {args.chunk} tokens, {args.rows} rows per line; max/mean tile area over ranks")
    print("| P | mean document | zigzag: mean / worst | plan: mean / worst | plan's area / zigzag's (slowest rank) |")
    print("|---|---|---|---|---|")
    for world in args.worlds:
        layout = [segments(r, args.seq // world, world, True) for r in range(world)]
        for mean in (256, 1024, 4096, args.seq // 2):
            before, after, gain = [], [], []
            for _ in range(args.rows):
                mask = document_mask(random_documents(args.seq, mean, rng))
                plan = B.plan(mask, True, 0, layout, 0, args.chunk)
                chunk = B.chunk_size([p for ps in layout for p in ps], args.chunk)
                grid = B.tile_grid(mask, True, 0, chunk)
                keys = [p for ps in layout for p in ps]
                b = [B.piece_work(grid, chunk, ps, keys) for ps in layout]
                a = plan.work[1] if plan is not None else b  # no plan: the program's layout runs
                before.append(spread(b))
                after.append(spread(a))
                gain.append(max(a) / max(b))
            print(
                f"| {world} | {mean} | {statistics.mean(before):.3f} / {max(before):.3f} | "
                f"{statistics.mean(after):.3f} / {max(after):.3f} | {statistics.mean(gain):.2f} |"
            )


def _rank(rank: int, world: int, store: str, seq: int, reps: int, chunk: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional  # noqa: F401

    import autosp_ring  # noqa: F401 - the op
    from autosp_ring import BLOCK_COUNTS
    from autosp_ring.op import segments
    from autosp_ring.work import document_mask

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", store=dist.FileStore(store, world), rank=rank, world_size=world, timeout=datetime.timedelta(600)
    )
    heads, dim = 8, 64
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, heads, seq, dim, generator=gen) for _ in range(4))
    mask = document_mask([3 * seq // 4, seq - 3 * seq // 4])
    pieces = segments(rank, seq // world, world, True)

    def local(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t[:, :, g : g + n] for g, n, _ in pieces], dim=2)

    def once(balance: int) -> tuple[float, list[torch.Tensor]]:
        ql, kl, vl = (local(t).requires_grad_() for t in (q, k, v))
        dist.barrier()
        start = time.perf_counter()
        o, _ = torch.ops.autosp_ring.ring_attention(
            ql, kl, vl, True, dim**-0.5, 0, True, dist.group.WORLD.group_name, mask, balance
        )
        o.backward(local(dout))
        took = time.perf_counter() - start
        return took, [o.detach(), ql.grad, kl.grad, vl.grad]

    times: dict[int, list[float]] = {0: [], chunk: []}
    results = {}
    once(0), once(chunk)  # warm-up
    for _ in range(reps):
        for balance in (0, chunk):
            BLOCK_COUNTS.clear()
            took, results[balance] = once(balance)
            times[balance].append(took)
    diff = max((a - b).abs().max().item() for a, b in zip(results[0], results[chunk], strict=True))
    with open(os.path.join(out, f"{rank}.txt"), "w") as f:
        f.write(f"{statistics.median(times[0])} {statistics.median(times[chunk])} {diff}\n")
    dist.destroy_process_group()


def measure(args: argparse.Namespace) -> None:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        mp.spawn(_rank, args=(args.sp, store, args.seq, args.reps, args.chunk, tmp), nprocs=args.sp, join=True)
        rows = [open(os.path.join(tmp, f"{r}.txt")).read().split() for r in range(args.sp)]
    print(
        f"ring op, fp32, S={args.seq}, P={args.sp}, causal documents of 3/4 and 1/4 of the row, median of {args.reps}"
    )
    print("| rank | zigzag s | plan s | plan / zigzag |")
    print("|---|---|---|---|")
    for r, (off, on, _) in enumerate(rows):
        print(f"| {r} | {float(off):.3f} | {float(on):.3f} | {float(on) / float(off):.2f} |")
    print(f"max |difference| of output and gradients between the two: {max(float(d) for *_, d in rows):.2e}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--rows", type=int, default=20)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--measure", action="store_true")
    parser.add_argument("--sp", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)
    if args.measure:
        measure(args)
    else:
        model_table(args)


if __name__ == "__main__":
    sys.exit(main())
