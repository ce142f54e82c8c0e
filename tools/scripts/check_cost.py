"""What AutoSP's per-call checks cost a training step: check_inputs "tokens" (the default), "shapes"
and False (none), compiled side by side on 2 gloo CPU ranks, their steps interleaved.

    python tools/scripts/check_cost.py [--seq 256] [--layers 2] [--steps 30]

Each step is a forward and a backward: the input check's all-gather (with the weights' and the
generators' digests), the run exchange of each graph, and the backward's step check (the same
all-gather, with the incoming gradient's sums). Prints the median step of each mode, rank 0.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

MODES = ("tokens", "shapes", False)


@dataclass
class _Cfg:
    seq: int
    layers: int
    steps: int
    nproc: int = 2


def _rank(cfg: _Cfg, rank: int, world: int) -> str:
    import autosp
    from autosp.testing.models import Config, LlamaLike

    ids = torch.randint(0, 96, (1, cfg.seq), generator=torch.Generator().manual_seed(0))
    models = {}
    for mode in MODES:
        torch.manual_seed(0)
        models[mode] = autosp.compile(LlamaLike(Config(layers=cfg.layers)), backend="aot_eager", check_inputs=mode)
        models[mode](ids, ids).backward()  # compile
    times: dict[object, list[float]] = {m: [] for m in MODES}
    for _ in range(cfg.steps):
        for mode, model in models.items():
            dist.barrier()
            start = time.perf_counter()
            model(ids, ids).backward()
            times[mode].append(time.perf_counter() - start)
    line = ", ".join(f"check_inputs={m!r}: {statistics.median(t) * 1e3:.2f} ms" for m, t in times.items())
    return f"median step of {cfg.steps} (S={cfg.seq}, {cfg.layers} layers): {line}"


def main() -> int:
    from autosp_tools.launch import launch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    print(launch(_rank, _Cfg(args.seq, args.layers, args.steps)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
