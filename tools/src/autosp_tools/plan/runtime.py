"""Where the planned program runs, as far as the memory inside its ops depends on it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Runtime:
    """``device``: "cuda" (NVIDIA or ROCm GPUs, NCCL/RCCL) or "cpu" (gloo); ``threads``: a CPU rank's
    intra-op threads (``torch.get_num_threads()``), since CPU kernels keep per-thread scratch."""

    device: str = "cuda"
    threads: int = 1

    @property
    def comm_backend(self) -> str:
        return "gloo" if self.device == "cpu" else "nccl"


GPU = Runtime()

__all__ = ["GPU", "Runtime"]
