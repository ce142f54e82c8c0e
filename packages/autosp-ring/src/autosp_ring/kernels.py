"""Fused attention kernels for one ring block, each with the kernel's own backward.

A fused kernel never materialises the block's [Lq, Lk] score matrix: it returns the block's output
and its log-sum-exp, which the ring merges.  The backward uses the standard ring identity: called
with the FINAL merged (out, lse) instead of the block's own, a kernel's backward computes
``P = exp(S - lse_final)`` (the block's share of the global softmax) and
``delta = rowsum(dout * out_final)``, so its (dq, dk, dv) are exactly the block's contributions.

Which kernel runs depends on the device, dtype, head dim and whether the block needs a mask tile:

- CPU: ``_scaled_dot_product_flash_attention_for_cpu`` (any dtype it takes, native GQA, additive mask).
- CUDA/ROCm: flash (fp16/bf16, head dim <= 256 and a multiple of 8, no mask) else memory-efficient
  (additive ``attn_bias``).  ROCm's lse base comes from autosp-rocm when installed.

Every kernel is checked once per (kernel, device, dtype, head dim, masked) against the fp32 reference
on a small block, forward and backward; one that disagrees is not used (a warning says so) and the
fp32 math of ``blocks`` computes those blocks instead.  A kernel returns, for rows of a block with no
allowed key, whatever it likes (CPU flash: lse 0); :func:`forward` resets them to out 0, lse -inf so
they weigh nothing in the merge.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from autosp_ring.blocks import NEG_INF, block_backward, block_forward, block_mask, natural_lse

aten = torch.ops.aten


@dataclass(frozen=True)
class Tile:
    """How one block is masked: ``causal`` (a diagonal block: equal offsets and lengths, plain causal),
    ``mask`` (bool: keep True; fp32: added to the scores) or neither (every pair allowed)."""

    causal: bool = False
    mask: Tensor | None = None

    def dense(self, q_len: int, device: torch.device) -> Tensor | None:
        """The mask as the fp32 reference takes it (the diagonal spelled out)."""
        if self.causal:
            return block_mask(0, q_len, 0, q_len, True, 0, device)
        return self.mask


Forward = Callable[[Tensor, Tensor, Tensor, float, bool, Tensor | None], tuple[Tensor, Tensor]]
Backward = Callable[
    [Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, float, bool, Tensor | None], tuple[Tensor, Tensor, Tensor]
]


@dataclass(frozen=True)
class FusedKernel:
    """``forward(q, k, v, scale, causal, bias) -> (out, lse [B,H,L] in base lse_base)`` and its backward.

    ``bias`` is an additive mask (fp32 or q's dtype, -inf where masked); k/v arrive with q's head count
    unless ``gqa`` (then the kernel maps kv head h to query heads h*g .. h*g+g-1 itself).
    """

    name: str
    forward: Forward
    backward: Backward
    gqa: bool
    lse_base: float = math.e


def _cpu_forward(q, k, v, scale, causal, bias):
    return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=bias, scale=scale)


def _cpu_backward(dout, q, k, v, out, lse, scale, causal, bias):
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, attn_mask=bias, scale=scale
    )


def _flash_forward(q, k, v, scale, causal, bias):
    assert bias is None
    r = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return r[0], r[1]


def _flash_backward(dout, q, k, v, out, lse, scale, causal, bias):
    lq, lk = q.shape[2], k.shape[2]
    # No dropout: the rng state is never read; shaped as the forward returns it. No cumulative lengths: dense.
    seed, offset = torch.zeros(2, dtype=torch.int64, device=q.device), torch.zeros((), dtype=torch.int64)
    return aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, None, None, lq, lk, 0.0, causal, seed, offset, scale=scale
    )


def _padded_bias(bias: Tensor | None, q: Tensor, k: Tensor) -> Tensor | None:
    # The efficient kernel wants the bias in q's dtype, its last dim's storage aligned to 16 elements.
    if bias is None:
        return None
    b, h, lq, lk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    pad = -lk % 16
    storage = torch.zeros(b, h, lq, lk + pad, dtype=q.dtype, device=q.device)
    view = storage[..., :lk]
    view.copy_(bias.expand(b, h, lq, lk))
    return view


def _efficient_forward(q, k, v, scale, causal, bias):
    out, lse, _, _ = aten._scaled_dot_product_efficient_attention(
        q, k, v, _padded_bias(bias, q, k), True, 0.0, causal, scale=scale
    )
    return out, lse[..., : q.shape[2]]  # the kernel pads lse's rows to a multiple of 32


def _efficient_backward(dout, q, k, v, out, lse, scale, causal, bias):
    lq = q.shape[2]
    padded = torch.zeros(*lse.shape[:-1], -(-lq // 32) * 32, dtype=lse.dtype, device=lse.device)
    padded[..., :lq] = lse
    seed = offset = torch.zeros((), dtype=torch.int64)  # no dropout: never read
    dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
        dout,
        q,
        k,
        v,
        _padded_bias(bias, q, k),
        out,
        padded,
        seed,
        offset,
        0.0,
        [True, True, True, False],
        causal,
        scale=scale,
    )
    return dq, dk, dv


def _rocm_lse_base() -> float:
    if not torch.version.hip:
        return math.e
    try:
        from autosp_rocm import lse_base
    except ImportError:
        return 2.0 if tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 9) else math.e
    return lse_base()


CPU_FLASH = FusedKernel("cpu flash", _cpu_forward, _cpu_backward, gqa=True)


def _cuda_kernels() -> tuple[FusedKernel, FusedKernel]:
    base = _rocm_lse_base()
    return (
        FusedKernel("cuda flash", _flash_forward, _flash_backward, gqa=False, lse_base=base),
        FusedKernel("cuda efficient", _efficient_forward, _efficient_backward, gqa=False, lse_base=base),
    )


def candidate(device: torch.device, dtype: torch.dtype, head_dim: int, masked: bool) -> FusedKernel | None:
    """The fused kernel for blocks of this kind, before its check; None when only fp32 math can."""
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return None
    if device.type == "cpu":
        return CPU_FLASH
    if device.type != "cuda":
        return None
    flash, efficient = _cuda_kernels()
    if not masked and dtype != torch.float32 and head_dim <= 256 and head_dim % 8 == 0:
        return flash
    return efficient


_CHECKED: dict[tuple, bool] = {}


def _tolerance(dtype: torch.dtype) -> float:
    return 1e-4 if dtype == torch.float32 else 3e-2


def check(kernel: FusedKernel, device: torch.device, dtype: torch.dtype, head_dim: int, masked: bool) -> bool:
    """Whether ``kernel`` agrees with the fp32 reference on a small block like this one (cached).

    The check covers what the ring relies on: lse in the declared base, rows with no allowed key,
    and the backward taking another (out, lse) than its own forward's.
    """
    key = (kernel.name, str(device), dtype, head_dim, masked)
    if key in _CHECKED:
        return _CHECKED[key]
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, 2, 40, head_dim, generator=gen).to(device, dtype) for _ in range(4))
    tile = Tile(causal=not masked)
    if masked:
        keep = torch.rand(40, 40, generator=gen) < 0.7
        keep[5] = False  # a row with no key in this block
        tile = Tile(mask=keep.to(device))
    try:
        ref_out, ref_lse = block_forward(q, k, v, 0.3, tile.dense(40, device))
        out, lse = forward(kernel, q, k, v, 0.3, tile)
        # Another block's (out, lse) as the final ones: the backward must not recompute them.
        final_lse = torch.logaddexp(ref_lse, torch.full_like(ref_lse, 1.5))
        final_out = (ref_out * 0.5).to(dtype)
        delta = (dout.float() * final_out.float()).sum(-1)
        ref = block_backward(q, k, v, dout.float(), final_lse, delta, 0.3, tile.dense(40, device))
        got = backward(kernel, dout, q, k, v, final_out, final_lse, 0.3, tile)
        tol = _tolerance(dtype)
        live = ~torch.isinf(ref_lse)
        ok = (
            torch.equal(torch.isinf(lse), ~live)
            and _close(out, ref_out, tol)
            and _close(lse[live], ref_lse[live], tol)
            and all(_close(a, b, tol) for a, b in zip(got, ref))
        )
    except Exception as e:  # noqa: BLE001 - any failure (not built for this device, dtype, head dim) rules it out
        ok, why = False, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    else:
        why = "its results differ from the fp32 reference"
    if not ok:
        warnings.warn(
            f"autosp-ring: the {kernel.name} kernel is not used for {dtype} blocks of head dim {head_dim} on "
            f"{device} ({'masked' if masked else 'unmasked'}): {why}; those blocks use fp32 math",
            stacklevel=2,
        )
    _CHECKED[key] = ok
    return ok


def _close(a: Tensor, b: Tensor, tol: float) -> bool:
    a, b = a.float(), b.float()
    return bool(torch.isfinite(a).all()) and bool(((a - b).abs() <= tol * (1 + b.abs())).all())


def choose(q: Tensor, k: Tensor, v: Tensor, masked: bool) -> FusedKernel | None:
    """The checked fused kernel for this block kind, or None (fp32 math)."""
    kernel = candidate(q.device, q.dtype, q.shape[-1], masked)
    if kernel is None or not check(kernel, q.device, q.dtype, q.shape[-1], masked):
        return None
    if k.shape[-1] != q.shape[-1] or v.shape[-1] != q.shape[-1]:
        # The fused kernels take one head size (MLA-style attention has a wider value head).
        return None
    return kernel


def _bias(tile: Tile, dtype: torch.dtype) -> Tensor | None:
    m = tile.mask
    if m is None:
        return None
    if m.dtype == torch.bool:
        return torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(~m, NEG_INF)
    if dtype == m.dtype:
        return m
    # A finite large negative (HF's finfo(fp32).min) stays finite in a narrower dtype: -inf would make
    # rows the model leaves uniform empty instead.
    return torch.where(torch.isneginf(m), m, m.clamp_min(torch.finfo(dtype).min)).to(dtype)


def _dead_rows(tile: Tile) -> Tensor | None:
    """[.., Lq] True where the tile leaves a row no key (None when it cannot: no mask, or causal)."""
    m = tile.mask
    if m is None:
        return None
    return ~m.any(-1) if m.dtype == torch.bool else torch.isneginf(m).all(-1)


def _heads(kernel: FusedKernel, q: Tensor, x: Tensor) -> Tensor:
    from autosp_ring.blocks import expand_kv

    return x if kernel.gqa else expand_kv(x, q.shape[1])


def forward(kernel: FusedKernel, q: Tensor, k: Tensor, v: Tensor, scale: float, tile: Tile) -> tuple[Tensor, Tensor]:
    """(out in q's dtype, natural fp32 lse [B,H,L] contiguous) of one block; empty rows: out 0, lse -inf."""
    # The additive tile stays fp32 on CPU (the kernel takes it with any q dtype) so large negatives survive.
    bias = _bias(tile, q.dtype if q.device.type != "cpu" else torch.float32)
    out, lse = kernel.forward(q, _heads(kernel, q, k), _heads(kernel, q, v), scale, tile.causal, bias)
    lse = natural_lse(lse.float(), kernel.lse_base).contiguous()
    dead = _dead_rows(tile)
    if dead is not None:
        dead = dead.expand(lse.shape)
        lse = lse.masked_fill(dead, NEG_INF)
        out = out.masked_fill(dead[..., None], 0)
    return out, lse


def backward(
    kernel: FusedKernel,
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    scale: float,
    tile: Tile,
) -> tuple[Tensor, Tensor, Tensor]:
    """This block's (dq, dk, dv) given the FINAL merged out (q's dtype) and natural fp32 lse."""
    from autosp_ring.blocks import reduce_kv

    # A row with no key anywhere has lse -inf; 0 gives its masked scores probability exp(-inf) = 0.
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    if kernel.lse_base != math.e:
        safe = safe / math.log(kernel.lse_base)
    bias = _bias(tile, q.dtype if q.device.type != "cpu" else torch.float32)
    ke, ve = _heads(kernel, q, k), _heads(kernel, q, v)
    dq, dk, dv = kernel.backward(dout, q, ke, ve, out, safe.contiguous(), scale, tile.causal, bias)
    if ke is not k:
        dk, dv = reduce_kv(dk, k.shape[1]), reduce_kv(dv, v.shape[1])
    return dq, dk, dv


__all__ = ["CPU_FLASH", "FusedKernel", "Tile", "backward", "candidate", "check", "choose", "forward"]
