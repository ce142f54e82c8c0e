"""Pass interface and manager."""

from autosp.passes.manager import Pass, PassManager, Stage, order_passes

__all__ = ["Pass", "PassManager", "Stage", "order_passes"]
