"""What the partitioner really did, read off the compiled forward and backward graphs.

The policy's numbers are estimates made before partitioning; these are counts on
the graphs that run. Without recompute, every forward matmul has two backward
matmuls of the same FLOPs (gradients of both operands) and every forward
all-to-all one backward all-to-all of the same bytes, so what the backward holds
beyond that was recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import fx

from autosp.context import CompileContext
from autosp_sac.cost import attention_flops, matmul_flops
from autosp_sac.graph import MATMULS, nbytes

# Flash attention's backward recomputes the scores and runs four more matmuls: about 2.5x its forward.
ATTENTION_BACKWARD_FACTOR = 2.5
_WAIT = "wait_tensor"


@dataclass
class GraphCounts:
    matmul_flops: float = 0.0
    attention_flops: float = 0.0
    attention_calls: int = 0
    all_to_all_bytes: int = 0
    comm_bytes: int = 0


def is_comm(node: fx.Node) -> bool:
    """AutoSP's collectives and the functional ones (gradient buckets); waits move no bytes."""
    name = str(node.target)
    return (
        name.startswith("autosp.")
        and name.split(".")[1] in {"all_gather", "reduce_scatter", "all_reduce", "all_to_all"}
    ) or (name.startswith("_c10d_functional.") and _WAIT not in name)


def count(gm: fx.GraphModule, attention: frozenset) -> GraphCounts:
    c = GraphCounts()
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in MATMULS:
            c.matmul_flops += matmul_flops(node)
        elif node.target in attention:
            c.attention_calls += 1
            c.attention_flops += attention_flops(node)
        elif is_comm(node):
            c.comm_bytes += nbytes(node)
            if "all_to_all" in str(node.target):
                c.all_to_all_bytes += nbytes(node)
    return c


def audit_forward(gm: fx.GraphModule, ctx: CompileContext, attention: frozenset) -> None:
    ctx.put_state(count(gm, attention))


def audit_backward(gm: fx.GraphModule, ctx: CompileContext, attention: frozenset) -> None:
    bwd = count(gm, attention)
    ctx.report.sac["attention forwards in backward"] = bwd.attention_calls
    fwd = ctx.get_state(GraphCounts)
    if fwd is None:
        return
    recomputed_flops = max(0.0, bwd.matmul_flops - 2 * fwd.matmul_flops)
    step_flops = (
        fwd.matmul_flops
        + bwd.matmul_flops
        + fwd.attention_flops * (1 + ATTENTION_BACKWARD_FACTOR)
        + bwd.attention_flops
    )
    recomputed_bytes = max(0, bwd.all_to_all_bytes - fwd.all_to_all_bytes)
    step_bytes = fwd.comm_bytes + bwd.comm_bytes
    ctx.report.sac["recomputed FLOP fraction"] = recomputed_flops / step_flops if step_flops else 0.0
    ctx.report.sac["recomputed comm fraction"] = recomputed_bytes / step_bytes if step_bytes else 0.0
    ctx.report.sac["recomputed (graphs)"] = (
        f"{recomputed_flops:.3g} matmul FLOPs of {step_flops:.3g} per step; "
        f"{recomputed_bytes:.3g} all-to-all bytes of {step_bytes:.3g} communicated"
    )


__all__ = ["ATTENTION_BACKWARD_FACTOR", "GraphCounts", "audit_backward", "audit_forward", "count", "is_comm"]
