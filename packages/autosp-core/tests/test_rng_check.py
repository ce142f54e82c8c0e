"""Which graph nodes draw random numbers, and the refusal when the ranks' generators differ."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from autosp.rng_check import (
    DEVICE_TYPES,
    RandomStateMismatch,
    random_ops,
    refuse_divergent_rng,
    refuse_eager_draws,
    rng_digests,
)


def _ops(fn, *args) -> list[str]:
    return [what.split(" ")[0] for _, what in random_ops(make_fx(fn)(*args))]


def test_attention_without_dropout_draws_nothing() -> None:
    q = torch.randn(1, 2, 8, 4)
    assert _ops(lambda q: F.scaled_dot_product_attention(q, q, q), q) == []
    assert _ops(lambda q: F.scaled_dot_product_attention(q, q, q, dropout_p=0.0), q) == []
    assert _ops(lambda q: F.dropout(q, 0.1, training=False), q) == []


def test_dropout_and_sampling_draw() -> None:
    x = torch.randn(2, 8)
    assert _ops(lambda x: F.dropout(x, 0.1), x) == ["aten::bernoulli_.float"]
    assert _ops(lambda x: x + torch.randn_like(x), x) == ["aten::randn_like"]
    q = torch.randn(1, 2, 8, 4)
    assert len(_ops(lambda q: F.scaled_dot_product_attention(q, q, q, dropout_p=0.5), q)) == 1


def test_the_graph_refuses_only_when_its_device_generators_differ() -> None:
    ops = [("cpu", 'aten::native_dropout (File "m.py", line 3)')]
    splits = {"cpu": [[0, 1]], "cuda": [[0], [1]]}
    fn = refuse_divergent_rng(lambda x: x + 1, ops, splits.__getitem__, "graph [0/0]")
    assert fn(1) == 2  # the CUDA generators differ, but this graph draws on the CPU
    splits["cpu"] = [[0, 2], [1]]
    with pytest.raises(RandomStateMismatch, match=r"cpu random number generator states \(ranks 0, 2 / rank 1"):
        fn(1)


def test_digests_need_no_numpy(monkeypatch) -> None:
    # torch does not require numpy; the digest runs on every SP call (once it crashed without it).
    def no_numpy(self):
        raise RuntimeError("Numpy is not available")

    monkeypatch.setattr(torch.Tensor, "numpy", no_numpy)
    before = rng_digests()
    assert before == rng_digests()
    torch.rand(1)
    assert rng_digests() != before


def test_a_draw_outside_the_graphs_is_refused_only_from_a_generator_the_ranks_held_apart() -> None:
    import numpy as np

    splits = {d: [[0, 1]] for d in DEVICE_TYPES}
    before = rng_digests()
    np.random.rand()  # eager code drew from NumPy's global generator during the call
    refuse_eager_draws(before, splits.__getitem__)  # the ranks agreed: every rank drew the same
    splits["cpu"] = [[0], [1]]
    refuse_eager_draws(before, splits.__getitem__)  # apart on torch's generator, which did not move
    splits["numpy"] = [[0], [1]]
    with pytest.raises(RandomStateMismatch, match=r"NumPy global random states \(rank 0 / rank 1.*np\.random\.seed"):
        refuse_eager_draws(before, splits.__getitem__)
    refuse_eager_draws(rng_digests(), splits.__getitem__)  # apart, but nothing drawn since
