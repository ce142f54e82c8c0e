"""Writes autograd does not record, stated in the graph (autosp.straight_through).

Each rewritten Dynamo graph is run as it is (eager ops) and must give eager's loss, gradients and
parameter values after the call; what it cannot state exactly stays refused.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from test_untracked_writes import Net

from autosp.analysis.source import user_line
from autosp.errors import AutoSPError
from autosp.straight_through import make_writes_explicit, straight_through
from autosp.untracked_writes import refuse_untracked_writes


class More(torch.nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.lin = torch.nn.Linear(4, 4)
        self.coef = torch.nn.Linear(4, 4, bias=False)
        with torch.no_grad():
            self.coef.weight.mul_(8.0)

    def forward(self, x):
        if self.kind == "param-data":  # Gemma-3n's AltUp, in its forward
            self.coef.weight.data.clamp_(-0.5, 0.5)
            return (self.coef(self.lin(x)) ** 2).sum()
        h = self.lin(x)
        if self.kind == "two-writes":
            with torch.no_grad():
                h.clamp_(-0.2, 0.2)
            a = h * 3
            with torch.no_grad():
                h[:, 0] = 1.0
            return (a * h).sum() + h.sum()
        if self.kind == "rebound":  # the write's result bound again: the tensor itself
            with torch.no_grad():
                h = h.clamp_(-0.2, 0.2)
            return (h * self.coef(x)).sum()
        if self.kind == "inf-values":  # a straight-through sum would turn -inf into NaN
            h = h.masked_fill(torch.ones_like(h, dtype=torch.bool).triu(1), float("-inf"))
            with torch.no_grad():
                h.clamp_(min=-1e4)
            return (h.softmax(-1) * self.coef(x)).sum()
        if self.kind == "view-read-after":  # a view that requires grad, taken before, read after
            v = h[:, 0]
            with torch.no_grad():
                h.mul_(2)
            return (v * h[:, 1]).sum()
        if self.kind == "read-before":  # mm saved h; eager refuses the backward
            y = h @ self.coef.weight
            with torch.no_grad():
                h.mul_(2)
            return (y * h).sum()
        raise AssertionError(self.kind)


def _capture(model: torch.nn.Module, x: torch.Tensor) -> tuple[torch.fx.GraphModule, list[Any]]:
    got: dict[str, Any] = {}

    def record(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        got["gm"], got["inputs"] = gm, example_inputs
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=record)(x)
    return got["gm"], got["inputs"]


EXPLICIT = ["clamp-no-grad", "setitem-no-grad", "detached-alias", "view-no-grad"]


@pytest.mark.parametrize(
    "build",
    [lambda k=k: Net(k) for k in EXPLICIT]
    + [lambda k=k: More(k) for k in ("param-data", "two-writes", "rebound", "inf-values")],
)
def test_a_rewritten_graph_gives_eager_values_gradients_and_parameters(build) -> None:
    torch.manual_seed(0)
    model = build()
    x = torch.randn(2, 3, 4)
    reference, traced = copy.deepcopy(model), copy.deepcopy(model)
    loss = reference(x)
    loss.backward()
    gm, inputs = _capture(traced, x)
    traced.load_state_dict(model.state_dict())  # the capture ran the writes once: start again
    explicit = make_writes_explicit(gm)
    assert explicit.writes >= 1
    refuse_untracked_writes(gm, True, user_line)  # nothing left to refuse
    assert any(n.target is torch.ops.autosp.straight_through.default for n in gm.graph.nodes)
    (got,) = explicit.write_back(gm.forward)(*inputs)
    got.backward()
    torch.testing.assert_close(got, loss, rtol=0, atol=0)
    for (name, p), q in zip(reference.named_parameters(), traced.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=0, msg=f"{name} after the call")
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0, msg=f"{name}.grad")


@pytest.mark.parametrize(
    "build",
    [
        lambda: More("view-read-after"),
        lambda: More("read-before"),
        lambda: Net("param-no-grad"),  # the weight read by the linear before: saved, eager would use the new values
        lambda: Net("foreach-no-grad"),  # several tensors at once
    ],
)
def test_what_one_read_cannot_state_stays_refused(build) -> None:
    gm, _ = _capture(build(), torch.randn(2, 3, 4))
    assert make_writes_explicit(gm).writes == 0
    with pytest.raises(AutoSPError, match="in-place write that autograd does not record"):
        refuse_untracked_writes(gm, True, user_line)


def test_straight_through_passes_the_gradient_to_the_tensor_and_gives_the_values() -> None:
    t = torch.tensor([-torch.inf, 0.5, 3.0], requires_grad=True)
    value = t.detach().clamp(-1.0, 1.0)
    out = straight_through(t, value)
    assert torch.equal(out, value) and out.data_ptr() != value.data_ptr()
    (out * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
    assert torch.equal(t.grad, torch.tensor([1.0, 2.0, 3.0]))
    assert torch.Tag.pointwise in torch.ops.autosp.straight_through.default.tags  # the engine's elementwise rule


def test_evaluation_rewrites_nothing() -> None:
    gm, _ = _capture(Net("clamp-no-grad"), torch.randn(2, 3, 4))
    with torch.no_grad():
        assert make_writes_explicit(gm).writes == 0
