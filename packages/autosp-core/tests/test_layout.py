"""The index map of layout chains (analysis/layout.py) against the elements the chain really moves."""

from __future__ import annotations

import math
import random

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.fx.experimental.proxy_tensor import make_fx

from autosp.analysis.layout import LAYOUT, chain_between, moves_like_reshape


def _traced(fn, shape):
    gm = make_fx(fn, tracing_mode="fake")(torch.zeros(shape))
    src = next(n for n in gm.graph.nodes if n.op == "placeholder")
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    return src, chain_between(src, out, LAYOUT | {torch.ops.aten._to_copy.default})


def _moves_like_reshape_really(fn, shape) -> bool:
    x = torch.arange(math.prod(shape)).view(shape)
    y = fn(x)
    return torch.equal(y, x.reshape(y.shape))


_OPS = st.sampled_from(["permute", "transpose", "unsqueeze", "squeeze", "merge", "split", "clone", "float"])


def _program(ops: list[str], seed: int):
    """A chain of layout ops, each choice drawn from ``seed`` and the shape reached."""

    def fn(x):
        rng = random.Random(seed)  # Python's: make_fx would trace torch's draws
        pick = rng.randrange
        for op in ops:
            n = x.dim()
            if op == "permute":
                x = x.permute(*rng.sample(range(n), n))
            elif op == "transpose" and n >= 2:
                x = x.transpose(pick(n), pick(n))
            elif op == "unsqueeze":
                x = x.unsqueeze(pick(n + 1))
            elif op == "squeeze" and 1 in x.shape:
                x = x.squeeze(x.shape.index(1))
            elif op == "merge" and n >= 2:
                i = pick(n - 1)
                x = x.reshape(*x.shape[:i], x.shape[i] * x.shape[i + 1], *x.shape[i + 2 :])
            elif op == "split" and x.shape[0] % 2 == 0:
                x = x.reshape(2, x.shape[0] // 2, *x.shape[1:])
            elif op == "clone":
                x = x.contiguous()
            elif op == "float":
                x = x.to(torch.float64)
        return x

    return fn


@settings(max_examples=150, deadline=None)
@given(
    st.lists(_OPS, min_size=1, max_size=7), st.integers(0, 2**16), st.sampled_from([(2, 4, 6, 8), (4, 3, 2), (6, 1, 4)])
)
def test_the_map_agrees_with_the_elements_moved(ops, seed, shape):
    fn = _program(ops, seed)
    src, chain = _traced(fn, shape)
    assert chain is not None
    out_shape = tuple(fn(torch.zeros(shape)).shape)
    assert moves_like_reshape(src, chain, out_shape) == _moves_like_reshape_really(fn, shape), ops


def test_einsum_scores_move_like_a_view():
    # What torch.einsum("bhqd,bhkd->bhqk") puts around its bmm: a [B*H, S, S] product seen as [B, H, S, S].
    def product_to_scores(p):
        return p.view(2, 4, 6, 1, 6).permute(0, 1, 2, 4, 3).reshape(2, 4, 6, 6)

    src, chain = _traced(product_to_scores, (8, 6, 6))
    assert moves_like_reshape(src, chain, (2, 4, 6, 6))

    def transposed(p):  # the same sizes, the keys and queries swapped: not the product's view
        return p.view(2, 4, 6, 6).transpose(-1, -2)

    src, chain = _traced(transposed, (8, 6, 6))
    assert not moves_like_reshape(src, chain, (2, 4, 6, 6))


def test_a_broadcast_or_a_symbolic_size_is_not_judged():
    src, chain = _traced(lambda x: x[:, None].expand(4, 2, 3).reshape(8, 3), (4, 3))
    assert not moves_like_reshape(src, chain, (8, 3))
