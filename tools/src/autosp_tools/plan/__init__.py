"""autosp-plan: per-rank memory, communication, FLOPs and step time of an AutoSP program, predicted.

The program of one rank of P is compiled on fake tensors under a fake process group (nothing is
allocated, nothing runs); the numbers come from its partitioned forward and backward graphs.
"""

from autosp_tools.plan.api import plan
from autosp_tools.plan.capture import Mode
from autosp_tools.plan.layout import Layout
from autosp_tools.plan.planner import Estimate, Plan

__all__ = ["Estimate", "Layout", "Mode", "Plan", "plan"]
