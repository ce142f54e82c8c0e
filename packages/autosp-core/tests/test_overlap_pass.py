"""The overlap pass on hand-built graphs: waits sink, starts rise, collectives keep their order, values stay."""

from __future__ import annotations

import operator

import torch
from torch import fx

from autosp.passes.overlap import describe_overlap, hoist_starts, overlap_lines, sink_waits
from autosp.sharding import collectives as C  # noqa: F401 - registers the autosp ops
from autosp.sharding.testing.threads import simulate

aten = torch.ops.aten
autosp = torch.ops.autosp
c10d = torch.ops._c10d_functional


def _order(graph: fx.Graph) -> list[str]:
    return [n.name for n in graph.nodes]


def _assert_topological(graph: fx.Graph) -> None:
    seen: set[fx.Node] = set()
    for node in graph.nodes:
        missing = [a.name for a in node.all_input_nodes if a not in seen]
        assert not missing, f"{node.name} runs before its inputs {missing}: {_order(graph)}"
        seen.add(node)


def _exchange_graph(group: str) -> fx.Graph:
    """x -> matmul ; start(x) ; wait ; relu(matmul) ; add(wait, relu): as a synchronous collective would sit."""
    g = fx.Graph()
    x = g.placeholder("x")
    mm = g.call_function(aten.mm.default, (x, x))
    mm.name = "mm"
    start = g.call_function(autosp.all_to_all.default, (x, 0, 0, group))  # swaps row blocks
    start.name = "start"
    wait = g.call_function(autosp.wait_exchange.default, (start, [4, 4], 0, 0, group))
    wait.name = "wait"
    relu = g.call_function(aten.relu.default, (mm,))
    relu.name = "relu"
    add = g.call_function(aten.add.Tensor, (wait, relu))
    add.name = "add"
    g.output(add)
    return g


def test_start_rises_to_its_input_and_wait_sinks_to_its_use() -> None:
    g = _exchange_graph("g")
    assert sink_waits(g) == 1 and hoist_starts(g) == 1
    assert _order(g) == ["x", "start", "mm", "relu", "wait", "add", "output"]
    _assert_topological(g)
    (pair,) = describe_overlap(g)
    assert pair[0] == "all_to_all 0" and pair[1]["matmul"] == 1 and pair[1]["other"] == 1
    assert (
        overlap_lines("forward", [pair])[0] == "overlap forward: 1 of 1 collectives in flight over attention or matmuls"
    )


def test_wait_stops_before_its_first_user_not_a_later_one() -> None:
    g = fx.Graph()
    x = g.placeholder("x")
    start = g.call_function(autosp.all_to_all.default, (x, 0, 1, "g"))
    wait = g.call_function(autosp.wait_exchange.default, (start, [4, 4], 0, 1, "g"))
    early = g.call_function(aten.neg.default, (x,))
    use = g.call_function(aten.mul.Tensor, (wait, early))  # first use of the wait
    late = g.call_function(aten.neg.default, (early,))
    again = g.call_function(aten.add.Tensor, (wait, late))
    g.output((use, again))
    sink_waits(g)
    order = list(g.nodes)
    assert order.index(wait) == order.index(use) - 1, _order(g)
    _assert_topological(g)


def test_start_stays_after_a_computed_input() -> None:
    g = fx.Graph()
    x = g.placeholder("x")
    h = g.call_function(aten.neg.default, (x,))
    other = g.call_function(aten.mm.default, (x, x))
    start = g.call_function(autosp.all_to_all.default, (h, 0, 1, "g"))
    wait = g.call_function(autosp.wait_exchange.default, (start, [4, 4], 0, 1, "g"))
    g.output((wait, other))
    hoist_starts(g)
    order = list(g.nodes)
    assert order.index(start) == order.index(h) + 1, _order(g)
    _assert_topological(g)


