"""Writes autograd does not record into tensors that require grad, refused (autosp.untracked_writes).

Each refused program gives another gradient in eager than its lowered graph would (measured on two
ranks before the refusal: probe "act-clamp-no-grad" in integration_tests); each accepted one is what
autograd records, or a write into a tensor no gradient reaches.
"""

from __future__ import annotations

import pytest
import torch
from _core_helpers import capture_graphs

from autosp.analysis.source import user_line
from autosp.errors import AutoSPError
from autosp.untracked_writes import refuse_untracked_writes, writes_held_tensors


class Net(torch.nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("ema", torch.zeros(4))
        self.register_buffer("cache", torch.zeros(2, 3, 4))

    def forward(self, x):
        h = self.lin(x)
        if self.kind == "clamp-no-grad":
            with torch.no_grad():
                h.clamp_(-0.1, 0.1)
        elif self.kind == "setitem-no-grad":
            with torch.no_grad():
                h[:, 0] = 0.0
        elif self.kind == "param-no-grad":
            with torch.no_grad():
                self.lin.weight.div_(self.lin.weight.norm())
        elif self.kind == "detached-alias":
            h.detach().mul_(2)
        elif self.kind == "view-no-grad":
            with torch.no_grad():
                h[:, :2].mul_(2)
        elif self.kind == "buffers":
            with torch.no_grad():
                self.ema.mul_(0.9).add_(h.mean((0, 1)))
            self.cache[:, :3] = h.detach()
            self.cache.zero_()
        elif self.kind == "recorded":
            h = h * 1
            h.mul_(2)  # grad mode on: autograd records it, as in any program
            h += 1
        elif self.kind == "foreach-no-grad":  # an EMA of the weights through torch's foreach ops
            with torch.no_grad():
                torch._foreach_mul_([self.lin.weight, self.lin.bias], 0.99)
        elif self.kind == "fresh-no-grad":
            with torch.no_grad():
                t = h.clone()
                t.clamp_(0, 1)
            h = h + t
        return h.sum()


REFUSED = ["clamp-no-grad", "setitem-no-grad", "param-no-grad", "detached-alias", "view-no-grad", "foreach-no-grad"]
ACCEPTED = ["buffers", "recorded", "fresh-no-grad"]


def dynamo_graph(model: torch.nn.Module) -> torch.fx.GraphModule:
    (gm,), _ = capture_graphs(model, torch.randn(2, 3, 4))
    return gm


@pytest.mark.parametrize("kind", REFUSED)
def test_a_write_autograd_does_not_record_is_refused_naming_the_line(kind):
    gm = dynamo_graph(Net(kind))
    with pytest.raises(AutoSPError, match=r"in-place write that autograd does not record.*test_untracked_writes\.py"):
        refuse_untracked_writes(gm, True, user_line)
    refuse_untracked_writes(gm, False, user_line)  # evaluation: nothing is differentiated


@pytest.mark.parametrize("kind", ACCEPTED)
def test_recorded_writes_and_writes_no_gradient_reaches_are_accepted(kind):
    refuse_untracked_writes(dynamo_graph(Net(kind)), True, user_line)


def test_the_refused_programs_do_differ_from_their_written_out_gradient():
    # Eager's gradient of "clamp-no-grad" is the unclamped one: what the lowered graph would not give.
    x = torch.randn(2, 3, 4)
    model = Net("clamp-no-grad")
    model(x).backward()
    eager = model.lin.weight.grad.clone()
    model.zero_grad()
    model.lin(x).clamp(-0.1, 0.1).sum().backward()
    assert not torch.allclose(eager, model.lin.weight.grad)


def test_an_optimizer_step_writes_the_tensors_its_graph_holds() -> None:
    """Dynamo keeps an optimizer's parameters and state in the graph module (get_attr), not as inputs:
    AutoSP's lowering would run writes into them for real, so such graphs are left to torch."""
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    graphs: list[torch.fx.GraphModule] = []

    def record(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    step = torch.compile(opt.step, backend=record)
    for _ in range(2):  # the second step has momentum buffers to write too
        model(torch.randn(2, 4)).sum().backward()
        step()
    held = writes_held_tensors(graphs[-1])
    assert len(held) == 4 and sum("momentum_buffer" in h or "state" in h for h in held) == 2, held
    assert writes_held_tensors(dynamo_graph(Net("buffers"))) == []  # buffers are lifted inputs there
