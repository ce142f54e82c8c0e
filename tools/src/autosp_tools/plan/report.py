"""The plan as a table, JSON and a plot of memory against sequence length."""

from __future__ import annotations

import json
from pathlib import Path

from autosp_tools.plan.planner import Estimate, Plan

GIB = 2**30


def _gib(b: float) -> str:
    return f"{b / GIB:.2f}"


def _seq(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def header(p: Plan) -> str:
    lay = p.layout
    return "\n".join(
        [
            f"model {p.model}: {p.params / 1e9:.2f} B parameters, {p.layers} layers, {p.dtype}",
            f"layout: {lay.gpus} GPUs = sp {lay.sp} x dp {lay.dp}, ZeRO-{lay.zero} over {lay.shard_over}, "
            f"optimizer {lay.optimizer}",
            f"device {p.device}: {_gib(p.memory_bytes)} GiB, reserve {_gib(p.reserve_bytes)} GiB, "
            f"budget {_gib(p.budget_bytes)} GiB per GPU",
            f"per GPU at rest: parameters {_gib(p.state.params)} GiB, gradients {_gib(p.state.grads)} GiB, "
            f"optimizer {_gib(p.state.optimizer)} GiB",
            f"all numbers are predictions from the compiled graphs (fake tensors, compile {p.compile_s:.1f} s)",
        ]
        + [f"note: {n}" for n in p.notes]
    )


def estimates_table(rows: list[Estimate]) -> str:
    lines = [
        "| mode | seq | saved GiB | step peak GiB | total GiB | fits | comm GiB by collective | TFLOP | "
        "step s (compute + comm) | note |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for e in rows:
        comm = ", ".join(f"{k} {_gib(v)}" for k, v in e.comm_bytes.items()) or "-"
        lines.append(
            f"| {e.mode} | {_seq(e.seq)} | {_gib(e.saved_bytes)} | {_gib(e.step_peak_bytes)} | "
            f"{_gib(e.total_bytes)} | {'yes' if e.fits else 'no'} | {comm} | {e.flops / 1e12:.1f} | "
            f"{e.step_s:.3f} ({e.compute_s:.3f} + {e.comm_s:.3f}) | {e.note} |"
        )
    return "\n".join(lines)


def max_seq_table(p: Plan) -> str:
    base = p.max_seq.get("hand-written Ulysses", {}).get("seq") or 0
    lines = [
        "| mode | longest seq | x hand-written | total GiB there | step s there | tokens/s per GPU |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in p.max_seq.items():
        e = r["estimate"]
        if not r["seq"] or e is None:
            lines.append(f"| {name} | does not fit | - | - | - | - |")
            continue
        ratio = f"{r['seq'] / base:.2f}" if base else "-"
        seq = (">= " if r["capped"] else "") + _seq(r["seq"])
        tps = e["seq"] / e["step_s"] / p.layout.sp if e["step_s"] else 0.0
        lines.append(f"| {name} | {seq} | {ratio} | {_gib(e['total_bytes'])} | {e['step_s']:.2f} | {tps:,.0f} |")
    return "\n".join(lines)


def render(p: Plan) -> str:
    parts = [header(p)]
    if p.estimates:
        parts.append(estimates_table(p.estimates))
    if p.max_seq:
        parts.append(max_seq_table(p))
    return "\n\n".join(parts)


def write_json(p: Plan, path: str | Path) -> None:
    Path(path).write_text(json.dumps(p.as_dict(), indent=2, default=str))


def plot(p: Plan, path: str | Path) -> None:
    """Total memory per GPU against sequence length, one line per mode, with the budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for name, points in p.curves.items():
        xs, ys = zip(*points)
        ax.plot(xs, [y / GIB for y in ys], marker=".", label=name)
    ax.axhline(p.budget_bytes / GIB, color="k", linestyle="--", label="budget (memory - reserve)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("GiB per GPU (predicted)")
    ax.set_title(f"{p.model} on {p.layout.gpus} x {p.device} (sp {p.layout.sp}), predicted")
    ax.legend(fontsize=8)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


__all__ = ["estimates_table", "header", "max_seq_table", "plot", "render", "write_json"]