def test_collectives_keep_their_relative_order() -> None:
    """A start never rises above another collective (sync, async or functional) nor an op it does not know."""
    g = fx.Graph()
    x = g.placeholder("x")
    s1 = g.call_function(autosp.all_to_all.default, (x, 0, 1, "g"))
    w1 = g.call_function(autosp.wait_exchange.default, (s1, [4, 4], 0, 1, "g"))
    mm1 = g.call_function(aten.mm.default, (x, x))
    s2 = g.call_function(autosp.all_to_all.default, (x, 0, 1, "g"))  # may rise to just after s1, not above it
    ar = g.call_function(autosp.all_reduce.default, (x, "g", False))  # a synchronous collective
    mm2 = g.call_function(aten.mm.default, (x, x))
    s3 = g.call_function(autosp.all_to_all.default, (x, 0, 1, "g"))  # stops below the all_reduce
    scaled = g.call_function(autosp.scale_grad.default, (x, 0.5))  # not aten: may communicate, a barrier
    f = g.call_function(c10d.all_reduce.default, (x, "sum", "g"))
    fw = g.call_function(c10d.wait_tensor.default, (f,))
    w2 = g.call_function(autosp.wait_exchange.default, (s2, [4, 4], 0, 1, "g"))
    w3 = g.call_function(autosp.wait_exchange.default, (s3, [4, 4], 0, 1, "g"))
    g.output((w1, w2, w3, mm1, mm2, ar, scaled, fw))
    collectives_before = [n for n in g.nodes if n in (s1, s2, ar, s3, f)]
    hoist_starts(g)
    sink_waits(g)
    _assert_topological(g)
    order = list(g.nodes)
    assert [n for n in order if n in (s1, s2, ar, s3, f)] == collectives_before
    assert order.index(s2) == order.index(s1) + 1, _order(g)
    assert order.index(s3) == order.index(ar) + 1, _order(g)
    assert order.index(f) == order.index(scaled) + 1, _order(g)
    # Waits sink to the output (their only user) and keep their relative order.
    assert order[-5:] == [w1, fw, w2, w3, g.output_node()], _order(g)


def test_reordered_graph_computes_the_same_on_two_ranks() -> None:
    """Real exchanges between two simulated ranks, before and after the pass, and the autograd of the pair."""

    def rank_fn(rank: int, group: str) -> tuple[bool, bool]:
        x = torch.arange(16, dtype=torch.float32).reshape(4, 4) + 10 * rank
        gm = fx.GraphModule(torch.nn.Module(), _exchange_graph(group))
        before = gm(x)
        sink_waits(gm.graph)
        hoist_starts(gm.graph)
        gm.recompile()
        after = gm(x)
        # The pair's backward is the inverse exchange: the gradient of sum(a2a(x)) is ones.
        leaf = x.clone().requires_grad_()
        C.all_to_all(leaf, 0, 1, group).sum().backward()
        return torch.equal(before, after), bool(leaf.grad.eq(1).all())

    assert simulate(rank_fn, 2) == [(True, True), (True, True)]


def test_split_exchange_matches_the_inverse() -> None:
    """start/wait of an exchange then of its inverse returns each rank's own input."""

    def rank_fn(rank: int, group: str) -> bool:
        x = torch.arange(2 * 4 * 6, dtype=torch.float32).reshape(2, 4, 6) + 100 * rank
        buf = C.all_to_all_start(x, 2, 1, group)
        heads = C.all_to_all_wait(buf, list(x.shape), 2, 1, group)
        back = C.all_to_all_wait(C.all_to_all_start(heads, 1, 2, group), list(heads.shape), 1, 2, group)
        return torch.equal(back, x) and list(heads.shape) == [2, 8, 3]

    assert simulate(rank_fn, 2) == [True, True]


def test_getitem_is_known_pure() -> None:
    g = fx.Graph()
    x = g.placeholder("x")
    parts = g.call_function(aten.split.Tensor, (x, 2))
    first = g.call_function(operator.getitem, (parts, 0))
    start = g.call_function(autosp.all_to_all.default, (x, 0, 1, "g"))
    g.output((first, g.call_function(autosp.wait_exchange.default, (start, [4, 4], 0, 1, "g"))))
    hoist_starts(g)
    assert list(g.nodes).index(start) == 1, _order(g)
