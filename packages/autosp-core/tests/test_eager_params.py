"""Parameters a compiled call used in eager, found from its autograd graph (one process)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autosp.eager_params import eager_params_message, params_used_in_eager


class _Eager(nn.Linear):
    @torch.compiler.disable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


class _Model(nn.Module):
    def __init__(self, eager: bool, tied: bool = False) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = _Eager(4, 4) if eager else nn.Linear(4, 4)
        self.tied = tied

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if self.tied:  # one parameter read by a graph and by eager code
            h = h + _eager_matmul(h, self.a.weight)
        return self.b(h).sum()


@torch.compiler.disable
def _eager_matmul(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return h @ w


def _run(model: nn.Module, grad: bool = True) -> list[str]:
    torch._dynamo.reset()
    with torch.set_grad_enabled(grad):
        out = torch.compile(model, backend="aot_eager")(torch.randn(2, 4))
    return params_used_in_eager(out, model.named_parameters())


def test_a_disabled_layer_is_named_and_compiled_ones_are_not():
    assert sorted(_run(_Model(eager=True))) == ["b.bias", "b.weight"]


def test_everything_compiled_names_nothing():
    assert _run(_Model(eager=False)) == []


def test_a_parameter_read_by_a_graph_and_by_eager_code_is_named():
    assert _run(_Model(eager=False, tied=True)) == ["a.weight"]


def test_plain_eager_model_names_every_parameter_it_used():
    model = _Model(eager=False)
    out = model(torch.randn(2, 4))
    assert sorted(params_used_in_eager(out, model.named_parameters())) == ["a.bias", "a.weight", "b.bias", "b.weight"]


def test_no_autograd_graph_no_answer():
    # Under no_grad nothing is recorded: the walk finds nothing, it does not guess.
    assert _run(_Model(eager=True), grad=False) == []


@pytest.mark.parametrize(("n", "tail"), [(2, "(x0, x1)"), (6, "(x0, x1, x2, x3 and 2 more)")])
def test_message_names_a_few_and_counts_the_rest(n, tail):
    msg = eager_params_message(2, [f"x{i}" for i in range(n)])
    assert f"{n} parameter(s) of the model {tail}" in msg and "torch.compiler.disable" in msg
