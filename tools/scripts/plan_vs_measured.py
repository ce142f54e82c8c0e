"""autosp-plan's predictions against real runs of the shipped model on this machine.

For S in --lengths, P in --sp and SAC off/on, predicts (fake-tensor compile, no run) and measures
(P spawned gloo ranks, ``autosp_tools.plan.measure``) the bytes saved for backward and the step's
memory peak of rank 0, and prints a markdown table with the ratios. Exits 1 when a saved-bytes
ratio is off by more than 10% or a peak ratio by more than 20%.

    python tools/scripts/plan_vs_measured.py --lengths 2048,4096,8192,16384 --sp 1,2,4 --out /tmp/plan-check.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from autosp_tools.launch import launch
from autosp_tools.plan.measure import SHIPPED, TINY, Case, measure, predict

SAVED_TOL, PEAK_TOL = 0.10, 0.20


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="2048,4096,8192,16384")
    ap.add_argument("--sp", default="1,2,4")
    ap.add_argument("--sac", default="off,on")
    ap.add_argument("--model", default="shipped", choices=("shipped", "tiny"))
    ap.add_argument("--out", default=None, help="write the rows as JSON")
    args = ap.parse_args()
    model = SHIPPED if args.model == "shipped" else TINY
    rows = []
    print("| P | S | SAC | saved MiB predicted | measured | ratio | peak MiB predicted | measured | ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    bad = 0
    for sp in (int(x) for x in args.sp.split(",")):
        for seq in (int(x) for x in args.lengths.split(",")):
            for sac in args.sac.split(","):
                case = Case(model, seq=seq, sp=sp, sac=sac == "on")
                start = time.perf_counter()
                try:
                    m = launch(measure, case)
                    p = predict(case, threads=m["threads"])
                except Exception as e:  # noqa: BLE001 - a failed point is a row, the sweep goes on
                    print(f"| {sp} | {seq} | {sac} | error: {type(e).__name__}: {str(e).splitlines()[0][:200]} |")
                    bad += 1
                    continue
                rs, rp = p["saved_bytes"] / m["saved_bytes"], p["peak_bytes"] / m["peak_bytes"]
                bad += abs(rs - 1) > SAVED_TOL or abs(rp - 1) > PEAK_TOL
                rows.append(
                    {
                        "sp": sp,
                        "seq": seq,
                        "sac": sac,
                        "predicted": p,
                        "measured": m,
                        "saved_ratio": rs,
                        "peak_ratio": rp,
                        "seconds": time.perf_counter() - start,
                    }
                )
                print(
                    f"| {sp} | {seq} | {sac} | {p['saved_bytes'] / 2**20:.2f} | {m['saved_bytes'] / 2**20:.2f} | "
                    f"{rs:.3f} | {p['peak_bytes'] / 2**20:.2f} | {m['peak_bytes'] / 2**20:.2f} | {rp:.3f} |",
                    flush=True,
                )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=2)
    print(f"\n{len(rows)} points, {bad} outside saved +-{SAVED_TOL:.0%} / peak +-{PEAK_TOL:.0%}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
