"""``sac="auto"`` by memory: recompute the cheapest layers that make the program fit, none when it fits.

The estimate, per rank, from the joint graph: the parameters and their gradients, plus what the
backward reads from the forward. Without recompute that is every forward value a backward node
uses; with a layer recomputed, only what SAC always keeps of it (its input from the residual
stream, attention's outputs, random ops). Layers are the spans between consecutive layer inputs;
each costs its matmul FLOPs and all-to-all bytes to recompute. Layers are taken cheapest per saved
byte first until the estimate meets the budget. Optimizer state and transient buffers are not in
the estimate: give ``memory_budget=`` what the device has left for the step.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import fx

from autosp.context import CompileContext
from autosp.errors import AutoSPError
from autosp_sac.cost import is_collective, matmul_flops
from autosp_sac.graph import MATMULS, JointInfo, nbytes

MiB = 2**20


def budget_bytes(ctx: CompileContext) -> tuple[int, str] | None:
    """The bytes the program must fit in and where that number comes from; None when nothing says."""
    budget = ctx.options.memory_budget
    device = int(getattr(ctx.hardware, "memory_bytes", 0) or 0)
    if isinstance(budget, float):
        if not device:
            raise AutoSPError(
                f"memory_budget={budget} is a fraction of the device's memory, but the hardware profile "
                f"{ctx.hardware.name!r} does not give its memory; give memory_budget in bytes (an int) instead"
            )
        return int(budget * device), f"memory_budget={budget} of {ctx.hardware.name}'s {device / MiB:.0f} MiB"
    if budget is not None:
        return int(budget), f"memory_budget={budget}"
    if device:
        return device, f"{ctx.hardware.name}'s memory"
    return None


@dataclass
class Layer:
    """One span of the forward: what recomputing it saves and costs."""

    nodes: list[fx.Node]
    saved_off: int  # bytes the backward reads from it without recompute
    saved_on: int  # bytes SAC keeps of it anyway
    seconds: float  # recompute time on this hardware

    @property
    def gain(self) -> int:
        return max(self.saved_off - self.saved_on, 0)


@dataclass
class Plan:
    fixed: int  # parameters and gradients
    layers: list[Layer]
    chosen: list[int]
    budget: int
    source: str

    def estimate(self, chosen: list[int] | None = None) -> int:
        picked = set(self.chosen if chosen is None else chosen)
        return self.fixed + sum(
            layer.saved_on if i in picked else layer.saved_off for i, layer in enumerate(self.layers)
        )

    def describe(self) -> dict[str, str | int]:
        off, on = self.estimate([]), self.estimate(list(range(len(self.layers))))
        if not self.chosen:
            choice = "fits: nothing recomputed"
        elif self.estimate() > self.budget:
            choice = f"does not fit even with all {len(self.layers)} layers recomputed: recompute all"
        else:
            choice = f"recompute {len(self.chosen)} of {len(self.layers)} layers (cheapest per saved byte first)"
        return {
            "memory budget bytes": self.budget,
            "estimated bytes without recompute": off,
            "estimated bytes with all recomputed": on,
            "estimated bytes chosen": self.estimate(),
            "layers recomputed": f"{len(self.chosen)} of {len(self.layers)}",
            "memory budget": f"{self.budget / MiB:.1f} MiB ({self.source})",
            "memory estimate": (
                f"{off / MiB:.1f} MiB without recompute, {on / MiB:.1f} MiB with all recomputed "
                f"({self.fixed / MiB:.1f} MiB of it parameters and gradients); chosen "
                f"{self.estimate() / MiB:.1f} MiB"
            ),
            "memory choice": choice,
        }


def _layers(gm: fx.GraphModule, info: JointInfo, keep: set[fx.Node], hw) -> list[Layer]:
    fwd = set(info.forward)
    starts = set(info.layer_inputs)
    spans: list[list[fx.Node]] = [[]]
    for node in info.forward:
        if node in starts and spans[-1]:
            spans.append([])
        spans[-1].append(node)
    layers = []
    for span in spans:
        read = [n for n in span if any(u not in fwd and u.op != "output" for u in n.users)]
        off = sum(nbytes(n) for n in read)
        on = sum(nbytes(n) for n in read if n in keep)
        flops = sum(matmul_flops(n) for n in span if n.target in MATMULS)
        comm = sum(nbytes(n) for n in span if is_collective(n))
        layers.append(Layer(span, off, on, flops / hw.flops + comm / hw.comm_bandwidth))
    return layers


def plan(gm: fx.GraphModule, ctx: CompileContext, info: JointInfo, keep: set[fx.Node], budget: tuple[int, str]) -> Plan:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder" and not n.name.startswith("tangent")]
    params = sum(nbytes(n) for n, is_param in zip(placeholders, ctx.is_param) if is_param)
    layers = _layers(gm, info, keep, ctx.hardware)
    p = Plan(2 * params, layers, [], *budget)
    need = p.estimate([]) - p.budget
    order = sorted(
        (i for i, layer in enumerate(layers) if layer.gain > 0), key=lambda i: layers[i].seconds / layers[i].gain
    )
    for i in order:
        if need <= 0:
            break
        p.chosen.append(i)
        need -= layers[i].gain
    return p


__all__ = ["Layer", "Plan", "budget_bytes", "plan"]
