"""``mode=`` and ``options=`` of ``torch.compile``, given to AutoSP: Inductor's config for its graphs.

``torch.compile(model, backend=<callable>, mode=..., options=...)`` hands both to the backend as
keywords; AutoSP runs Inductor itself (``autosp.compiler``), so it applies them there as config
patches, under its own (the collectives' order and the partitioner stay AutoSP's). Before, either
keyword crashed the first compile with a ``TypeError`` from deep inside Dynamo.

CUDA graphs (``mode="reduce-overhead"``, ``"triton.cudagraphs"``) are refused: capture and
replay of AutoSP's collectives and its failure checks between ranks have never been run. "max-autotune"
means autotuning and CUDA graphs, so it gets the autotuning and a warning naming what it leaves out.
"""

from __future__ import annotations

import warnings
from typing import Any

from autosp.errors import ConfigError

_CUDA_GRAPHS = "triton.cudagraphs"


def inductor_config(
    backend: str, mode: str | None, options: dict[str, Any] | None, dynamic: bool | None
) -> dict[str, Any]:
    """The Inductor config patches ``mode`` and ``options`` mean; raises before any collective when refused."""
    if mode in (None, "default") and not options:
        return {}
    if backend != "inductor":
        raise ConfigError(
            f"mode={mode!r} / options= configure Inductor, and backend={backend!r} runs no Inductor: drop them, "
            "or compile with backend='inductor'"
        )
    if mode == "reduce-overhead" or (options or {}).get(_CUDA_GRAPHS):
        raise ConfigError(
            "CUDA graphs (mode='reduce-overhead', options={'triton.cudagraphs': True}) are not supported by AutoSP: "
            "its collectives have not been captured and replayed in a graph. Use mode='max-autotune-no-cudagraphs' "
            "or the default mode"
        )
    from torch._inductor import list_mode_options

    try:
        config = dict(list_mode_options(mode, dynamic)) if mode is not None else {}
    except RuntimeError as e:
        raise ConfigError(f"mode={mode!r}: {e}") from None
    if config.pop(_CUDA_GRAPHS, False):
        warnings.warn(
            f"mode={mode!r}: AutoSP applies its autotuning and leaves out CUDA graphs, which it does not support; "
            "pass mode='max-autotune-no-cudagraphs' to say so and silence this warning",
            stacklevel=4,
        )
    return {**config, **(options or {})}


__all__ = ["inductor_config"]
