"""``autosp.discarded_outputs`` on one process: what each output reaches, and ``None`` where eager has it.

``reach`` is read from the lowered graph, so its cases are lowered programs; ``drop_discarded`` is
tried under a backend that lowers, compiles with AOT autograd and wraps, as ``compile_graph`` does
under SP, on every way a caller can leave an output without a gradient. The multi-process programs
(a backbone, Hugging Face's BertModel) are in integration_tests/test_discarded_outputs.py.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch._functorch.aot_autograd import aot_module_simplified, make_boxed_func

from autosp.compiler import _fake_inputs
from autosp.discarded_outputs import Reach, drop_discarded, reach
from autosp.lowering import lower_to_aten


def _lowered_reach(fn: Any, *args: torch.Tensor) -> Reach | None:
    found: list[Reach | None] = []

    def record(gm: torch.fx.GraphModule, example_inputs: list[Any]):
        fakes, mode = _fake_inputs(gm, example_inputs)
        found.append(reach(lower_to_aten(gm, fakes, mode)))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=record, fullgraph=True)(*args)
    (only,) = found
    return only


def test_each_output_reaches_the_floating_inputs_it_is_made_from():
    def program(x, w, v, ids):
        h = x @ w
        return h, (h @ v).sum(), h.argmax(-1), ids + 1, h.detach() * 2

    x, w, v = torch.randn(3, 4), torch.randn(4, 4, requires_grad=True), torch.randn(4, 2, requires_grad=True)
    found = _lowered_reach(program, x, w, v, torch.arange(3))
    # Bits are inputs in Dynamo's order (x, w, v, ids); integers, argmax and detach carry no gradient.
    assert found == Reach(outputs=(0b011, 0b111, 0, 0, 0), kept=0)
    assert found.can_drop


def test_what_flows_into_a_written_input_is_always_kept():
    def program(x, w, buf):
        y = x * w  # used first, so that Dynamo's inputs are (x, w, buf)
        buf.add_(y)  # the written input's new value carries x's and w's gradient, which no hook sees
        return (x * 2).sum(), w.sum()

    found = _lowered_reach(program, torch.randn(3), torch.randn(3, requires_grad=True), torch.zeros(3))
    assert found is not None
    assert found.outputs == (0b001, 0b010)
    assert found.kept & 0b011 == 0b011


def test_one_reach_for_every_output_leaves_nothing_to_drop():
    found = _lowered_reach(lambda x, w: ((x @ w).sum(), x @ w), torch.randn(2, 2), torch.randn(2, 2))
    assert found is not None and not found.can_drop


def _backend(gm: torch.fx.GraphModule, example_inputs: list[Any]):
    fakes, mode = _fake_inputs(gm, example_inputs)
    found = reach(lower_to_aten(gm, fakes, mode))
    boxed = lambda g, _: make_boxed_func(g.forward)  # noqa: E731
    return drop_discarded(aot_module_simplified(gm, example_inputs, fw_compiler=boxed, bw_compiler=boxed), found)


class Backbone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.pooler, self.aux = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = torch.tanh(self.body(x))
        return {"hidden": h, "pooled": self.pooler(h[:, 0]), "aux": self.aux(h).mean(1), "flat": h.view(-1)}


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def _assert_same(got: dict, want: dict) -> None:
    assert {n for n, g in got.items() if g is None} == {n for n, g in want.items() if g is None}
    for n, g in want.items():
        if g is not None:
            torch.testing.assert_close(got[n], g, msg=n)


@pytest.fixture
def pair():
    torch.manual_seed(0)
    eager = Backbone()
    model = copy.deepcopy(eager)
    torch._dynamo.reset()
    return eager, model, torch.compile(model, backend=_backend, fullgraph=True), torch.randn(2, 3, 4)


def _compare(pair, use) -> None:
    eager, model, compiled, x = pair
    use(eager(x))
    use(compiled(x))
    _assert_same(_grads(model), _grads(eager))


@pytest.mark.parametrize(
    "use",
    [
        pytest.param(lambda o: o["hidden"].sum().backward(), id="hidden"),
        pytest.param(lambda o: o["pooled"].sum().backward(), id="pooled"),
        pytest.param(lambda o: o["flat"].square().sum().backward(), id="a-view-made-outside-the-graph"),
        pytest.param(lambda o: (o["hidden"].sum() + o["aux"].sum()).backward(), id="two-of-four"),
        pytest.param(lambda o: o["aux"].mul_(3).sum().backward(), id="written-after-the-call"),
        pytest.param(lambda o: o["pooled"].argmax().float().requires_grad_().backward(), id="through-argmax"),
    ],
)
def test_a_parameter_gets_a_gradient_exactly_where_eager_gives_one(pair, use) -> None:
    _compare(pair, use)


def test_each_backward_through_a_retained_graph_drops_on_its_own(pair) -> None:
    def twice(out):
        out["pooled"].sum().backward(retain_graph=True)
        out["aux"].sum().backward()  # accumulates: the pooler keeps its gradient, the aux head gets one

    _compare(pair, twice)


def test_autograd_grad_reports_an_unreached_parameter_as_none(pair) -> None:
    eager, model, compiled, x = pair
    got = torch.autograd.grad(compiled(x)["hidden"].sum(), list(model.parameters()), allow_unused=True)
    want = torch.autograd.grad(eager(x)["hidden"].sum(), list(eager.parameters()), allow_unused=True)
    assert [g is None for g in got] == [g is None for g in want] == [False, False, True, True, True, True]


def test_outputs_aliasing_inputs_leave_an_earlier_graphs_backward_alone() -> None:
    """Across a graph break: the second graph hands back views of its inputs (the first graph's output
    and a parameter), so AOT autograd makes them outside it and it has no backward node of its own. The
    search for one stops at the graph's inputs: it must not take the first graph's node, where the
    second graph's hooks would drop the parameter's gradient."""

    torch.manual_seed(0)
    eager = nn.Linear(4, 4)
    model = copy.deepcopy(eager)

    def program(x, a):
        h = a(x)
        torch._dynamo.graph_break()
        return h.view(-1), a.weight.view(-1)

    torch._dynamo.reset()
    compiled = torch.compile(program, backend=_backend)
    x = torch.randn(2, 4)
    compiled(x, model)[0].sum().backward()
    program(x, eager)[0].sum().backward()
    _assert_same(_grads(model), _grads(eager))


def test_a_call_fed_the_previous_calls_output_drops_per_call(pair) -> None:
    """A block applied twice by the caller (weights shared): the second call's input is the first call's
    output, and each call's node gets its own hooks; its search stops at that input's node."""
    eager, model, compiled, x = pair
    for fn in (eager, compiled):
        fn(fn(x)["hidden"])["hidden"].sum().backward()
    _assert_same(_grads(model), _grads(eager))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_one_rank_lowers_the_graph_for_the_analysis_alone(backend) -> None:
    # On one rank the passes do not lower the graph; the analysis lowers it apart (zeros before).
    import autosp

    torch.manual_seed(0)
    eager = Backbone()
    model = copy.deepcopy(eager)
    torch._dynamo.reset()
    compiled = autosp.compile(model, backend=backend)
    x = torch.randn(2, 3, 4)
    eager(x)["pooled"].sum().backward()
    compiled(x)["pooled"].sum().backward()
    _assert_same(_grads(model), _grads(eager))
    assert model.aux.weight.grad is None and model.pooler.weight.grad is not None


def test_one_rank_analyses_only_graphs_with_two_differentiable_outputs() -> None:
    from autosp.discarded_outputs import reach_alone

    seen: list[Reach | None] = []

    def record(gm: torch.fx.GraphModule, example_inputs: list[Any]):
        seen.append(reach_alone(gm, *_fake_inputs(gm, example_inputs)))
        return gm.forward

    w = torch.randn(2, 2, requires_grad=True)
    for fn in (lambda x: (x @ w).sum(), lambda x: ((x @ w).sum(), (x @ w).argmax()), lambda x: (x @ w, x.sin())):
        torch._dynamo.reset()
        torch.compile(fn, backend=record, fullgraph=True)(torch.randn(2, 2, requires_grad=True))
    assert seen[0] is None and seen[1] is None  # one output carries a gradient: nothing to drop
    both, sin = seen[2].outputs if seen[2] is not None else (0, 0)
    assert sin and both & sin == sin != both  # x.sin() reaches x alone, x @ w reaches x and w


def test_one_rank_leaves_a_dynamic_graph_general() -> None:
    # Lowering on Dynamo's symbolic fakes added guards to its shape environment: a recompile per length.
    import autosp

    torch.manual_seed(0)
    eager = Backbone()
    model = copy.deepcopy(eager)
    torch._dynamo.reset()
    compiled = autosp.compile(model, backend="aot_eager")
    for seq in (3, 5, 7):  # the second length recompiles with a symbolic one, which the third reuses
        x = torch.randn(2, seq, 4)
        torch.testing.assert_close(compiled(x)["hidden"], eager(x)["hidden"])
    assert len(compiled.autosp_reports) == 2
