"""One block of ring attention: q of one sequence chunk against k/v of another.

Blocks merge in fp32 (fp64 for fp64 inputs: ``acc_dtype``) through the log-sum-exp, so
the order in which they arrive does not change the result beyond rounding.  This module's
block math (in that dtype, [Lq, Lk] scores) is the reference and the fallback; ``autosp_ring.kernels``
computes blocks on fused kernels where it can.  Masks are
built from global positions: causal keeps ``k <= q``; a sliding window of
``window`` keeps ``0 <= q - k < window`` (causal sliding window, as in Mistral).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

NEG_INF = float("-inf")


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """What blocks of ``dtype`` compute and merge in: fp32, or fp64 for fp64 (a float64 model's
    attention in fp32 would lose half its digits, silently)."""
    return torch.promote_types(dtype, torch.float32)


def block_mask(
    q_off: int, q_len: int, k_off: int, k_len: int, causal: bool, window: int, device: torch.device
) -> Tensor | None:
    """Boolean [q_len, k_len] mask of allowed pairs, or None when every pair is allowed."""
    if not causal and window <= 0:
        return None
    qpos = torch.arange(q_off, q_off + q_len, device=device)[:, None]
    kpos = torch.arange(k_off, k_off + k_len, device=device)[None, :]
    allowed = kpos <= qpos
    if window > 0:
        allowed = allowed & (qpos - kpos < window)
    return allowed


def block_needed(q_off: int, q_len: int, k_off: int, k_len: int, causal: bool, window: int) -> bool:
    """Whether any (q, k) pair of the block is allowed; skipped blocks cost no compute."""
    return allowed_pairs(q_off, q_len, k_off, k_len, causal, window) > 0


def allowed_pairs(q_off: int, q_len: int, k_off: int, k_len: int, causal: bool, window: int) -> int:
    """Number of unmasked score entries of a block (per batch row and head): its work."""
    if not causal and window <= 0:
        return q_len * k_len
    total = 0
    for i in range(q_off, q_off + q_len):
        hi = min(i, k_off + k_len - 1)  # causal: k <= i
        lo = k_off if window <= 0 else max(k_off, i - window + 1)
        total += max(0, hi - lo + 1)
    return total


def expand_kv(x: Tensor, heads: int) -> Tensor:
    """GQA: kv head h serves query heads h*g .. h*g+g-1 (SDPA's enable_gqa); expanded locally only."""
    kv = x.shape[1]
    if kv == heads:
        return x
    return x.repeat_interleave(heads // kv, dim=1)


def reduce_kv(dx: Tensor, kv_heads: int) -> Tensor:
    """Gradient of ``expand_kv``: sum over the query heads that shared a kv head."""
    b, h, s, d = dx.shape
    if h == kv_heads:
        return dx
    return dx.view(b, kv_heads, h // kv_heads, s, d).sum(2)


def _safe(lse: Tensor) -> Tensor:
    # Fully masked rows have lse = -inf; subtracting 0 instead keeps their probabilities exactly 0.
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def _scores(q: Tensor, k: Tensor, scale: float, mask: Tensor | None) -> Tensor:
    acc = acc_dtype(q.dtype)
    s = torch.matmul(q.to(acc), expand_kv(k, q.shape[1]).to(acc).transpose(-1, -2)) * scale
    if mask is None:
        return s
    if mask.dtype == torch.bool:
        return s.masked_fill(~mask, NEG_INF)
    return s + mask.to(acc)


def tile_mask(structural: Tensor | None, tile: Tensor | None) -> Tensor | None:
    """One block's mask: the causal/window pattern combined with the block's tile of the model's mask.

    A boolean tile keeps the pairs it marks True (as SDPA's boolean ``attn_mask``); a float tile is
    added to the scores (an additive mask or bias).  The result is bool or float, as ``_scores`` takes.
    """
    if tile is None:
        return structural
    if tile.dtype == torch.bool:
        return tile if structural is None else tile & structural
    bias = tile.to(acc_dtype(tile.dtype))
    return bias if structural is None else bias.masked_fill(~structural, NEG_INF)


def tile_needed(tile: Tensor | None) -> bool:
    """Whether the model's mask leaves any pair of the block; fully masked tiles are skipped."""
    if tile is None:
        return True
    if tile.dtype == torch.bool:
        return bool(tile.any())
    return not bool(torch.isneginf(tile).all())


def block_forward(q: Tensor, k: Tensor, v: Tensor, scale: float, mask: Tensor | None) -> tuple[Tensor, Tensor]:
    """(out, lse) of one block in ``acc_dtype``; rows with no allowed key get out 0 and lse -inf."""
    s = _scores(q, k, scale, mask)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - _safe(lse)[..., None])
    return torch.matmul(p, expand_kv(v, q.shape[1]).to(s.dtype)), lse


def natural_lse(lse: Tensor, base: float) -> Tensor:
    """A log-sum-exp in base ``base`` as a natural one: log_b(x) * ln(b).

    Fused kernels may return base-2 lse (AOTriton before 0.11, on ROCm); merging that as if it
    were natural would weight the blocks wrongly, silently.
    """
    return lse if base == math.e else lse * math.log(base)


@dataclass(frozen=True)
class BlockKernel:
    """What computes one block's (out, lse): ``forward(q, k, v, scale, mask)``, lse in base ``lse_base``."""

    name: str
    forward: Callable[[Tensor, Tensor, Tensor, float, Tensor | None], tuple[Tensor, Tensor]]
    lse_base: float = math.e


REFERENCE_KERNEL = BlockKernel("fp32 reference", block_forward)
# The default: each block on the fused kernel ``autosp_ring.kernels`` picks (forward and backward),
# fp32 math where none can.  Any other kernel set here computes forward blocks only, with the fp32
# backward; REFERENCE_KERNEL makes every block fp32 math (the ring before fused kernels).
FUSED_KERNEL = BlockKernel("fused when available", block_forward)
_active = FUSED_KERNEL  # per process, like the device: which kernel runs here


def block_kernel() -> BlockKernel:
    """The kernel the ring op computes blocks with (FUSED_KERNEL unless one is set)."""
    return _active


def set_block_kernel(kernel: BlockKernel) -> BlockKernel:
    """Compute blocks with ``kernel`` in this process; returns the previous one."""
    global _active
    previous, _active = _active, kernel
    return previous


def merge(out: Tensor, lse: Tensor, b_out: Tensor, b_lse: Tensor) -> tuple[Tensor, Tensor]:
    """Combine two partial softmax results (in ``acc_dtype``) through their log-sum-exps."""
    m = _safe(torch.maximum(lse, b_lse))
    ea, eb = torch.exp(lse - m), torch.exp(b_lse - m)
    denom = ea + eb
    new_lse = m + torch.log(denom)
    denom = denom.clamp_min(torch.finfo(denom.dtype).tiny)
    return out * (ea / denom)[..., None] + b_out * (eb / denom)[..., None], new_lse


def block_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dout: Tensor,
    lse: Tensor,
    delta: Tensor,
    scale: float,
    mask: Tensor | None,
    return_ds: bool = False,
) -> tuple[Tensor, ...]:
    """(dq, dk, dv) of one block in ``acc_dtype`` given the final lse and delta = rowsum(dout * out).

    With ``return_ds``, also the gradient of the scores (that of an additive mask's tile).
    """
    heads, kv_heads = q.shape[1], k.shape[1]
    s = _scores(q, k, scale, mask)
    p = torch.exp(s - _safe(lse)[..., None])
    ve = expand_kv(v, heads).to(s.dtype)
    dv = torch.matmul(p.transpose(-1, -2), dout)
    dp = torch.matmul(dout, ve.transpose(-1, -2))
    ds = p * (dp - delta[..., None])
    dq = torch.matmul(ds, expand_kv(k, heads).to(s.dtype)) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q.to(s.dtype)) * scale
    if return_ds:
        return dq, reduce_kv(dk, kv_heads), reduce_kv(dv, kv_heads), ds
    return dq, reduce_kv(dk, kv_heads), reduce_kv(dv, kv_heads)


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


__all__ = [
    "FUSED_KERNEL",
    "acc_dtype",
    "REFERENCE_KERNEL",
    "BlockKernel",
    "block_kernel",
    "natural_lse",
    "set_block_kernel",
    "allowed_pairs",
    "block_backward",
    "block_forward",
    "block_mask",
    "block_needed",
    "default_scale",
    "expand_kv",
    "merge",
    "reduce_kv",
    "tile_mask",
    "tile_needed",
]
