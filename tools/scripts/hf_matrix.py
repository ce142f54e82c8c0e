"""Run the Hugging Face model matrix (issue 12, item 7) and print its markdown results table.

    python tools/scripts/hf_matrix.py [--sp 2] [--only SUBSTRING ...] [--timeout 300] [--backend aot_eager]
        [--more [--checkpointing]]

Every row builds a tiny HF model in code (``integration_tests/hf_matrix.py``), runs one step under
``autosp.compile`` on a persistent pool of ``--sp`` gloo processes and compares the loss, the logits
and every parameter's gradient (no gradients for eval) with single-device eager on the same rank. A row
is ``exact``, ``refused`` (an ``AutoSPError`` raised alike on every rank, quoted verbatim) or ``BUG``
(a wrong value, a hang past ``--timeout``, or any other error). The full text of every refusal and
bug, and every op that ran on gathered inputs, follows the table. Exits 1 when some row is a bug.
44 rows, one compile per rank each: about 10 minutes (250 s of CPU) on 2 loaded cores at sp=2; with
``--more``, 218 rows (109 architectures under Ulysses and ring) beyond the matrix (``integration_tests/hf_more.py``), each with
HF gradient checkpointing on too with ``--checkpointing``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

# This script shares its module name with the matrix it runs: the suite's directory must come first.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "integration_tests"))

from hf_matrix import Outcome, Row, check_row, matrix_rows  # noqa: E402
from hf_more import more_rows  # noqa: E402
from spmd_pool import SPMDPool  # noqa: E402


def table(results: list[tuple[Row, Outcome]]) -> str:
    lines = ["| model | variant | checkpointing | run | result | time (s) |", "|---|---|---|---|---|---|"]
    for row, out in results:
        short = out.cell() if out.kind != "bug" else out.cell().split("\n")[0][:300]
        lines.append(
            f"| {row.model} | {row.variant} | {'on' if row.checkpointing else 'off'} | {row.mode} "
            f"| {short} | {out.seconds:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sp", type=int, default=2, help="ranks of the SP group (default 2)")
    ap.add_argument(
        "--only",
        nargs="*",
        default=[],
        help="run only rows whose 'model | variant | checkpointing on/off | mode' contains one of these",
    )
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds a row may take before it counts as a hang")
    ap.add_argument("--backend", default="aot_eager", help="inner compiler given to autosp.compile")
    ap.add_argument(
        "--more",
        action="store_true",
        help="the architectures beyond the matrix instead (integration_tests/hf_more.py: generic tiny configs)",
    )
    ap.add_argument(
        "--checkpointing",
        action="store_true",
        help="with --more: each architecture with gradient_checkpointing_enable() (off by default)",
    )
    args = ap.parse_args(argv)
    if args.sp < 2:
        ap.error(f"--sp {args.sp}: sequence parallelism needs at least 2 ranks; give --sp 2 or more")
    if args.checkpointing and not args.more:
        ap.error("--checkpointing goes with --more: the matrix has its own checkpointing rows")
    every = more_rows(checkpointing=args.checkpointing) if args.more else matrix_rows()
    rows = [r for r in every if not args.only or any(s in r.label() for s in args.only)]
    if not rows:
        ap.error(f"--only {args.only} matches no row; rows look like {every[0].label()!r}")
    results: list[tuple[Row, Outcome]] = []
    start = time.perf_counter()
    with SPMDPool(args.sp, pg_timeout_s=args.timeout) as pool:
        for row in rows:
            out = check_row(pool, row, backend=args.backend, timeout_s=args.timeout)
            results.append((row, out))
            print(
                f"[{len(results)}/{len(rows)}] {row.label()}: {out.kind} ({out.seconds:.1f} s)",
                file=sys.stderr,
                flush=True,
            )
    print(table(results))
    print(
        f"\n{len(rows)} rows at sp={args.sp}, backend {args.backend}, {time.perf_counter() - start:.0f} s in all; "
        + ", ".join(f"{sum(o.kind == k for _, o in results)} {k}" for k in ("exact", "refused", "bug"))
    )
    for row, out in results:
        if out.kind != "exact":
            print(f"\n### {row.label()}: {out.kind}\n\n```\n{out.detail}\n```")
        elif out.gathered:
            print(
                f"\n### {row.label()}: exact, with inputs gathered for\n\n" + "\n".join(f"- {g}" for g in out.gathered)
            )
    return 1 if any(o.kind == "bug" for _, o in results) else 0


if __name__ == "__main__":
    sys.exit(main())
