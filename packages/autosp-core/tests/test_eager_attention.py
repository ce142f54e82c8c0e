"""Hand-written attention in the lowered graph: found, judged, and rewritten to SDPA only when exact."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from autosp.analysis.eager import find_eager_regions, may_mask_rows_finitely, region_site, rewrite_region
from autosp.lowering import SDPA, leaves_for_kernels

B, H, S, D = 2, 4, 6, 8
CAUSAL = torch.tril(torch.ones(S, S, dtype=torch.bool))
MIN = torch.finfo(torch.float32).min


def nano(q, k, v, mask):
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
    return F.softmax(att.masked_fill(~mask, float("-inf")), dim=-1) @ v


def hf(q, k, v, mask):
    att = torch.matmul(q, k.transpose(2, 3)) / 3.0 + torch.where(mask, 0.0, MIN)
    return torch.matmul(F.softmax(att, dim=-1, dtype=torch.float32).to(q.dtype), v)


def gpt2(q, k, v, mask):
    att = torch.matmul(q, k.transpose(-1, -2)) / torch.full([], 2.0)
    att = torch.where(mask, att, torch.full([], MIN))
    return torch.matmul(att.softmax(-1), v)


def scale_after_mask(q, k, v, mask):
    att = (q @ k.transpose(-2, -1)).masked_fill(~mask, MIN) * 0.25 - 1.5
    return att.softmax(-1) @ v


def padding_mask(q, k, v, mask):
    pad = torch.zeros(B, 1, 1, S)
    pad[0, ..., -2:] = MIN
    return ((q @ k.transpose(-2, -1)) * 0.3 + pad).softmax(-1) @ v


def softcap(q, k, v, mask):
    att = torch.tanh((q @ k.transpose(-2, -1)) / 5.0) * 5.0
    return att.masked_fill(~mask, float("-inf")).softmax(-1) @ v


def weights_returned(q, k, v, mask):
    p = (q @ k.transpose(-2, -1)).softmax(-1)
    return p @ v, p


def weak_mask(q, k, v, mask):
    return (q @ k.transpose(-2, -1)).masked_fill(~mask, -1e4).softmax(-1) @ v


def negative_scale(q, k, v, mask):
    return ((q @ k.transpose(-2, -1)) * -0.5).softmax(-1) @ v


def scores_twice(q, k, v, mask):
    s = q @ k.transpose(-2, -1)
    return (s + s).softmax(-1) @ v


def bias_minus_scaled_scores(q, k, v, mask):
    s = q @ k.transpose(-2, -1)
    return torch.sub(torch.zeros(S, S), s, alpha=-2.0).softmax(-1) @ v


def fp32_values(q, k, v, mask):
    return (q @ k.transpose(-2, -1)).softmax(-1).double() @ v.double()


def q_dependent_bias(q, k, v, mask):
    return ((q @ k.transpose(-2, -1)) + q.sum(-1, keepdim=True)).softmax(-1) @ v


def _flat(t):
    return t.reshape(B * H, S, D)


def bloom(q, k, v, mask):
    # BLOOM: per-head ALiBi and the scale inside baddbmm over merged batch and heads, a 4-D view masked.
    alibi = (torch.arange(1, H + 1.0)[:, None] * torch.arange(S)[None] / H).repeat(B, 1)[:, None, :]
    att = alibi.baddbmm(_flat(q), _flat(k).transpose(-1, -2), beta=0.5, alpha=0.3).view(B, H, S, S)
    p = F.softmax(att.masked_fill(~mask, float("-inf")), -1, dtype=torch.float32)
    return torch.bmm(p.view(B * H, S, S), _flat(v)).view(B, H, S, D)


def reordered(q, k, v, mask):
    # GPT-2's reordered attention: k transposed before flattening, a baddbmm into a tensor it ignores
    # (beta=0: the NaN in it must not come along).
    kt = k.transpose(-1, -2).reshape(B * H, D, S)
    att = torch.baddbmm(torch.full((B * H, S, S), float("nan")), _flat(q), kt, beta=0, alpha=0.25)
    att = torch.where(mask, att.view(B, H, S, S), torch.full([], float("-inf")))
    return torch.matmul(att.softmax(-1), v)


def bloom_min(q, k, v, mask):
    alibi = torch.zeros(B * H, 1, S).masked_fill(~mask[-1:], MIN)
    att = alibi.baddbmm(_flat(q), _flat(k).transpose(-1, -2), alpha=0.3).view(B, H, S, S)
    return torch.bmm(att.softmax(-1).view(B * H, S, S), _flat(v)).view(B, H, S, D)


def bias_from_q(q, k, v, mask):
    att = _flat(q).sum(-1, keepdim=True).baddbmm(_flat(q), _flat(k).transpose(1, 2)).view(B, H, S, S)
    return torch.bmm(att.softmax(-1).view(B * H, S, S), _flat(v)).view(B, H, S, D)


def negative_alpha(q, k, v, mask):
    att = torch.zeros(1, S, S).baddbmm(_flat(q), _flat(k).transpose(1, 2), alpha=-0.3).view(B, H, S, S)
    return torch.bmm(att.softmax(-1).view(B * H, S, S), _flat(v)).view(B, H, S, D)


def tensor_fill(q, k, v, mask):
    # The fill as a tensor the model makes: a constant of the traced graph.
    att = (q @ k.transpose(-2, -1)).masked_fill(~mask, torch.tensor(float("-inf"))) / 4.0
    return att.softmax(-1) @ v


def einsum_heads_first(q, k, v, mask):
    att = torch.einsum("bhqd,bhkd->bhqk", q, k) * 0.3
    return torch.einsum("bhqk,bhkd->bhqd", att.masked_fill(~mask, float("-inf")).softmax(-1), v)


def einsum_tokens_first(q, k, v, mask):
    # q, k, v as [B, S, H, d] (no transpose before attention), the output back in that layout.
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    att = torch.einsum("bqhd,bkhd->bhqk", q, k) / 2.0
    out = torch.einsum("bhqk,bkhd->bqhd", F.softmax(att.masked_fill(~mask, float("-inf")), -1, torch.float32), v)
    return out.transpose(1, 2)


def einsum_over_queries(q, k, v, mask):
    # The weights transposed (each key's distribution over the queries): the shapes match, not attention.
    att = torch.einsum("bhqd,bhkd->bhqk", q, k).softmax(-1)
    return torch.einsum("bhqk,bhqd->bhkd", att, v)


def _sinks():
    return torch.linspace(-1.0, 1.0, H)  # made inside the trace (a module's parameter in a real model)


def sinks_gpt_oss(q, k, v, mask):
    # GPT-OSS's eager attention: a logit per head joins the keys, the row's max is subtracted, the sink dropped.
    s = torch.matmul(q, k.transpose(2, 3)) * D**-0.5 + torch.where(mask, 0.0, float("-inf"))
    combined = torch.cat([s, _sinks().reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[-2], -1)], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    return torch.matmul(F.softmax(combined, dim=-1)[..., :-1], v)


def sinks_plain(q, k, v, mask):
    s = (q @ k.transpose(-2, -1) / math.sqrt(D)).masked_fill(~mask, float("-inf"))
    return torch.cat([s, _sinks().view(1, H, 1, 1).expand(B, H, S, 1)], -1).softmax(-1)[..., :S] @ v


def sink_column_kept(q, k, v, mask):
    # The sink's probability is used (its column multiplies a value row): not attention over the keys.
    s = (q @ k.transpose(-2, -1) / math.sqrt(D)).masked_fill(~mask, float("-inf"))
    p = torch.cat([s, _sinks().view(1, H, 1, 1).expand(B, H, S, 1)], -1).softmax(-1)
    return p @ torch.cat([v, v[:, :, :1]], 2)


def _inputs():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, H, S, D, generator=g) for _ in range(3)] + [CAUSAL]


def _lowered(fn):
    return make_fx(fn, tracing_mode="fake")(*_inputs())


def _ops(gm, target):
    return [n for n in gm.graph.nodes if n.target is target]


@pytest.mark.parametrize(
    "fn",
    [
        nano,
        hf,
        gpt2,
        scale_after_mask,
        padding_mask,
        bloom,
        reordered,
        einsum_heads_first,
        einsum_tokens_first,
        tensor_fill,
    ],
)
def test_sdpa_expressible_forms_become_one_exact_call(fn):
    gm = _lowered(fn)
    regions = find_eager_regions(gm)
    assert len(regions) == 1 and regions[0].why_not is None, [r.why_not for r in regions]
    rewrite_region(gm, regions[0], SDPA.leaf)
    gm = make_fx(gm, tracing_mode="fake")(*_inputs())  # meta values for the new nodes, as autosp.lower does
    assert len(_ops(gm, SDPA.leaf)) == 1
    assert not _ops(gm, torch.ops.aten.bmm.default) and not _ops(gm, torch.ops.aten._softmax.default)
    torch.testing.assert_close(gm(*_inputs()), fn(*_inputs()), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("fn", "why"),
    [
        (softcap, "not affine in the scores"),
        (weights_returned, "used outside the attention"),
        (weak_mask, "still weighs after softmax"),
        (negative_scale, "positive constant"),
        (q_dependent_bias, "mixes the scores"),
        (fp32_values, "different dtypes"),
        (scores_twice, "more than once"),
        (bias_minus_scaled_scores, "negates the scores"),
        (bias_from_q, "adds a bias computed from q"),
        (negative_alpha, "positive constant"),
        (sinks_gpt_oss, "sink logit per head"),
        (sinks_plain, "sink logit per head"),
    ],
)
def test_other_forms_are_found_and_kept(fn, why):
    regions = find_eager_regions(_lowered(fn))
    assert len(regions) == 1 and regions[0].why_not is not None and why in regions[0].why_not, [
        r.why_not for r in regions
    ]


def test_site_has_the_mask_shape_sdpa_gets():
    site = region_site(find_eager_regions(_lowered(padding_mask))[0])
    assert (site.seq_len, site.kv_seq_len, site.heads, site.kv_heads, site.head_dim) == (S, S, H, H, D)
    assert site.mask_shape == (B, 1, S, S)
    assert region_site(find_eager_regions(_lowered(nano))[0]).mask_shape == (1, 1, S, S)
    # baddbmm's bias is over batch * heads: the mask SDPA gets keeps both (ALiBi differs per head).
    assert region_site(find_eager_regions(_lowered(bloom))[0]).mask_shape == (B, H, S, S)
    assert region_site(find_eager_regions(_lowered(reordered))[0]).mask_shape == (1, 1, S, S)


def test_fully_masked_rows_agree():
    # A row with every key masked by the dtype's minimum is uniform in both forms (never NaN).
    mask = CAUSAL.clone()
    mask[0] = False
    q, k, v, _ = _inputs()
    gm = make_fx(scale_after_mask, tracing_mode="fake")(q, k, v, mask)
    rewrite_region(gm, find_eager_regions(gm)[0], SDPA.leaf)
    torch.testing.assert_close(gm(q, k, v, mask), scale_after_mask(q, k, v, mask), rtol=1e-5, atol=1e-6)


def alibi_like(q, k, v, mask):
    pos = torch.arange(S)
    return ((q @ k.transpose(-2, -1)) * 0.3 - 0.5 * (pos[None] - pos[:, None]).abs()).softmax(-1) @ v


def given_float_mask(q, k, v, mask):
    return ((q @ k.transpose(-2, -1)) * 0.3 + mask).softmax(-1) @ v


@pytest.mark.parametrize(
    ("fn", "finite"),
    [
        (nano, False),
        (alibi_like, False),
        (bloom, False),
        (hf, True),
        (gpt2, True),
        (scale_after_mask, True),
        (padding_mask, True),
        (bloom_min, True),
    ],
)
def test_masks_that_can_hold_a_finite_fill_are_told(fn, finite):
    """-inf fills and biases of ordinary size cannot leave a row fully masked by a finite value; the
    dtype's minimum can (SDPA's fused backward would then give that row n times its gradient)."""
    gm = _lowered(fn)
    assert may_mask_rows_finitely(gm, find_eager_regions(gm)[0], {}) is finite


def test_a_float_mask_passed_in_or_held_in_a_buffer_is_judged_by_what_it_can_hold():
    q, k, v, _ = _inputs()
    gm = make_fx(given_float_mask, tracing_mode="fake")(q, k, v, torch.zeros(S, S))
    region = find_eager_regions(gm)[0]
    mask_input = gm.graph.find_nodes(op="placeholder")[3]
    assert may_mask_rows_finitely(gm, region, {})  # an input: any value, call to call
    assert may_mask_rows_finitely(gm, region, {mask_input: torch.full((S, S), MIN)})  # a buffer holding MIN
    assert not may_mask_rows_finitely(gm, region, {mask_input: -torch.rand(S, S)})  # a buffer of small biases


def test_a_row_fully_masked_by_the_minimum_gets_other_gradients_from_sdpa():
    """Why such a mask keeps the attention as written: the fused kernel's backward, recomputing the row's
    weights from a log-sum-exp that rounded log(n) away, differs from the written softmax's."""
    mask = CAUSAL.clone()
    mask[0] = False
    q, k, v = (t.requires_grad_() for t in _inputs()[:3])
    bias = torch.zeros(S, S).masked_fill(~mask, MIN)
    written = torch.autograd.grad(((q @ k.transpose(-2, -1)) * 0.3 + bias).softmax(-1) @ v, v, torch.ones(B, H, S, D))
    fused = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, bias, scale=0.3), v, torch.ones(B, H, S, D))
    assert not torch.allclose(written[0], fused[0], rtol=1e-3)


