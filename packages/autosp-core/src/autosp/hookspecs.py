"""The hooks AutoSP plugins implement.

Plugins are modules or objects listed under the ``autosp`` entry-point group
(use your distribution name as the entry-point name).  Each registration hook
receives a ``register`` callback, so plugins never touch the registry itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    import torch

    from autosp.analysis.attention import AttentionSpec
    from autosp.hardware import HardwareProfile
    from autosp.passes.manager import Pass
    from autosp.variants import SPVariant

PROJECT = "autosp"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def autosp_register_passes(register: Callable[[Pass], None]) -> None:
    """Called once when the registry loads; call ``register(pass_)`` for each pass you provide."""


@hookspec
def autosp_register_variants(register: Callable[[SPVariant], None]) -> None:
    """Called once when the registry loads; register SP variants (``variant="..."``)."""


@hookspec
def autosp_register_attention(register: Callable[[AttentionSpec], None]) -> None:
    """Called once when the registry loads; register attention ops that SP variants must treat as attention."""


@hookspec
def autosp_register_sharding_rules(register: Callable[..., None]) -> None:
    """Called once when the registry loads; give sharding rules for ops you own.

    Call ``register(op, rule, accepts=())`` per aten/custom op overload: ``rule(ctx, node, args, kwargs)``
    returns this rank's ``SPValue`` (see ``autosp.sharding`` and its README for the contract);
    ``accepts`` names the placements beyond Replicate and Shard the rule handles itself
    (``Partial``, ``HeadShard``); the engine makes other inputs whole first. Registering an op
    that already has a rule (core's or another plugin's) is an error.
    """


@hookspec
def autosp_register_hardware(register: Callable[[HardwareProfile], None]) -> None:
    """Called once when the registry loads; register hardware profiles for cost models."""


@hookspec(firstresult=True)
def autosp_select_hardware(device: torch.device, profiles: tuple[HardwareProfile, ...]) -> HardwareProfile | None:
    """Called per compile without ``hardware=``: the profile for ``device`` if you recognise it.

    The first non-None result wins; with none, core matches device names against ``profiles``
    (every registered profile). ROCm builds report device type "cuda", so autosp-rocm answers
    here from ``torch.version.hip`` and ``gcnArchName``.
    """


__all__ = [
    "autosp_register_attention",
    "autosp_register_hardware",
    "autosp_register_passes",
    "autosp_register_sharding_rules",
    "autosp_register_variants",
    "autosp_select_hardware",
    "hookimpl",
    "hookspec",
]
