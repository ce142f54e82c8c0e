"""autosp-plan: the longest sequence a model trains with on GPUs you do not have, predicted from its compiled graphs."""

from __future__ import annotations

import argparse
import sys
import time

from autosp.errors import AutoSPError
from autosp_tools.plan.api import DTYPES, plan
from autosp_tools.plan.layout import OPTIMIZERS
from autosp_tools.plan.models import presets
from autosp_tools.plan.report import plot, render, write_json


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="autosp-plan",
        description="Compile one rank's AutoSP program on fake tensors and a fake process group, and report per "
        "GPU: parameter/gradient/optimizer bytes, bytes saved for backward, the step's memory peak, "
        "communication by collective, FLOPs and step time; --max-seq finds the longest sequence that "
        "fits for SAC off/on/auto, each variant and hand-written Ulysses. Every number is a prediction.",
    )
    ap.add_argument(
        "--model", required=True, help=f"preset ({', '.join(sorted(presets()))}), HF config.json, or module:factory"
    )
    ap.add_argument("--gpus", type=int, required=True, help="GPUs in all (= sp x dp)")
    ap.add_argument("--hardware", required=True, help="hardware profile name (h100-80gb, mi250x, ...) or JSON path")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--sp", type=int, default=None, help="ranks per sequence (default: gpus / dp)")
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--zero", type=int, default=1, choices=(0, 1, 2, 3), help="ZeRO stage (3: FSDP full sharding)")
    ap.add_argument(
        "--shard-over",
        default="world",
        choices=("dp", "world"),
        help="ranks ZeRO shards over (default: all GPUs, as DeepSpeed with SP)",
    )
    ap.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS)
    ap.add_argument("--batch", type=int, default=1, help="sequences per step per SP group")
    ap.add_argument("--seq", type=int, default=None, help="report at this length (a multiple of sp)")
    ap.add_argument("--max-seq", action="store_true", help="search the longest length that fits, per mode")
    ap.add_argument("--memory-gb", type=float, default=None, help="device memory in GiB (overrides the profile)")
    ap.add_argument(
        "--reserve-gb",
        type=float,
        default=None,
        help="GiB kept free for the CUDA context, fragmentation and buffers (default 8%% of memory)",
    )
    ap.add_argument("--json", default=None, metavar="PATH", help="write the plan as JSON")
    ap.add_argument("--plot", default=None, metavar="PNG", help="plot memory against sequence length (with --max-seq)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.plot and not args.max_seq:
        parser().error("--plot draws the --max-seq search's curves: add --max-seq")
    start = time.perf_counter()
    try:
        p = plan(
            args.model,
            gpus=args.gpus,
            hardware=args.hardware,
            dtype=args.dtype,
            sp=args.sp,
            dp=args.dp,
            zero=args.zero,
            shard_over=args.shard_over,
            optimizer=args.optimizer,
            batch=args.batch,
            seq=args.seq,
            max_seq=args.max_seq,
            memory_gb=args.memory_gb,
            reserve_gb=args.reserve_gb,
        )
    except AutoSPError as e:
        print(f"autosp-plan: error: {e}", file=sys.stderr)
        return 2
    print(render(p))
    print(f"\n(planned in {time.perf_counter() - start:.1f} s)")
    if args.json:
        write_json(p, args.json)
    if args.plot:
        plot(p, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
