"""The Ulysses variant as registered: found through its entry point, and its compile-time check."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from autosp import AutoSPError
from autosp.analysis.attention import AttentionSite, AttentionSpec
from autosp.lowering import SDPA
from autosp.registry import build_registry
from autosp_ulysses import ULYSSES


def _site(heads: int, kv_heads: int) -> AttentionSite:
    return AttentionSite("sdpa", SDPA, 1, heads, kv_heads, 64, 64, 16, True, None, None)


def test_registered_through_the_entry_point():
    reg = build_registry()
    assert reg.variant("ulysses") is ULYSSES
    assert "autosp-ulysses" in reg.plugin_names()


def test_heads_must_divide_sp_size_only_where_the_attention_op_is_a_plugins():
    from autosp.lowering import FLEX

    ULYSSES.check(_site(8, 2), 4)  # 2 kv heads on 4 ranks are replicated, not an error
    ULYSSES.check(_site(6, 2), 4)  # SDPA: padded to 8 heads
    ULYSSES.check(AttentionSite("flex", FLEX, 1, 6, 2, 64, 64, 16, True, None, None), 4)  # Flex: padded too
    plugin = AttentionSpec("plugin_attn", targets=(torch.ops.aten.scaled_dot_product_attention.default,))
    site = AttentionSite("plugin", plugin, 1, 6, 2, 64, 64, 16, True, None, None)
    with pytest.raises(AutoSPError, match=r"6 query heads, not divisible by sp_size=4.*variant='ring'"):
        ULYSSES.check(site, 4)
    # A plugin's op that declares it computes each head alone, reading no head index: padded.
    ULYSSES.check(
        AttentionSite("plugin", dataclasses.replace(plugin, pads_heads=True), 1, 6, 2, 64, 64, 16, True, None, None), 4
    )


@pytest.mark.parametrize(
    ("world", "seq", "heads", "kv_heads", "chunks", "mask"),
    [
        (3, 6, 4, 4, 1, None),  # causal; 6 padded heads, 2 per rank
        (3, 6, 4, 2, 1, "bool"),  # GQA, k/v repeated to 4 heads first; a per-head boolean mask
        (4, 8, 6, 3, 2, "float"),  # 8 heads in two pipelined groups per rank; a per-head additive bias
        (3, 7, 4, 1, 1, "row"),  # multi-query, a length split unevenly too; a [B, 1, S, S] mask
        (2, 6, 5, 5, 1, "bool"),  # an odd head count over two ranks
    ],
)
def test_heads_the_ranks_do_not_split_are_padded_with_zero_heads(world, seq, heads, kv_heads, chunks, mask):
    # Exact values and gradients, and the same exchanges as a head count the ranks split (k/v
    # repeated to it): q, k and v are never gathered whole.
    import torch

    from autosp.sharding import Shard
    from autosp.sharding.testing import check_op, shard

    def run(h, kv):
        gen = torch.Generator().manual_seed(h)
        q = torch.randn(2, h, seq, 4, generator=gen)
        k, v = (torch.randn(2, kv, seq, 4, generator=gen) for _ in range(2))
        kwargs = {"is_causal": mask is None, "enable_gqa": kv != h}
        placements = [shard(2)] * 3
        if mask is not None:
            shape = (2, 1 if mask == "row" else h, seq, seq)
            m = torch.rand(shape, generator=gen) > 0.4 if mask != "float" else torch.randn(shape, generator=gen)
            if m.dtype == torch.bool:
                m |= torch.eye(seq, dtype=torch.bool)  # kernels disagree on a fully masked row
            kwargs["attn_mask"] = m
            placements.append(shard(2))
        site = AttentionSite("op", SDPA, 2, h, kv, seq, seq, 4, mask is None, None, torch.float32)
        return check_op(
            torch.ops.aten.scaled_dot_product_attention.default,
            (q, k, v),
            kwargs,
            placements=placements,
            world=world,
            expect=[Shard],
            requires_grad=[True] * 3 + [False] * (len(placements) - 3),  # SDPA takes no gradient for a mask
            context={
                "attention_rule": ULYSSES.attention_rule,
                "sites": {"op": site},
                "variant_options": {"ulysses_chunks": chunks},
            },
        )

    def exchanges(report):
        return [c for c in report.collectives if c.startswith("all_to_all")]

    padded = -(-heads // world) * world
    got = exchanges(run(heads, kv_heads))
    assert len(got) >= 2 and got == exchanges(run(padded, padded)), got


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_ulysses_chunks_is_checked(bad):
    from autosp import ConfigError
    from autosp_ulysses.attention import chunk_option

    assert chunk_option({}) == 1 and chunk_option({"ulysses_chunks": 3}) == 3
    with pytest.raises(ConfigError, match=r"ulysses_chunks=.*use an int >= 1"):
        chunk_option({"ulysses_chunks": bad})


@pytest.mark.parametrize(("world", "heads", "kv_heads"), [(2, 4, 1), (4, 4, 2), (3, 6, 1)])
def test_fewer_kv_heads_than_ranks_is_exact_and_leaves_no_fake_tensor_in_the_program(world, heads, kv_heads):
    # The kv heads are repeated to a multiple of the ranks; the repeated value's global shape once
    # came from an op traced on the lowering's fake tensor, which the program then took as an input
    # (unused on CPU, a crash in Inductor's alignment check on CUDA). check_op traces as autosp.shard
    # does and refuses such a program.
    import torch

    from autosp.sharding.testing import check_op, shard

    seq, dim = 6 * world, 8
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, heads, seq, dim, generator=gen)
    k, v = (torch.randn(1, kv_heads, seq, dim, generator=gen) for _ in range(2))
    site = AttentionSite("op", SDPA, 1, heads, kv_heads, seq, seq, dim, True, None, torch.float32)
    report = check_op(
        torch.ops.aten.scaled_dot_product_attention.default,
        (q, k, v),
        {"is_causal": True, "enable_gqa": True},
        placements=[shard(2)] * 3,
        world=world,
        expect=[None],
        context={"attention_rule": ULYSSES.attention_rule, "sites": {"op": site}},
    )
    assert any("all_to_all" in c for c in report.collectives), report.collectives


@pytest.mark.parametrize(
    ("world", "seq", "heads", "kv_heads", "chunks", "causal"),
    [
        (2, 7, 4, 4, 1, True),  # pieces of 3 and 4
        (3, 10, 6, 2, 1, False),  # 3, 3, 4; GQA
        (4, 9, 4, 1, 1, True),  # 2, 2, 2, 3; one kv head repeated over the ranks
        (2, 5, 8, 2, 2, True),  # head groups pipelined, each exchange padded
        (4, 6, 8, 8, 2, False),  # 1, 2, 1, 2
    ],
)
def test_a_length_the_ranks_do_not_split_evenly_is_exchanged_padded(world, seq, heads, kv_heads, chunks, causal):
    # Balanced pieces one token apart travel padded to equal blocks (autosp_ulysses.uneven): exact
    # values and gradients, and no q, k or v gathered whole.
    import torch

    from autosp.sharding import Shard
    from autosp.sharding.testing import check_op, shard

    def run(length):
        gen = torch.Generator().manual_seed(length)
        q = torch.randn(2, heads, length, 4, generator=gen)
        k, v = (torch.randn(2, kv_heads, length, 4, generator=gen) for _ in range(2))
        site = AttentionSite("op", SDPA, 2, heads, kv_heads, length, length, 4, causal, None, torch.float32)
        return check_op(
            torch.ops.aten.scaled_dot_product_attention.default,
            (q, k, v),
            {"is_causal": causal, "enable_gqa": kv_heads != heads},
            placements=[shard(2)] * 3,
            world=world,
            expect=[Shard],
            context={
                "attention_rule": ULYSSES.attention_rule,
                "sites": {"op": site},
                "variant_options": {"ulysses_chunks": chunks},
            },
        )

    # The same exchanges as the next length the ranks split evenly (the padded one); the one
    # all-gather is check_op's own, making the output whole to compare it.
    padded = -(-seq // world) * world
    assert run(seq).collectives == run(padded).collectives


def test_uneven_lengths_are_declared():
    assert ULYSSES.uneven  # core refuses such a length for a variant without it (autosp.variants.refuses_length)
