"""What a compiled call ran in eager, found from its autograd graph (one process)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autosp.eager_work import EagerWork, eager_work, eager_work_message


class _Eager(nn.Linear):
    @torch.compiler.disable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


@torch.compiler.disable
def _eager_matmul(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return h @ w


@torch.compiler.disable
def _eager_attention(h: torch.Tensor) -> torch.Tensor:
    q = h.view(2, 1, 2, 2)  # [B, H, S, d]: no parameters, attention only
    return F.scaled_dot_product_attention(q, q, q, is_causal=True).reshape(2, 4)


class _Model(nn.Module):
    def __init__(self, eager: str = "") -> None:
        super().__init__()
        self.eager = eager
        self.a = nn.Linear(4, 4)
        self.b = _Eager(4, 4) if eager == "layer" else nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if self.eager == "tied":  # one parameter read by a graph and by eager code
            h = h + _eager_matmul(h, self.a.weight)
        if self.eager == "attention":
            h = h + _eager_attention(h)
        return self.b(h).sum()


def _run(model: nn.Module, grad: bool = True) -> EagerWork:
    torch._dynamo.reset()
    x = torch.randn(2, 4)
    with torch.set_grad_enabled(grad):
        out = torch.compile(model, backend="aot_eager")(x)
    return eager_work(out, model.named_parameters(), [x])


def test_a_disabled_layer_is_named_and_compiled_ones_are_not():
    work = _run(_Model("layer"))
    assert sorted(work.params) == ["b.bias", "b.weight"] and not work.attention


def test_everything_compiled_finds_nothing():
    assert not _run(_Model())


def test_a_parameter_read_by_a_graph_and_by_eager_code_is_named():
    assert _run(_Model("tied")).params == ["a.weight"]


def test_attention_in_eager_is_found_without_parameters():
    work = _run(_Model("attention"))
    assert not work.params and len(work.attention) == 1 and "ScaledDotProduct" in work.attention[0]


def test_the_walk_ends_at_the_calls_inputs():
    # Attention and a layer the user ran before the call made its input: not the call's work.
    model = _Model()
    x = _eager_attention(model.a(torch.randn(2, 4)))  # model.a read in eager, outside the call
    torch._dynamo.reset()
    out = torch.compile(model, backend="aot_eager")(x)
    assert not eager_work(out, model.named_parameters(), [x])
    assert sorted(eager_work(out, model.named_parameters()).params) == ["a.bias", "a.weight"]  # without the bound


def test_plain_eager_model_reads_every_parameter_in_eager():
    model = _Model()
    out = model(torch.randn(2, 4))
    assert sorted(eager_work(out, model.named_parameters()).params) == ["a.bias", "a.weight", "b.bias", "b.weight"]


def test_no_autograd_graph_no_answer():
    # Under no_grad nothing is recorded: the walk finds nothing, it does not guess.
    assert not _run(_Model("layer"), grad=False)


@pytest.mark.parametrize(("n", "tail"), [(2, "(x0, x1)"), (6, "(x0, x1, x2, x3 and 2 more)")])
def test_message_names_a_few_and_counts_the_rest(n, tail):
    msg = eager_work_message(2, EagerWork([f"x{i}" for i in range(n)], ["SdpaBackward"]))
    assert f"{n} parameter(s) of the model {tail} were read and attention (SdpaBackward) was computed" in msg
    assert "torch.compiler.disable" in msg
