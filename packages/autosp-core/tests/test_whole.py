"""A graph AutoSP fails to compile runs whole, compiled by torch alone (``autosp.whole``), in one process.

The P=2 and P=4 runs (exact against single-device eager, a rank-dependent failure refused, a graph
break between an SP graph and a whole one) are in integration_tests/test_compiled_whole.py.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator

import pytest
import torch
from _core_helpers import TinyAttention, capture_graphs
from torch.testing import assert_close

import autosp
from autosp.errors import AutoSPError, CollectiveFailure
from autosp.lowering import SDPA, insert_leaves
from autosp.passes.manager import Pass, Stage
from autosp.registry import get_registry
from autosp.whole import is_crash, torch_state_restored, untouched_copy


@pytest.fixture
def crashing_pass() -> Iterator[list[BaseException]]:
    """A registered pass that raises what the test puts in the list (nothing while it is empty)."""
    raises: list[BaseException] = []

    def crash(gm: torch.fx.GraphModule, ctx: object) -> None:
        if raises:
            raise raises[0]

    passes = get_registry().passes
    passes["test.crash"] = Pass("test.crash", Stage.GRAPH, crash, doc="raises on demand")
    try:
        yield raises
    finally:
        del passes["test.crash"]
        torch._dynamo.reset()


def _step(model: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    out = model(x)
    out.square().mean().backward()
    module = getattr(model, "_orig_mod", model)
    return out.detach(), {n: p.grad.clone() for n, p in module.named_parameters()}


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_graph_whose_compile_crashes_is_compiled_by_torch_and_warned(crashing_pass, backend: str) -> None:
    crashing_pass.append(RuntimeError("internal assert in a pass"))
    torch.manual_seed(0)
    eager, x = TinyAttention(), torch.randn(2, 8, 16)
    compiled = autosp.compile(copy.deepcopy(eager), sp_size=1, backend=backend)
    with pytest.warns(
        autosp.CompiledWhole, match=r"\(RuntimeError: internal assert in a pass, in AutoSP pass test.crash"
    ):
        got = _step(compiled, x)
    expected = _step(eager, x)
    assert_close(got[0], expected[0])
    assert got[1].keys() == expected[1].keys()
    for name in expected[1]:
        assert_close(got[1][name], expected[1][name], msg=name)
    (report,) = compiled.autosp_reports
    assert report.compiled_whole == "RuntimeError: internal assert in a pass"
    assert "runs whole on every rank" in str(report) and report.group_ops == [] and not report.sites


def test_the_fallback_is_an_error_where_the_warning_is(crashing_pass) -> None:
    crashing_pass.append(RuntimeError("internal assert in a pass"))
    compiled = autosp.compile(TinyAttention(), sp_size=1, backend="aot_eager")
    with warnings.catch_warnings():
        warnings.simplefilter("error", autosp.CompiledWhole)
        with pytest.raises(
            autosp.CompileCrashed, match=r"internal assert in a pass, in AutoSP pass test.crash"
        ) as caught:
            compiled(torch.randn(2, 8, 16))
    assert isinstance(caught.value.error, RuntimeError)  # the pass's own error, with its traceback
    assert "test_whole.py" in str(caught.value) and "in crash" in str(caught.value)  # where it was raised


def test_refusals_are_raised_not_compiled_whole(crashing_pass) -> None:
    crashing_pass.append(AutoSPError("this program is refused: do X"))
    compiled = autosp.compile(TinyAttention(), sp_size=1, backend="aot_eager")
    with warnings.catch_warnings():
        warnings.simplefilter("error", autosp.CompiledWhole)
        with pytest.raises(AutoSPError, match="refused: do X"):
            compiled(torch.randn(2, 8, 16))


def test_a_graph_torch_cannot_compile_either_raises_autosps_error(crashing_pass, monkeypatch) -> None:
    import autosp.whole

    def fails(*args: object, **kwargs: object) -> None:
        raise TypeError("torch fails too")

    monkeypatch.setattr(autosp.whole, "compile_whole", fails)
    crashing_pass.append(RuntimeError("internal assert in a pass"))
    compiled = autosp.compile(TinyAttention(), sp_size=1, backend="aot_eager")
    with pytest.raises(Exception, match="internal assert in a pass") as caught:
        compiled(torch.randn(2, 8, 16))
    original = caught.value.inner_exception  # Dynamo's BackendCompilerFailed wraps it, as before the fallback
    assert "torch's aot_eager alone fails on this graph too: TypeError: torch fails too" in original.__notes__


def test_crashes_are_told_from_refusals_and_failed_collectives() -> None:
    assert is_crash(RuntimeError("INTERNAL ASSERT FAILED")) and is_crash(AttributeError("mode"))
    assert not is_crash(AutoSPError("refused"))
    assert not is_crash(CollectiveFailure("a peer left"))
    assert not is_crash(RuntimeError("Connection closed by peer"))  # gloo's words for a peer that left
    assert not is_crash(MemoryError())
    assert not is_crash(KeyboardInterrupt())


def test_the_copy_keeps_the_graph_the_passes_edit_and_shares_its_tensors() -> None:
    def program(x: torch.Tensor) -> torch.Tensor:
        q = x.unflatten(-1, (2, 8)).transpose(1, 2)
        ckpt = torch.utils.checkpoint.checkpoint(
            torch.nn.functional.scaled_dot_product_attention, q, q, q, use_reentrant=False
        )
        return torch.nn.functional.scaled_dot_product_attention(q, q, ckpt)

    (gm,), _ = capture_graphs(program, torch.randn(2, 8, 16))
    gm.register_buffer("table", torch.arange(4.0))
    copied = untouched_copy(gm)
    assert copied is not None and copied.table is gm.table
    assert insert_leaves(gm, [SDPA]) == 2  # in the graph and in the checkpoint's body, in place
    leaf = SDPA.leaf
    targets = [n.target for m in copied.modules() if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes]
    assert leaf not in targets and torch.nn.functional.scaled_dot_product_attention in targets


def test_a_compile_that_raises_inside_a_functorch_level_leaves_none_behind() -> None:
    depth = torch._C._functorch.get_dynamic_layer_stack_depth()
    with pytest.raises(RuntimeError, match="mid-transform"):
        with torch_state_restored():
            torch._C._functorch._grad_increment_nesting()
            raise RuntimeError("mid-transform")
    assert torch._C._functorch.get_dynamic_layer_stack_depth() == depth
    assert torch.ones(2).tolist() == [1.0, 1.0]  # a plain tensor with storage, not a functorch wrapper


class _Backbone(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.pooler = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.body(x).tanh()
        return h, self.pooler(h[:, 0])


def test_a_graph_compiled_whole_leaves_unreached_parameters_without_a_gradient(crashing_pass) -> None:
    # The pooler feeds only the output the caller discards: eager leaves its .grad None, AOT autograd
    # alone gives zeros (autosp.discarded_outputs).
    crashing_pass.append(RuntimeError("internal assert in a pass"))
    torch.manual_seed(0)
    eager, x = _Backbone(), torch.randn(2, 3, 4)
    model = copy.deepcopy(eager)
    with pytest.warns(autosp.CompiledWhole):
        autosp.compile(model, sp_size=1, backend="aot_eager")(x)[0].sum().backward()
    eager(x)[0].sum().backward()
    assert model.pooler.weight.grad is None and eager.pooler.weight.grad is None
    assert_close(model.body.weight.grad, eager.body.weight.grad)
