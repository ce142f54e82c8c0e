"""Activation peak per rank with and without tiled logits and loss (``tile_loss=``), same model and tokens.

    python tools/scripts/tile_loss_bench.py [--vocab 32000] [--seq 8192] [--sp 2] [--backend aot_eager]

Each setting runs in fresh gloo processes (FileStore, no ports): a Llama-style model (RoPE, RMSNorm,
SwiGLU, GQA, untied head, labels shifted inside) compiled with ``autosp.compile``, one step to
compile, then one measured step. The peak is the process's resident-set high-water mark during the
measured step, above what it held before it (``/proc/self/clear_refs`` resets the mark; malloc is
told to map every block over 128 KiB, so freed tensors leave the RSS at once). Loss and every
gradient are compared between the settings. Needs Linux; about 2 x 3 GiB of RAM at the defaults.
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


def _hwm_reset() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _rank(rank: int, args: argparse.Namespace, tile: Any, store: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    import autosp
    from autosp.testing import Config, LlamaLike

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store, args.sp),
        rank=rank,
        world_size=args.sp,
        timeout=datetime.timedelta(minutes=30),
    )
    try:
        torch.manual_seed(0)
        model = LlamaLike(
            Config(
                vocab=args.vocab,
                dim=args.dim,
                heads=4,
                kv_heads=2,
                layers=args.layers,
                hidden=2 * args.dim,
                max_len=args.seq,
            )
        )
        ids = torch.randint(0, args.vocab, (1, args.seq), generator=torch.Generator().manual_seed(1))
        compiled = autosp.compile(model, sp_size=args.sp, backend=args.backend, tile_loss=tile, sac=False)
        compiled(ids, ids).backward()  # compile
        model.zero_grad(set_to_none=False)
        before = _status("VmRSS")
        _hwm_reset()
        loss = compiled(ids, ids)
        loss.backward()
        peak = _status("VmHWM") - before
        notes = [n for n in compiled.autosp_reports[0].notes if n.startswith("tile_loss")]
        result = {
            "loss": loss.detach(),
            "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
            "peak": peak,
            "notes": notes,
        }
        Path(out, f"{rank}.pkl").write_bytes(pickle.dumps(result))
    finally:
        dist.destroy_process_group()


def run(args: argparse.Namespace, tile: Any) -> list[dict]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _rank, args=(args, tile, os.path.join(tmp, "store"), tmp), nprocs=args.sp, start_method="spawn", join=True
        )
        return [pickle.loads(Path(tmp, f"{r}.pkl").read_bytes()) for r in range(args.sp)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--sp", type=int, default=2)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--backend", default="aot_eager", choices=("aot_eager", "inductor", "eager"))
    args = p.parse_args(argv)
    if sys.platform != "linux":
        p.error("the peak is read from /proc: Linux only")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"  # inherited by the spawned ranks
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    off, on = run(args, False), run(args, True)
    local = args.seq // args.sp
    logits = local * args.vocab * 4
    print(
        f"vocab {args.vocab}, S={args.seq}, sp={args.sp}, dim {args.dim}, {args.layers} layer(s), fp32, "
        f"{args.backend}; [{local}, {args.vocab}] fp32 logits per rank = {logits / MiB:.0f} MiB"
    )
    print(on[0]["notes"][0] if on[0]["notes"] else "tile_loss: no note")
    print(
        "\n| rank | peak MiB, tile_loss=False | peak MiB, tile_loss=True | saved MiB | saved / logits | "
        "loss off | loss on | max grad diff |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r, (a, b) in enumerate(zip(off, on)):
        diff = max(float((a["grads"][n] - b["grads"][n]).abs().max()) for n in a["grads"])
        saved = a["peak"] - b["peak"]
        print(
            f"| {r} | {a['peak'] / MiB:.0f} | {b['peak'] / MiB:.0f} | {saved / MiB:.0f} | {saved / logits:.2f} | "
            f"{a['loss'].item():.7f} | {b['loss'].item():.7f} | {diff:.2e} |"
        )
        torch.testing.assert_close(b["loss"], a["loss"], rtol=1e-6, atol=1e-6)
    return 0


if __name__ == "__main__":
    sys.exit(main())
