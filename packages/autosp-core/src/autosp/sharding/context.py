"""State shared by the sharding rules while one graph is rewritten."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from autosp.sharding.placement import IntLike, Layout, Placement, even_ranges

if TYPE_CHECKING:
    from autosp.analysis.attention import AttentionSite


@dataclass
class SPValue:
    """A value of the rewritten program: this rank's tensor, its placement, and the global meta value."""

    local: torch.Tensor
    placement: Placement
    gval: torch.Tensor

    @property
    def ndim(self) -> int:
        return self.gval.dim()


def global_like(gval: torch.Tensor, shape: Sequence[Any]) -> torch.Tensor:
    """A new global value of ``shape`` (``gval``'s dtype and device) made outside the sharded trace.

    Global values are the lowering's fake tensors. An op run on one while ``shard_graph`` traces is
    recorded, with the fake tensor as a constant that the compiled program then takes as an input
    (Inductor on CUDA reads its data pointer and fails; see the engine's README).
    """
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    with disable_proxy_modes_tracing():
        return gval.new_empty(list(shape))


AttentionRule = Callable[["SPContext", torch.fx.Node, "AttentionSite", tuple, dict], Any]


def _core_rules() -> Mapping[Any, Callable[..., Any]]:
    from autosp.sharding.rules import RULES

    return RULES


@dataclass
class SPContext:
    """What the rules need to know about the SP group and the program.

    Attributes:
        rank: this process' rank in the SP group (baked into the traced graph).
        world: size of the SP group.
        group_name: name of the process group, resolved inside the collective ops.
        seq_len: global sequence length found at the attention sites.
        attention_rule: how the selected SP variant rewrites one attention site.
        sites: attention sites by the name of their node in the lowered graph.
        layout_fn: the variant's choice of sequence layout (``None``: contiguous, even).
        rules: sharding rule per aten op (core's and the plugins'); defaults to core's own.
        variant_state: what the variant prepared for this compile (``SPVariant.prepare``).
        fallbacks, notes: what the report says of values run whole, and of anything else a rule chose.
    """

    rank: int
    world: int
    group_name: str
    seq_len: IntLike
    attention_rule: AttentionRule
    sites: dict[str, AttentionSite] = field(default_factory=dict)
    counts: Counter = field(default_factory=Counter)
    fallbacks: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)  # how each tensor output leaves the graph
    sharded_outputs: bool = False  # outputs="sharded": sequence-sharded outputs leave as this rank's piece
    output_shards: list[tuple[int, Any] | None] = field(default_factory=list)  # per output: (dim, length)
    variant_options: dict[str, Any] = field(default_factory=dict)
    layout_fn: Callable[[IntLike, int, dict[str, Any]], Layout | None] | None = None
    rules: Mapping[Any, Callable[..., Any]] = field(default_factory=_core_rules)
    variant_state: Any = None

    def even_ranges(self, length: IntLike) -> Layout:
        return even_ranges(length, self.world)

    def layout(self, length: IntLike) -> Layout:
        """How the variant wants a sequence of ``length`` split where sharding starts."""
        chosen = self.layout_fn(length, self.world, self.variant_options) if self.layout_fn else None
        return chosen if chosen is not None else self.even_ranges(length)

    def note(self, what: str) -> None:
        self.counts[what] += 1
