"""``autosp.token_wise_body.is_token_wise``: which Function and hook bodies may run on each rank's positions.

A wrong yes would run a body on a shard that needs the whole value (a silent wrong result); a wrong no
only gathers. Each case is a forward ``(*args) -> ([results], [saved])`` and a backward
``(*grads, *saved) -> input grads``, traced on fake values of ``[B, S, D]`` (and a weight ``[D]``).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from autosp.token_wise_body import is_token_wise

MODE = FakeTensorMode()
with MODE:
    X, Y, W = torch.empty(2, 8, 4), torch.empty(2, 8, 4), torch.empty(4)
    SQUARE = torch.empty(2, 8, 8)


def _gelu(x):
    return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))


def _same(x):
    return [x.clone()], []


def _identity_grad(g, *saved):
    return g


Case = tuple[Callable, Callable, list]
YES: dict[str, Case] = {
    "bloom-gelu": (lambda x: ([_gelu(x)], [x]), lambda g, x: g * (1 + torch.tanh(x)), [X]),
    "straight-through-round": (lambda x: ([x.round()], []), _identity_grad, [X]),
    "clamped-gradient-view-as": (lambda x: ([x.view_as(x)], []), lambda g: g.clamp(-1, 1), [X]),
    "gate-two-inputs": (
        lambda x, y: ([x * torch.sigmoid(y)], [x, y]),
        lambda g, x, y: (g * torch.sigmoid(y), g * x * torch.sigmoid(y) * (1 - torch.sigmoid(y))),
        [X, Y],
    ),
    "0-d-constant": (lambda x: ([x * torch.tensor(3.0)], []), lambda g: g * 3, [X]),
    "cast-and-where": (lambda x: ([torch.where(x > 0, x, 0.0).double()], []), lambda g: g.float(), [X]),
    "two-results": (lambda x: ([x.exp(), x > 0], [x]), lambda g, g2, x: g * x.exp(), [X]),
}
NO: dict[str, Case] = {
    "norm-in-backward": (_same, lambda g: g / g.norm(), [X]),
    "mean-over-sequence": (_same, lambda g: g - g.mean(1, keepdim=True), [X]),
    "cumsum": (lambda x: ([x.cumsum(1)], []), _identity_grad, [X]),
    "roll-in-backward": (_same, lambda g: g.roll(1, 1), [X]),
    "weight-of-another-shape": (lambda x, w: ([x * w], [x, w]), lambda g, x, w: (g * w, (g * x).sum((0, 1))), [X, W]),
    "transpose-keeping-a-square-shape": (lambda x: ([x.transpose(1, 2).contiguous()], []), _identity_grad, [SQUARE]),
    "size-baked-into-a-constant": (lambda x: ([x + torch.ones(2, 8, 4)], []), _identity_grad, [X]),
    "random": (lambda x: ([x * torch.rand_like(x)], []), _identity_grad, [X]),
    "matmul": (lambda x: ([x @ x.transpose(1, 2) @ x], [x]), lambda g, x: g, [X]),
    "saves-a-reduction": (lambda x: ([x * 2], [x.sum()]), lambda g, s: g * s, [X]),
    "no-inputs": (lambda: ([], []), lambda: (), []),
    "a-0-d-input": (lambda s: ([s * 2], []), lambda g: g * 2, [torch.tensor(1.0)]),
}


@pytest.mark.parametrize("name", list(YES))
def test_elementwise_bodies_are_token_wise(name: str) -> None:
    fwd, bwd, args = YES[name]
    assert is_token_wise(fwd, bwd, args, MODE)


@pytest.mark.parametrize("name", list(NO))
def test_bodies_that_read_other_positions_or_shapes_are_not(name: str) -> None:
    fwd, bwd, args = NO[name]
    assert not is_token_wise(fwd, bwd, args, MODE)
