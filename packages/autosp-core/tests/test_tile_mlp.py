"""autosp.tile_mlp in one process: the chunked op against the whole MLP, and which MLPs the pass tiles."""

from __future__ import annotations

import copy
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import autosp
from autosp.testing.models import Config, LlamaLike
from autosp.tiled_mlp import ACTIVATIONS, tiled_mlp, tiled_mlp_backward

# CI compiles tiled MLPs under Inductor at sp=2, with SAC, there.
INDUCTOR_IN_CI = "integration_tests/test_tile_mlp.py::test_two_ranks_ulysses_ring_sac_and_inductor"

V, D, FF = 96, 16, 40


def _whole(x, w_in, b_in, w_gate, w_out, b_out, act):
    f = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda z: F.gelu(z, approximate="tanh"), "relu": F.relu}[act]
    z = F.linear(x, w_in, b_in)
    return F.linear(f(z) if w_gate is None else f(F.linear(x, w_gate)) * z, w_out, b_out)


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize("chunk", [7, 25, 1000])  # rows not dividing N, dividing it, and one chunk
def test_op_equals_the_whole_mlp_values_and_gradients(gated: bool, act: str, chunk: int) -> None:
    # Not hash(): str hashes change per process (PYTHONHASHSEED), and so did the inputs, and so did the
    # rounding: one run in many drew a gradient a chunked sum missed by 1.01e-6.
    g = torch.Generator().manual_seed(ACTIVATIONS.index(act) * 2 + gated)

    def p(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) / shape[-1] ** 0.5).requires_grad_()

    x, w_in, w_out = p(50, D), p(FF, D), p(D, FF)
    w_gate = p(FF, D) if gated else None
    b_in, b_out = (None, None) if gated else (p(FF), p(D))
    leaves = [t for t in (x, w_in, b_in, w_gate, w_out, b_out) if t is not None]
    ref = _whole(x, w_in, b_in, w_gate, w_out, b_out, act)
    grad = torch.randn(ref.shape, generator=g)
    want = torch.autograd.grad(ref, leaves, grad)
    out = tiled_mlp(x, w_in, b_in, w_gate, w_out, b_out, act, chunk)
    got = torch.autograd.grad(out, leaves, grad)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    # Gradients sum over 50 rows in chunks, in another order than the whole op's: fp32 rounding of
    # sums of size ~5. A wrong chunk or a missing row is off by orders more.
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


class _LiveBytes(TorchDispatchMode):
    """The most bytes of storage that ops run under it held live at once (new storages only: not
    ``inputs``, views of them, or in-place results)."""

    def __init__(self, *inputs: torch.Tensor | None) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._seen = {t.untyped_storage().data_ptr() for t in inputs if t is not None}

    def _freed(self, ptr: int, size: int) -> None:
        self._seen.discard(ptr)
        self.live -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.untyped_storage().data_ptr() in self._seen:
                continue
            if any(a is t for a in pytree.tree_leaves((args, kwargs))):
                continue  # an in-place op's own argument
            ptr, size = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
            self._seen.add(ptr)
            self.live += size
            self.peak = max(self.peak, self.live)
            weakref.finalize(t, self._freed, ptr, size)
        return out


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("act", ["silu", "relu"])
def test_backward_keeps_few_chunk_values_live(gated: bool, act: str) -> None:
    """The backward's loop is where a tiled program peaks: four [rows, ffn] values at once, three
    without a gate (nine and five before they were ordered and freed)."""
    n, d, ff, rows = 256, 8, 512, 64
    x, w_in, w_out = torch.randn(n, d), torch.randn(ff, d), torch.randn(d, ff)
    w_gate = torch.randn(ff, d) if gated else None
    grad = torch.randn(n, d)
    inputs = (grad, x, w_in, None, w_gate, w_out, None)
    with _LiveBytes(*inputs) as mode:
        tiled_mlp_backward._init_fn(*inputs, act, rows)  # the op's body, so the mode sees its ops
    results = (n * d + 2 * ff * d + (ff * d if gated else 0)) * 4  # dx and the weight gradients
    chunk_values = (mode.peak - results) / (rows * ff * 4)
    assert chunk_values <= (4 if gated else 3) + 0.25, chunk_values


