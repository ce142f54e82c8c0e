"""Lowering keeps what ``no_grad`` means: values made under it carry no gradient in the aten graph.

The aten graph records ops, not grad mode, and AOT autograd differentiates the rewritten graph;
a buffer's running mean or a self-distillation target made under ``no_grad`` once got a gradient
there (silently wrong parameter gradients; the end-to-end probes are ``ema-buffer`` and
``no-grad-target`` in integration_tests/test_probe_programs.py).
"""

from __future__ import annotations

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode

from autosp.lowering import lower_to_aten


def _dynamo_like() -> fx.GraphModule:
    """``y = x * w; with no_grad: z = y.sum() * 2 (a method, then a function); return y * z``, with the
    grad-mode changes written as Dynamo writes them: calls of ``torch._C._set_grad_enabled``."""
    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    y = g.call_function(torch.mul, (x, w))
    g.call_function(torch._C._set_grad_enabled, (False,))
    z = g.call_method("sum", (y,))
    z2 = g.call_function(torch.mul, (z, 2.0))
    g.call_function(torch._C._set_grad_enabled, (True,))
    out = g.call_function(torch.mul, (y, z2))
    g.output((out,))
    return fx.GraphModule(torch.nn.Module(), g)


def _grad(fn, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    w = w.clone().requires_grad_()
    (out,) = fn(x, w)
    out.sum().backward()
    return w.grad


def test_values_made_under_no_grad_carry_no_gradient():
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, 3, generator=gen), torch.randn(4, 3, generator=gen)
    gm = _dynamo_like()
    expected = _grad(gm, x, w)  # eager: z is a constant, so dw = x * z2
    mode = FakeTensorMode()
    fake = [mode.from_tensor(x), mode.from_tensor(w.clone().requires_grad_())]
    aten_gm = lower_to_aten(gm, fake, mode)
    assert any(n.target == torch.ops.aten.detach.default for n in aten_gm.graph.nodes)
    torch.testing.assert_close(_grad(aten_gm, x, w), expected, rtol=0, atol=0)
    # Through z as well, the gradient would be twice as large.
    assert not torch.allclose(4 * (x * w).sum() * x, expected)
