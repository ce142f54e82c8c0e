"""Gradient hooks kept as identities whose backward is the hook (autosp.tensor_hooks), on one process.

The rewritten Dynamo graph must compute the program's values and, after ``backward``, its
gradients: each hook fires once on its value's whole gradient (uses before the registration
included), hooks on one value in registration order. Whole programs at sp > 1 are in
integration_tests/test_probe_programs.py.
"""

from __future__ import annotations

import pytest
import torch
from _core_helpers import capture_graphs

from autosp.errors import AutoSPError
from autosp.tensor_hooks import is_hook, keep_tensor_hooks
from autosp.user_function import BODIES, USER_FUNCTION


def dynamo_graph(fn, *inputs: torch.Tensor) -> torch.fx.GraphModule:
    (gm,), _ = capture_graphs(fn, *inputs)
    return gm


def grads(fn, x: torch.Tensor, w: torch.Tensor) -> list[torch.Tensor]:
    w = w.clone().requires_grad_()
    out = fn(x, w)
    out = out[0] if isinstance(out, (tuple, list)) else out
    out.backward()
    return [out.detach(), w.grad]


def ordered(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = torch.tanh(x @ w)
    early = h * 2  # read before the hooks: its gradient reaches them too
    h.register_hook(lambda g: (g * 3).clamp(-0.05, 0.05))
    h.register_hook(lambda g: g - g.mean(0, keepdim=True))
    h.register_hook(lambda g: None)  # leaves the gradient as it is
    return (early + h).square().sum()


def captured(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = x @ w
    scale = h.detach().abs().mean()  # made from the value after it, no gradient back
    h.register_hook(lambda g: g * scale / g.norm())
    return torch.sin(h).sum()


def captured_late(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = x @ w
    h.register_hook(lambda g: g * 2)
    scale = h.detach().square().mean()  # reads the first hook's result, with no gradient back
    h.register_hook(lambda g: g * scale + g.flip(0))
    return torch.sin(h).sum()


@pytest.mark.parametrize(("fn", "hooks"), [(ordered, 3), (captured, 1), (captured_late, 2)])
def test_the_rewritten_graph_applies_each_hook_once_in_order_on_the_whole_gradient(fn, hooks):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(6, 4, generator=g), torch.randn(4, 5, generator=g)
    gm = dynamo_graph(fn, x, w.clone().requires_grad_())
    assert sum(is_hook(n) for n in gm.graph.nodes) == hooks
    assert keep_tensor_hooks(gm) == hooks
    calls = [n for n in gm.graph.nodes if n.target is USER_FUNCTION]
    assert len(calls) == hooks and not any(is_hook(n) for n in gm.graph.nodes)
    assert all(BODIES[n.args[1]].what.startswith("a gradient hook") for n in calls)
    assert not [name for name, _ in gm.named_children()]  # the hook bodies now live in BODIES only
    got, expected = grads(gm, x, w), grads(fn, x, w)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)
    # The hooks do change the gradient (a test of nothing otherwise).
    plain = grads(lambda a, b: _without_hooks(fn, a, b), x, w)
    assert not torch.allclose(plain[1], expected[1])


def _without_hooks(fn, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    saved = torch.Tensor.register_hook
    torch.Tensor.register_hook = lambda self, hook: None  # type: ignore[method-assign]
    try:
        return fn(x, w)
    finally:
        torch.Tensor.register_hook = saved  # type: ignore[method-assign]


def test_hooks_in_reverse_order_would_differ():
    # The two non-commuting hooks of ``ordered``: applied the other way round, w's gradient changes,
    # so the comparison above would see a chain built the wrong way.
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(6, 4, generator=g), torch.randn(4, 5, generator=g)

    def swapped(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(a @ b)
        early = h * 2
        h.register_hook(lambda g: g - g.mean(0, keepdim=True))
        h.register_hook(lambda g: (g * 3).clamp(-0.05, 0.05))
        return (early + h).square().sum()

    assert not torch.allclose(grads(swapped, x, w)[1], grads(ordered, x, w)[1])


def test_a_value_read_with_a_gradient_before_its_hooks_capture_exists_is_refused():
    def tangled(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = x @ w
        scale = h.abs().mean()  # not detached: h's gradient flows through it, before the hook can read it
        h.register_hook(lambda g: g * scale.detach())
        return (h * scale).sum()

    gm = dynamo_graph(tangled, torch.randn(3, 4), torch.randn(4, 2, requires_grad=True))
    with pytest.raises(AutoSPError, match=r"register_hook.*read, with a gradient, before.*torch\.compiler\.disable"):
        keep_tensor_hooks(gm)
