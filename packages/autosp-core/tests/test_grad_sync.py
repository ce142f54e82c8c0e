"""Bucket planning of the gradient all-reduce (the collectives themselves run in integration_tests)."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from autosp.passes.grad_sync import plan_buckets, sync_grads


def grads_of(*shapes_dtypes) -> tuple[list[tuple[int, fx.Node]], dict[fx.Node, int]]:
    """One placeholder per gradient, in the order given, with slots reversed: the plan takes them in
    the order given (descending slots)."""
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


def test_buckets_follow_descending_slots_and_close_at_the_cap():
    # 64 floats = 256 B, 64x64 floats = 16 KiB; cap 2 KiB.
    grads, _ = grads_of(((64,), f32), ((64, 64), f32), ((64,), f32), ((64,), f32), ((64, 64), f32))
    shuffled = [grads[3], grads[0], grads[4], grads[2], grads[1]]
    buckets = plan_buckets(shuffled, cap_bytes=2048)
    # A bucket closes once it holds the cap: small gradients ride with the next big one.
    assert names(buckets) == [["g0", "g1"], ["g2", "g3", "g4"]]
    assert [b.nbytes for b in buckets] == [256 + 16384, 256 + 256 + 16384]
    assert buckets[0].grads[0][0] == 4  # output slots travel with the gradients


def test_the_plan_reads_slots_never_node_order():
    # Two ranks' joint graphs may order the same gradients differently; their plans must agree.
    grads, _ = grads_of(((64,), f32), ((64, 64), f32), ((64,), f32), ((8,), bf16))
    other = [(slot, fx.Graph().placeholder(node.name)) for slot, node in reversed(grads)]
    for (_, a), (_, b) in zip(reversed(grads), other):
        b.meta["val"] = a.meta["val"]
    plans = [plan_buckets(g, cap_bytes=300) for g in (grads, other)]
    assert names(plans[0]) == names(plans[1]) == [["g0", "g1"], ["g2"], ["g3"]]


def test_one_bucket_under_the_cap_and_one_per_gradient_at_zero():
    grads, _ = grads_of(((64,), f32), ((64, 64), f32), ((8,), f32))
    assert names(plan_buckets(grads, cap_bytes=25 * 2**20)) == [["g0", "g1", "g2"]]
    assert names(plan_buckets(grads, cap_bytes=0)) == [["g0"], ["g1"], ["g2"]]


def test_dtypes_never_share_a_bucket():
    grads, _ = grads_of(((64,), f32), ((64,), bf16), ((64,), f32), ((64,), bf16))
    buckets = plan_buckets(grads, cap_bytes=2**20)
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
    buckets = plan_buckets([(2, a), (1, b), (0, c)], cap_bytes=2**20)
    assert names(buckets) == [["a", "c"], ["b"]]
    assert not env.guards  # planning did not specialise the symbolic size


def _joint(order: str) -> fx.GraphModule:
    """A joint-like graph: one forward output, then the gradients of x, y, z made in ``order``."""

    def joint(x, y, z):
        made = {}
        for name in order:
            made[name] = {"x": x, "y": y, "z": z}[name] * 2
        return x.sum(), made["x"], made["y"], made["z"]

    with FakeTensorMode():
        return make_fx(joint)(torch.empty(4), torch.empty(8), torch.empty(16))


def _issued_slots(gm: fx.GraphModule) -> list[list[int]]:
    """Per all-reduce in graph order, the output slots of the gradients it reduces."""
    out = list(gm.graph.output_node().args[0])
    slot_of = {}
    for node in gm.graph.nodes:
        if node.target is torch.ops._c10d_functional.wait_tensor.default:
            slot_of[node.args[0]] = out.index(node) if node in out else None
    issued = []
    for node in gm.graph.nodes:
        if node.target is torch.ops._c10d_functional.all_reduce.default:
            issued.append(slot_of[node])
    return issued


def test_all_reduces_run_in_the_plans_sequence_whatever_order_the_backward_made_the_gradients():
    sequences = []
    for order in ("xyz", "zyx", "yxz"):
        gm = _joint(order)
        ctx = SimpleNamespace(
            num_fwd_outputs=1,
            options=SimpleNamespace(grad_bucket_mb=0),
            group_name="sp",
            report=SimpleNamespace(collectives=Counter()),
        )
        sync_grads(gm, ctx)
        sequences.append(_issued_slots(gm))
        # Each all-reduce still comes after the gradient it reduces.
        position = {n: i for i, n in enumerate(gm.graph.nodes)}
        for node in gm.graph.nodes:
            if node.target is torch.ops._c10d_functional.all_reduce.default:
                assert position[node.args[0]] < position[node]
    assert sequences == [[3, 2, 1]] * 3
