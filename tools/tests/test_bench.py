"""autosp-bench on tiny sizes writes well-formed results; the numbers themselves are not checked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autosp_tools.bench import run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# Eager methods only, so nothing compiles; the search needs no length the sweep did not run (eager
# fits 16 tokens and not 32 in the budget, Ulysses fits both and is capped): four attempts in all.
TINY = [
    "--quick",
    "--methods",
    "eager,ulysses",
    "--seq-lens",
    "16,32",
    "--batch-size",
    "1",
    "--warmup",
    "0",
    "--steps",
    "1",
    "--search-max",
    "32",
    "--mem-budget-mb",
    "0.3",
    "--no-progress",
]


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("bench")
    run(TINY + ["--out", str(d)])
    return d


def test_results_json(out: Path) -> None:
    results = json.loads((out / "results.json").read_text())
    for key in ("machine", "settings", "methods", "runs", "longest", "reference_loss", "budget", "baseline"):
        assert key in results, key
    assert list(results["methods"]) == ["eager", "ulysses"]
    assert results["baseline"] == "ulysses"
    swept = {(r["method"], r["seq_len"]) for r in results["runs"]}
    assert {("eager", 16), ("eager", 32), ("ulysses", 16), ("ulysses", 32)} <= swept
    for r in results["runs"]:
        assert r["ok"], r["error"]
        assert len(r["ranks"]) == (2 if r["method"] == "ulysses" else 1)
        for key in ("loss", "saved_bytes", "peak_rss_delta_mb", "median_step_s", "tokens_per_s", "compile_s"):
            assert key in r["summary"], key
    # Hand-written Ulysses computes the exact global loss.
    for n in ("16", "32"):
        ulysses = next(r for r in results["runs"] if r["method"] == "ulysses" and str(r["seq_len"]) == n)
        assert ulysses["summary"]["loss"] == pytest.approx(results["reference_loss"][n], rel=1e-5)
    for name in ("eager", "ulysses"):
        assert set(results["longest"][name]) == {"seq_len", "capped", "attempts"}
    # The search reads the sweep's runs: eager's longest is 16, Ulysses' the cap.
    longest = {name: (r["seq_len"], r["capped"]) for name, r in results["longest"].items()}
    assert longest == {"eager": (16, False), "ulysses": (32, True)}, longest
    assert len(results["runs"]) == 4


def test_results_md_table(out: Path) -> None:
    md = (out / "results.md").read_text()
    rows = [line for line in md.splitlines() if line.startswith("|")]
    header = rows[0]
    assert "saved MB" in header and "step ms" in header and "tokens/s" in header and "longest seq" in header
    width = header.count("|")
    table = rows[: 2 + 2]
    assert all(r.count("|") == width for r in table), table
    assert any(r.startswith("| ulysses |") for r in table)
    assert "ratios (×) are against `ulysses` (hand-written DeepSpeed-Ulysses, eager)" in md


def test_the_ratios_name_the_method_they_are_against() -> None:
    from autosp_tools.bench.report import _label

    # Without hand-written Ulysses in the run the ratios are against the single-device reference.
    assert _label({"methods": {}}, "eager") == "single device, eager"
    assert (
        _label({"methods": {"autosp-ring-sac": {"label": "ours: ring + SAC"}}}, "autosp-ring-sac") == "ours: ring + SAC"
    )


def test_plots_are_pngs(out: Path) -> None:
    for name in ("memory_vs_seq.png", "longest_seq.png"):
        assert (out / name).read_bytes()[:8] == PNG_MAGIC, name
