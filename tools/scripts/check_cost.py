"""What AutoSP's per-call checks cost a training step: check_inputs "tokens" (the default), "shapes"
and False (none), compiled side by side on 2 gloo CPU ranks, their steps interleaved.

    python tools/scripts/check_cost.py [--seq 256] [--layers 2] [--steps 30]

Each step is a forward and a backward: the input check's all-gather (with the weights' and the
generators' digests), the run exchange of each graph, and the backward's step check (the same
all-gather, with the incoming gradient's sums). Prints the median step of each mode, rank 0.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MODES = ("tokens", "shapes", False)


def _rank(rank: int, world: int, store: str, out: str, args: argparse.Namespace) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=300)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world, timeout=timeout)
    try:
        import autosp
        from autosp.testing.models import Config, LlamaLike

        ids = torch.randint(0, 96, (1, args.seq), generator=torch.Generator().manual_seed(0))
        models = {}
        for mode in MODES:
            torch.manual_seed(0)
            models[mode] = autosp.compile(LlamaLike(Config(layers=args.layers)), backend="aot_eager", check_inputs=mode)
            models[mode](ids, ids).backward()  # compile
        times: dict[object, list[float]] = {m: [] for m in MODES}
        for _ in range(args.steps):
            for mode, model in models.items():
                dist.barrier()
                start = time.perf_counter()
                model(ids, ids).backward()
                times[mode].append(time.perf_counter() - start)
        if rank == 0:
            line = ", ".join(f"check_inputs={m!r}: {statistics.median(t) * 1e3:.2f} ms" for m, t in times.items())
            Path(out).write_text(f"median step of {args.steps} (S={args.seq}, {args.layers} layers): {line}")
    finally:
        dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out")
        mp.start_processes(_rank, args=(2, os.path.join(tmp, "store"), out, args), nprocs=2, start_method="spawn")
        print(Path(out).read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
