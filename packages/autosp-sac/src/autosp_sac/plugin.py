"""Registers sequence-aware activation checkpointing with AutoSP."""

from __future__ import annotations

from autosp import Pass, Stage, hookimpl
from autosp_sac.audit import audit_backward, audit_forward
from autosp_sac.order import free_early
from autosp_sac.policy import attention_ops, tag


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


FORWARD_AUDIT_PASS = Pass(
    "sac.audit_forward",
    Stage.FORWARD,
    lambda gm, ctx: audit_forward(gm, ctx, attention_ops(ctx)),
    after=("autosp.dce_forward",),
    applies=_sac_on,
    doc="count the forward's matmul FLOPs and communication, for the backward audit",
)

AUDIT_PASS = Pass(
    "sac.audit_backward",
    Stage.BACKWARD,
    lambda gm, ctx: audit_backward(gm, ctx, attention_ops(ctx)),
    after=("autosp.dce_backward",),
    applies=_sac_on,
    doc="attention forwards, FLOPs and bytes recomputed in the backward (attention forwards should be 0)",
)


FREE_EARLY_PASS = Pass(
    "sac.free_early",
    Stage.BACKWARD,
    free_early,
    after=("autosp.dce_backward", "autosp.overlap_backward", "sac.audit_backward"),
    applies=_sac_on,
    doc="matmuls that last read a large activation move up to their inputs, so it is freed sooner",
)


@hookimpl
def autosp_register_passes(register):
    register(SAC_PASS)
    register(FORWARD_AUDIT_PASS)
    register(AUDIT_PASS)
    register(FREE_EARLY_PASS)
