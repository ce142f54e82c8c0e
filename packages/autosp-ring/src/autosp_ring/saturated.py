"""Query rows whose every key a finite mask value masks (HF's ``finfo(fp32).min``, left padding).

Single-device attention adds the mask to the scores: ``s + finfo.min`` rounds to ``finfo.min``
whatever ``s`` is, so such a row attends uniformly to the keys holding the row's largest mask
value, and its log-sum-exp ``M + log(n)`` rounds to ``M``. The ring merges blocks through their
log-sum-exps, which have lost ``log(n)``: weighted by them, the blocks' means would not average
to the row's mean. For these *saturated* rows (largest mask value at most ``SATURATED``) each
block's log-sum-exp is replaced by the log of its count of such keys, which merges into the
exact mean; the merged log-sum-exp is then set back to ``M``, the value the single-device kernel
holds, so each block's backward recomputes what the kernel's backward does.

Rows fully masked by a finite value above that (``-1e4``: the scores are not absorbed, and the
log-sum-exp keeps too few digits to weight the blocks to fp32 accuracy) are refused, on every
rank alike (the mask is whole on each), before the ring's first transfer.
"""

from __future__ import annotations

import torch
from torch import Tensor

from autosp.errors import AutoSPError

SATURATED = -1e30  # ulp(1e30) is ~7.6e22: any score added to it is absorbed, log(n) is lost
PRECISE = -1e3  # a row fully masked by more than this loses less than 1e-4 in the merge


def refuse_imprecise(top: Tensor) -> None:
    """The same error on every rank when some row is fully masked by a finite value the merge cannot weight.

    ``top``: every query row's largest mask value (the whole mask's, alike on every rank).
    """
    bad = torch.isfinite(top) & (top > SATURATED) & (top < PRECISE)
    if bool(bad.any()):
        worst = float(top[bad].max())
        raise AutoSPError(
            f"ring attention: a query row has every key masked by a finite value (largest {worst:g}); the ring "
            "merges its blocks through log-sum-exps too large to weight them to fp32 accuracy. Mask with -inf "
            "(or a boolean mask), or with torch.finfo(dtype).min, or use variant='ulysses'"
        )


def my_rows(top: Tensor, pieces: list[tuple[int, int, int]], chunk: int) -> Tensor:
    """``[Bm, Hm, chunk]``: the rows of ``top`` (by global position) this rank's query pieces hold."""
    mine = top.new_empty((top.shape[0], top.shape[1], chunk))
    for qo, ql, qs in pieces:
        mine[:, :, qs : qs + ql] = top[:, :, qo : qo + ql]
    return mine


def is_saturated(top: Tensor) -> Tensor:
    return torch.isfinite(top) & (top <= SATURATED)


def block_lse(lse: Tensor, tile_mask: Tensor, top: Tensor, saturated: Tensor) -> Tensor:
    """On saturated rows, the log of the block's count of keys at the row's largest mask value."""
    count = (tile_mask == top[..., None]).sum(-1).to(lse.dtype)
    return torch.where(saturated, count.log(), lse)


def restore(lse: Tensor, top: Tensor, saturated: Tensor) -> Tensor:
    """The merged log-sum-exp of a saturated row as fp32 holds it: ``M + log(n)`` rounds to ``M``."""
    return torch.where(saturated, top.to(lse.dtype).expand_as(lse), lse)


__all__ = ["PRECISE", "SATURATED", "block_lse", "is_saturated", "my_rows", "refuse_imprecise", "restore"]
