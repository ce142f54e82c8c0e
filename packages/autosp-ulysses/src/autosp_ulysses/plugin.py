"""Registers the Ulysses variant with AutoSP."""

from __future__ import annotations

from autosp import SPVariant, hookimpl
from autosp_ulysses.attention import check, ulysses_attention

ULYSSES = SPVariant(
    name="ulysses",
    attention_rule=ulysses_attention,
    check=check,
    doc="DeepSpeed-Ulysses: all-to-all between sequence- and head-sharded around attention",
)


@hookimpl
def autosp_register_variants(register):
    register(ULYSSES)
