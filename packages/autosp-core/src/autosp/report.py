"""What AutoSP found and did for one compiled graph, in words and numbers."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from autosp.analysis.attention import AttentionSite
from autosp.passes.manager import PassRecord


@dataclass
class Report:
    """Provenance of one compiled graph; ``str(report)`` is the human-readable form."""

    graph_id: int
    variant: str
    sp_size: int
    rank: int
    backend: str
    sites: list[AttentionSite] = field(default_factory=list)
    inputs: list[str] = field(default_factory=list)
    passes: list[PassRecord] = field(default_factory=list)
    collectives: Counter[str] = field(default_factory=Counter)
    fallbacks: list[str] = field(default_factory=list)
    sac: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    hardware: str = ""
    seq_len: int | None = None  # the sequence length this graph sharded, if any (at compile time)
    # The symbol of a length marked dynamic: the graph serves other lengths too, while ``seq_len``
    # and the estimates (SAC's memory and time) are the compile-time call's.
    seq_symbol: str | None = None
    outputs: list[str] = field(default_factory=list)  # what leaves the graph (crosses a graph break)
    random_ops: list[tuple[str, str]] = field(default_factory=list)  # (device type, op and line) drawing random numbers
    # The group ops of the compiled forward, then backward, in the order each rank issues them; None
    # when AOT autograd took the graphs from its cache (no stage compiled here).
    group_ops: list[str] | None = None
    # The lowered graph's code in canonical form (``autosp.canonical``), which the SP ranks compare;
    # None when the graph was not lowered.
    lowered: str | None = field(default=None, repr=False)
    # The error that made AutoSP leave this graph to torch, whole on every rank (``autosp.whole``).
    compiled_whole: str | None = None

    def __str__(self) -> str:
        lines = [
            f"AutoSP graph {self.graph_id}: variant={self.variant} sp_size={self.sp_size} rank={self.rank} "
            f"backend={self.backend}",
            f"  attention sites: {len(self.sites)}",
        ]
        if self.sp_size > 1:
            lines.insert(1, self._sharded_line())
        if self.hardware:
            lines.insert(1, f"  hardware profile: {self.hardware}")
        lines += [f"    {s.describe()}" for s in self.sites]
        if self.inputs:
            lines.append("  inputs:")
            lines += [f"    {i}" for i in self.inputs]
        if self.outputs:
            lines.append("  outputs:")
            lines += [f"    {o}" for o in self.outputs]
        if self.random_ops:
            lines.append(f"  random ops (the SP ranks' generators must agree): {len(self.random_ops)}")
            lines += [f"    {what} on {device}" for device, what in self.random_ops]
        if self.passes:
            lines.append("  passes:")
            lines += [
                f"    {p.stage:8s} {p.name:28s} {p.seconds * 1e3:8.1f} ms  nodes {p.nodes_before} -> {p.nodes_after}"
                for p in self.passes
            ]
        if self.collectives:
            lines.append("  inserted: " + ", ".join(f"{k} x{v}" for k, v in sorted(self.collectives.items())))
        if self.fallbacks:
            lines.append(f"  gathered for ops without a sharding rule ({len(self.fallbacks)}):")
            lines += [f"    {f}" for f in self.fallbacks]
        if self.sac:
            lines.append("  activation checkpointing:")
            lines += [f"    {k}: {v}" for k, v in self.sac.items()]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def _sharded_line(self) -> str:
        if not self.seq_len:
            return "  no sequence sharded: the graph runs whole on every rank"
        if self.seq_symbol:
            return (
                f"  sequence length dynamic ({self.seq_symbol}; {self.seq_len} when compiled, the length the "
                f"estimates below are for) sharded over {self.sp_size} ranks"
            )
        return f"  sequence length {self.seq_len} sharded over {self.sp_size} ranks"


__all__ = ["Report"]