def flat_heads(q, k, v, mask):
    # Older Hugging Face code (XGLM, BART before transformers 5): batch and heads merged, the mask
    # added on a 4-D view of the scores, a floor clamp, a 3-D softmax.
    q3, k3, v3 = (t.reshape(B * H, S, D) for t in (q, k, v))
    att = torch.bmm(q3, k3.transpose(1, 2)).view(B, H, S, S) + torch.where(mask, 0.0, MIN)
    att = torch.max(att, torch.tensor(MIN)).view(B * H, S, S)
    return torch.bmm(att.softmax(-1), v3).view(B, H, S, D)


def _kept_over_4d_inputs(fn, why: str):
    """The one region of ``fn``, kept as written for ``why``, with q, k and v the 4-D tensors they come
    from: the graph shards their dim 2, the sequence."""
    gm = _lowered(fn)
    (region,) = find_eager_regions(gm)
    assert region.why_not is not None and why in region.why_not
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert (region.q, region.k, region.v) == tuple(placeholders[:3])
    return region


def test_attention_over_merged_batch_and_heads_is_found_and_kept():
    region = _kept_over_4d_inputs(flat_heads, "[batch * heads, S, d]")
    assert region.output.target is torch.ops.aten.bmm.default


def flat_relative_terms(q, k, v, mask):
    # DeBERTa's disentangled attention: relative terms (a gather along the key axis of q's products
    # with position keys) added to the flat [B*H, S, S] scores, then a 4-D view for the mask and softmax.
    q3, k3, v3 = (t.reshape(B * H, S, D) for t in (q, k, v))
    pos_k = torch.arange(2 * S * D, dtype=q.dtype).reshape(2 * S, D) / (2 * S * D)
    rel = torch.arange(S)[None, :] - torch.arange(S)[:, None] + S
    c2p = torch.gather(q3 @ pos_k.T, -1, rel.expand(B * H, S, S))
    att = (torch.bmm(q3, k3.transpose(-1, -2)) + c2p).view(B, H, S, S).masked_fill(~mask, MIN)
    return torch.bmm(att.softmax(-1).view(B * H, S, S), v3).view(B, H, S, D)


