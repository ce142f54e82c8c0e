"""``autosp.plan``: predict one rank's memory, communication, FLOPs and step time without running.

The planner lives in ``autosp-tools`` (``autosp_tools.plan``, also the ``autosp-plan`` command); this
is its entry point from core, imported only when called, so core does not depend on the tools.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from autosp.errors import ConfigError

if TYPE_CHECKING:
    from autosp_tools.plan.planner import Plan


def plan(model: Any, *, gpus: int, hardware: str, **options: Any) -> Plan:
    """Compile ``model`` for one rank of ``gpus`` on fake tensors and a fake process group; return the plan.

    Args:
        model: a preset name (``llama-3.1-8b``, ...), an HF config.json path, ``module:factory``, or a
            callable returning a module whose ``forward(input_ids, labels)`` returns the loss.
        gpus: GPUs in all (``sp * dp``).
        hardware: a hardware profile name (``h100-80gb``) or an ``autosp-profile`` JSON path.
        **options: ``seq``, ``max_seq``, ``sp``, ``dp``, ``zero``, ``dtype``, ... (see ``autosp_tools.plan.plan``).
    """
    try:
        from autosp_tools.plan import plan as run
    except ImportError as e:
        raise ConfigError(f"autosp.plan needs the autosp-tools package: pip install autosp-tools ({e})") from e
    return run(model, gpus=gpus, hardware=hardware, **options)


__all__ = ["plan"]
