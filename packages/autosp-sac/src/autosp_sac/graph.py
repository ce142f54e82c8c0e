"""What the policy needs to know about a joint graph: forward nodes, attention, layer inputs, sizes."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import fx

from autosp.torch_compat import optimization_hint

aten = torch.ops.aten

# Attention kernels SDPA lowers to, per backend, and Flex; plugins add their ops through the registry.
ATTENTION_KERNELS = frozenset(
    op
    for name in (
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_fused_attention_overrideable",
        "_flash_attention_forward",
        "_efficient_attention_forward",
    )
    if hasattr(aten, name)
    for op in [getattr(aten, name).default]
) | frozenset(
    # FlexAttention stays one higher-order op in the joint graph, its backward reading (out, lse).
    op
    for op in [getattr(torch.ops.higher_order, "flex_attention", None)]
    if op is not None
)

MATMULS = frozenset({aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default})


def is_random(node: fx.Node) -> bool:
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags


def hint(n: int | torch.SymInt) -> int:
    """A concrete size: symbolic sizes are costed at the example's value.

    A data-dependent size (``nonzero``, boolean indexing) has no example value: torch's
    optimization hint stands in for it, without a guard.
    """
    return n if isinstance(n, int) else int(optimization_hint(n))


def _tensor_bytes(t: torch.Tensor) -> int:
    numel = 1
    for s in t.shape:
        numel *= hint(s)
    return numel * t.element_size()


def nbytes(node: fx.Node) -> int:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return _tensor_bytes(val)
    if isinstance(val, (tuple, list)):
        return sum(_tensor_bytes(v) for v in val if isinstance(v, torch.Tensor))
    return 0


@dataclass
class JointInfo:
    """Forward part of a joint graph and the landmarks the policy uses."""

    forward: list[fx.Node]
    attention: list[fx.Node]
    layer_inputs: list[fx.Node] = field(default_factory=list)


def forward_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """call_function nodes that do not depend on any tangent."""
    backward: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder" and "tangent" in node.name:
            backward.add(node)
        elif node.op == "call_function" and any(a in backward for a in node.all_input_nodes):
            backward.add(node)
    return [n for n in gm.graph.nodes if n.op == "call_function" and n not in backward]


def _ancestors(starts: Iterable[fx.Node], within: set[fx.Node]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = [s for s in starts if s in within]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        stack.extend(a for a in node.all_input_nodes if a in within)
    return seen


def layer_input(
    attn: fx.Node, fwd: set[fx.Node], order: dict[fx.Node, int], live: set[fx.Node] | None = None
) -> fx.Node | None:
    """The residual-stream tensor an attention block starts from.

    The latest forward node that q, k and v all descend from and that is also used
    outside their computation (by the residual connection) on the way to the forward's
    outputs (``live``). A node that does not need a tangent but feeds only the backward
    (Inductor's decompositions make such nodes, e.g. an MLP activation's sigmoid for its
    backward) is not the residual stream.
    """
    qkv = [a for a in attn.args[:3] if isinstance(a, fx.Node)]
    if len(qkv) < 3:
        return None
    cones = [_ancestors([a], fwd) for a in qkv]
    common = cones[0] & cones[1] & cones[2]
    cone = cones[0] | cones[1] | cones[2]
    # The residual stream is the widest such tensor (a norm's statistics are narrower); the latest wins.
    candidates = [
        node
        for node in common
        if isinstance(node.meta.get("val"), torch.Tensor)
        and node.meta["val"].is_floating_point()
        and any(u in fwd and u not in cone and (live is None or u in live) for u in node.users)
    ]
    if not candidates:
        return None
    return max(candidates, key=lambda n: (nbytes(n), order[n]))


def forward_outputs_cone(gm: fx.GraphModule, num_fwd_outputs: int, fwd: set[fx.Node]) -> set[fx.Node]:
    """Forward nodes the joint graph's first ``num_fwd_outputs`` outputs depend on."""
    outs = gm.graph.output_node().args[0][:num_fwd_outputs]
    return _ancestors([o for o in outs if isinstance(o, fx.Node)], fwd)


def analyse(gm: fx.GraphModule, attention_ops: frozenset, num_fwd_outputs: int | None = None) -> JointInfo:
    fwd_list = forward_nodes(gm)
    fwd = set(fwd_list)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    attention = [n for n in fwd_list if n.target in attention_ops]
    info = JointInfo(fwd_list, attention)
    live = forward_outputs_cone(gm, num_fwd_outputs, fwd) if num_fwd_outputs is not None else None
    for attn in attention:
        x = layer_input(attn, fwd, order, live)
        if x is not None and x not in info.layer_inputs:
            info.layer_inputs.append(x)
    return info


__all__ = [
    "ATTENTION_KERNELS",
    "MATMULS",
    "JointInfo",
    "analyse",
    "forward_nodes",
    "forward_outputs_cone",
    "hint",
    "is_random",
    "layer_input",
    "nbytes",
]
