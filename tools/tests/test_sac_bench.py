"""autosp-sac-bench runs on tiny sizes and writes well-formed output (no timing is checked)."""

from __future__ import annotations

import json

from autosp_tools import sac_bench


def test_tiny_run_writes_table_json_and_plot(tmp_path):
    out = tmp_path / "sac"
    rows = sac_bench.run(
        ["--lengths", "64,128", "--sp", "1", "--layers", "1", "--dim", "32", "--heads", "4", "--kv-heads", "2",
         "--steps", "1", "--out", str(out)]
    )
    assert len(rows) == 6 and all("error" not in r for r in rows), rows
    data = json.loads((out / "results.json").read_text())
    assert {r["sac"] for r in data["rows"]} == {"False", "auto", "True"}
    on = {r["seq"]: r["saved_bytes"] for r in rows if r["sac"] == "True"}
    off = {r["seq"]: r["saved_bytes"] for r in rows if r["sac"] == "False"}
    assert all(on[s] < off[s] for s in on)
    md = (out / "sac.md").read_text()
    assert md.startswith("| sp | seq |") and md.count("\n") == 4
    assert (out / "sac.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
