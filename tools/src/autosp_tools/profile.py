"""``autosp-profile``: measure this machine's SP group and write a hardware profile as JSON.

    autosp-profile --nproc 2 --out node.json              # 2 gloo processes on this CPU
    torchrun --nproc-per-node 8 -m autosp_tools.profile --out node.json   # the GPUs of a node

It measures all-to-all, all-gather and one ring hop (point-to-point) over message sizes, dense
matmul and causal attention throughput per dtype, autosp-ring's block kernel when installed, and writes a profile that names the built-in
(or plugin) profile it refines as ``base``: ``autosp.compile(..., hardware="node.json")`` then uses
the measured figures and the base's for the rest (memory size, topology, kernel facts).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pickle
import platform
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from autosp.hardware import COLLECTIVES, CommModel, dtype_name
from autosp.hardware_io import FORMAT
from autosp_tools import profile_bench as bench

UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}
DEFAULTS = {  # device type -> (sizes, dtypes, matmul n, attention (seq, heads, head dim))
    "cpu": ("4K,64K,1M", "float32", 256, (512, 4, 64)),
    "cuda": ("64K,1M,16M,128M", "bfloat16,float32", 8192, (8192, 16, 128)),
}


def parse_size(text: str) -> int:
    t = text.strip().upper().removesuffix("B")
    unit = t[-1] if t and t[-1] in UNITS else ""
    try:
        value = float(t[: len(t) - len(unit)])
    except ValueError:
        raise argparse.ArgumentTypeError(f"size {text!r}: give bytes like 4096, 64K, 1M") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size {text!r} must be > 0")
    return int(value * UNITS[unit])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="autosp-profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2, help="processes to spawn (gloo, CPU) when not under torchrun")
    p.add_argument("--out", default="autosp-profile.json", help="where to write the JSON profile")
    p.add_argument("--name", help="profile name (default: <base>-measured)")
    p.add_argument("--base", help="profile the measurement refines (default: the detected one)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--sizes", help="bytes per rank per collective, comma-separated (4K,1M,...)")
    p.add_argument("--dtypes", help="matmul/attention dtypes, comma-separated (bfloat16,float32)")
    p.add_argument("--matmul-n", type=int, help="n of the [n, n] @ [n, n] matmul")
    p.add_argument("--attention", help="SEQ,HEADS,HEAD_DIM of the causal SDPA measured")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per measurement (median taken)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before a collective gives up")
    return p


def _config(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> argparse.Namespace:
    device = ns.device if ns.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no GPU is visible to PyTorch; use --device cpu")
    sizes, dtypes, n, attention = DEFAULTS[device]
    ns.device_type = device
    try:
        ns.size_list = sorted({parse_size(s) for s in (ns.sizes or sizes).split(",") if s.strip()})
    except argparse.ArgumentTypeError as e:
        parser.error(str(e))
    ns.dtype_list = [d.strip() for d in (ns.dtypes or dtypes).split(",") if d.strip()]
    for d in ns.dtype_list:
        if not isinstance(getattr(torch, d, None), torch.dtype) or not getattr(torch, d).is_floating_point:
            parser.error(f"--dtypes: {d!r} is not a floating torch dtype (float32, bfloat16, float16)")
    ns.matmul_n = ns.matmul_n or n
    try:
        ns.attn = tuple(int(x) for x in ns.attention.split(",")) if ns.attention else attention
    except ValueError:
        parser.error(f"--attention {ns.attention!r}: give SEQ,HEADS,HEAD_DIM, e.g. 1024,8,64")
    if len(ns.attn) != 3 or min(ns.attn) < 1:
        parser.error(f"--attention {ns.attention!r}: give three positive ints SEQ,HEADS,HEAD_DIM")
    if not ns.size_list:
        parser.error("--sizes: give at least one size")
    for flag, value in (("--nproc", ns.nproc), ("--repeats", ns.repeats), ("--matmul-n", ns.matmul_n)):
        if value < 1:
            parser.error(f"{flag} {value}: must be >= 1")
    if ns.timeout <= 0:
        parser.error(f"--timeout {ns.timeout}: must be > 0 seconds")
    return ns


def measure(cfg: argparse.Namespace, rank: int, world: int) -> dict[str, Any]:
    """Everything measured on this rank's view (times are the slowest rank's)."""
    device = (
        torch.device(cfg.device_type, int(os.environ.get("LOCAL_RANK", rank)) % max(1, torch.cuda.device_count()))
        if cfg.device_type == "cuda"
        else torch.device("cpu")
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    group = dist.group.WORLD if world > 1 else None
    comm: dict[str, list[tuple[int, float]]] = {}
    if group is not None:
        for kind in COLLECTIVES:
            comm[kind] = [
                (n, bench.timed(bench.collective(kind, n, device, group), device, cfg.repeats, group))
                for n in cfg.size_list
            ]
    seq, heads, head_dim = cfg.attn
    matmul = {
        d: bench.matmul_flops(getattr(torch, d), cfg.matmul_n, device, cfg.repeats, group) for d in cfg.dtype_list
    }
    attention = {
        d: bench.attention_flops(getattr(torch, d), seq, heads, head_dim, device, cfg.repeats, group)
        for d in cfg.dtype_list
    }
    ring = bench.ring_block_flops(max(1, seq // 2), heads, head_dim, device, cfg.repeats, group)
    from autosp.hardware_select import resolve
    from autosp.registry import get_registry

    base, _ = resolve(cfg.base, device, get_registry())
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    return {
        "comm": comm,
        "matmul": matmul,
        "attention": attention,
        "ring_block": ring,
        "base": base.name,
        "device": name,
        "world": world,
    }


def to_profile(cfg: argparse.Namespace, m: dict[str, Any]) -> dict[str, Any]:
    """The JSON profile: measured figures over the named base profile."""
    world = m["world"]
    comm = {}
    for kind, points in m["comm"].items():
        fit = CommModel.fit([(float(b), t) for b, t in points], world, kind)
        comm[kind] = {
            "latency": fit.latency,
            "bandwidth": fit.bandwidth,
            "world": world,
            "points": [[b, t] for b, t in fit.points],
        }
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return {
        "format": FORMAT,
        "name": cfg.name or f"{m['base']}-measured",
        "base": m["base"],
        "source": f"autosp-profile on {platform.node()} ({m['device']}), {world} ranks, torch {torch.__version__}, {when}",
        "matmul_flops": {dtype_name(d): v for d, v in m["matmul"].items()},
        "attention_flops": {dtype_name(d): v for d, v in m["attention"].items()},
        # The ring op's blocks (autosp-ring installed): what variant="auto" weighs ring and hybrid by.
        "kernel_flops": {"ring-block/float32": m["ring_block"]} if m["ring_block"] else {},
        "comm": comm,
    }


def summary(profile: dict[str, Any]) -> str:
    lines = [f"{profile['name']} (base {profile['base']}): {profile['source']}"]
    for d, v in profile["matmul_flops"].items():
        lines.append(
            f"  matmul {d}: {v / 1e12:.3g} TFLOP/s; attention {profile['attention_flops'][d] / 1e12:.3g} TFLOP/s"
        )
    for k, v in profile["kernel_flops"].items():
        lines.append(f"  {k}: {v / 1e12:.3g} TFLOP/s")
    for kind, c in profile["comm"].items():
        pts = ", ".join(f"{b / 2**10:.0f} KiB {t * 1e6:.0f} us" for b, t in c["points"])
        lines.append(f"  {kind}: latency {c['latency'] * 1e6:.1f} us, {c['bandwidth'] / 1e9:.3g} GB/s ({pts})")
    return "\n".join(lines)


def _worker(rank: int, world: int, store_path: str, out: str, cfg: argparse.Namespace) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=cfg.timeout)
    )
    try:
        result: Any = ("ok", measure(cfg, rank, world))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which names the rank
        result = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    finally:
        dist.destroy_process_group()
    if rank == 0 or result[0] == "error":
        Path(out, f"{rank}.pkl").write_bytes(pickle.dumps(result))


def _spawn(cfg: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="autosp-profile-") as tmp:
        store = os.path.join(tmp, "store")
        try:
            mp.start_processes(_worker, args=(cfg.nproc, store, tmp, cfg), nprocs=cfg.nproc, start_method="spawn")
        except mp.ProcessRaisedException as e:  # pragma: no cover - the worker catches its own errors
            raise SystemExit(f"autosp-profile: a rank failed: {e}") from e
        results = {int(p.stem): pickle.loads(p.read_bytes()) for p in Path(tmp).glob("*.pkl")}
    errors = [f"rank {r}: {msg}" for r, (status, msg) in sorted(results.items()) if status == "error"]
    if errors:
        raise SystemExit("autosp-profile failed:\n" + "\n".join(errors))
    return results[0][1]


def _torchrun(cfg: argparse.Namespace) -> dict[str, Any] | None:
    backend = "nccl" if cfg.device_type == "cuda" else "gloo"
    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group(backend, init_method="env://", timeout=datetime.timedelta(seconds=cfg.timeout))
    try:
        m = measure(cfg, dist.get_rank(), dist.get_world_size())
    finally:
        if owns:
            dist.destroy_process_group()
    return m if int(os.environ["RANK"]) == 0 else None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    cfg = _config(parser.parse_args(argv), parser)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        m = _torchrun(cfg)
    elif cfg.nproc == 1:
        m = measure(cfg, 0, 1)
    else:
        if cfg.device_type == "cuda":
            parser.error("spawned ranks use gloo on the CPU; for GPUs launch under torchrun, or pass --device cpu")
        m = _spawn(cfg)
    if m is None:
        return 0
    profile = to_profile(cfg, m)
    Path(cfg.out).write_text(json.dumps(profile, indent=2) + "\n")
    print(summary(profile))
    print(f"wrote {cfg.out}; use it with autosp.compile(..., hardware={str(cfg.out)!r})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

__all__ = ["build_parser", "main", "measure", "parse_size", "summary", "to_profile"]
