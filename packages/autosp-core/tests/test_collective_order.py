"""Collectives under Inductor: never dropped, chained in graph order, and a schedule that breaks the order refused;
and never merged by AOT's CSE on any backend.

The end-to-end cases (two independent exchanges that Inductor's memory reordering swapped on one
rank; a reduce-scatter it dropped on the rank whose piece was empty) are in
integration_tests/test_probe_programs.py; these pin each piece on its own.
"""

from __future__ import annotations

import operator
from types import SimpleNamespace

import pytest
import torch
from torch import fx

import autosp.sharding.collectives  # noqa: F401 - registers the autosp:: collectives
from autosp.errors import AutoSPError
from autosp.passes.collective_order import (
    INDEX,
    ScheduleCheck,
    chain_collectives,
    group_op_sequence,
    group_size_label,
    inductor_patches,
    keep_collectives,
    never_merged,
    scheduled_order,
    talks_to,
)

autosp_ops = torch.ops.autosp
c10d = torch.ops._c10d_functional


def test_ops_that_talk_to_a_group():
    for op in (
        autosp_ops.all_gather.default,
        autosp_ops.reduce_scatter.default,
        autosp_ops.all_reduce.default,
        autosp_ops.all_to_all.default,
        autosp_ops.wait_exchange.default,
        c10d.all_reduce.default,
        c10d.wait_tensor.default,
    ):
        assert talks_to(op), op
    for op in (torch.ops.aten.mm.default, autosp_ops.scale_grad.default, operator.getitem, None):
        assert not talks_to(op), op


def _two_all_reduces() -> fx.GraphModule:
    """Two independent all-reduces and a matmul between them."""
    g = fx.Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    r1 = g.call_function(autosp_ops.all_reduce.default, (a, "0", False))
    mm = g.call_function(torch.ops.aten.mm.default, (a, b))
    r2 = g.call_function(autosp_ops.all_reduce.default, (b, "0", False))
    g.output((r1, mm, r2))
    return fx.GraphModule(torch.nn.Module(), g)


def test_the_group_op_sequence_names_each_op_and_its_group_in_graph_order():
    g = fx.Graph()
    a = g.placeholder("a")
    x = g.call_function(autosp_ops.all_to_all.default, (a, 1, 2, "7"))
    y = g.call_function(c10d.all_reduce.default, (x, "sum"), {"group_name": "9"})
    z = g.call_function(c10d.wait_tensor.default, (y,))
    g.output(g.call_function(torch.ops.aten.mm.default, (z, a)))
    # The wait is left out: it completes an op on this rank alone, and pairs with nothing elsewhere.
    assert group_op_sequence(g) == ["autosp::all_to_all@7", "_c10d_functional::all_reduce@9"]


def test_an_all_reduce_carries_its_shape_so_ranks_sending_different_sizes_part():
    # A gradient bucket missing one parameter's gradient on one rank: same ops, different sizes.
    def graph(numel: int) -> fx.Graph:
        g = fx.Graph()
        a = g.placeholder("a")
        a.meta["val"] = torch.empty(numel)
        y = g.call_function(c10d.all_reduce.default, (a, "sum", "9"))
        g.output(g.call_function(c10d.wait_tensor.default, (y,)))
        return g

    assert group_op_sequence(graph(8))[0] == "_c10d_functional::all_reduce[float32 8]@9"
    assert group_op_sequence(graph(8)) != group_op_sequence(graph(6))


def test_a_group_reads_as_its_size_on_every_rank():
    # A hybrid layout's sub-groups have other names on other ranks of the SP group; their sizes agree.
    import torch.distributed as dist

    from autosp.sharding.testing.threads import simulate

    def rank_fn(rank: int, name: str) -> tuple[str, str]:
        subs = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # every rank makes both, in one order
        mine = subs[rank % 2]
        return group_size_label(name), group_size_label(mine.group_name), mine.group_name

    results = simulate(rank_fn, 4)
    assert {r[:2] for r in results} == {("4 ranks", "2 ranks")}
    assert results[0][2] != results[1][2]  # the names differ: compared as names, the ranks would part
    assert group_size_label("no such group") == "no such group"


