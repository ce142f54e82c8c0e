"""Automatic DeepSpeed-Ulysses sequence parallelism for AutoSP (``variant="ulysses"``)."""

from autosp_ulysses.attention import ulysses_attention
from autosp_ulysses.plugin import ULYSSES

__all__ = ["ULYSSES", "ulysses_attention"]
