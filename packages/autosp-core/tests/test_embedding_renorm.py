"""``nn.Embedding(max_norm=...)`` written out as eager runs it (autosp.embedding_renorm).

Each rewritten Dynamo graph, its writes then stated by ``autosp.straight_through``, is run as it is
(eager ops) and must give eager's loss, gradients and table after the call.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from test_straight_through import _capture

from autosp.analysis.source import user_line
from autosp.embedding_renorm import write_out_renorms
from autosp.straight_through import make_writes_explicit
from autosp.untracked_writes import refuse_untracked_writes


class Lookups(torch.nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.table = torch.nn.Embedding(10, 4, max_norm=1.0)  # rows start near norm 2: every lookup renorms
        self.bag = torch.nn.EmbeddingBag(10, 4, max_norm=0.5, norm_type=1.0, mode="sum")
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, ids):
        if self.kind == "module":
            x = self.table(ids)
        elif self.kind == "positional":  # max_norm as F.embedding's fourth positional argument
            x = F.embedding(ids, self.table.weight, None, 0.7, 1.0)
        elif self.kind == "twice":
            x = self.table(ids) + self.table((ids + 3) % 10)
        elif self.kind == "bag":
            x = self.table(ids) + self.bag(ids)[:, None]
        else:
            raise AssertionError(self.kind)
        return (self.lin(x) ** 2).sum() + (x @ self.table.weight.T).sum()  # the table read again, renormed


@pytest.mark.parametrize(("kind", "lookups"), [("module", 1), ("positional", 1), ("twice", 2), ("bag", 2)])
def test_written_out_renormalisation_gives_eager_values_gradients_and_table(kind: str, lookups: int) -> None:
    torch.manual_seed(0)
    model = Lookups(kind)
    ids = torch.tensor([[1, 2, 2, 7], [0, 9, 1, 4]])
    reference, traced = copy.deepcopy(model), copy.deepcopy(model)
    loss = reference(ids)
    loss.backward()
    gm, inputs = _capture(traced, ids)
    traced.load_state_dict(model.state_dict())  # the capture renormalised the rows once: start again
    assert write_out_renorms(gm) == lookups
    assert not any(n.kwargs.get("max_norm") for n in gm.graph.nodes if n.op == "call_function")
    assert sum(n.target is torch.embedding_renorm_ for n in gm.graph.nodes) == lookups
    explicit = make_writes_explicit(gm)
    assert explicit.writes == lookups and explicit.inputs  # the table gets its renormalised rows back
    refuse_untracked_writes(gm, True, user_line)  # nothing left to refuse
    (got,) = explicit.write_back(gm.forward)(*inputs)
    got.backward()
    torch.testing.assert_close(got, loss, rtol=0, atol=0)
    for (name, p), q in zip(reference.named_parameters(), traced.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=0, msg=f"{name} after the call")
        if p.grad is not None or q.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0, msg=f"{name}.grad")


def test_lookups_without_max_norm_are_left_as_they_are() -> None:
    model = Lookups("module")
    model.table.max_norm = None
    gm, _ = _capture(model, torch.tensor([[1, 2]]))
    before = gm.code
    assert write_out_renorms(gm) == 0 and gm.code == before
