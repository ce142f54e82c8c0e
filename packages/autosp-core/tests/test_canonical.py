"""The canonical form the SP ranks compile: inputs by name, pure work in an order of the program's own."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from autosp.canonical import (
    canonical_nodes,
    canonical_order,
    inputs_in_canonical_order,
    lowered_code,
    natural_key,
    permuted,
    program_code,
)


def _branches(first: str, apart: bool = False):
    """Two independent branches computed in the order ``first`` names, as a loop over a set would;
    ``apart``: both returned, never joined."""

    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        out = {}
        for kind in ("a", "b") if first == "a" else ("b", "a"):
            y = x @ w if kind == "a" else x.sin() * 2
            out[kind] = y.cumsum(0) + (1.0 if kind == "a" else 3.0)
        return (out["a"], out["b"]) if apart else out["a"] * out["b"].exp()

    return fn


def _lowered(fn, *args: torch.Tensor) -> torch.fx.GraphModule:
    return make_fx(fn)(*args)


def _through(first: str, effect):
    """Branch a (a sine) and branch b (a cosine) each through ``effect``, in the order ``first`` names."""

    def fn(x: torch.Tensor) -> torch.Tensor:
        out = {kind: effect(x.sin() if kind == "a" else x.cos()) for kind in (first, "b" if first == "a" else "a")}
        return out["a"] + out["b"]

    return fn


def test_natural_order_of_names() -> None:
    names = ["L_layers_10_w", "L_layers_2_w", "L_x_", "L_layers_2_b", "G_t"]
    assert sorted(names, key=natural_key) == ["G_t", "L_layers_2_b", "L_layers_2_w", "L_layers_10_w", "L_x_"]


@pytest.mark.parametrize("apart", [False, True], ids=["joined", "apart"])
def test_independent_work_in_either_order_becomes_one_graph(apart: bool) -> None:
    x, w = torch.randn(4, 4), torch.randn(4, 4)
    a, b = _lowered(_branches("a", apart), x, w), _lowered(_branches("b", apart), x, w)
    assert a.code != b.code  # traced as written: another order, other names
    expected = _branches("a", apart)(x, w)
    assert canonical_order(a) and canonical_order(b)
    assert a.code == b.code and lowered_code(a) == lowered_code(b)
    torch.testing.assert_close(a(x, w), expected, rtol=0, atol=0)
    torch.testing.assert_close(b(x, w), expected, rtol=0, atol=0)
    # Names follow the new order: the first `cumsum` is the one the output reads first.
    assert [n.name for n in a.graph.nodes if n.op == "call_function" and "cumsum" in n.name] == ["cumsum", "cumsum_1"]


def test_random_draws_keep_their_order_and_pure_work_never_crosses_one() -> None:
    def draw(y: torch.Tensor) -> torch.Tensor:
        return y * torch.rand_like(y)

    x = torch.randn(4)
    a, b = _lowered(_through("a", draw), x), _lowered(_through("b", draw), x)
    assert canonical_order(a) and canonical_order(b)
    # Other draws in another order: other programs, and the canonical forms say so.
    assert a.code != b.code
    nodes = [n for n in a.graph.nodes if n.op == "call_function"]
    rand = [i for i, n in enumerate(nodes) if n.target is torch.ops.aten.rand_like.default]
    sin = next(i for i, n in enumerate(nodes) if n.target is torch.ops.aten.sin.default)
    cos = next(i for i, n in enumerate(nodes) if n.target is torch.ops.aten.cos.default)
    assert sin < rand[0] < cos < rand[1]  # as traced: the sine before the first draw, the cosine after it
    torch.manual_seed(0)
    expected = _through("a", draw)(x)
    torch.manual_seed(0)
    torch.testing.assert_close(a(x), expected, rtol=0, atol=0)


@torch.library.custom_op("autosp_canonical_test::record", mutates_args=())
def _record(x: torch.Tensor) -> torch.Tensor:
    """A custom op whose schema writes nothing, as one that runs a user's hook may be."""
    return x.clone()


@_record.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def test_ops_beyond_aten_keep_their_order() -> None:
    x = torch.randn(3)
    a, b = _lowered(_through("a", _record), x), _lowered(_through("b", _record), x)
    assert canonical_order(a) and canonical_order(b)
    assert a.code != b.code
    recorded = [n.args[0].target for n in a.graph.nodes if n.target is torch.ops.autosp_canonical_test.record.default]
    assert recorded == [torch.ops.aten.sin.default, torch.ops.aten.cos.default]


