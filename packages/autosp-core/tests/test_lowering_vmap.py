"""Lowering a graph that holds ``torch.func.vmap``: two traces, the vmaps run into plain aten ops.

Dynamo inlines a vmap as functorch level calls (``_vmap_increment_nesting``, ``_add_batch_dim``)
that functorch's ``functionalize`` cannot interpret inside its own level; such graphs were
refused (HF Mamba, FalconMamba and Jamba, whose reference scan is ``associative_scan``). The end
to end probes are ``vmap-*`` and ``associative-scan`` in integration_tests/test_probe_programs.py.
"""

from __future__ import annotations

import torch
from _core_helpers import capture_graphs
from torch._higher_order_ops.associative_scan import associative_scan
from torch._subclasses.fake_tensor import FakeTensorMode

from autosp.lowering import _has_vmap, lower_to_aten


def _program(x: torch.Tensor, w: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
    rows = torch.vmap(lambda r: (r @ w).softmax(-1), in_dims=1, out_dims=1)(x)  # per position
    gate = torch.sigmoid(x)

    def combine(left, right):
        return left[0] * right[0], right[0] * left[1] + right[1]

    _, scanned = associative_scan(combine, (gate, x * (1 - gate)), dim=1, combine_mode="generic")
    buf.add_(rows.detach().mean())  # an input written in place: the lowering keeps the write
    return rows.sum(-1) + scanned.sum(-1)


def test_a_graph_with_vmap_lowers_to_plain_aten_with_the_same_values_and_gradients():
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 6, 4, generator=gen), torch.randn(4, 4, generator=gen)
    (gm,), _ = capture_graphs(_program, x, w, torch.zeros(()))
    assert _has_vmap(gm)
    order = [n.name.removeprefix("l_").removesuffix("_") for n in gm.graph.nodes if n.op == "placeholder"]

    def run(fn):
        given = {"x": x, "w": w.clone().requires_grad_(), "buf": torch.zeros(())}
        out = fn(*(given[name] for name in order)) if fn is not _program else fn(**given)
        out = out[0] if isinstance(out, (tuple, list)) else out
        out.pow(2).sum().backward()
        return out, given["w"].grad, given["buf"]

    mode = FakeTensorMode()
    fakes = [mode.from_tensor(t) for t in (x, w.clone().requires_grad_(), torch.zeros(()))]
    aten_gm = lower_to_aten(gm, [dict(zip(("x", "w", "buf"), fakes))[name] for name in order], mode)
    assert not _has_vmap(aten_gm)
    calls = [n.target for n in aten_gm.graph.nodes if n.op == "call_function"]
    assert all(isinstance(t, torch._ops.OpOverload) or t.__name__ == "getitem" for t in calls), calls
    assert torch.ops.aten.copy_.default in calls  # the buffer's write, made functional then copied back
    for got, expected in zip(run(aten_gm), run(_program)):
        torch.testing.assert_close(got, expected)


def test_a_graph_with_torch_func_vjp_jvp_and_grad_lowers_with_the_same_values_and_gradients():
    """``torch.func.vjp``/``jvp``/``grad`` are functorch levels too (``_grad_increment_nesting``, ...):
    functionalization alone failed on them with an internal assert."""
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 6, 4, generator=gen), torch.randn(4, 4, generator=gen)

    def program(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        def f(t: torch.Tensor) -> torch.Tensor:
            return torch.tanh(t @ w)

        y, vjp = torch.func.vjp(f, x)
        (gx,) = vjp(torch.ones_like(y))
        _, tangent = torch.func.jvp(f, (x,), (gx,))
        return y + tangent + torch.func.grad(lambda t: f(t).square().sum())(x)

    (gm,), _ = capture_graphs(program, x, w)
    assert _has_vmap(gm)
    order = [n.name.removeprefix("l_").removesuffix("_") for n in gm.graph.nodes if n.op == "placeholder"]
    mode = FakeTensorMode()
    fakes = {"x": mode.from_tensor(x), "w": mode.from_tensor(w.clone().requires_grad_())}
    aten_gm = lower_to_aten(gm, [fakes[name] for name in order], mode)

    def run(fn):
        given = {"x": x, "w": w.clone().requires_grad_()}
        out = fn(*(given[name] for name in order)) if fn is not program else fn(**given)
        out = out[0] if isinstance(out, (tuple, list)) else out
        out.pow(2).sum().backward()
        return out, given["w"].grad

    for got, expected in zip(run(aten_gm), run(program)):
        torch.testing.assert_close(got, expected)
