"""SDPA on other than 4 dims rewritten to SDPA on 4 (autosp.passes.fold_attention_batch), on one process.

The rewritten Dynamo graph must compute what the program did, values and gradients, and leave every
SDPA call on 4-D q/k/v, the layout the attention analysis and the variants read. Whole programs at
sp > 1 are in integration_tests/test_probe_programs.py (probes chunk-local and sdpa-3d).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from _core_helpers import capture_graphs

from autosp.passes.fold_attention_batch import fold_attention_batch

N, L, E = 6, 8, 4  # batch * heads, length, head size


def three_d(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def three_d_bool_mask(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(L, L, dtype=torch.bool).tril())


def three_d_bias(q, k, v):
    # A bias per batch-times-head entry: its leading dim is q's and must stay aligned with it.
    slopes = torch.arange(1, N + 1, dtype=q.dtype).view(N, 1, 1)
    pos = torch.arange(L)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=-(pos[:, None] - pos[None, :]).abs() * slopes)


def two_d(q, k, v):
    return torch.stack([F.scaled_dot_product_attention(q[i], k[i], v[i], is_causal=True) for i in range(2)])


def five_d(q, k, v):
    f = lambda t: t.view(2, 3, L, E).unflatten(2, (2, L // 2)).transpose(1, 2)  # noqa: E731 - [2, 2, 3, L/2, E]
    o = F.scaled_dot_product_attention(f(q), f(k), f(v), is_causal=True)
    return o.transpose(1, 2).flatten(2, 3).reshape(N, L, E)


def dynamo_graph(fn, *inputs: torch.Tensor) -> torch.fx.GraphModule:
    (gm,), _ = capture_graphs(fn, *inputs)
    return gm


def sdpa_dims(gm: torch.fx.GraphModule) -> list[int]:
    return [
        n.args[0].meta["example_value"].dim()
        for n in gm.graph.nodes
        if n.op == "call_function" and n.target is F.scaled_dot_product_attention
    ]


def by_name(gm: torch.fx.GraphModule):
    """``gm`` called as ``fn(q, k, v)``: Dynamo orders its inputs by first use, not as the arguments."""
    names = [n.target for n in gm.graph.find_nodes(op="placeholder")]
    return lambda q, k, v: gm(*({"L_q_": q, "L_k_": k, "L_v_": v}[n] for n in names))


def values_and_grads(fn, *inputs: torch.Tensor) -> list[torch.Tensor]:
    inputs = [t.clone().requires_grad_() for t in inputs]
    out = fn(*inputs)
    out = out[0] if isinstance(out, tuple) else out  # a Dynamo graph returns a tuple
    out.square().sum().backward()
    return [out.detach(), *(t.grad for t in inputs)]


@pytest.mark.parametrize(
    ("fn", "dims_before"),
    [(three_d, [3]), (three_d_bool_mask, [3]), (three_d_bias, [3]), (two_d, [2, 2]), (five_d, [5])],
)
def test_sdpa_on_other_dims_becomes_sdpa_on_four_and_computes_the_same(fn, dims_before):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(N, L, E, generator=g) for _ in range(3))
    if fn is two_d:
        q, k, v = (t[:2] for t in (q, k, v))
    gm = dynamo_graph(fn, q, k, v)
    assert sdpa_dims(gm) == dims_before
    ctx = SimpleNamespace(report=SimpleNamespace(notes=[]))
    assert fold_attention_batch(gm, ctx) is gm
    assert sdpa_dims(gm) == [4] * len(dims_before)
    assert len(ctx.report.notes) == len(dims_before) and not any("left as is" in n for n in ctx.report.notes)
    for got, expected in zip(values_and_grads(by_name(gm), q, k, v), values_and_grads(fn, q, k, v)):
        torch.testing.assert_close(got, expected)


def test_sdpa_on_four_dims_is_left_alone():
    q = torch.randn(2, 3, L, E)
    gm = dynamo_graph(lambda a, b, c: F.scaled_dot_product_attention(a, b, c), q, q, q)
    assert fold_attention_batch(gm, SimpleNamespace(report=SimpleNamespace(notes=[]))) is None
