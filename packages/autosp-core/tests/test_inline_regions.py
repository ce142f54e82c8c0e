"""``autosp.passes.inline_regions``: nested compile regions become ordinary ops of the graph."""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch
from _core_helpers import capture_graphs

from autosp.passes.inline_regions import inline_regions


@torch.compiler.nested_compile_region
def _block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.relu(x @ w) + x


def _program(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return _block(_block(x, w), w.t()).sum(-1) + _block(x, w * 2).mean(-1)


def _invokes(gm: torch.fx.GraphModule) -> int:
    return sum(n.target is torch.ops.higher_order.invoke_subgraph for n in gm.graph.nodes)


def test_regions_are_inlined_with_the_same_values_and_gradients() -> None:
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 4, generator=gen), torch.randn(4, 4, generator=gen)
    (gm,), _ = capture_graphs(_program, x, w)
    assert _invokes(gm) >= 2  # Dynamo may trace a call inline (here, one of the three)
    order = [n.name.removeprefix("l_").removesuffix("_") for n in gm.graph.nodes if n.op == "placeholder"]

    def run(fn):
        given = {"x": x, "w": w.clone().requires_grad_()}
        out = fn(*(given[name] for name in order)) if fn is not _program else fn(**given)
        out = out[0] if isinstance(out, (tuple, list)) else out
        out.square().sum().backward()
        return out, given["w"].grad

    expected = run(_program)
    assert inline_regions(gm, None) is gm
    assert _invokes(gm) == 0
    assert not [m for m in gm.modules() if m is not gm and isinstance(m, torch.fx.GraphModule) and _invokes(m)]
    for got, want in zip(run(gm), expected):
        torch.testing.assert_close(got, want)
    assert inline_regions(gm, None) is None  # nothing left: the graph is unchanged


def _calling(
    name: str, body: torch.fx.GraphModule, then: Callable[[torch.fx.Node], torch.fx.Node]
) -> torch.fx.GraphModule:
    """A graph ``x -> then(invoke_subgraph(body, x)[0])``, built as Dynamo builds one."""
    g = torch.fx.Graph()
    x = g.placeholder("x")
    call = g.call_function(torch.ops.higher_order.invoke_subgraph, (g.get_attr(name), name, x))
    g.output((then(g.call_function(operator.getitem, (call, 0))),))
    return torch.fx.GraphModule({name: body}, g)


def test_a_region_called_inside_a_region_is_inlined_too() -> None:
    """Dynamo flattens such calls today; a graph that holds one (another torch, a hand-made graph) is
    inlined to the bottom all the same."""
    inner = torch.fx.symbolic_trace(lambda x: (torch.relu(x) + x,))
    outer = _calling("inner", inner, lambda y: y.graph.call_function(torch.mul, (y, 2.0)))
    top = _calling("outer", outer, lambda y: y.graph.call_function(torch.sin, (y,)))
    x = torch.randn(3, 4)
    expected = top(x)
    assert inline_regions(top, None) is top
    assert _invokes(top) == 0
    torch.testing.assert_close(top(x), expected)
    torch.testing.assert_close(expected[0], torch.sin((torch.relu(x) + x) * 2.0))


def test_writes_whose_results_go_unused_stay() -> None:
    """FX counts a method call such as ``buf.add_(1)`` pure: dead-code elimination after the inlining
    would drop a buffer's update whose result the program does not use."""

    def program(x: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
        buf.add_(1.0)
        return _block(_block(x, x), x)

    x, buf = torch.randn(4, 4), torch.zeros(3)
    (gm,), _ = capture_graphs(program, x, buf)
    assert _invokes(gm) >= 1
    inline_regions(gm, None)
    assert _invokes(gm) == 0
    order = [n.name.removeprefix("l_").removesuffix("_") for n in gm.graph.nodes if n.op == "placeholder"]
    fresh = torch.zeros(3)
    gm(*({"x": x, "buf": fresh}[name] for name in order))
    assert fresh.tolist() == [1.0, 1.0, 1.0]