def test_group_ops_are_side_effectful_only_while_inductor_compiles():
    gm = _two_all_reduces()
    ops = [n for n in gm.graph.nodes if n.target == autosp_ops.all_reduce.default]
    assert not any(n.is_impure() for n in ops)  # the partitioner may recompute them (SAC)
    with keep_collectives(gm.graph):
        assert all(n.is_impure() for n in ops)
        gm.graph.output_node().args = ((ops[0],),)  # the second result unread, as on the rank that dropped it
        gm.graph.eliminate_dead_code()
        assert sum(n.target == autosp_ops.all_reduce.default for n in gm.graph.nodes) == 2
    assert not any(n.is_impure() for n in ops)


def test_chain_makes_each_group_op_wait_for_the_one_before():
    gm = _two_all_reduces()
    assert chain_collectives(gm.graph) == 2
    control = [n for n in gm.graph.nodes if n.op == "call_function" and "control_deps" in str(n.target)]
    assert len(control) == 1
    second = control[0]
    assert second.meta[INDEX] == 1
    (dep,) = second.args[0]
    assert dep.target == autosp_ops.all_reduce.default and dep.meta[INDEX] == 0
    # The matmul between them stays free: it is not chained.
    mm = next(n for n in gm.graph.nodes if n.target == torch.ops.aten.mm.default)
    assert INDEX not in mm.meta


def _snode(index: int | None, op=autosp_ops.all_reduce.default) -> SimpleNamespace:
    """A scheduler node as ScheduleCheck reads one: its IR node's op and the FX nodes it came from."""
    origin = fx.Graph().placeholder("x")
    if index is not None:
        origin.meta[INDEX] = index
    ir_node = SimpleNamespace(op_overload=op, get_origins=lambda: {origin})
    sub = SimpleNamespace(node=ir_node)
    return SimpleNamespace(get_nodes=lambda: [sub])


def test_schedule_in_graph_order_passes_and_compute_is_ignored():
    nodes = [_snode(0), _snode(None, torch.ops.aten.mm.default), _snode(1), _snode(2)]
    assert scheduled_order(nodes) == [0, 1, 2]
    assert ScheduleCheck(reorder=False)(nodes) is nodes


def test_schedule_out_of_graph_order_is_refused():
    nodes = [_snode(0), _snode(2), _snode(1)]
    with pytest.raises(AutoSPError, match=r"out of the graph's order \(positions \[0, 2, 1\]\)"):
        ScheduleCheck(reorder=False)(nodes)


def test_inductor_patches_take_over_the_memory_reordering():
    patches = inductor_patches()
    assert patches["reorder_for_peak_memory"] is False
    check = patches["_post_fusion_custom_pass"]
    assert check.reorder is torch._inductor.config.reorder_for_peak_memory
    # Inductor pickles its config into cache keys.
    assert isinstance(check.__reduce__()[1][0], str)


def _twice_reduced() -> fx.Graph:
    """Two all-reduces of the same zeros and two equal negations: what CSE sees in a loop over positions."""
    g = fx.Graph()
    x = g.placeholder("x")
    outs = []
    for _ in range(2):
        zeros = g.call_function(torch.ops.aten.mul.Tensor, (x, 0))
        outs.append(g.call_function(autosp_ops.all_reduce.default, (zeros, "0", False)))
        outs.append(g.call_function(torch.ops.aten.neg.default, (x,)))
    total = outs[0]
    for o in outs[1:]:  # not returned themselves: CSE keeps values that alias an output
        total = g.call_function(torch.ops.aten.add.Tensor, (total, o))
    g.output((total,))
    with torch._subclasses.FakeTensorMode():
        for n in g.nodes:  # CSE considers nodes with a tensor value, each of its own storage
            if n.op != "output":
                n.meta["val"] = torch.empty(4)
    return g


def _count(g: fx.Graph, target) -> int:
    return sum(n.target is target for n in g.nodes)


def test_cse_never_merges_collectives_but_still_merges_the_rest():
    from torch._functorch.compile_utils import fx_graph_cse, rand_ops

    before = list(rand_ops)
    g = _twice_reduced()
    merged = fx_graph_cse(g)  # what AOT does without the guard: one all-reduce left on this rank
    assert _count(merged, autosp_ops.all_reduce.default) == 1
    with never_merged(g):
        kept = fx_graph_cse(g)
    assert _count(kept, autosp_ops.all_reduce.default) == 2
    assert _count(kept, torch.ops.aten.neg.default) == 1  # other equal values are still deduplicated
    assert rand_ops == before
