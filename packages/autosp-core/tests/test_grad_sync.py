"""Bucket planning of the gradient all-reduce (the collectives themselves run in integration_tests)."""

from __future__ import annotations

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from autosp.passes.grad_sync import plan_buckets


def grads_of(*shapes_dtypes) -> tuple[list[tuple[int, fx.Node]], dict[fx.Node, int]]:
    """One placeholder per gradient, produced in the order given; slots are reversed so order != slot."""
    graph = fx.Graph()
    mode = FakeTensorMode(shape_env=ShapeEnv())
    nodes = []
    for i, (shape, dtype) in enumerate(shapes_dtypes):
        node = graph.placeholder(f"g{i}")
        with mode:
            node.meta["val"] = torch.empty(shape, dtype=dtype)
        nodes.append(node)
    slots = [(len(nodes) - 1 - i, n) for i, n in enumerate(nodes)]
    return slots, {n: i for i, n in enumerate(nodes)}


def names(buckets) -> list[list[str]]:
    return [[n.name for _, n in b.grads] for b in buckets]


f32, bf16 = torch.float32, torch.bfloat16


def test_buckets_follow_production_order_and_close_at_the_cap():
    # 64 floats = 256 B, 64x64 floats = 16 KiB; cap 2 KiB.
    grads, order = grads_of(((64,), f32), ((64, 64), f32), ((64,), f32), ((64,), f32), ((64, 64), f32))
    shuffled = [grads[3], grads[0], grads[4], grads[2], grads[1]]
    buckets = plan_buckets(shuffled, order, cap_bytes=2048)
    # A bucket closes once it holds the cap: small gradients ride with the next big one.
    assert names(buckets) == [["g0", "g1"], ["g2", "g3", "g4"]]
    assert [b.nbytes for b in buckets] == [256 + 16384, 256 + 256 + 16384]
    assert buckets[0].grads[0][0] == 4  # output slots travel with the gradients


def test_one_bucket_under_the_cap_and_one_per_gradient_at_zero():
    grads, order = grads_of(((64,), f32), ((64, 64), f32), ((8,), f32))
    assert names(plan_buckets(grads, order, cap_bytes=25 * 2**20)) == [["g0", "g1", "g2"]]
    assert names(plan_buckets(grads, order, cap_bytes=0)) == [["g0"], ["g1"], ["g2"]]


def test_dtypes_never_share_a_bucket():
    grads, order = grads_of(((64,), f32), ((64,), bf16), ((64,), f32), ((64,), bf16))
    buckets = plan_buckets(grads, order, cap_bytes=2**20)
    assert names(buckets) == [["g0", "g2"], ["g1", "g3"]]
    assert [b.key[0] for b in buckets] == [f32, bf16]


def test_a_symbolic_gradient_is_reduced_alone():
    graph = fx.Graph()
    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env)
    s = env.create_unbacked_symint()
    a, b, c = (graph.placeholder(n) for n in "abc")
    with mode:
        a.meta["val"] = torch.empty(64)
        b.meta["val"] = torch.empty(s, 4)
        c.meta["val"] = torch.empty(64)
    order = {a: 0, b: 1, c: 2}
    buckets = plan_buckets([(0, a), (1, b), (2, c)], order, cap_bytes=2**20)
    assert names(buckets) == [["a", "c"], ["b"]]
    assert not env.guards  # planning did not specialise the symbolic size
