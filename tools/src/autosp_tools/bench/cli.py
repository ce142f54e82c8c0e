"""autosp-bench: AutoSP against single-device, hand-written DeepSpeed-Ulysses and DeepSpeed AutoSP.

One run sweeps every method over the sequence lengths (each attempt in fresh processes),
searches the longest sequence each trains under a per-rank memory budget, and writes
results.json, results.md and two PNG plots under --out.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

from autosp_tools.bench.methods import BASELINE, METHODS, REFERENCE
from autosp_tools.bench.report import summarize, write_all
from autosp_tools.bench.search import METRICS, Budget, longest
from autosp_tools.bench.spawn import Attempt, run_attempt
from autosp_tools.bench.workload import Workload
from autosp_tools.model import PRESETS

# --quick: a tiny model and a few lengths, about 5 minutes on 2 CPU cores.
QUICK: dict[str, Any] = {
    "model_size": "tiny",
    "seq_lens": [128, 256],
    "batch_size": 2,
    "warmup": 1,
    "steps": 3,
    "mem_budget_mb": 4.0,
    "search_max": 512,
    "search_refine": 0,
}
FULL: dict[str, Any] = {
    "model_size": "small",
    "seq_lens": [512, 1024, 2048],
    "batch_size": 1,
    "warmup": 2,
    "steps": 5,
    "mem_budget_mb": 64.0,
    "search_max": 16384,
    "search_refine": 1,
}


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="autosp-bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", required=True, help="directory for results.json, results.md and the plots")
    p.add_argument("--quick", action="store_true", help="tiny model, two lengths, 2 ranks (minutes on a CPU)")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, from: {', '.join(METHODS)}")
    p.add_argument("--model-size", choices=sorted(PRESETS))
    p.add_argument("--seq-lens", help="comma-separated sequence lengths to sweep (multiples of --sp-size)")
    p.add_argument("--batch-size", type=int)
    p.add_argument("--sp-size", type=int, default=2)
    p.add_argument(
        "--backend",
        choices=("aot_eager", "inductor"),
        help="compiler for the compiled methods (default: inductor on GPU, aot_eager on CPU)",
    )
    p.add_argument("--warmup", type=int, help="steps after the first (compile) step before timing")
    p.add_argument("--steps", type=int, help="timed steps; step time is their median")
    p.add_argument("--mem-budget-mb", type=float, help="per-rank memory budget for the longest-sequence search")
    p.add_argument(
        "--budget-metric",
        choices=METRICS,
        help="memory compared with the budget (default: cuda on GPU, saved elsewhere)",
    )
    p.add_argument("--search-max", type=int, help="longest length the search tries; 0 skips the search")
    p.add_argument("--search-refine", type=int, help="bisection steps after the doubling search")
    p.add_argument("--zero-stage", type=int, choices=(0, 1), default=0, help="ZeRO stage for DeepSpeed AutoSP")
    p.add_argument("--attempt-timeout", type=float, default=900.0, help="seconds before an attempt is killed")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    return p


def settings_from_args(ns: argparse.Namespace) -> dict[str, Any]:
    base = dict(QUICK if ns.quick else FULL)
    for key in base:
        val = getattr(ns, key)
        if val is not None:
            base[key] = [int(x) for x in val.split(",")] if key == "seq_lens" else val
    names = [n.strip() for n in ns.methods.split(",") if n.strip()]
    unknown = [n for n in names if n not in METHODS]
    if unknown:
        raise SystemExit(f"autosp-bench: unknown method(s) {unknown}; choose from {list(METHODS)}")
    # The single-device loss is the yardstick every other loss is printed against.
    if REFERENCE not in names:
        names.insert(0, REFERENCE)
    bad = [n for n in base["seq_lens"] if n % ns.sp_size]
    if bad:
        raise SystemExit(f"autosp-bench: sequence lengths {bad} are not multiples of --sp-size {ns.sp_size}")
    cuda = _cuda()
    base.update(
        methods=names,
        sp_size=ns.sp_size,
        backend=ns.backend or ("inductor" if cuda else "aot_eager"),
        budget_metric=ns.budget_metric or ("cuda" if cuda else "saved"),
        zero_stage=ns.zero_stage,
        attempt_timeout=ns.attempt_timeout,
        quick=ns.quick,
    )
    return base


def machine() -> dict[str, Any]:
    import torch

    cpu = platform.processor() or platform.machine()
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "cpu": cpu,
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["summary"] = f"{torch.cuda.device_count()}× {info['gpu']}"
    else:
        info["summary"] = f"{os.cpu_count()}-core CPU ({cpu}), 1 thread per rank, gloo"
    try:
        import deepspeed  # noqa: F401 - only its version

        info["deepspeed"] = sys.modules["deepspeed"].__version__
    except Exception as e:  # noqa: BLE001 - DeepSpeed is optional; its methods then record the error
        info["deepspeed"] = f"unavailable: {type(e).__name__}"
    return info


class Bench:
    """Runs attempts once each, caching them by (method, length), with a progress bar."""

    def __init__(self, s: dict[str, Any], bar: Any) -> None:
        self.s, self.bar = s, bar
        self.runs: dict[tuple[str, int], dict[str, Any]] = {}

    def attempt(self, name: str, seq_len: int) -> dict[str, Any]:
        key = (name, seq_len)
        if key not in self.runs:
            s = self.s
            w = Workload(s["model_size"], seq_len, s["batch_size"])
            self.bar.set_postfix_str(f"{name} S={seq_len}")
            a = Attempt(METHODS[name], w, s["sp_size"], s["backend"], s["warmup"], s["steps"], s["zero_stage"])
            run = run_attempt(a, timeout_s=s["attempt_timeout"])
            run.update(method=name, seq_len=seq_len, summary=summarize(run, w.tokens))
            self.runs[key] = run
            self.bar.update(1)
        return self.runs[key]


def run(argv: Sequence[str] | None = None) -> dict[str, Any]:
    from tqdm import tqdm

    ns = build_parser().parse_args(argv)
    s = settings_from_args(ns)
    out = Path(ns.out)
    budget = Budget(s["budget_metric"], int(s["mem_budget_mb"] * 2**20))
    start = min(s["seq_lens"])
    ladder = 0
    n = start
    while s["search_max"] and n <= s["search_max"]:
        ladder, n = ladder + 1, n * 2
    planned = len(s["methods"]) * max(len(s["seq_lens"]), ladder + s["search_refine"])
    t0 = time.perf_counter()
    with tqdm(total=planned, desc="autosp-bench", unit="run", disable=ns.no_progress, file=sys.stderr) as bar:
        bench = Bench(s, bar)
        for name in s["methods"]:
            for seq_len in s["seq_lens"]:
                bench.attempt(name, seq_len)
        found: dict[str, Any] = {}
        if s["search_max"]:
            for name in s["methods"]:
                found[name] = longest(
                    partial(bench.attempt, name),
                    budget,
                    start,
                    s["search_max"],
                    multiple=s["sp_size"] * 8,
                    refine=s["search_refine"],
                )
        bar.total = bar.n
        bar.refresh()
    runs = sorted(bench.runs.values(), key=lambda r: (s["methods"].index(r["method"]), r["seq_len"]))
    ref = {str(r["seq_len"]): r["summary"]["loss"] for r in runs if r["method"] == REFERENCE and r["summary"]}
    results = {
        "command": ["autosp-bench", *(argv if argv is not None else sys.argv[1:])],
        "machine": machine(),
        "settings": s,
        "baseline": BASELINE if BASELINE in s["methods"] else REFERENCE,
        "methods": {
            n: {
                "label": METHODS[n].label,
                "family": METHODS[n].family,
                "distributed": METHODS[n].distributed,
                "compiled": METHODS[n].compiled,
                "options": dict(METHODS[n].options),
            }
            for n in s["methods"]
        },
        "budget": {"metric": budget.metric, "bytes": budget.bytes},
        "reference_loss": ref,
        "runs": runs,
        "longest": found,
        "wall_s": time.perf_counter() - t0,
    }
    results["files"] = [str(p) for p in write_all(out, results)]
    return results


def main(argv: Sequence[str] | None = None) -> None:
    results = run(argv)
    print((Path(results["files"][1])).read_text())
    print(f"wrote {', '.join(results['files'])} in {results['wall_s']:.0f} s")


__all__ = ["build_parser", "main", "run"]
