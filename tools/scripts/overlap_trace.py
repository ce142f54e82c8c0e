"""All-to-all in flight while attention and matmuls run: a profiler trace on 2 gloo CPU ranks.

    python tools/scripts/overlap_trace.py [--seq 4096] [--layers 4] [--steps 3] [--backends aot_eager,inductor]

For each backend, the Llama-style model of ``autosp.testing`` is compiled once per mode on the same
two ranks: ``off`` (``ulysses_chunks=1`` and the overlap passes disabled: every all-to-all waited
on at once, as before), ``on`` (``ulysses_chunks=2``, the passes on) and, with ``--modes
off,pass,on``, ``pass`` (the passes alone). Steps of the modes alternate, so all see the same
machine load. One profiled step of each gives:

* in flight: time between each exchange's start (``autosp::all_to_all``) and the end of its wait
  (``autosp::wait_exchange``), summed over exchanges;
* overlapped: time of matmuls and attention kernels inside those windows (what ran while the
  data was in flight);
* blocked: time spent inside the waits (the communication not hidden);

and the median step time of each. ``--trace DIR`` writes the Chrome traces (rank 0).

``--device cuda`` runs both ranks on GPU 0 (what a one-GPU machine allows: the exchanges go
through gloo, not NCCL) and counts as overlapped the CUDA kernels (copies excluded) that ran on
the device inside the windows, from the profiler's CUDA activity.
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
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COMPUTE = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "scaled_dot_product", "attention")
MODES = {
    "off": {"variant_options": {"ulysses_chunks": 1}, "disable_passes": ("autosp.overlap", "autosp.overlap_backward")},
    "pass": {"variant_options": {"ulysses_chunks": 1}},  # the overlap passes alone, one head group
    "on": {"variant_options": {"ulysses_chunks": 2}},
}


def _intervals(
    prof: Any, on_gpu: bool = False
) -> tuple[list[tuple[float, float]], list[tuple[float, float]], list[tuple[float, float]]]:
    """(in-flight windows, wait intervals, compute intervals) in microseconds; windows and waits
    from the main thread, compute from it too or, ``on_gpu``, from the CUDA kernels."""
    everything = list(prof.events())
    events = sorted(
        (e for e in everything if e.device_type == torch.autograd.DeviceType.CPU), key=lambda e: e.time_range.start
    )
    starts = [e for e in events if e.name == "autosp::all_to_all"]
    waits = [e for e in events if e.name == "autosp::wait_exchange"]
    # Each wait with the earliest unmatched start before it (the pass keeps starts and waits in order).
    windows = []
    timeline = sorted([(s.time_range.start, 0, s) for s in starts] + [(w.time_range.start, 1, w) for w in waits])
    pending: list[Any] = []
    for _, kind, e in timeline:
        if kind == 0:
            pending.append(e)
        elif pending:
            s = pending.pop(0)
            windows.append((s.time_range.start, e.time_range.end))
    blocked = [(w.time_range.start, w.time_range.end) for w in waits]
    if on_gpu:
        kernels = [
            (e.time_range.start, e.time_range.end)
            for e in everything
            if e.device_type == torch.autograd.DeviceType.CUDA and not any(k in e.name for k in ("Memcpy", "Memset"))
        ]
        return windows, blocked, _union(kernels)
    compute = [
        (e.time_range.start, e.time_range.end)
        for e in events
        if any(k in e.name for k in COMPUTE) and not e.name.startswith("autosp::")
    ]
    return windows, blocked, _outermost(compute)


def _outermost(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Drop spans nested in another (an aten::mm inside aten::addmm's dispatch, say)."""
    out: list[tuple[float, float]] = []
    for s, e in sorted(spans):
        if out and e <= out[-1][1]:
            continue
        out.append((s, e))
    return out


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for s, e in sorted(spans):
        if merged and s <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], e))
        else:
            merged.append((s, e))
    return merged


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    total = 0.0
    for s1, e1 in _union(a):
        for s2, e2 in b:
            total += max(0.0, min(e1, e2) - max(s1, s2))
    return total


