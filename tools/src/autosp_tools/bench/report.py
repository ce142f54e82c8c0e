"""results.json, results.md (ratios against hand-written Ulysses) and the PNG plots."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

MB = 2**20


def summarize(run: dict[str, Any], tokens: int) -> dict[str, Any]:
    """Per-attempt numbers across ranks: memory is the worst rank, a step is as slow as its slowest rank."""
    ranks = run.get("ranks") or []
    if not run["ok"] or not ranks:
        return {}
    step = max(r["median_step_s"] for r in ranks)
    cuda = [r["cuda_max_allocated"] for r in ranks if r["cuda_max_allocated"] is not None]
    return {
        "loss": ranks[0]["loss"],
        "loss_per_rank": [r["loss"] for r in ranks],
        "saved_bytes": max(r["saved_bytes"] for r in ranks),
        "peak_rss_delta_mb": max(r["peak_rss_delta_mb"] for r in ranks),
        "cuda_max_allocated": max(cuda) if cuda else None,
        "median_step_s": step,
        "tokens_per_s": tokens / step if step > 0 else None,
        "compile_s": max(r["compile_s"] for r in ranks),
    }


def write_json(out: Path, results: dict[str, Any]) -> Path:
    path = out / "results.json"
    path.write_text(json.dumps(results, indent=2, default=str))
    return path


def _ratio(x: float | None, base: float | None) -> str:
    if x is None or not base:
        return "–"
    return f"{x / base:.2f}×"


def _num(x: float | None, fmt: str) -> str:
    return "–" if x is None else format(x, fmt)


def _longest_cell(entry: dict[str, Any] | None) -> tuple[str, float | None]:
    if not entry or entry.get("seq_len") is None:
        return "none fit", None
    n = entry["seq_len"]
    return (f"≥{n}" if entry.get("capped") else str(n)), float(n)


def _label(results: dict[str, Any], name: str) -> str:
    """What a method is, in words (the reference ran without being asked for: its label from the table)."""
    from autosp_tools.bench.methods import METHODS

    known = results.get("methods", {}).get(name, {}).get("label")
    return str(known or (METHODS[name].label if name in METHODS else name))


def markdown(results: dict[str, Any]) -> str:
    s = results["settings"]
    runs = results["runs"]
    lengths = sorted({r["seq_len"] for r in runs})
    base_name = results["baseline"]
    # Compare at the longest swept length the baseline ran at.
    swept = set(s["seq_lens"])
    base_ok = [r["seq_len"] for r in runs if r["method"] == base_name and r["summary"] and r["seq_len"] in swept]
    at = max(base_ok) if base_ok else (lengths[-1] if lengths else 0)
    by = {(r["method"], r["seq_len"]): r for r in runs}
    base = by.get((base_name, at), {}).get("summary", {})
    ref = results["reference_loss"].get(str(at))
    base_long = _longest_cell(results["longest"].get(base_name))[1]
    lines = [
        (
            f"Model `{s['model_size']}` (builtin Llama: RoPE, RMSNorm, SwiGLU, GQA), batch {s['batch_size']}, "
            f"SP size {s['sp_size']}, compiler `{s['backend']}`, {results['machine']['summary']}."
        ),
        "",
        (
            f"At sequence length {at}; ratios (×) are against `{base_name}` ({_label(results, base_name)}). "
            f"Memory is per rank; saved = bytes autograd keeps for backward (parameters excluded); "
            f"longest = longest sequence whose `{results['budget']['metric']}` memory per rank stays under "
            f"{results['budget']['bytes'] / MB:g} MB (≥: the search stopped at its cap)."
        ),
        "",
        (
            "| method | loss | single-device loss | saved MB | × | peak RSS Δ MB | × | step ms | × | tokens/s | × "
            "| compile s | longest seq | × |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in results["methods"]:
        sm = by.get((name, at), {}).get("summary", {})
        long_txt, long_n = _longest_cell(results["longest"].get(name))
        if not sm:
            err = (by.get((name, at), {}).get("error") or "not run").strip().splitlines()[0][:80]
            lines.append(f"| {name} | failed: {err} | {_num(ref, '.5f')} |" + " – |" * 9 + f" {long_txt} | – |")
            continue
        saved, rss, step = sm["saved_bytes"] / MB, sm["peak_rss_delta_mb"], sm["median_step_s"] * 1e3
        lines.append(
            f"| {name} | {sm['loss']:.5f} | {_num(ref, '.5f')} | {saved:.2f} | "
            f"{_ratio(saved, base.get('saved_bytes', 0) / MB)} | {rss:.0f} | {_ratio(rss, base.get('peak_rss_delta_mb'))} | "
            f"{step:.1f} | {_ratio(step, (base.get('median_step_s') or 0) * 1e3)} | {_num(sm['tokens_per_s'], ',.0f')} | "
            f"{_ratio(sm['tokens_per_s'], base.get('tokens_per_s'))} | {sm['compile_s']:.1f} | {long_txt} | "
            f"{_ratio(long_n, base_long)} |"
        )
    lines += [
        "",
        "All attempts (saved MB per rank / median step ms / loss):",
        "",
        "| method | " + " | ".join(f"S={n}" for n in lengths) + " |",
        "|---|" + "---|" * len(lengths),
    ]
    for name in results["methods"]:
        cells = []
        for n in lengths:
            r = by.get((name, n))
            sm = r.get("summary") if r else None
            cells.append(
                "–"
                if r is None
                else "failed"
                if not sm
                else f"{sm['saved_bytes'] / MB:.2f} / {sm['median_step_s'] * 1e3:.1f} / {sm['loss']:.4f}"
            )
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    errors = [(r["method"], r["seq_len"], r["error"]) for r in runs if r["error"]]
    if errors:
        lines += ["", "Errors:", ""]
        lines += [f"- `{m}` at {n}: `{e.strip().splitlines()[0][:200]}`" for m, n, e in errors]
    return "\n".join(lines) + "\n"


def plots(out: Path, results: dict[str, Any]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in results["methods"]:
        pts = sorted(
            (r["seq_len"], r["summary"]["saved_bytes"] / MB)
            for r in results["runs"]
            if r["method"] == name and r["summary"]
        )
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("saved for backward per rank (MB)")
    ax.set_title("Activation memory against sequence length")
    ax.axhline(results["budget"]["bytes"] / MB, color="grey", linestyle="--", linewidth=1, label="budget")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out / "memory_vs_seq.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    names = list(results["methods"])
    vals = [(results["longest"].get(n) or {}).get("seq_len") or 0 for n in names]
    bars = ax.bar(range(len(names)), vals)
    for bar, n in zip(bars, names):
        if (results["longest"].get(n) or {}).get("capped"):
            ax.annotate("≥", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom")
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("longest trainable sequence (tokens)")
    ax.set_title(f"Under {results['budget']['bytes'] / MB:g} MB per rank ({results['budget']['metric']})")
    fig.tight_layout()
    paths.append(out / "longest_seq.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def write_all(out: Path, results: dict[str, Any]) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    files = [write_json(out, results)]
    (out / "results.md").write_text(markdown(results))
    files.append(out / "results.md")
    return files + plots(out, results)


__all__ = ["markdown", "plots", "summarize", "write_all", "write_json"]
