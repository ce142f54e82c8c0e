"""autosp-core's own plugin, loaded through the ``autosp`` entry point like any other."""

from __future__ import annotations

from autosp.hardware import BUILTIN_PROFILES
from autosp.hookspecs import hookimpl
from autosp.passes.choose_variant import CHOOSE_VARIANT
from autosp.passes.core import PASSES
from autosp.passes.overlap import OVERLAP, OVERLAP_BACKWARD


@hookimpl
def autosp_register_passes(register):
    for p in PASSES:
        register(p)
    register(CHOOSE_VARIANT)
    register(OVERLAP)
    register(OVERLAP_BACKWARD)


@hookimpl
def autosp_register_hardware(register):
    for profile in BUILTIN_PROFILES:
        register(profile)


@hookimpl
def autosp_register_sharding_rules(register):
    from autosp.sharding.rules import RULES

    for op, rule in RULES.items():
        register(op, rule)
