"""Registers the Ulysses variant with AutoSP."""

from __future__ import annotations

from autosp import SPVariant, hookimpl
from autosp.lowering import FLEX
from autosp_ulysses.attention import check, chunk_option, ulysses_attention
from autosp_ulysses.flex import flex_rule


def _attention(ctx, node, site, args, kwargs):
    rule = flex_rule if site.spec is FLEX else ulysses_attention
    return rule(ctx, node, site, args, kwargs)


ULYSSES = SPVariant(
    name="ulysses",
    attention_rule=_attention,
    check=check,
    prepare=lambda ctx: chunk_option(ctx.options.variant_options),
    uneven=True,
    dynamic_uneven=True,
    doc="DeepSpeed-Ulysses: all-to-all between sequence- and head-sharded around attention",
)


@hookimpl
def autosp_register_variants(register):
    register(ULYSSES)
