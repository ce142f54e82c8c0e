"""Re-run the training-tool rows of issue 16 through the real CLI and print a markdown table.

    python tools/scripts/fault_table.py [--timeout 10]

Each row runs ``python -m autosp_tools.train`` in a fresh process (faults through
``AUTOSP_FAULT``, checkpoints damaged on disk) and reports the first line of the error,
the exit code, the wall time of the command and, for faults, the seconds from the
fault to the end of the job. About 3 minutes on 2 idle CPU cores.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

TINY = [
    "--model-size",
    "tiny",
    "--model-impl",
    "builtin",
    "--seq-len",
    "64",
    "--batch-size",
    "2",
    "--steps",
    "6",
    "--seed",
    "5",
    "--quiet",
]
SP = TINY + ["--sp-size", "2", "--backend", "eager"]
ONE = TINY + ["--sp-size", "1", "--nproc", "1", "--backend", "none"]


def cli(argv: list[str], fault: str | None = None) -> tuple[int, str, float, float | None]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("AUTOSP_FAULT", None)
    if fault:
        env["AUTOSP_FAULT"] = fault
    start = time.time()
    done = subprocess.run(
        [sys.executable, "-m", "autosp_tools.train", *argv], env=env, capture_output=True, text=True, timeout=900
    )
    end = time.time()
    fired = re.search(r"AUTOSP_FAULT: \w+ on rank \d+ in step \d+ at unix time ([\d.]+)", done.stderr)
    errors = [line for line in done.stderr.splitlines() if line.startswith("autosp-train: error:")]
    notes = [line for line in done.stderr.splitlines() if line.startswith(("--resume auto:", "removed "))]
    if errors:
        text = errors[0].removeprefix("autosp-train: error: ")
    elif notes:
        text = " / ".join(notes)
    else:
        text = "(no error)"
    if done.returncode == 0:
        text += " — trained"
    return done.returncode, text, end - start, (end - float(fired.group(1))) if fired else None


def flip(path: Path) -> None:
    """64 bytes flipped in the middle of the largest tensor's data."""
    import struct
    import zipfile

    with zipfile.ZipFile(path) as z:
        info = max(z.infolist(), key=lambda i: i.file_size)
    data = bytearray(path.read_bytes())
    n, m = struct.unpack("<HH", data[info.header_offset + 26 : info.header_offset + 30])
    mid = info.header_offset + 30 + n + m + info.file_size // 2
    data[mid : mid + 64] = bytes(b ^ 0xFF for b in data[mid : mid + 64])
    path.write_bytes(bytes(data))


def rows(timeout: int, tmp: Path) -> list[tuple[str, list[str], str | None]]:
    empty = tmp / "empty.txt"
    empty.write_bytes(b"")
    a_file = tmp / "a_file"
    a_file.write_text("x")
    t = ["--timeout", str(timeout)]

    def checkpoints(name: str, damage: Callable[[Path], object]) -> list[str]:
        d = tmp / name
        cli(ONE + ["--stop-at", "3", "--save-every", "1", "--checkpoint-dir", str(d)])
        damage(d / "step_00000003.pt")
        return ["--checkpoint-dir", str(d)]

    def stale(d: Path) -> list[str]:
        cli(ONE + ["--stop-at", "3", "--save-every", "1", "--checkpoint-dir", str(d)])
        (d / "step_00000004.pt.999.tmp").write_bytes(b"half")
        return ["--checkpoint-dir", str(d)]

    return [
        (
            "truncated latest checkpoint, --resume",
            ONE + checkpoints("trunc", lambda p: p.write_bytes(p.read_bytes()[:5000])) + ["--resume"],
            None,
        ),
        (
            "empty latest checkpoint, --resume",
            ONE + checkpoints("empty", lambda p: p.write_bytes(b"")) + ["--resume"],
            None,
        ),
        ("64 flipped bytes in tensor data, --resume", ONE + checkpoints("flip", flip) + ["--resume"], None),
        ("64 flipped bytes, --resume auto", ONE + checkpoints("flip2", flip) + ["--resume", "auto"], None),
        ("stale .tmp left by a crash mid-save", ONE + stale(tmp / "stale") + ["--resume", "auto"], None),
        ("rank raises mid-step", SP + t, "1:3:raise"),
        ("rank calls os._exit mid-step", SP + t, "1:3:exit"),
        ("rank gets SIGKILL mid-step", SP + t, "1:3:kill"),
        ("one rank interrupted (SIGINT)", SP + t, "1:3:interrupt"),
        ("rank stuck inside a step", SP + t, "1:3:hang"),
        ("half-dead rank (SIGSTOP)", SP + t, "1:3:stop"),
        ("every rank stuck (no collective waiting)", SP + t, "*:3:hang"),
        *[
            (f"`{flag}`", ONE + flag.split(), None)
            for flag in (
                "--heads 0",
                "--dim 0",
                "--layers 0",
                "--nproc 0",
                "--min-lr-ratio -1",
                "--warmup -5",
                "--grad-clip -1",
            )
        ],
        ("empty data file", ONE + ["--data", str(empty)], None),
        ("--checkpoint-dir is a file", ONE + ["--checkpoint-dir", str(a_file)], None),
        ("--seq-len 63 with --sp-size 2", TINY + ["--seq-len", "63", "--sp-size", "2"], None),
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--timeout", type=int, default=10, help="--timeout for the fault rows")
    args = p.parse_args()
    print(f"| case | exit | result | command s | fault to end s (--timeout {args.timeout}) |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as d:
        for name, argv, fault in rows(args.timeout, Path(d)):
            code, text, wall, after = cli(argv, fault)
            text = text.replace(d, "$TMP").replace("|", "\\|")
            after_s = f"{after:.1f}" if after is not None else ""
            print(f"| {name} | {code} | {text} | {wall:.1f} | {after_s} |", flush=True)


if __name__ == "__main__":
    main()