def test_scores_changed_before_their_four_dimensional_view_are_found_and_kept():
    region = _kept_over_4d_inputs(flat_relative_terms, "before their [B, H, S, Sk] view")
    assert (region.shape4("q"), region.shape4("k")) == ((B, H, S, D), (B, H, S, D))


def test_multihead_attention_returning_its_weights_is_found_and_kept():
    # need_weights=True (nn.MultiheadAttention's default): bmm over [S, B*H, d] views transposed, no 4-D q.
    mha = torch.nn.MultiheadAttention(H * D, H, batch_first=True)

    def weights_returned_mha(q, k, v, mask):
        x = q.transpose(1, 2).reshape(B, S, H * D)
        return mha(x, x, x, need_weights=True)

    (region,) = find_eager_regions(make_fx(weights_returned_mha)(*_inputs()))
    assert region.why_not is not None and "[batch * heads, S, d]" in region.why_not
    assert region.merged == {"q", "k", "v"}
    assert (region.shape4("q")[2], region.shape4("k")[2]) == (S, S)  # what the graph shards by


def test_a_merged_batch_softmax_over_the_queries_is_not_attention():
    def over_queries(q, k, v, mask):
        q3, k3, v3 = (t.reshape(B * H, S, D) for t in (q, k, v))
        return torch.bmm(torch.bmm(q3, k3.transpose(1, 2)).softmax(1), v3)

    assert find_eager_regions(_lowered(over_queries)) == []


