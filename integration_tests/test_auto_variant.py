"""variant="auto" against single-device eager at sp 2 and 4, with head counts the ranks do not split."""

from __future__ import annotations

import pytest
import torch
from auto_variant_workers import batch, build, run_auto, step
from harness import run_spmd

from autosp.hardware import CommModel, HardwareProfile
from autosp.hardware_io import save

pytest.importorskip("autosp_ring", reason="auto chooses among ulysses, ring and hybrid; autosp-ring is not installed")


def check(world: int, cases: list[tuple[str, str | None]], variant: str = "auto") -> dict:
    refs = {name: step(build(name), batch()) for name, _ in cases}
    per_rank = run_spmd(run_auto, world, cases, variant)
    for rank, results in enumerate(per_rank):
        for name, hardware in cases:
            got, ref = results[f"{name}@{hardware}"], refs[name]
            where = f"{name} on {hardware} rank {rank} ({got['variant']})"
            torch.testing.assert_close(got["loss"], ref["loss"], rtol=1e-5, atol=1e-6, msg=where)
            assert got["grads"].keys() == ref["grads"].keys(), where
            for pname, g in ref["grads"].items():
                torch.testing.assert_close(got["grads"][pname], g, rtol=1e-4, atol=1e-6, msg=f"{where}: {pname}")
    return per_rank[0]


def test_auto_two_ranks():
    results = check(2, [("h4", None), ("h3", None), ("mha3", None)])
    # 3 heads: Ulysses pads them to 4 (once it refused them and only the ring was left); both costed.
    # nn.MultiheadAttention's SDPA call is a site only once lowered (it once raised Ulysses' refusal).
    for key in ("h3@None", "mha3@None"):
        notes = results[key]["notes"]
        assert any(n.lstrip(" *").startswith("ulysses: ~") for n in notes), (key, notes)
        assert any(n.lstrip(" *").startswith("ring: ~") for n in notes), (key, notes)


@pytest.mark.extended(covered_by="test_auto_two_ranks")
def test_auto_four_ranks_with_heads_the_ranks_do_not_split(tmp_path):
    # A node whose neighbour hops are slow (1 ms each) and all-to-alls fast: with 2 heads at sp=4
    # Ulysses (the heads padded to 4) beats hybrid's one ring hop, which beats the ring's three. On
    # the built-in profiles, at this tiny size, launch latency decides and the ring's fewer collectives win.
    slow_hops = tmp_path / "slow-hops.json"
    save(
        HardwareProfile(
            "slow-hops",
            "cpu",
            matmul_flops={"float32": 5e10},
            comm={"all_to_all": CommModel(1e-6, 1e10), "p2p": CommModel(1e-3, 1e9)},
        ),
        slow_hops,
    )
    results = check(4, [("h4", "h100-80gb"), ("h2", str(slow_hops)), ("h3", None), ("h2", None), ("mha3", None)])
    assert results["h4@h100-80gb"]["variant"].startswith("ulysses")
    assert results[f"h2@{slow_hops}"]["variant"].startswith("ulysses")
    ranked = [n for n in results[f"h2@{slow_hops}"]["notes"] if n.startswith("  ")]
    assert [n.lstrip(" *").split(":")[0] for n in ranked[:3]] == ["ulysses", "hybrid(ulysses_degree=2)", "ring"], ranked
    seconds = [float(n.split("~")[1].split(" ")[0]) for n in ranked[:3]]
    assert seconds[0] < seconds[1] < seconds[2], ranked
    # 3 heads: hybrid pads them to 4 in ulysses groups of 2 (once no hybrid degree was a candidate).
    for key in ("h3@None", "mha3@None"):
        assert any(n.lstrip(" *").startswith("hybrid(ulysses_degree=2): ~") for n in results[key]["notes"]), key
    assert results["h2@None"]["variant"].split()[0] in ("ring", "hybrid(ulysses_degree=2)", "ulysses")
    for key, r in results.items():
        assert any(n.startswith("variant='auto' chose") for n in r["notes"]), key
    # variant="hybrid" without a degree: 2, its 3 heads padded to 4 (once: "no ulysses_degree divides").
    # nn.MultiheadAttention's site appears only once lowered, after the degree was chosen.
    for key, r in check(4, [("h3", None), ("mha3", None)], "hybrid").items():
        assert r["variant"].startswith("hybrid(ulysses_degree=2)"), (key, r["variant"])
        assert any("3 heads padded to 4" in n for n in r["notes"]), (key, r["notes"])