@pytest.mark.parametrize("dropout_p", [0.0, 0.1])
def test_attention_is_an_effect_only_when_it_draws_dropout(dropout_p: float) -> None:
    """The attention leaf with dropout draws from the generator: two of them swapped would each get the
    other's numbers, not the single-device program's."""
    from autosp.lowering import SDPA

    def attend(y: torch.Tensor) -> torch.Tensor:
        return SDPA.leaf(y, y, y, dropout_p=dropout_p)

    q = torch.randn(1, 2, 4, 8)
    a, b = _lowered(_through("a", attend), q), _lowered(_through("b", attend), q)
    assert canonical_order(a) and canonical_order(b)
    assert (a.code == b.code) == (dropout_p == 0.0)


def test_writes_stay_where_they_were() -> None:
    def fn(x: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
        y = x.sin()
        buf.add_(1)
        return y + buf.cos()

    from torch.func import functionalize

    x, buf = torch.randn(3), torch.zeros(3)
    gm = _lowered(functionalize(fn, remove="mutations"), x, buf)
    order = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert canonical_order(gm)
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"].index(torch.ops.aten.copy_.default) == (
        order.index(torch.ops.aten.copy_.default)
    )
    ref = buf.clone()
    expected = fn(x, ref)
    torch.testing.assert_close(gm(x, buf), expected)
    torch.testing.assert_close(buf, ref)


def test_a_dead_pure_node_leaves_the_graph_as_traced() -> None:
    gm = _lowered(lambda x: x.sin(), torch.randn(3))
    with gm.graph.inserting_before(next(iter(gm.graph.find_nodes(op="output")))):
        gm.graph.call_function(torch.ops.aten.cos.default, (next(iter(gm.graph.find_nodes(op="placeholder"))),))
    before = list(gm.graph.nodes)
    assert canonical_nodes(gm.graph) is None and not canonical_order(gm)
    assert list(gm.graph.nodes) == before


def _dynamo_like(first: str) -> torch.fx.GraphModule:
    """A graph with inputs lifted in the order the trace used them (Dynamo's)."""
    graph = torch.fx.Graph()
    names = ("L_a_", "L_b_") if first == "a" else ("L_b_", "L_a_")
    inputs = {name: graph.placeholder(name) for name in names}
    values = {name: graph.call_function(torch.sin, (inputs[name],)) for name in names}
    graph.output(graph.call_function(torch.add, (values["L_a_"], values["L_b_"])))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def test_inputs_are_taken_by_name_and_dynamo_s_order_restored() -> None:
    gm = _dynamo_like("b")
    with inputs_in_canonical_order(gm) as order:
        assert order == [1, 0]
        assert [n.target for n in gm.graph.find_nodes(op="placeholder")] == ["L_a_", "L_b_"]
    # Dynamo reads the placeholders again once its backend returns, to pass the arguments in their order.
    assert [n.target for n in gm.graph.find_nodes(op="placeholder")] == ["L_b_", "L_a_"]
    seen: list[torch.Tensor] = []
    a, b = torch.tensor([1.0]), torch.tensor([2.0])
    permuted(lambda *args: seen.extend(args), order)(b, a)  # Dynamo's order in, the canonical one out
    assert seen == [a, b]
    with inputs_in_canonical_order(_dynamo_like("a")) as order:
        assert order is None


def test_program_code_does_not_depend_on_the_trace_s_order() -> None:
    x, w = torch.randn(4, 4), torch.randn(4, 4)
    codes = []
    for first in ("a", "b"):
        gm = _dynamo_like(first)
        lowered = _lowered(_branches(first), x, w)
        assert canonical_order(lowered)
        with inputs_in_canonical_order(gm):
            codes.append(program_code(gm, lowered_code(lowered)))
    assert codes[0] == codes[1]
    # Not lowered (a compile that failed): the Dynamo graph as traced.
    assert program_code(_dynamo_like("a"), None) != program_code(_dynamo_like("b"), None)
    # Another constant is another program.
    other = _lowered(lambda x, w: _branches("a")(x, w) * 2, x, w)
    assert canonical_order(other)
    with inputs_in_canonical_order(gm := _dynamo_like("a")):
        assert program_code(gm, lowered_code(other)) != codes[0]
