"""The plugin op against SDPA with the equivalent mask, and its registration (one process)."""

import torch
import torch.nn.functional as F

import autosp_window  # noqa: F401
from autosp.registry import build_registry


def test_matches_masked_sdpa_forward_and_backward():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 16, 8, generator=gen, requires_grad=True)
    k = torch.randn(2, 2, 16, 8, generator=gen, requires_grad=True)
    v = torch.randn(2, 2, 16, 8, generator=gen, requires_grad=True)
    pos = torch.arange(16)
    mask = (pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] < 5)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    ref_grads = torch.autograd.grad(ref.sum(), (q, k, v))
    out = torch.ops.autosp_window.sliding_window_attention(q, k, v, 5)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    torch.testing.assert_close(out, ref)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r)


def test_registered_as_sliding_window_attention():
    spec = build_registry().attention["sliding_window"]
    assert torch.ops.autosp_window.sliding_window_attention.default in spec.targets
    assert spec.mask is None and spec.layout == "BHSD"
