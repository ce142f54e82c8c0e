"""gpu_check's FlexAttention stage: values and every gradient on CUDA, where Flex has a backward.

torch has no FlexAttention backward on CPU: the CPU suite checks gradients through Flex's reference
math under ``aot_eager`` and the kernel's forward under Inductor; this runs the fused kernels both
ways, with ``autosp.verify`` (single-device eager reference, values and gradients) on the CPU suite's model
(``autosp.testing.models.SdpaThenFlex``: an SDPA layer, then Flex with a per-head ``score_mod``),
wider, with a block mask of packed documents made outside the compiled function. On the CPU
(``--quick`` self-test) it compares the loss alone.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

VOCAB, DIM, HEADS, KV_HEADS = 64, 64, 4, 2


def fresh_rank(kind: str) -> torch.device:
    """This rank's device (both ranks share GPU 0), with Dynamo's caches reset and the seed set."""
    device = torch.device(kind, 0) if kind == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch._dynamo.reset()
    torch.manual_seed(0)
    return device


def document_mask(seq: int, device: torch.device) -> Any:
    """Causal within three uneven packed documents whose boundaries cross the ranks' chunks."""
    from torch.nn.attention.flex_attention import create_block_mask

    docs = ((torch.arange(seq) * 3) // seq).to(device)
    docs[seq // 3 - 5] = 1

    def documents(b, h, q, k):
        return (docs[q] == docs[k]) & (k <= q)

    return create_block_mask(documents, None, None, seq, seq, device=str(device), BLOCK_SIZE=min(128, seq // 4))


def flex_rank(cfg: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    """One rank: ``autosp.verify`` on CUDA; on the CPU, the forward's loss against eager."""
    import autosp
    from autosp.testing.models import SdpaThenFlex

    device = fresh_rank(cfg["device"])

    model = SdpaThenFlex(KV_HEADS, vocab=VOCAB, dim=DIM, heads=HEADS).to(device)
    seq = cfg["seq"]
    gen = torch.Generator().manual_seed(2)
    ids, labels = (torch.randint(0, VOCAB, (2, seq), generator=gen).to(device) for _ in range(2))
    args = (ids, document_mask(seq, device), labels)
    options = {"sp_size": world, "backend": cfg["backend"], "variant": cfg["variant"]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # flex_attention's "called without torch.compile" in the reference
        if device.type == "cuda":
            report = autosp.verify(model, *args, **options)
            return {"passed": True, "report": str(report)[:2000]}
        with torch.no_grad():
            reference = model(*args)
            loss = autosp.compile(model, **options)(*args)
    diff = float((loss - reference).abs())
    return {"passed": diff <= 1e-5 * max(1.0, float(reference.abs())), "loss_diff": diff, "forward_only": True}


__all__ = ["document_mask", "flex_rank", "fresh_rank"]