def _step(model: Any, ids: torch.Tensor) -> None:
    model(ids, ids).backward()
    if ids.is_cuda:
        torch.cuda.synchronize(ids.device)


def _measure(model: Any, ids: torch.Tensor) -> dict[str, float]:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if ids.is_cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        _step(model, ids)
    windows, blocked, compute = _intervals(prof, on_gpu=ids.is_cuda)
    return {
        "exchanges": len(windows),
        "in_flight_ms": sum(e - s for s, e in windows) / 1e3,
        "overlapped_ms": _overlap(windows, compute) / 1e3,
        "blocked_ms": sum(e - s for s, e in blocked) / 1e3,
        "prof": prof,
    }


def _rank(rank: int, world: int, store_path: str, out: str, args: argparse.Namespace) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=900))
    try:
        import autosp
        from autosp.testing.models import Config, LlamaLike

        cfg = Config(
            vocab=256, dim=args.dim, heads=args.heads, kv_heads=args.kv_heads, layers=args.layers, hidden=2 * args.dim
        )
        cfg.max_len = args.seq
        device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
        ids = torch.randint(0, cfg.vocab, (1, args.seq), generator=torch.Generator().manual_seed(0)).to(device)
        lines = []
        for backend in args.backends.split(","):
            models = {}
            modes = args.modes.split(",")
            for mode in modes:
                opts = MODES[mode]
                torch.manual_seed(0)
                model = LlamaLike(cfg).to(device)
                models[mode] = autosp.compile(model, backend=backend, sac=False, fullgraph=True, **opts)
                _step(models[mode], ids)  # compile and warm up
            times: dict[str, list[float]] = {m: [] for m in modes}
            for _ in range(args.steps):
                for mode in modes:
                    dist.barrier()
                    t0 = time.perf_counter()
                    _step(models[mode], ids)
                    times[mode].append(time.perf_counter() - t0)
            stats = {}
            for mode in modes:
                dist.barrier()
                stats[mode] = _measure(models[mode], ids)
                if args.trace and rank == 0:
                    Path(args.trace).mkdir(parents=True, exist_ok=True)
                    stats[mode]["prof"].export_chrome_trace(str(Path(args.trace) / f"{backend}-{mode}.json"))
            for mode in modes:
                s = stats[mode]
                lines.append(
                    f"{backend:9s} {mode:4s}: step {statistics.median(times[mode]) * 1e3:8.1f} ms (median of "
                    f"{args.steps}), {s['exchanges']:3d} exchanges, in flight {s['in_flight_ms']:7.1f} ms, "
                    f"matmul/attention inside {s['overlapped_ms']:7.1f} ms, blocked in waits {s['blocked_ms']:7.1f} ms"
                )
            base = statistics.median(times[modes[0]])
            ratios = ", ".join(f"{m} {statistics.median(times[m]) / base:.3f}" for m in modes[1:])
            lines.append(f"{backend:9s} step time relative to {modes[0]}: {ratios}")
            if device.type == "cuda":
                lines.append(f"{backend:9s} (CUDA: 'matmul/attention inside' is every CUDA kernel but copies)")
        Path(out, f"{rank}.txt").write_text("\n".join(lines))
    finally:
        dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--backends", default="aot_eager,inductor")
    ap.add_argument(
        "--modes",
        default="off,on",
        help="off: one head group, no overlap pass (as before); pass: the overlap passes alone; on: 2 head groups",
    )
    ap.add_argument("--trace", default=None, help="directory for rank 0's Chrome traces")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cuda: both ranks on GPU 0")
    args = ap.parse_args()
    unknown = [m for m in args.modes.split(",") if m not in MODES]
    if unknown or not args.modes:
        ap.error(f"--modes: unknown {unknown}; choose from {sorted(MODES)}")
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _rank, args=(2, os.path.join(tmp, "store"), tmp, args), nprocs=2, start_method="spawn", join=True
        )
        for r in range(2):
            print(f"rank {r}:")
            print(Path(tmp, f"{r}.txt").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
