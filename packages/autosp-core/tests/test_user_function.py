"""A custom autograd.Function kept as ``autosp::user_function`` (autosp.user_function), on one process.

The Dynamo graph with the Function rewritten must compute what the Function does, values and
gradients, with the user's backward (not autograd's derivative of the forward). The sharding rule
around it is checked in test_sharding_rules.py; whole programs at sp > 1 in integration_tests.
"""

from __future__ import annotations

import pytest
import torch

from autosp.errors import AutoSPError
from autosp.user_function import BODIES, is_function_call, keep_user_functions


class Reverse(torch.autograd.Function):
    """Identity forward that returns its input's view; the gradient reversed and halved."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return -0.5 * g


class Gate(torch.autograd.Function):
    """Two results, one marked non-differentiable; saved: the inputs, a product and a result; a clamped backward."""

    @staticmethod
    def forward(ctx, x, w):
        h = x @ w
        t = torch.tanh(h)
        ctx.save_for_backward(x, w, h, t)
        sign = (h > 0).to(h.dtype)
        ctx.mark_non_differentiable(sign)
        return t, sign

    @staticmethod
    def backward(ctx, g, _g_sign):
        x, w, h, t = ctx.saved_tensors
        dh = (g * (1 - t**2) + 0 * h).clamp(-0.1, 0.1)
        return dh @ w.t(), x.flatten(0, -2).t() @ dh.flatten(0, -2)


class Dirty(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x.mul_(2)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return 2 * g


def program(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    y = Reverse.apply(x * 1.5)
    h, sign = Gate.apply(y, w)
    return (h * (1 + sign)).square().sum() + y.sum()


def dynamo_graph(fn, *inputs: torch.Tensor) -> torch.fx.GraphModule:
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    torch._dynamo.reset()
    # Inputs that need no gradient: Dynamo inlines the Function's forward, no higher-order op is left.
    torch.compile(fn, backend=backend, fullgraph=True)(*[x.detach().requires_grad_() for x in inputs])
    return graphs[0]


def values_and_grads(fn, x: torch.Tensor, w: torch.Tensor) -> list[torch.Tensor]:
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = fn(x, w)
    out.backward()
    return [out.detach(), x.grad, w.grad]


def test_the_rewritten_graph_computes_the_functions_values_and_the_users_gradients():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 5, 4, generator=g), torch.randn(4, 3, generator=g)
    gm = dynamo_graph(program, x, w)
    assert sum(is_function_call(n) for n in gm.graph.nodes) == 2
    assert keep_user_functions(gm) == 2
    gate = next(b for b in BODIES.values() if b.n_out == 2 and len(b.saved_from) == 4)
    # x and w are the op's arguments, t its first result: only h comes back as an extra output.
    assert sorted(gate.saved_from, key=str) == [("arg", 0), ("arg", 1), ("out", 0), None], gate.saved_from
    assert not any(is_function_call(n) for m in gm.modules() for n in getattr(m, "graph", torch.fx.Graph()).nodes)
    # The subgraphs are gone from the module: passes that walk submodules must not rewrite them.
    assert not [name for name, _ in gm.named_children()]
    got = values_and_grads(lambda a, b: gm(a, b)[0], x, w)
    expected = values_and_grads(program, x, w)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)
    # Not autograd's derivative of the forward: the reversal shows in x's gradient, the clamp in w's.

    def plain(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        h = (a * 1.5) @ b
        return (torch.tanh(h) * (1 + (h > 0))).square().sum() + (a * 1.5).sum()

    plain = values_and_grads(plain, x, w)
    assert not torch.allclose(got[1], plain[1]) and not torch.allclose(got[2], plain[2])


def test_a_function_that_marks_its_input_dirty_is_refused_naming_it():
    def dirty(x: torch.Tensor) -> torch.Tensor:
        return Dirty.apply(x.clone()).sum()

    gm = dynamo_graph(dirty, torch.randn(3, requires_grad=True))
    assert any(is_function_call(n) for n in gm.graph.nodes)
    with pytest.raises(AutoSPError, match=r"ctx\.mark_dirty.*torch\.compiler\.disable"):
        keep_user_functions(gm)


class Drop(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        keep = (torch.rand_like(x) > 0.5).to(x.dtype) * 2
        ctx.save_for_backward(keep)
        return x * keep

    @staticmethod
    def backward(ctx, g):
        (keep,) = ctx.saved_tensors
        return g * keep


def test_random_draws_inside_a_function_are_reported_for_the_rng_check():
    # Opaque to the SP graph, yet every rank runs it whole: the ranks' generators must agree
    # (autosp.rng_check refuses a run where they differ, for the ops random_ops names).
    from autosp.rng_check import random_ops

    gm = dynamo_graph(
        lambda x, w: (Drop.apply(x) * w).sum() + Reverse.apply(w).sum(), torch.randn(3, 4), torch.randn(4)
    )
    keep_user_functions(gm)
    found = random_ops(gm)
    assert len(found) == 1, found
    device, what = found[0]
    assert device == "cpu" and what.startswith("aten::rand") and "custom torch.autograd.Function" in what, what


class Pair(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2, x * 3

    @staticmethod
    def backward(ctx, g2, g3):
        return g2 * 2 + g3 * 3


class PairFirstOnly(torch.autograd.Function):
    """Pair's code, its second result marked non-differentiable: a flag of the call, not in the code."""

    @staticmethod
    def forward(ctx, x):
        out = x * 2, x * 3
        ctx.mark_non_differentiable(out[1])
        return out

    @staticmethod
    def backward(ctx, g2, g3):
        return g2 * 2 + g3 * 3


def test_functions_of_the_same_code_with_other_flags_keep_their_own_backward():
    def two(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        a, b = Pair.apply(x)
        c, d = PairFirstOnly.apply(x)
        return ((a + b + c + d) * w).sum()

    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(5, generator=g), torch.randn(5, generator=g)
    gm = dynamo_graph(two, x, w)
    assert keep_user_functions(gm) == 2
    got, expected = values_and_grads(lambda a, b: gm(a, b)[0], x, w), values_and_grads(two, x, w)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)
