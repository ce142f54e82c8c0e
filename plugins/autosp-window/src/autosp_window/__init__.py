"""Causal sliding-window attention as a custom op, declared to AutoSP as ``sliding_window`` attention."""

from autosp_window.op import reference_attention, sliding_window_attention
from autosp_window.plugin import SPEC

__all__ = ["SPEC", "reference_attention", "sliding_window_attention"]
