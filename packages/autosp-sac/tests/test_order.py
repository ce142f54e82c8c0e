"""``sac.free_early``: a matmul that last reads a large activation moves up to its inputs, results unchanged."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode

from autosp_sac.order import free_early

aten = torch.ops.aten
T, D, F = 64, 8, 32  # tokens, model width, MLP width: the activation [T, F] is larger than dW [D, F]


def _graph(act_read_late: bool, write_between: bool = False) -> fx.GraphModule:
    """The tail of an MLP backward: dW = dy^T @ act comes after the input gradient's work."""
    g = fx.Graph()
    mode = FakeTensorMode()
    vals = {}

    def node(target, *args):
        n = g.call_function(target, args)
        with mode:
            n.meta["val"] = target(*fx.node.map_arg(args, lambda a: a.meta["val"]))
        return n

    def placeholder(name, *shape):
        n = g.placeholder(name)
        with mode:
            n.meta["val"] = vals[name] = torch.empty(shape)
        return n

    dy, w, act = placeholder("dy", T, D), placeholder("w", D, F), placeholder("act", T, F)
    d_act = node(aten.mm.default, dy, w)
    d_in = node(aten.mul.Tensor, d_act, d_act)
    late = node(aten.add.Tensor, d_in, act) if act_read_late else d_in
    if write_between:
        node(aten.mul_.Tensor, act, 2.0)  # after the input gradient, before dW: dW must read the doubled act
    dw = node(aten.mm.default, node(aten.t.default, dy), act)
    g.output((late, dw))
    return fx.GraphModule(torch.nn.Module(), g)


def _targets(gm: fx.GraphModule) -> list[str]:
    return [str(n.target).split(".")[-2] for n in gm.graph.nodes if n.op == "call_function"]


def _run(gm: fx.GraphModule) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    return gm(torch.randn(T, D, generator=gen), torch.randn(D, F, generator=gen), torch.randn(T, F, generator=gen))


def test_weight_gradient_moves_up_and_results_are_identical():
    gm = _graph(act_read_late=False)
    before = _run(gm)
    ctx = SimpleNamespace(report=SimpleNamespace(sac={}))
    free_early(gm, ctx)
    # dW (and the transpose feeding only it) now runs first, so ``act`` can be freed before d_act exists.
    assert _targets(gm) == ["t", "mm", "mm", "mul"]
    assert ctx.report.sac["matmuls moved up to free their inputs"] == 1
    for a, b in zip(before, _run(gm)):
        assert torch.equal(a, b)


def test_nothing_moves_when_the_activation_is_read_later_anyway():
    gm = _graph(act_read_late=True)
    order = _targets(gm)
    ctx = SimpleNamespace(report=SimpleNamespace(sac={}))
    free_early(gm, ctx)
    assert _targets(gm) == order
    assert ctx.report.sac["matmuls moved up to free their inputs"] == 0


def test_nothing_moves_across_an_in_place_write():
    gm = _graph(act_read_late=False, write_between=True)
    before, order = _run(gm), _targets(gm)
    ctx = SimpleNamespace(report=SimpleNamespace(sac={}))
    free_early(gm, ctx)
    assert _targets(gm) == order
    for a, b in zip(before, _run(gm)):
        assert torch.equal(a, b)
