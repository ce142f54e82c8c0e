"""autosp.sharding.padded: uneven pieces through equal-block exchanges, checked on a simulated all-to-all."""

from __future__ import annotations

import pytest
import torch

from autosp.sharding import padded


def _to_heads(sent: list[torch.Tensor]) -> list[torch.Tensor]:
    """Ulysses' exchange to heads: rank j gets head block j of every rank's [B, m, n*h], sequence order."""
    n = len(sent)
    return [torch.cat([s.chunk(n, 2)[j] for s in sent], 1) for j in range(n)]


def _to_sequence(sent: list[torch.Tensor]) -> list[torch.Tensor]:
    """The exchange back: rank r gets sequence block r of every rank's [B, n*m, h], head order."""
    n = len(sent)
    return [torch.cat([s.chunk(n, 1)[r] for s in sent], 2) for r in range(n)]


@pytest.mark.parametrize("pieces", [[3, 4, 4], [5, 4], [2, 2, 2, 3], [4, 5, 4, 5]])
def test_pieces_cross_padded_and_arrive_exactly(pieces: list[int]) -> None:
    n, h = len(pieces), 2
    whole = torch.randn(2, sum(pieces), n * h)
    own = list(whole.split(pieces, 1))
    heads = _to_heads([padded.pad_own(x, 1, pieces) for x in own])
    for j, received in enumerate(heads):
        assert torch.equal(padded.keep_real(received, 1, pieces), whole[..., j * h : (j + 1) * h])
    back = _to_sequence([padded.pad_each(whole[..., j * h : (j + 1) * h], 1, pieces) for j in range(n)])
    for r, received in enumerate(back):
        assert torch.equal(padded.cut_own(received, 1, pieces, r), own[r])


def test_equal_pieces_are_left_alone_and_padding_is_always_an_op() -> None:
    x = torch.randn(2, 4)
    assert padded.pad_own(x, 1, None) is x and padded.keep_real(x, 1, None) is x
    assert padded.pad_each(x, 1, None) is x and padded.cut_own(x, 1, None, 0) is x
    # Zero rows are still concatenated: every rank's graph holds the same ops whatever its piece.
    assert padded.pad_to(x, 1, 4) is not x and torch.equal(padded.pad_to(x, 1, 4), x)
    # The padding is zeros, and a padded row's gradient is dropped.
    y = torch.randn(3, requires_grad=True)
    out = padded.pad_to(y, 0, 5)
    assert torch.equal(out[3:], torch.zeros(2))
    (out * torch.arange(5.0)).sum().backward()
    assert torch.equal(y.grad, torch.arange(3.0))