def test_einsum_over_the_queries_is_not_attention():
    assert find_eager_regions(_lowered(einsum_over_queries)) == []


def test_matmul_on_other_layouts_is_not_attention():
    # [B, S, H, D] scores over heads, softmax over the last axis: not a q @ k^T over the sequence.
    def heads_mix(x, y, z, mask):
        return (x.transpose(1, 2) @ y.transpose(1, 2).transpose(-2, -1)).softmax(-1).sum()

    assert find_eager_regions(_lowered(heads_mix)) == []


def test_sdpa_kernels_become_the_leaf():
    # What F.multi_head_attention_forward (kept whole by Dynamo) lowers to on CPU.
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default

    def attention_out(q, k, v, mask):
        return flash(q, k, v, 0.0, True)[0].transpose(1, 2).reshape(B, S, H * D)

    def lse_used(q, k, v, mask):
        out, lse = flash(q, k, v)
        return out.sum() + lse.sum()

    gm = _lowered(attention_out)
    assert leaves_for_kernels(gm) == 1
    gm = make_fx(gm, tracing_mode="fake")(*_inputs())
    assert len(_ops(gm, SDPA.leaf)) == 1 and not _ops(gm, flash)
    torch.testing.assert_close(gm(*_inputs()), attention_out(*_inputs()), rtol=1e-5, atol=1e-6)
    assert leaves_for_kernels(_lowered(lse_used)) == 0


def test_a_sink_whose_probability_is_used_is_not_attention():
    assert find_eager_regions(_lowered(sink_column_kept)) == []


def test_a_sink_region_has_the_sites_lengths():
    (region,) = find_eager_regions(_lowered(sinks_gpt_oss))
    site = region_site(region)
    assert (site.seq_len, site.kv_seq_len, site.heads, site.head_dim) == (S, S, H, D)
