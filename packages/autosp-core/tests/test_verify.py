"""``autosp.verify`` in one process (sp_size=1): what it compares, how, and what it refuses.

The SP program of one rank is the compiled program; a model that computes something else when
Dynamo traces it (``torch.compiler.is_compiling()``) stands in for a wrong rewrite. The sp=2
checks (a dropped collective, AUTOSP_VERIFY on two ranks) are in integration_tests/test_verify.py.
"""

from __future__ import annotations

import pickle
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autosp
from autosp import ConfigError, VerificationError, VerifyReport
from autosp.verify_compare import DEFAULT_TOLERANCES, compare

VERIFY = sys.modules["autosp.verify"]


def _scale_grad(x: torch.Tensor, factor: float) -> torch.Tensor:
    """``x`` in the forward; its gradient times ``factor`` in the backward, but only when compiled."""
    if torch.compiler.is_compiling():
        return x + (x - x.detach()) * (factor - 1)
    return x


class TwoHeads(nn.Module):
    """A loss from head ``a`` and a [B, S, 4] output from head ``b``: two outputs, both differentiated."""

    def __init__(self, wrong_a: float = 1.0, wrong_b: float = 1.0, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16, dtype=dtype)
        self.a = nn.Linear(16, 3, dtype=dtype)
        self.b = nn.Linear(16, 4, dtype=dtype)
        self.unused = nn.Linear(2, 2, dtype=dtype)
        self.wrong_a, self.wrong_b = wrong_a, wrong_b

    def forward(self, x, y):
        h = torch.tanh(self.embed(x))
        loss = F.cross_entropy(_scale_grad(self.a(h.mean(dim=1)), self.wrong_a), y)
        return {"loss": loss, "side": _scale_grad(self.b(h), self.wrong_b)}


class Loss(nn.Module):
    def __init__(self, wrong: float = 1.0) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(8, 16), nn.Linear(16, 1)
        self.wrong = wrong

    def forward(self, x):
        return self.second(_scale_grad(torch.relu(self.first(x)), self.wrong)).pow(2).mean()


