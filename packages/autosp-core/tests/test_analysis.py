"""Attention sites and their axes, inferred from Dynamo graphs of models written in different styles."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _core_helpers import capture_graphs

import autosp
from autosp import AttentionSpec, AutoSPError
from autosp.analysis.attention import find_attention_sites
from autosp.lowering import SDPA


def _sites(graphs, specs=(SDPA,)):
    return [s for gm in graphs for s in find_attention_sites(gm, list(specs))]


def _axes(site):
    return (site.batch, site.heads, site.kv_heads, site.seq_len, site.kv_seq_len, site.head_dim, site.is_causal)


def test_llama_like_rope_gqa():
    from autosp.testing.models import Config, LlamaLike

    torch.manual_seed(0)
    ids = torch.randint(0, 96, (2, 16))
    graphs, _ = capture_graphs(LlamaLike(Config(dim=64, heads=4, kv_heads=2, layers=2)), ids, ids)
    sites = _sites(graphs)
    assert len(sites) == 2
    for s in sites:
        # kv is repeated to the query heads before SDPA (repeat_kv), so SDPA sees 4 kv heads.
        assert _axes(s) == (2, 4, 4, 16, 16, 16, True)
        assert s.mask_shape is None and s.dtype == torch.float32 and s.spec is SDPA
        assert (s.axis("B"), s.axis("H"), s.axis("S"), s.axis("D")) == (0, 1, 2, 3)
    assert "B=2 H=4 S=16 D=16, causal" in sites[0].describe()


def test_llama_like_sliding_window_mask():
    from autosp.testing.models import Config, LlamaLike

    ids = torch.randint(0, 96, (1, 8))
    graphs, _ = capture_graphs(LlamaLike(Config(layers=1, window=4)), ids, ids)
    (site,) = _sites(graphs)
    assert _axes(site) == (1, 4, 4, 8, 8, 16, False)
    assert site.mask_shape == (1, 1, 8, 8)
    assert "mask [1, 1, 8, 8]" in site.describe()


def test_gpt2_like():
    from autosp.testing.models import Config, GPT2Like

    ids = torch.randint(0, 96, (3, 12))
    graphs, _ = capture_graphs(GPT2Like(Config(dim=48, heads=6, layers=3)), ids, ids)
    sites = _sites(graphs)
    assert len(sites) == 3
    assert all(_axes(s) == (3, 6, 6, 12, 12, 8, True) for s in sites)
    assert len({s.name for s in sites}) == 3


def test_hf_llama_gqa():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 64, (2, 8))
    graphs, out = capture_graphs(model, input_ids=ids, labels=ids)
    assert torch.isfinite(out.loss)
    sites = _sites(graphs)
    assert len(sites) == 2
    for s in sites:
        assert _axes(s) == (2, 4, 2, 8, 8, 8, True)  # HF passes un-repeated kv with enable_gqa
    assert "GQA 4:2" in sites[0].describe()


def test_custom_layout_and_positions():
    """A plugin-style spec: a BSHD attention op with q/k/v at other argument positions."""

    @torch.library.custom_op("autosp_unittest::bshd_attn", mutates_args=())
    def bshd_attn(scale: float, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale
        ).transpose(1, 2)

    @bshd_attn.register_fake
    def _(scale, q, k, v):
        return torch.empty_like(q)

    spec = AttentionSpec("bshd", targets=(torch.ops.autosp_unittest.bshd_attn.default,), layout="BSHD", qkv=(1, 2, 3))

    def f(x, kv):
        return bshd_attn(0.5, x, kv, kv)

    graphs, _ = capture_graphs(f, torch.randn(2, 10, 3, 4), torch.randn(2, 6, 1, 4))
    (site,) = _sites(graphs, [SDPA, spec])
    assert site.spec is spec
    assert _axes(site) == (2, 3, 1, 10, 6, 4, False)
    assert (site.axis("S"), site.axis("H")) == (1, 2)


def test_layout_rank_mismatch_is_an_autosp_error():
    graphs, _ = capture_graphs(lambda q: F.scaled_dot_product_attention(q, q, q), torch.randn(2, 4, 8))
    with pytest.raises(AutoSPError, match=r"q has 3 dims but layout 'BHSD' of sdpa expects 4 .*q.unsqueeze\(1\)"):
        _sites(graphs)


def test_positional_mask_and_causal_flag():
    q, mask = torch.randn(1, 2, 6, 4), torch.ones(6, 6, dtype=torch.bool).tril()
    graphs, _ = capture_graphs(lambda q, m: F.scaled_dot_product_attention(q, q, q, m), q, mask)
    (site,) = _sites(graphs)
    assert site.mask_shape == (6, 6) and not site.is_causal
    graphs, _ = capture_graphs(lambda q: F.scaled_dot_product_attention(q, q, q, None, 0.0, True), q)
    (site,) = _sites(graphs)
    assert site.mask_shape is None and site.is_causal


def test_no_sites():
    graphs, _ = capture_graphs(lambda x: (x @ x.T).softmax(-1), torch.randn(4, 4))
    assert _sites(graphs) == []


def test_explain_mentions_the_sites():
    from autosp.testing.models import Config, GPT2Like

    torch.manual_seed(0)
    ids = torch.randint(0, 96, (2, 8))
    text = autosp.explain(GPT2Like(Config(layers=2)), ids, ids, sp_size=1)
    assert "variant=ulysses sp_size=1 rank=0 backend=aot_eager" in text
    assert "attention sites: 2" in text
    assert text.count("[sdpa] B=2 H=4 S=8 D=16, causal") == 2
    assert "autosp.find_attention" in text
