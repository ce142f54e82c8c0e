"""One process, no process group: AutoSP is the identity transform."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F
from _core_helpers import TinyAttention
from torch.testing import assert_close

import autosp


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_dynamo_backend_entry_point():
    assert "autosp" in torch._dynamo.list_backends(exclude_tags=())


@pytest.fixture(scope="module")
def inductor_run():
    """``torch.compile(model, backend="autosp")``: default options, Inductor after AutoSP, forward and backward."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    codecache = logging.getLogger("torch._inductor.codecache")
    codecache.addHandler(handler)
    try:
        torch.manual_seed(0)
        eager = TinyAttention()
        model = copy.deepcopy(eager)
        x = torch.randn(2, 8, 16)
        out = torch.compile(model, backend="autosp")(x)
        out.square().mean().backward()
    finally:
        codecache.removeHandler(handler)
    ref = eager(x)
    ref.square().mean().backward()
    return {"out": out, "ref": ref, "model": model, "eager": eager, "logs": records}


def test_torch_compile_backend_autosp_equals_eager(inductor_run):
    assert_close(inductor_run["out"], inductor_run["ref"])
    got = dict(inductor_run["model"].named_parameters())
    for name, grad in _grads(inductor_run["eager"]).items():
        assert_close(got[name].grad, grad, msg=name)


def test_inductor_compile_logs_no_cache_key_warning(inductor_run):
    messages = [r.getMessage() for r in inductor_run["logs"] if r.levelno >= logging.WARNING]
    assert not any("Failed to pickle cache key" in m for m in messages), messages


@pytest.fixture(scope="module")
def llama_run():
    from autosp.testing.models import Config, LlamaLike

    torch.manual_seed(0)
    eager = LlamaLike(Config(layers=2))
    model = copy.deepcopy(eager)
    ids = torch.randint(0, 96, (2, 16))
    labels = ids.clone()
    labels[0, :3] = -100
    compiled = autosp.compile(model, sp_size=1, backend="aot_eager")
    loss = compiled(ids, labels)
    loss.backward()
    ref = eager(ids, labels)
    ref.backward()
    return {"loss": loss, "ref": ref, "model": model, "eager": eager, "reports": compiled.autosp_reports}


def test_sp1_loss_equals_eager(llama_run):
    assert_close(llama_run["loss"], llama_run["ref"])


def test_sp1_every_gradient_equals_eager(llama_run):
    got, want = _grads(llama_run["model"]), _grads(llama_run["eager"])
    assert set(got) == set(want) and len(got) == 21
    for name in want:
        assert_close(got[name], want[name], msg=name)


def test_sp1_report_shows_no_rewrite(llama_run):
    (report,) = llama_run["reports"]
    assert (report.sp_size, report.rank, report.variant, report.backend) == (1, 0, "ulysses", "aot_eager")
    # No SP pass runs on one rank (SAC, when installed, and loss tiling still may: they change no result).
    names = [r.name for r in report.passes if not r.name.startswith("sac.") and r.name != "autosp.tile_loss"]
    assert names == ["autosp.find_attention", "autosp.dce_forward", "autosp.dce_backward"]
    assert not report.collectives and not report.fallbacks
    assert len(report.sites) == 2
    assert "attention sites: 2" in str(report)


def test_sp1_eager_backend_tuple_outputs():
    from autosp.testing.models import Config, GPT2Like

    torch.manual_seed(0)
    eager = GPT2Like(Config(layers=1))
    model = copy.deepcopy(eager)
    ids = torch.randint(0, 96, (2, 8))
    loss, logits = autosp.compile(model, sp_size=1, backend="eager")(ids, ids)
    ref_loss, ref_logits = eager(ids, ids)
    assert_close(loss, ref_loss)
    assert_close(logits, ref_logits)
    loss.backward()
    ref_loss.backward()
    for name, grad in _grads(eager).items():
        assert_close(dict(model.named_parameters())[name].grad, grad, msg=name)


def test_sp1_recompiles_with_dynamic_shapes():
    from autosp.testing.models import Config, GPT2Like

    torch.manual_seed(0)
    model = GPT2Like(Config(layers=1))
    compiled = autosp.compile(model, sp_size=1, backend="aot_eager")
    for seq in (8, 12, 16):  # the second length makes Dynamo recompile with a symbolic length
        ids = torch.randint(0, 96, (2, seq))
        assert_close(compiled(ids, ids)[0], model(ids, ids)[0])
    assert len(compiled.autosp_reports) == 2
    assert not isinstance(compiled.autosp_reports[-1].sites[0].seq_len, int)


def test_sp1_accepts_3d_sdpa():
    lin = torch.nn.Linear(8, 24)

    def f(x):
        q, k, v = lin(x).chunk(3, -1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).sum()

    x = torch.randn(2, 6, 8)
    assert_close(autosp.compile(f, sp_size=1, backend="aot_eager")(x), f(x))


@pytest.mark.parametrize(
    "around",
    [
        lambda f, *a: torch.utils.checkpoint.checkpoint(f, *a, use_reentrant=False),
        lambda f, *a: _under(torch.autograd.graph.save_on_cpu(), f, *a),
    ],
    ids=["checkpoint", "save_on_cpu"],
)
def test_first_call_under_saved_tensor_hooks_equals_eager(around):
    # The compile runs inside the first call, under the caller's hooks; the passes' own traces
    # used to count among the checkpointed forward's saved tensors, and its recomputation refused.
    from autosp.testing.models import Config, LlamaLike

    torch.manual_seed(0)
    eager = LlamaLike(Config(layers=1))
    model = copy.deepcopy(eager)
    ids = torch.randint(0, 96, (2, 16))
    compiled = autosp.compile(model, sp_size=1, backend="aot_eager")
    loss = around(compiled, ids, ids)
    loss.backward()
    ref = eager(ids, ids)
    ref.backward()
    assert_close(loss, ref)
    for name, grad in _grads(eager).items():
        assert_close(_grads(model)[name], grad, msg=name)


def _under(context, f, *args):
    with context:
        return f(*args)


class _SoftLabels(torch.nn.Module):
    """A cross entropy against soft labels over ``logits.transpose(1, 2)`` (classes on dim 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 11)

    def forward(self, x, labels):
        logits = self.head(torch.tanh(self.proj(x)))
        soft = F.one_hot(labels, 11).float() * 0.9 + 0.1 / 11
        return F.cross_entropy(logits.transpose(1, 2), soft.transpose(1, 2))


def test_a_view_whose_fake_layout_differs_from_the_kernels_runs_under_aot_eager():
    # The log-softmax backward's meta function keeps a transposed gradient's layout and the CPU kernel
    # returns a contiguous one, so the backward's view of it failed ("view size is not compatible").
    torch.manual_seed(0)
    eager = _SoftLabels()
    model = copy.deepcopy(eager)
    x, labels = torch.randn(2, 8, 16), torch.randint(0, 11, (2, 8))
    loss = autosp.compile(model, sp_size=1, backend="aot_eager")(x, labels)
    loss.backward()
    ref = eager(x, labels)
    ref.backward()
    assert_close(loss, ref)
    for name, p in eager.named_parameters():
        assert_close(dict(model.named_parameters())[name].grad, p.grad, msg=name)
