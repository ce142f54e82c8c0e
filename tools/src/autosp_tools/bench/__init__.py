"""autosp-bench: AutoSP against hand-written and DeepSpeed sequence parallelism (see ``cli``)."""

from autosp_tools.bench.cli import main, run

__all__ = ["main", "run"]
