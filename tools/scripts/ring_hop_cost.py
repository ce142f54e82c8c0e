"""What one ring hop costs on gloo CPU ranks: the all-to-all the ring sends its hops with on gloo
(its wait can be polled for a failed peer, ``autosp.peer_failure``) against point-to-point
isend/irecv (what the ring uses on other backends), side by side in one run.

    python tools/scripts/ring_hop_cost.py [--nproc 2] [--mib 0.25 8] [--hops 10]

Each hop sends a buffer to rank+1 and receives one from rank-1, as every ring step does; the ranks
meet in a barrier before each. Prints rank 0's best median of three rounds per transport.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class _Cfg:
    mib: tuple[float, ...]
    hops: int
    nproc: int = 2


def _p2p(buf: torch.Tensor, recv: torch.Tensor, rank: int, world: int) -> None:
    ops = [
        dist.P2POp(dist.isend, buf, (rank + 1) % world, None, 7),
        dist.P2POp(dist.irecv, recv, (rank - 1) % world, None, 7),
    ]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def _rank(cfg: _Cfg, rank: int, world: int) -> list[str]:
    from autosp_ring.op import _Ring

    ring = _Ring(dist.group.WORLD.group_name)  # type: ignore[union-attr]
    lines = []
    for mib in cfg.mib:
        buf = torch.randn(int(mib * 2**20) // 4)
        recv = torch.empty_like(buf)
        hops = {
            "all-to-all (the ring on gloo)": lambda: ring.finish(ring.start(buf, 1, 7)),
            "isend/irecv": lambda: _p2p(buf, recv, rank, world),
        }
        best: dict[str, float] = {}
        for _ in range(3):
            for name, hop in hops.items():
                times = []
                for _ in range(cfg.hops):
                    dist.barrier()
                    start = time.perf_counter()
                    hop()
                    times.append(time.perf_counter() - start)
                best[name] = min(best.get(name, float("inf")), statistics.median(times))
        a2a, p2p = best.values()
        lines.append(
            f"P={world} {mib:g} MiB: all-to-all {a2a * 1e3:.3f} ms, isend/irecv {p2p * 1e3:.3f} ms ({a2a / p2p:.2f}x)"
        )
    return lines


def main() -> int:
    from autosp_tools.launch import launch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--mib", type=float, nargs="+", default=[0.25, 8.0])
    ap.add_argument("--hops", type=int, default=10)
    args = ap.parse_args()
    print("\n".join(launch(_rank, _Cfg(tuple(args.mib), args.hops, args.nproc))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