class PlainMLPs(nn.Module):
    """GPT-2-style blocks: biased fc -> gelu(tanh) -> biased proj, residual; and a relu MLP without biases."""

    def __init__(self, aux: str = "") -> None:
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.fc, self.proj = nn.Linear(D, FF), nn.Linear(FF, D)
        self.up, self.down = nn.Linear(D, FF, bias=False), nn.Linear(FF, D, bias=False)
        self.head = nn.Linear(D, V, bias=False)
        self.aux = aux

    def forward(self, ids: torch.Tensor, labels: torch.Tensor):
        h = self.embed(ids)
        hidden = F.gelu(self.fc(h), approximate="tanh")
        h = h + self.proj(hidden)
        h = h + self.down(F.relu(self.up(h)))
        loss = F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())
        if self.aux == "activation_loss":  # an auxiliary loss reads the first MLP's activation
            loss = loss + 1e-3 * hidden.pow(2).mean()
        return (loss, hidden) if self.aux == "returned" else loss


def _batch(seq: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (2, seq), generator=g)
    return ids, ids.roll(-1, 1)


def _run(model: nn.Module, **options) -> tuple[torch.Tensor, dict, list[str]]:
    compiled = autosp.compile(model, **options)
    out = compiled(*_batch())
    loss = out[0] if isinstance(out, tuple) else out
    loss.backward()
    notes = [n for r in compiled.autosp_reports for n in r.notes if n.startswith("tile_mlp")]
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, notes


def _exact(make, **options) -> list[str]:
    torch.manual_seed(0)
    model = make()
    ref = copy.deepcopy(model)
    out = ref(*_batch())
    (out[0] if isinstance(out, tuple) else out).backward()
    loss, grads, notes = _run(model, **options)
    torch.testing.assert_close(loss, out[0] if isinstance(out, tuple) else out, rtol=1e-5, atol=1e-6)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)
    return notes


@pytest.mark.parametrize(
    "backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.extended(covered_by=INDUCTOR_IN_CI))]
)
def test_llama_mlps_are_tiled_and_exact(backend: str) -> None:
    notes = _exact(lambda: LlamaLike(Config(layers=2)), backend=backend, tile_mlp=32)
    tiled = [n for n in notes if "tiled the gated silu MLP" in n]
    assert len(tiled) == 2 and "in chunks of 32 rows" in tiled[0], notes


def test_plain_mlps_with_biases_are_tiled_and_exact() -> None:
    notes = _exact(PlainMLPs, backend="aot_eager", tile_mlp=48)
    assert any("tiled the gelu_tanh MLP" in n for n in notes), notes
    assert any("tiled the relu MLP" in n for n in notes), notes


@pytest.mark.parametrize("aux", ["activation_loss", "returned"])
def test_an_mlp_whose_values_are_read_elsewhere_is_left_as_is(aux: str) -> None:
    notes = _exact(lambda: PlainMLPs(aux), backend="aot_eager", tile_mlp=48)
    # The second MLP is tiled; the first, whose activation is also read, is not.
    assert sum("tiled the relu MLP" in n for n in notes) == 1, notes
    assert not any("gelu_tanh" in n for n in notes), notes
    assert sum("not tiled: its hidden values are read elsewhere" in n for n in notes) == 1, notes


def test_on_by_default_with_sac_only_and_one_chunk_is_not_tiled() -> None:
    assert _exact(lambda: LlamaLike(Config(layers=1)), backend="aot_eager") == []  # sac="auto"
    assert _exact(lambda: LlamaLike(Config(layers=1)), backend="aot_eager", sac=False) == []
    for options in ({"tile_mlp": True}, {"sac": True}):  # "auto" with sac=True tiles
        notes = _exact(lambda: LlamaLike(Config(layers=1)), backend="aot_eager", **options)
        assert notes and all("fit in one chunk" in n for n in notes), (options, notes)


@pytest.mark.parametrize("bad", [0, -3, 2.5, "yes", "Auto"])
def test_bad_tile_mlp_is_refused(bad) -> None:
    with pytest.raises(autosp.ConfigError, match="tile_mlp="):
        autosp.compile(nn.Linear(2, 2), tile_mlp=bad)


def test_composes_with_tiled_loss() -> None:
    # On one rank tile_loss lowers the graph first when it tiles; tile_mlp then works on its output.
    notes = _exact(lambda: LlamaLike(Config(layers=2)), backend="aot_eager", tile_mlp=16, tile_loss=16)
    assert sum(n.startswith("tile_mlp: tiled") for n in notes) == 2, notes
