"""Sequence-aware activation checkpointing for AutoSP (``sac="auto"|True|False``)."""

from autosp_sac.cost import Costs, estimate
from autosp_sac.plugin import SAC_PASS
from autosp_sac.policy import tag

__all__ = ["SAC_PASS", "Costs", "estimate", "tag"]