def _inputs(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(2, 6, 8, generator=gen, dtype=dtype), torch.tensor([0, 2])


def test_correct_model_passes_and_is_left_as_it_was():
    torch.manual_seed(0)
    model = TwoHeads()
    model.embed.weight.grad = torch.full_like(model.embed.weight, 7.0)  # a user's accumulated gradient
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    rng = torch.get_rng_state()
    report = autosp.verify(model, *_inputs(), backend="aot_eager")
    assert isinstance(report, VerifyReport) and report.ok and report.sp_size == 1 and report.failed_ranks == []
    assert [c.name for c in report.outputs] == ["output['loss']", "output['side']"]
    # Every parameter with a gradient was compared; the unused layer has one in neither run.
    assert sorted(c.name for c in report.grads) == [
        "a.bias",
        "a.weight",
        "b.bias",
        "b.weight",
        "embed.bias",
        "embed.weight",
    ]
    assert report.graphs == 1 and report.tolerance_dtype == "float32"
    assert (report.rtol, report.atol) == DEFAULT_TOLERANCES[torch.float32]
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert torch.equal(model.embed.weight.grad, torch.full_like(model.embed.weight, 7.0))
    assert all(p.grad is None for n, p in model.named_parameters() if n != "embed.weight")
    assert torch.equal(torch.get_rng_state(), rng)


def test_wrong_gradient_names_the_parameter():
    torch.manual_seed(0)
    with pytest.raises(VerificationError) as info:
        autosp.verify(Loss(wrong=1.01), _inputs()[0], backend="aot_eager")
    report = info.value.report
    assert not report.ok and report.failed_ranks == [0]
    assert all(c.ok for c in report.outputs)  # the forward is right: only gradients reveal it
    assert report.worst_grad.name in ("first.weight", "first.bias") and report.worst_grad.ratio > 1
    assert {c.name for c in report.grads if not c.ok} == {"first.weight", "first.bias"}
    assert 0.005 < report.worst_grad.max_rel < 0.02
    assert "worst gradient: first." in str(info.value) and "do not train with it" in str(info.value)
    # The error travels between processes with its report.
    again = pickle.loads(pickle.dumps(info.value))
    assert isinstance(again, VerificationError) and again.report.worst_grad == report.worst_grad


def test_a_non_scalar_output_has_its_gradients_checked():
    # Only the [B, S, 4] output's gradient is wrong, and only in head b: the weighted reduction sees it.
    torch.manual_seed(0)
    with pytest.raises(VerificationError) as info:
        autosp.verify(TwoHeads(wrong_b=1.01), *_inputs(), backend="aot_eager")
    bad = {c.name for c in info.value.report.grads if not c.ok}
    assert "b.weight" in bad and not bad & {"a.weight", "a.bias"}


def test_tolerances_follow_the_dtype_and_can_be_overridden():
    torch.manual_seed(0)
    x, y = _inputs(torch.float64)
    report = autosp.verify(TwoHeads(dtype=torch.float64), x, y, backend="aot_eager")
    assert report.tolerance_dtype == "float64" and (report.rtol, report.atol) == DEFAULT_TOLERANCES[torch.float64]
    # A 1% error in one layer's gradient passes a 5% tolerance and fails the default.
    torch.manual_seed(0)
    report = autosp.verify(Loss(wrong=1.01), x.float(), rtol=0.05, atol=0.0, backend="aot_eager")
    assert report.ok and (report.rtol, report.atol) == (0.05, 0.0) and report.worst_grad.ratio < 1


def test_input_gradients_and_buffers_are_compared():
    class Stats(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.register_buffer("seen", torch.zeros(8))

        def forward(self, x):
            h = self.lin(x)
            # A buffer update the SP program gets wrong (e.g. statistics of this rank's tokens only).
            self.seen.add_(h.detach().mean(dim=(0, 1)) * (2.0 if torch.compiler.is_compiling() else 1.0))
            return h.sum()

    torch.manual_seed(0)
    x = _inputs()[0].requires_grad_()
    with pytest.raises(VerificationError) as info:
        autosp.verify(Stats(), x, backend="aot_eager")
    report = info.value.report
    assert [c.name for c in report.outputs if not c.ok] == ["buffer:seen"]
    assert "input[0]" in {c.name for c in report.grads} and x.grad is None


def test_compare_scales_atol_and_handles_nan_and_integers():
    ref = torch.tensor([1.0, 0.0, 1e-9])
    assert compare("t", ref + 1e-6, ref, 0.0, 1e-5, scale=1.0).ok  # atol * scale: 1e-5
    assert not compare("t", ref + 1e-6, ref, 0.0, 1e-5, scale=0.01).ok
    nan = torch.tensor([float("nan"), 1.0])
    assert compare("t", nan.clone(), nan, 1e-4, 1e-5, 1.0).ok
    assert not compare("t", torch.tensor([0.0, 1.0]), nan, 1e-4, 1e-5, 1.0).ok
    ints = torch.tensor([1, 2, 3])
    check = compare("t", ints + torch.tensor([0, 0, 1]), ints, 0.5, 0.5, 3.0)
    assert not check.ok and check.max_abs == 1.0  # integers must be equal, whatever the tolerance


def test_autosp_verify_env_checks_the_first_call_only(monkeypatch):
    calls = []
    real = VERIFY._verify
    monkeypatch.setattr(VERIFY, "_verify", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setenv("AUTOSP_VERIFY", "1")
    torch.manual_seed(0)
    model = Loss()
    compiled = autosp.compile(model, backend="aot_eager")
    x = _inputs()[0]
    compiled(x).backward()
    compiled(x)
    assert len(calls) == 1 and model.first.weight.grad is not None
    assert len(compiled.autosp_reports) == 1  # the user's calls reuse the graph verify compiled

    torch.manual_seed(0)
    broken = Loss(wrong=1.01)
    compiled = autosp.compile(broken, backend="aot_eager")
    for _ in range(2):  # stays armed: the program that failed the check never runs
        with pytest.raises(VerificationError):
            compiled(x)
    assert all(p.grad is None for p in broken.parameters())

    with pytest.raises(ConfigError, match="AUTOSP_VERIFY=1 verifies nn.Module models"):
        autosp.compile(lambda t: t * 2, backend="aot_eager")


def test_bad_input_is_refused_before_anything_runs():
    model, x = Loss(), _inputs()[0]
    with pytest.raises(ConfigError, match=r"sp_size=2 needs an initialized process group"):
        autosp.verify(model, x, sp_size=2)
    with pytest.raises(ConfigError, match=r"needs a torch.nn.Module .* got a function"):
        autosp.verify(lambda t: t, x)
    with pytest.raises(ConfigError, match=r"already compiled model: pass the nn.Module itself"):
        autosp.verify(torch.compile(model), x)
    with pytest.raises(ConfigError, match=r"input\[1\] is a generator: .* pass tensors, numbers"):
        autosp.verify(model, x, (t for t in [x]))
    with pytest.raises(ConfigError, match=r"input\['mask'\] is a meta or fake tensor"):
        autosp.verify(model, x, input_kwargs={"mask": torch.empty(2, device="meta")})
    with pytest.raises(ConfigError, match=r"rtol=-1; it must be a number >= 0"):
        autosp.verify(model, x, rtol=-1)
    with pytest.raises(ConfigError, match=r"backend='tvm' is not one of"):
        autosp.verify(model, x, backend="tvm")
    dropout = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.1))
    with pytest.raises(ConfigError, match=r"dropout is active in 1 \(p=0.1\).*model.eval\(\) or p=0"):
        autosp.verify(dropout, x)
    assert all(p.grad is None for p in model.parameters())
