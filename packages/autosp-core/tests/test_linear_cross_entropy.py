"""The chunked LM head + cross entropy op against the plain (unchunked) computation, values and gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from autosp.linear_cross_entropy import format_epilogue, linear_cross_entropy, parse_epilogue

N, D, V = 37, 8, 29  # N prime: every chunk size below leaves a short last chunk


def _inputs(dtype: torch.dtype, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, D, generator=g).to(dtype).requires_grad_()
    w = torch.randn(V, D, generator=g).to(dtype).requires_grad_()
    b = torch.randn(V, generator=g).to(dtype).requires_grad_() if bias else None
    t = torch.randint(0, V, (N,), generator=g)
    t[torch.rand(N, generator=g) < 0.3] = -100
    return h, w, b, t


def _reference(h, w, b, t, epilogue: str, reduction: str) -> torch.Tensor:
    z = F.linear(h, w, b)
    for kind, arg in parse_epilogue(epilogue):
        z = z.to(arg) if kind == "to" else z * arg if kind == "mul" else z / arg if kind == "div" else z.tanh()
    return F.cross_entropy(z, t, ignore_index=-100, reduction=reduction)


def _tiled(h, w, b, t, epilogue: str, reduction: str, chunk: int) -> torch.Tensor:
    stats = linear_cross_entropy(h, w, b, t, -100, epilogue, chunk)
    return stats[0] / stats[1] if reduction == "mean" else stats[0]


def _grads(loss: torch.Tensor, *xs) -> list[torch.Tensor]:
    return list(torch.autograd.grad(loss, [x for x in xs if x is not None]))


@pytest.mark.parametrize("chunk", [1, 5, 16, 37, 100])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_cross_entropy_fp32(chunk: int, reduction: str, bias: bool) -> None:
    h, w, b, t = _inputs(torch.float32, bias)
    want = _reference(h, w, b, t, "", reduction)
    got = _tiled(h, w, b, t, "", reduction, chunk)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for g_got, g_want in zip(_grads(got, h, w, b), _grads(want, h, w, b)):
        torch.testing.assert_close(g_got, g_want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "epilogue", ["to:float32", "div:3.0,tanh,mul:3.0", "mul:0.125", "to:float64,div:2.5,tanh,mul:2.5"]
)
def test_epilogues_match(epilogue: str) -> None:
    h, w, b, t = _inputs(torch.float32, True, seed=1)
    want = _reference(h, w, b, t, epilogue, "mean")
    got = _tiled(h, w, b, t, epilogue, "mean", 7)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for g_got, g_want in zip(_grads(got, h, w, b), _grads(want, h, w, b)):
        torch.testing.assert_close(g_got, g_want, rtol=1e-5, atol=1e-6)


def test_bf16_hidden_upcast_loss() -> None:
    # A bf16 model that upcasts its logits: the matmul runs in bf16, the loss in fp32, as in the model.
    h, w, b, t = _inputs(torch.bfloat16, False, seed=2)
    want = _reference(h, w, b, t, "to:float32", "mean")
    got = _tiled(h, w, b, t, "to:float32", "mean", 8)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for g_got, g_want in zip(_grads(got, h, w), _grads(want, h, w)):
        assert g_got.dtype == torch.bfloat16
        torch.testing.assert_close(g_got.float(), g_want.float(), rtol=2e-2, atol=2e-2)


def test_all_tokens_ignored() -> None:
    h, w, b, t = _inputs(torch.float32, False)
    t.fill_(-100)
    stats = linear_cross_entropy(h, w, None, t, -100, "", 8)
    assert stats.tolist() == [0.0, 0.0]
    assert torch.isnan(stats[0] / stats[1]) and torch.isnan(F.cross_entropy(h @ w.t(), t))
    (dh,) = torch.autograd.grad(stats[0], [h])
    assert not dh.any()


def test_empty_rows() -> None:
    # A rank can hold no tokens of the loss (a layout that leaves it empty): zeros, and a zero gradient.
    h = torch.zeros(0, D, requires_grad=True)
    w = torch.randn(V, D, requires_grad=True)
    stats = linear_cross_entropy(h, w, None, torch.zeros(0, dtype=torch.long), -100, "", 4)
    assert stats.tolist() == [0.0, 0.0]
    dh, dw = torch.autograd.grad(stats[0], [h, w])
    assert dh.shape == (0, D) and not dw.any()


def test_epilogue_round_trips() -> None:
    steps = [("to", torch.float32), ("div", 1 / 3), ("tanh", None), ("mul", 30.0)]
    assert parse_epilogue(format_epilogue(steps)) == steps
    with pytest.raises(ValueError, match="not one of"):
        parse_epilogue("relu")


def test_opcheck() -> None:
    h, w, b, t = _inputs(torch.float32, True)
    torch.library.opcheck(torch.ops.autosp.linear_cross_entropy.default, (h, w, b, t, -100, "to:float32", 8))
