"""The memory peak of one training step per rank and what is live at it, for several methods side by side.

    python tools/scripts/peak_breakdown.py [--seq 8192] [--sp 2] [--backend inductor]
        [--methods autosp-ulysses-sac,autosp-ulysses,ds-autosp,ulysses,ulysses-compiled]
        [--before /path/to/older/checkout] [--top 10]

Each method (names from ``autosp_tools.bench.methods.METHODS``) runs in fresh gloo processes
(spawn, FileStore): a Llama (GQA 8:2, dim 256, ffn 688, 4 layers, vocab 264, fp32) takes a
compile step and a warm step, then three steps under the memory profiler (the table shows the
median and the range) and one for the resident high-water mark (``autosp_tools.bench.peak``). ``--before`` runs every AutoSP method a second time
with the packages of another checkout (a ``git worktree`` of an older commit) first on the path, so
the peak before and after a change comes from one run. Prints a table and each method's composition.
"""

from __future__ import annotations

import argparse
import datetime
import os
import pickle
import sys
import tempfile
from pathlib import Path
from typing import Any

MiB = 2**20


def _rank(
    rank: int, args: argparse.Namespace, method: str, inductor: dict, store: str, out: str, tree: str | None
) -> None:
    if tree:
        # A spawned child starts from its parent's sys.path, not from PYTHONPATH: put the tree first here.
        sys.path[:0] = _path_of(tree).split(os.pathsep)
    import torch
    import torch.distributed as dist

    from autosp_tools.bench.peak import ModelShape, measure_method

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(args.sp), LOCAL_WORLD_SIZE=str(args.sp))
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store, args.sp),
        rank=rank,
        world_size=args.sp,
        timeout=datetime.timedelta(minutes=30),
    )
    try:
        shape = ModelShape(args.dim, args.layers, args.heads, args.kv_heads, args.hidden, args.vocab)
        result = measure_method(method, shape, args.seq, args.backend, rank, args.sp, inductor)
        import autosp

        result["autosp"] = str(Path(autosp.__file__).parent)
        Path(out, f"{rank}.pkl").write_bytes(pickle.dumps(result))
    finally:
        dist.destroy_process_group()


def _path_of(tree: str) -> str:
    """The source folders of a checkout, to put first on the children's path."""
    root = Path(tree)
    dirs = sorted(str(p) for p in root.glob("packages/*/src")) + [str(root / "tools" / "src")]
    return os.pathsep.join(dirs)


def run(args: argparse.Namespace, method: str, tree: str | None, inductor: dict | None = None) -> list[dict[str, Any]]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _rank,
            args=(args, method, inductor or {}, os.path.join(tmp, "store"), tmp, tree),
            nprocs=args.sp,
            start_method="spawn",
        )
        return [pickle.loads(Path(tmp, f"{r}.pkl").read_bytes()) for r in range(args.sp)]


def _settings(text: str) -> dict[str, Any]:
    import ast

    pairs = (item.split("=", 1) for item in text.split(",") if item)
    return {key.strip(): ast.literal_eval(value.strip()) for key, value in pairs}


def _label(settings: dict[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in settings.items())


def _print_method(label: str, ranks: list[dict[str, Any]], top: int) -> None:
    print(f"\n{label}, rank 0 ({ranks[0]['autosp']}):\n{ranks[0]['peak'].describe(top)}", flush=True)


def _plain_names(norms: dict[str, float]) -> dict[str, float]:
    """Parameter names without the wrappers' prefixes (DeepSpeed's engine, torch.compile)."""
    out = {}
    for name, value in norms.items():
        while name.startswith(("module.", "_orig_mod.")):
            name = name.split(".", 1)[1]
        out[name] = value
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--sp", type=int, default=2)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--hidden", type=int, default=688)
    p.add_argument("--vocab", type=int, default=264, help="at least 264, the ids the batch draws")
    p.add_argument("--backend", default="inductor", choices=("inductor", "aot_eager"))
    p.add_argument("--methods", default="autosp-ulysses-sac,autosp-ulysses,ds-autosp,ulysses,ulysses-compiled")
    p.add_argument("--before", help="an older checkout: AutoSP's methods run with its packages too")
    p.add_argument(
        "--also",
        type=_settings,
        default={},
        help="Inductor settings (allow_buffer_reuse=False,...): AutoSP's methods run with them too",
    )
    p.add_argument("--top", type=int, default=10, help="groups of live buffers to print per method")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"  # freed tensors leave the resident set at once
    rows: list[tuple[str, list[dict[str, Any]]]] = []

    def add(label: str, ranks: list[dict[str, Any]]) -> None:
        rows.append((label, ranks))
        _print_method(label, ranks, args.top)

    for method in args.methods.split(","):
        if args.before and method.startswith("autosp"):
            add(f"{method} (before)", run(args, method, args.before))
        add(method, run(args, method, None))
        if args.also and method.startswith("autosp"):
            add(f"{method} ({_label(args.also)})", run(args, method, None, args.also))
    print(
        f"Llama dim {args.dim}, {args.layers} layers, heads {args.heads}:{args.kv_heads}, ffn {args.hidden}, "
        f"vocab {args.vocab}, fp32, S={args.seq}, sp={args.sp}, {args.backend}; per rank, MiB above the step's start"
    )
    print(
        "\n| method | rank | peak (allocator, median of 3 steps) | of 3 | in | forward peak | backward peak | kept | resident HWM | loss "
        "| grad norms vs first row |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    first = rows[0][1]
    for label, ranks in rows:
        for r, ref in zip(ranks, first):
            pk = r["peak"]
            lo, hi = r["peak_spread"]
            hwm = f"{r['hwm'] / MiB:.1f}" if r["hwm"] is not None else "-"
            mine, theirs = _plain_names(r["grad_norms"]), _plain_names(ref["grad_norms"])
            common = mine.keys() & theirs.keys()
            diff = f"{max(abs(mine[n] / theirs[n] - 1) for n in common):.1e}" if common else "-"
            print(
                f"| {label} | {r['rank']} | {pk.peak / MiB:.1f} | {lo / MiB:.1f}-{hi / MiB:.1f} | {pk.phase} | {pk.phase_peaks['forward'] / MiB:.1f} "
                f"| {pk.phase_peaks['backward'] / MiB:.1f} | {pk.end / MiB:.1f} | {hwm} | {r['loss']:.6f} | {diff} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
