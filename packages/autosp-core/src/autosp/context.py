"""Everything one compile knows: options, group, inputs, findings."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from autosp.analysis.attention import AttentionSite
from autosp.discarded_outputs import Reach
from autosp.hardware import HardwareProfile
from autosp.options import SPOptions
from autosp.registry import Registry
from autosp.report import Report
from autosp.variants import SPVariant
from autosp.weak_group import WeakGroup, weak_repr

T = TypeVar("T")


@dataclass(repr=False)
class CompileContext:
    """State shared by the passes of one compiled graph.

    Attributes:
        options: what the user asked for.
        registry: loaded plugins.
        variant: the selected SP variant (``None`` when ``world == 1``).
        group: SP process group (``None`` when ``world == 1``).
        world: SP group size; rank: this process' rank in it.
        example_inputs: what Dynamo passed to the backend.
        fake_inputs: the same as fake tensors of Dynamo's fake mode.
        is_param: per input, whether it is a parameter or buffer (never sequence-shaped).
        sites: attention sites found in the graph.
        report: filled as passes run.
        min_cut: set by passes that need the min-cut partitioner (recompute tags).
        seq_len: the sequence length the attention sites agree on (set by ``autosp.lower``); ``None``
            when the graph runs whole on every rank.
        known_seq_len: the length of the last graph of this program compiled with attention: a graph
            without attention (after a graph break) shards its inputs of this length.
        num_fwd_outputs: outputs of the joint graph that belong to the forward (set before the joint stage).
        variant_state: what ``SPVariant.prepare`` returned for this compile (subgroups, tables).
        reach: per output, the inputs its gradient reaches (``autosp.discarded_outputs``; set by ``autosp.lower``).
    """

    options: SPOptions
    registry: Registry
    variant: SPVariant | None
    world: int
    rank: int
    graph_id: int
    hardware: HardwareProfile
    example_inputs: list[Any]
    fake_inputs: list[Any]
    fake_mode: Any
    is_param: list[bool]
    input_names: list[str]
    report: Report
    sites: list[AttentionSite] = field(default_factory=list)
    min_cut: bool = False
    seq_len: int | torch.SymInt | None = None
    known_seq_len: int | None = None
    output_shards: list[tuple[int, Any] | None] = field(default_factory=list)  # outputs="sharded": per output
    num_fwd_outputs: int | None = None
    variant_state: Any = None
    reach: Reach | None = None
    group: Any = WeakGroup()  # held weakly: see autosp.weak_group
    _plugin_state: dict[type, Any] = field(default_factory=dict)

    __repr__ = weak_repr

    def put_state(self, value: Any) -> None:
        """Keep a plugin's per-compile state, keyed by its type (one value per type)."""
        self._plugin_state[type(value)] = value

    def get_state(self, kind: type[T]) -> T | None:
        """The value of type ``kind`` a pass stored earlier in this compile, if any."""
        return self._plugin_state.get(kind)

    @property
    def sp(self) -> bool:
        return self.world > 1

    @property
    def group_name(self) -> str:
        return self.group.group_name

    @property
    def device(self) -> torch.device:
        for x in self.example_inputs:
            if isinstance(x, torch.Tensor):
                return x.device
        return torch.device("cpu")


__all__ = ["CompileContext"]
