"""Facts about PyTorch's ROCm attention kernels (AOTriton) that change the SP rewrite.

- GQA: the memory-efficient kernel needs as many k/v heads as q heads. SDPA with
  ``enable_gqa=True`` and fewer k/v heads skips it; when the flash kernel cannot run the call
  either (fp32, or a head dim over its limit) SDPA falls back to the math path, which
  materialises the [S, S] score matrix. ``autosp_rocm.gqa`` repeats k/v locally, after the
  exchange, exactly when only the memory-efficient kernel can run the call.
- Head dims up to 256 and fp16/bf16 for flash (fp32 too for memory-efficient); gfx950 kernels
  were experimental in early AOTriton releases (``TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL=1``).
- Log-sum-exp base: AOTriton before 0.11 returned log2-based lse (``log2(sum 2^x)`` of the scaled
  scores in base 2), and kernels that merge partial attention results through it
  (ring attention, context parallelism) must convert (pytorch/pytorch#156012, fixed in PyTorch by
  #156903 and in AOTriton by ROCm/aotriton#108). PyTorch 2.9 ships AOTriton 0.11 (natural lse).
"""

from __future__ import annotations

import math
import os

import torch

from autosp.hardware import AttentionKernel

LSE_BASE_ENV = "AUTOSP_ROCM_LSE_BASE"  # "2" or "e": override what the torch version implies


def _version(v: str) -> tuple[int, int]:
    major, minor = (v.split("+")[0].split(".") + ["0"])[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def lse_base(torch_version: str | None = None) -> float:
    """The base of the lse ROCm's fused attention kernels return with this PyTorch (2.0 or e)."""
    forced = os.environ.get(LSE_BASE_ENV, "").strip().lower()
    if forced:
        if forced not in ("2", "e"):
            raise ValueError(f"{LSE_BASE_ENV}={forced!r}; use 2 or e")
        return 2.0 if forced == "2" else math.e
    version = torch_version or torch.__version__
    return 2.0 if _version(version) < (2, 9) else math.e


def rocm_kernels(torch_version: str | None = None, experimental: bool = False) -> tuple[AttentionKernel, ...]:
    """ROCm SDPA kernels in PyTorch's order of preference (flash, then memory-efficient)."""
    base = lse_base(torch_version)
    note = "AOTriton" + (" (experimental on this architecture)" if experimental else "")
    return (
        AttentionKernel("flash", gqa=True, max_head_dim=256, dtypes=("float16", "bfloat16"), lse_base=base, note=note),
        AttentionKernel(
            "efficient",
            gqa=False,
            max_head_dim=256,
            dtypes=("float16", "bfloat16", "float32"),
            lse_base=base,
            note=note,
        ),
    )


__all__ = ["LSE_BASE_ENV", "lse_base", "rocm_kernels"]
