"""The engine's side of the rule contract: what a rule may be handed, and which rule table is used."""

from __future__ import annotations

import torch

from autosp.sharding import Partial, Replicate, SPContext, SPValue, declare, evaluate, replicated
from autosp.sharding.testing import simulate

aten = torch.ops.aten


def _exp_node() -> torch.fx.Node:
    g = torch.fx.Graph()
    node = g.call_function(aten.exp.default, (g.placeholder("x"),))
    node.meta["val"] = torch.empty(2, 3)
    return node


def _run(rule, world: int = 2) -> list[tuple[list[type], torch.Tensor]]:
    summands = [torch.full((2, 3), 0.25 * (r + 1)) for r in range(world)]

    def on_rank(rank: int, group_name: str):
        seen: list[type] = []

        def spy(ctx, node, args, kwargs):
            seen.append(type(args[0].placement))
            return rule(ctx, node, args, kwargs)

        declare(spy, getattr(rule, "accepts", ()))
        ctx = SPContext(
            rank=rank, world=world, group_name=group_name, seq_len=8, attention_rule=None, rules={aten.exp.default: spy}
        )
        x = SPValue(summands[rank], Partial(), torch.empty(2, 3))
        out = evaluate(ctx, _exp_node(), (x,), {})
        return seen, out.local

    return simulate(on_rank, world)


def test_undeclared_rule_gets_the_whole_value_of_a_partial_input():
    for seen, local in _run(lambda ctx, node, args, kwargs: replicated(ctx, node, args, kwargs)):
        assert seen == [Replicate]
        torch.testing.assert_close(local, torch.full((2, 3), 0.75).exp())  # exp of the sum, not of a summand


def test_declared_rule_sees_the_partial_input():
    def keeps_partial(ctx, node, args, kwargs):
        return SPValue(args[0].local, args[0].placement, node.meta["val"])

    declare(keeps_partial, (Partial,))
    for seen, _ in _run(keeps_partial):
        assert seen == [Partial]


def test_rules_come_from_the_context_table():
    # An op with no rule in the context's table and a partial input gathers, whatever core's table says.
    def on_rank(rank: int, group_name: str):
        ctx = SPContext(rank=rank, world=2, group_name=group_name, seq_len=8, attention_rule=None, rules={})
        x = SPValue(torch.full((2, 3), float(rank + 1)), Partial(), torch.empty(2, 3))
        return evaluate(ctx, _exp_node(), (x,), {})

    for out in simulate(on_rank, 2):
        assert isinstance(out.placement, Replicate)
        torch.testing.assert_close(out.local, torch.full((2, 3), 3.0).exp())


def test_a_whole_output_no_gradient_reaches_is_returned_as_computed():
    # A float output gets a backward that scales its gradient by 1/P (each rank holds the whole
    # value); one without any gradient is the very tensor, so an input returned is that object.
    from autosp.sharding.propagate import _may_need_grad, finish

    g = torch.fx.Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    c = g.call_function(aten.mul.Tensor, (b, 2.0))
    d = g.call_function(aten.add.Tensor, (a, c))
    g.output((b, c, d))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    reach = _may_need_grad(gm, [a, b], [torch.ones(2, requires_grad=True), torch.ones(2)])
    assert reach == {a, d}

    ctx = SPContext(rank=0, world=2, group_name="unused", seq_len=8, attention_rule=None)
    x = torch.ones(2, 3)
    assert finish(ctx, SPValue(x, Replicate(), x), may_need_grad=False) is x
    w = torch.ones(2, 3, requires_grad=True)
    scaled = finish(ctx, SPValue(w, Replicate(), w))
    assert scaled is not w
    scaled.sum().backward()
    torch.testing.assert_close(w.grad, torch.full((2, 3), 0.5))
