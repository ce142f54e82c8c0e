"""variant="auto" and hybrid's default degrees: candidates, costs, and how the hardware profile moves them."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import autosp
from autosp import variant_cost as cost
from autosp.analysis.attention import AttentionSite
from autosp.hardware import CommModel, HardwareProfile, Interconnect
from autosp.hardware_io import save
from autosp.lowering import SDPA
from autosp.passes.choose_variant import _refuses_degree, choose, sequence_sites
from autosp.registry import get_registry

pytest.importorskip("autosp_ring", reason="auto chooses among ulysses, ring and hybrid; autosp-ring is not installed")


# A plugin op the ring takes that does not declare pads_heads: its heads are not padded.
PLUGIN = dataclasses.replace(SDPA, name="sliding_window", leaf=None, pads_heads=False)


def site(heads: int, kv: int | None = None, seq: int = 4096, dim: int = 128, causal: bool = True) -> AttentionSite:
    return AttentionSite("attn", SDPA, 1, heads, kv or heads, seq, seq, dim, causal, None, torch.bfloat16)


def ctx(sites, world, hw, variant="auto", **variant_options):
    options = autosp.SPOptions(variant=variant, variant_options=variant_options)
    return SimpleNamespace(sites=sites, world=world, hardware=hw, registry=get_registry(), options=options)


# Two hand-written nodes: one with fast all-to-all links, one where all-to-all is measured slow
# (a high-latency fabric) while neighbour hops stay fast.
FAST_A2A = HardwareProfile(
    "fast-a2a",
    "cuda",
    matmul_flops={"bfloat16": 1e15, "float32": 5e14},
    interconnect=Interconnect("switch", 4e11, "switch", 8),
    comm={"all_to_all": CommModel(latency=2e-6, bandwidth=4e11), "p2p": CommModel(latency=5e-5, bandwidth=5e10)},
)
SLOW_A2A = dataclasses.replace(
    FAST_A2A,
    name="slow-a2a",
    flops=0.0,
    comm_bandwidth=0.0,
    comm={"all_to_all": CommModel(latency=5e-3, bandwidth=1e9), "p2p": CommModel(latency=1e-5, bandwidth=4e11)},
)


def test_every_candidate_is_listed_and_the_cheapest_wins():
    choice = choose(ctx([site(8, 2)] * 4, 4, FAST_A2A))
    labels = [e.label for e in choice.candidates]
    assert labels == ["ulysses", "hybrid(ulysses_degree=2)", "ring"]
    assert choice.chosen.seconds == min(e.seconds for e in choice.candidates)
    assert all(e.comm_bytes > 0 and e.comm_seconds > 0 and e.compute_seconds > 0 for e in choice.candidates)


def test_the_profile_changes_the_choice():
    sites = [site(8, 8)] * 4
    assert choose(ctx(sites, 4, FAST_A2A)).chosen.variant == "ulysses"
    assert choose(ctx(sites, 4, SLOW_A2A)).chosen.variant == "ring"


@pytest.mark.parametrize(
    "heads, expected, excluded",
    [
        # SDPA's heads travel padded under Ulysses and hybrid alike (3 over 4 ranks as 4, over 2 as 4).
        (3, {"ulysses", "hybrid(ulysses_degree=2)", "ring"}, ()),
        (2, {"ulysses", "hybrid(ulysses_degree=2)", "ring"}, ()),
        # A plugin's op is not padded: no degree splits its 3 heads.
        (-3, {"ring"}, ("ulysses: ", "hybrid: no ulysses_degree in [2] divides the heads")),
    ],
)
def test_heads_the_ranks_do_not_split_never_error(heads, expected, excluded):
    one = site(abs(heads), 1) if heads > 0 else dataclasses.replace(site(3, 1), spec=PLUGIN)
    choice = choose(ctx([one], 4, FAST_A2A))
    assert {e.label for e in choice.candidates} == expected
    for why in excluded:
        assert any(x.startswith(why) for x in choice.excluded), choice.excluded


def test_ulysses_and_hybrid_are_costed_with_the_heads_they_pad():
    # 6 heads over 4 ranks travel and are attended as 8, k/v repeated to the query heads first.
    padded, split = (cost.ulysses([s], 4, FAST_A2A) for s in (site(6, 2), site(8, 8)))
    assert (padded.comm_bytes, padded.compute_seconds) == pytest.approx((split.comm_bytes, split.compute_seconds))
    # 3 heads over ulysses groups of 2 as 4.
    padded, split = (cost.hybrid([s], 4, FAST_A2A, 2) for s in (site(3, 1), site(4, 4)))
    assert (padded.comm_bytes, padded.compute_seconds) == pytest.approx((split.comm_bytes, split.compute_seconds))


def test_a_length_the_ranks_do_not_split_evenly_keeps_every_variant_that_takes_one():
    # Every built-in variant takes pieces one token apart (hybrid once did not, and was left out).
    choice = choose(ctx([site(8, 8, seq=4095)], 4, FAST_A2A))
    assert {e.label for e in choice.candidates} == {"ulysses", "ring", "hybrid(ulysses_degree=2)"}


def test_hybrid_without_degrees_gets_the_cheapest_degree():
    choice = choose(ctx([site(8, 8)], 8, FAST_A2A, variant="hybrid"), only="hybrid")
    assert {e.label for e in choice.candidates} == {"hybrid(ulysses_degree=2)", "hybrid(ulysses_degree=4)"}
    assert choice.chosen.variant == "hybrid"


def test_hybrid_that_takes_no_degree_points_at_ring_when_installed():
    # sp_size=2: no ulysses_degree strictly between 1 and 2. Once: "install autosp-ring", installed.
    with pytest.raises(autosp.AutoSPError, match=r"no ulysses_degree.*\); use variant='ring' \(it takes any head"):
        choose(ctx([site(8, 8)], 2, FAST_A2A, variant="hybrid"), only="hybrid")


def test_auto_without_any_variant_names_the_packages():
    reg = SimpleNamespace(variants={}, manager=None)
    with pytest.raises(autosp.ConfigError, match="pip install autosp-ulysses"):
        type(get_registry()).variant(reg, "auto")


class Attention(torch.nn.Module):
    """One attention layer with an MLP, so SAC has matmuls to weigh against attention."""

    def __init__(self, heads=4, dim=32):
        super().__init__()
        self.h, self.d = heads, dim // heads
        self.qkv = torch.nn.Linear(dim, 3 * dim, bias=False)
        self.mlp = torch.nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.h, self.d).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)
        return self.mlp(out).pow(2).mean()


@pytest.fixture
def fake_two_ranks():
    # One rank of a 2-rank program, without peers: the compile decisions are what is tested.
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


# Two hand-written slow-compute nodes for a whole compile: on the first, all-to-all is fast and
# neighbour hops slow; on the second the reverse.
A2A_NODE = HardwareProfile(
    "a2a-node",
    "cpu",
    matmul_flops={"float32": 1e10},
    comm={"all_to_all": CommModel(latency=2e-6, bandwidth=4e11), "p2p": CommModel(latency=5e-3, bandwidth=1e9)},
)
P2P_NODE = HardwareProfile(
    "p2p-node",
    "cpu",
    matmul_flops={"float32": 1e10},
    comm={"all_to_all": CommModel(latency=1e-3, bandwidth=1e8), "p2p": CommModel(latency=1e-6, bandwidth=4e11)},
)


def test_sac_and_auto_follow_the_profile_file(fake_two_ranks, tmp_path):
    pytest.importorskip("autosp_sac", reason="the SAC half of this test needs autosp-sac")
    reports = {}
    for profile in (A2A_NODE, P2P_NODE):
        path = tmp_path / f"{profile.name}.json"
        save(profile, path)
        for variant in ("auto", "ulysses"):
            torch._dynamo.reset()
            compiled = autosp.compile(
                Attention(), sp_size=2, variant=variant, hardware=str(path), backend="aot_eager", check_inputs=False
            )
            compiled(torch.randn(1, 512, 32))
            reports[profile.name, variant] = compiled.autosp_reports[0]
    a2a, p2p = reports["a2a-node", "auto"], reports["p2p-node", "auto"]
    assert a2a.variant == "ulysses (chosen by variant='auto')" and p2p.variant == "ring (chosen by variant='auto')"
    assert f"hardware profile: a2a-node (from {tmp_path / 'a2a-node.json'}" in str(a2a)
    assert any("variant='auto' chose ulysses on a2a-node" in n for n in a2a.notes)
    # SAC's cost model: recomputing the all-to-alls pays where they are cheap, not where they are slow.
    assert reports["a2a-node", "ulysses"].sac["mode"] == "auto -> recompute"
    assert reports["p2p-node", "ulysses"].sac["mode"] == "auto -> default partitioner choices"


@pytest.fixture
def fake_four_ranks():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    yield
    dist.destroy_process_group()


def test_hybrid_without_degrees_compiles_with_the_chosen_degree(fake_four_ranks):
    torch._dynamo.reset()
    compiled = autosp.compile(
        Attention(heads=8),
        sp_size=4,
        variant="hybrid",
        hardware="h100-80gb",
        backend="aot_eager",
        check_inputs=False,
        sac=False,
    )
    compiled(torch.randn(1, 64, 32))
    report = compiled.autosp_reports[0]
    assert report.variant == "hybrid(ulysses_degree=2) (chosen by variant='hybrid')"
    assert "hybrid: ulysses_degree=2 x ring_degree=2" in report.notes
    assert report.collectives["ring_attention"] == 1  # the ring variant's own pass saw the chosen variant


def test_attention_over_a_shorter_length_decides_nothing():
    # Chunks of a sorted sequence where SDPA expects heads (3 of them, over 4 tokens each): no
    # sequence attention, computed by the engine's rules; hybrid's degree is the sequence's sites'.
    chunks = site(3, seq=4)
    choice = choose(ctx([site(8, 2), chunks], 4, FAST_A2A), only="hybrid")
    assert [e.label for e in choice.candidates] == ["hybrid(ulysses_degree=2)"]
    assert sequence_sites(ctx([site(8, 2), chunks], 4, FAST_A2A)) == [site(8, 2)]
    # Without the fix hybrid had no degree: none divides both 8 and 3 heads.


def test_a_dynamic_length_the_ranks_do_not_split_evenly_keeps_only_ulysses():
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    # A length marked dynamic (4095 at this call): ring and hybrid take uneven pieces of concrete lengths only.
    env = ShapeEnv()
    seq = env.create_symintnode(env.create_symbol(4095, source=ConstantSource("seq")), hint=4095)
    choice = choose(ctx([site(8, 8, seq=seq)], 4, FAST_A2A))
    assert {e.label for e in choice.candidates} == {"ulysses"}, choice.excluded
    assert any(
        x.startswith("ring: variant 'ring' takes no uneven pieces of a length marked dynamic") for x in choice.excluded
    )


def test_a_degree_that_a_site_found_after_lowering_does_not_split_is_chosen_for_again():
    # A site can appear only once lowered (nn.MultiheadAttention's SDPA call): the hybrid degree chosen
    # before it is kept where the site's heads travel padded (SDPA, Flex), and chosen again where they
    # cannot (a plugin's op whose heads the degree does not divide).
    chosen = choose(ctx([site(4, 4)], 4, FAST_A2A, variant="hybrid"), only="hybrid").chosen
    assert chosen.options == {"ulysses_degree": 2}
    assert _refuses_degree(chosen, ctx([site(4, 4), site(3, 1)], 4, FAST_A2A)) is None
    plugin = dataclasses.replace(site(3, 1), spec=PLUGIN)
    why = _refuses_degree(chosen, ctx([site(4, 4), plugin], 4, FAST_A2A))
    assert why == "ulysses_degree=2 does not divide every site's query heads", why
