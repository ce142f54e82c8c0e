"""autosp.flex_mods: Flex's mods keep the reads plain torch.compile differentiates, and never write."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex, mod_index
from torch.fx.experimental.proxy_tensor import make_fx

from autosp import flex_mods
from autosp.errors import AutoSPError

FLEX = torch.ops.higher_order.flex_attention


def _graph_with_mod(mod) -> torch.fx.GraphModule:
    """A graph calling Flex with ``mod`` as its score_mod, as lowering leaves it (the mod traced to aten)."""
    bias = torch.randn(4, 7)
    with TransformGetItemToIndex():  # as Flex traces mods: ``bias[h, ...]`` reads by tensor index
        sub = make_fx(mod)(torch.zeros(()), *(torch.zeros((), dtype=torch.int) for _ in range(4)), bias)
    root = torch.nn.Module()
    root.score_mod = sub
    graph = torch.fx.Graph()
    q = graph.placeholder("q")
    b = graph.placeholder("bias")
    fn = graph.get_attr("score_mod")
    out = graph.call_function(FLEX, (q, q, q, fn, (), 1.0, {}, (b,), ()))
    graph.output(out)
    return torch.fx.GraphModule(root, graph)


def test_reads_of_captured_tensors_become_mod_index_again():
    gm = _graph_with_mod(lambda s, b, h, q, k, bias: s + bias[h, q - k + 3])
    assert flex_mods.restore_mod_index(gm, (FLEX,)) == 1
    targets = [n.target for n in gm.score_mod.graph.nodes if n.op == "call_function"]
    assert mod_index in targets and torch.ops.aten.index.Tensor not in targets
    # Its forward is the read it replaced.
    bias = torch.randn(4, 7)
    args = (torch.tensor(0.5), torch.tensor(0), torch.tensor(2), torch.tensor(4), torch.tensor(1), bias)
    assert torch.equal(gm.score_mod(*args), 0.5 + bias[2, 6])


def test_a_graph_without_flex_is_left_alone():
    gm = make_fx(lambda x, i: x[i])(torch.randn(5), torch.tensor([1, 2]))
    assert flex_mods.restore_mod_index(gm, (FLEX,)) == 0
    assert any(n.target is torch.ops.aten.index.Tensor for n in gm.graph.nodes)


def test_a_mod_that_writes_in_place_is_refused():
    def writes(s, b, h, q, k, bias):
        return s.add_(bias[h, 0])

    gm = _graph_with_mod(writes)
    with pytest.raises(AutoSPError, match="writes in place"):
        flex_mods.call_unfunctionalized(FLEX, (None, None, None, gm.score_mod), {})


def _dynamo_graph(monkeypatch, transform) -> torch.fx.GraphModule:
    """Dynamo's graph of Flex whose score_mod reads ``transform(rel)``, rel a leaf requiring grad."""
    import torch.nn.attention.flex_attention as flex

    monkeypatch.setattr(flex, "_validate_device", lambda *args: None)  # CPU has no Flex backward to check for
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm

    def program(q, rel):
        r = transform(rel)
        return flex.flex_attention(q, q, q, score_mod=lambda s, b, h, qi, ki: s + r[h, qi - ki + 15])

    torch._dynamo.reset()
    rel = torch.randn(2, 31, requires_grad=True)
    torch.compile(program, backend=keep, fullgraph=True)(torch.randn(1, 2, 16, 8, requires_grad=True), rel)
    return graphs[0]


def test_a_mod_reading_a_computed_tensor_that_requires_grad_is_refused(monkeypatch):
    gm = _dynamo_graph(monkeypatch, lambda rel: rel * 2)
    with pytest.raises(
        AutoSPError, match=r"reads .*computed in the compiled code that requires grad.*Read the parameter"
    ):
        flex_mods.refuse_computed_captures(gm, (FLEX,), True, lambda node: "")
    flex_mods.refuse_computed_captures(gm, (FLEX,), False, lambda node: "")  # nothing is differentiated
    # The input itself (a parameter is one) and a detached tensor are fine.
    flex_mods.refuse_computed_captures(_dynamo_graph(monkeypatch, lambda rel: rel), (FLEX,), True, lambda node: "")
    detached = _dynamo_graph(monkeypatch, lambda rel: rel.detach() * 2)
    flex_mods.refuse_computed_captures(detached, (FLEX,), True, lambda node: "")
