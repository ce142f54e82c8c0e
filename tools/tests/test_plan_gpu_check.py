"""tools/gpu_check.sh's stages, run on the CPU with small sizes (the CUDA path needs a GPU machine)."""

from __future__ import annotations

import json

import pytest
import torch

from autosp_tools.plan import gpu_check


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the no-GPU error is for machines without one")
def test_without_a_gpu_it_fails_clearly_and_still_writes_json(tmp_path):
    out = tmp_path / "check.json"
    assert gpu_check.main(["--out", str(out)]) == 2
    env = json.loads(out.read_text())["stages"]["env"]
    assert env["ok"] is False and "no CUDA device" in env["error"]


# Its stages' measurements each have a first-tier test: the plan's (test_plan.py) and SAC's (test_sac.py).
@pytest.mark.extended(covered_by="packages/autosp-sac/tests/test_sac.py::test_sac_on_saves_near_the_floor")
def test_cpu_quick_stages(tmp_path):
    """SAC keeps attention saved (no attention forward in the backward), and the plan agrees with
    rank 0 of sp=8 run for real in this process under a fake group."""
    out = tmp_path / "check.json"
    rc = gpu_check.main(["--device", "cpu", "--quick", "--out", str(out), "--stages", "sac_kernels,plan_vs_measured"])
    stages = json.loads(out.read_text())["stages"]
    assert rc == 0, {k: v.get("error") for k, v in stages.items()}
    assert stages["sac_kernels"]["result"]["failed"] == []
    flash = stages["sac_kernels"]["result"]["FLASH_ATTENTION"]
    assert flash["ok"], flash
    assert flash["sac=True"]["saved_bytes"] < flash["sac=False"]["saved_bytes"]
    points = stages["plan_vs_measured"]["result"]
    assert points.pop("failed") == []
    assert set(points) == {"sp=8/seq=8192/sac=False"}
    for key, point in points.items():
        assert "error" not in point, (key, point)
        assert point["saved_ratio"] == pytest.approx(1.0, abs=0.10), (key, point)
        assert point["peak_ratio"] == pytest.approx(1.0, abs=0.20), (key, point)


def test_the_checked_models_run_in_bf16():
    """The GPU check's models in bf16 (its dtype there): RoPE's fp32 angles must not turn q/k fp32
    while v stays bf16 (SDPA refuses mixed dtypes; the first CUDA run failed on it)."""
    from autosp_tools.bench.workload import rope_tables
    from autosp_tools.model import build_model
    from autosp_tools.plan.measure import TINY

    model = build_model(TINY).to(torch.bfloat16)
    ids = torch.randint(0, TINY.vocab, (1, 64))
    loss = model(ids, ids)
    assert loss.dtype == torch.bfloat16 and torch.isfinite(loss)
    cos, sin = rope_tables(model, torch.arange(64))  # the hand-written Ulysses baseline's tables
    assert cos.dtype == sin.dtype == torch.bfloat16


def test_equivalence_combos_are_checked_before_any_stage(tmp_path):
    with pytest.raises(ValueError, match="variant/backend/sac"):
        gpu_check.main(["--device", "cpu", "--quick", "--out", str(tmp_path / "c.json"), "--combos", "ring/inductor"])
    assert not (tmp_path / "c.json").exists()


def test_a_failing_stage_is_recorded_and_the_others_run(tmp_path):
    check = gpu_check.Check(tmp_path / "c.json")
    check.stage("boom", lambda: 1 / 0)
    check.stage("fine", lambda: {"x": 1})
    data = json.loads((tmp_path / "c.json").read_text())["stages"]
    assert data["boom"]["ok"] is False and "ZeroDivisionError" in data["boom"]["error"]
    assert data["fine"] == {"ok": True, "result": {"x": 1}, "seconds": data["fine"]["seconds"]}


@pytest.mark.extended(covered_by="packages/autosp-sac/tests/test_sac.py::test_sac_on_saves_near_the_floor")
def test_overlap_trace_stage_reports_exchanges_and_writes_traces(tmp_path):
    out = tmp_path / "check.json"
    rc = gpu_check.main(["--device", "cpu", "--quick", "--out", str(out), "--stages", "overlap_trace"])
    stage = json.loads(out.read_text())["stages"]["overlap_trace"]
    assert rc == 0, stage.get("error")
    lines = stage["result"]["lines"]
    assert any("aot_eager off" in line and "exchanges" in line for line in lines), lines
    assert any("step time relative to off" in line for line in lines), lines
    assert stage["result"]["traces"] == ["aot_eager-off.json.gz", "aot_eager-on.json.gz"]
    assert all((tmp_path / "overlap_traces" / name).stat().st_size > 0 for name in stage["result"]["traces"])


@pytest.mark.extended(covered_by="packages/autosp-sac/tests/test_sac.py::test_sac_on_saves_near_the_floor")
def test_flex_stage_runs_forward_on_the_cpu(tmp_path):
    # On CUDA the stage checks every gradient too; here it keeps the model, the block mask and the
    # compile working (torch has no FlexAttention backward on CPU).
    out = tmp_path / "check.json"
    rc = gpu_check.main(["--device", "cpu", "--quick", "--out", str(out), "--stages", "flex"])
    stage = json.loads(out.read_text())["stages"]["flex"]
    assert rc == 0, stage.get("error")
    assert set(stage["result"]) == {"ulysses/aot_eager", "ring/aot_eager"}
    for result in stage["result"].values():
        assert result["passed"] and result["forward_only"] and result["loss_diff"] <= 1e-5, result
