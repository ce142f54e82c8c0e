"""The notes a failed rank leaves its peers (``autosp.peer_failure``): who writes one, and when it counts.

The protocol end to end (a rank raising in its program, its peers failing at once, ranks that all
raised at the same point going on) is ``integration_tests/test_guards.py``.
"""

from __future__ import annotations

import pytest
import torch

from autosp import peer_failure
from autosp.errors import CollectiveFailure, PeerFailed
from autosp.peer_failure import announce_backward_of, counting_error, note_of

WAITED = {"0": 7, "3": 2}


def test_a_rank_that_raised_notes_its_error_and_its_place_in_each_group():
    note = note_of(IndexError("index out of range in self\nmore lines"), WAITED, 5)
    assert note == "0=7 3=2\n5\nIndexError: index out of range in self"
    assert note_of(KeyboardInterrupt(), {"0": 1}, 0) == "0=1\n0\nKeyboardInterrupt"


@pytest.mark.parametrize(
    "error",
    [
        CollectiveFailure("global rank 0: a collective of the SP program did not complete"),
        PeerFailed("global rank 0: global rank 1 of the SP group raised IndexError"),
        RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:39619"),
        RuntimeError("Timed out waiting 60000ms for send operation to complete"),
    ],
)
def test_a_rank_that_failed_for_want_of_a_peer_leaves_no_note(error):
    # Its note would name a victim, not the cause, to the ranks that read it first.
    assert note_of(error, WAITED, 0) is None


def test_a_note_counts_unless_this_rank_raised_at_the_same_point():
    note = "0=7 3=2\n5\nIndexError: index out of range in self"
    cause = (5, "IndexError: index out of range in self")
    assert counting_error(note, "0", set()) == cause
    assert counting_error(note, "0", {7}) is None  # both raised after 7 collectives: still in step
    assert counting_error(note, "0", {3, 9}) == cause
    assert counting_error(note, "3", {2}) is None
    # A group the failed rank never waited on: it failed before its first collective there.
    assert counting_error(note, "5", set()) == cause
    assert counting_error(note, "5", {0}) is None


_RAISE_IN_BACKWARD = {"now": False}


@torch.library.custom_op("autosp_peer_failure_test::passes", mutates_args=())
def _passes(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@torch.library.custom_op("autosp_peer_failure_test::takes_gradient", mutates_args=())
def _takes_gradient(grad: torch.Tensor) -> torch.Tensor:
    if _RAISE_IN_BACKWARD["now"]:
        raise ValueError("raised in the compiled backward")
    return grad.clone()


_passes.register_fake(torch.empty_like)
_takes_gradient.register_fake(torch.empty_like)
_passes.register_autograd(lambda ctx, grad: torch.ops.autosp_peer_failure_test.takes_gradient(grad))


def test_the_compiled_backward_announces_what_it_raises(monkeypatch):
    announced: list[BaseException] = []
    monkeypatch.setattr(peer_failure, "announce", announced.append)
    # The output is a view of the graph's output (AOT autograd regenerates it): the search looks past it.
    compiled = torch.compile(lambda x: torch.ops.autosp_peer_failure_test.passes(x * 2).t(), backend="aot_eager")
    x = torch.ones(3, 4, requires_grad=True)
    with torch.no_grad():
        assert not announce_backward_of(compiled(x))  # nothing recorded: looked for again next call
    out = compiled(x)
    assert announce_backward_of(out)
    node = out.grad_fn
    while getattr(node, "_forward_cls", None) is None or node._forward_cls.__name__ != "CompiledFunction":
        node = node.next_functions[0][0]
    wrapped = node._forward_cls.backward
    assert announce_backward_of(compiled(x)) and node._forward_cls.backward is wrapped  # wrapped once
    out.sum().backward()
    assert announced == [] and torch.equal(x.grad, torch.full((3, 4), 2.0))
    _RAISE_IN_BACKWARD["now"] = True
    try:
        with pytest.raises(ValueError, match="raised in the compiled backward"):
            compiled(x).sum().backward()
    finally:
        _RAISE_IN_BACKWARD["now"] = False
    assert [str(e) for e in announced] == ["raised in the compiled backward"]
