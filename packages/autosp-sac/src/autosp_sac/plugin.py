"""Registers sequence-aware activation checkpointing with AutoSP."""

from __future__ import annotations

from autosp import Pass, Stage, hookimpl
from autosp_sac.policy import audit_backward, tag

def _sac_on(ctx) -> bool:
    return ctx.options.sac is not False and ctx.options.backend != "eager"


SAC_PASS = Pass(
    "sac.policy",
    Stage.JOINT,
    lambda gm, ctx: tag(gm, ctx),
    after=("autosp.sync_grads",),
    applies=_sac_on,
    doc="sequence-aware activation checkpointing: save attention, recompute the cheap rest",
)


AUDIT_PASS = Pass(
    "sac.audit_backward",
    Stage.BACKWARD,
    lambda gm, ctx: audit_backward(gm, ctx),
    after=("autosp.dce_backward",),
    applies=_sac_on,
    doc="count attention forwards recomputed in the backward (should be zero)",
)


@hookimpl
def autosp_register_passes(register):
    register(SAC_PASS)
    register(AUDIT_PASS)
