"""Models with SDPA in one layer and FlexAttention (block mask, score_mod) in the next.

torch 2.13 refuses FlexAttention's backward on CPU in ``flex_attention``'s device check, because
Inductor has no CPU kernel for it. Eager and ``aot_eager`` run Flex as the higher-order op's
reference math, whose backward is plain aten and works on any device; so with ``grads=True`` the
workers lift that one check (the same way in the reference and in the compiled program) and compare
every parameter's gradient under ``aot_eager``. Inductor runs forward only.
"""

from __future__ import annotations

import contextlib
import warnings
from collections import Counter
from collections.abc import Iterator

import torch
import torch._inductor.config as inductor_config
import torch.nn.attention.flex_attention as flex
from torch.nn.attention.flex_attention import create_block_mask

from autosp.testing.models import SdpaThenFlex

VOCAB, HEADS = 50, 4


def block_mask(kind: str, seq: int, size: int = 16, heads: int = HEADS):
    """``documents``: causal within three uneven packed documents that cross the ranks' chunks.
    ``per_head``: heads 0 and 1 see their document, heads 2 and 3 a causal window of 24 (a per-head mask).
    ``window``: a sliding window of 40 keys, both directions (no causal block skipping)."""
    docs = (torch.arange(seq) * 3) // seq
    docs[seq // 3 - 2] = 1

    def documents(b, h, q, k):
        return (docs[q] == docs[k]) & (k <= q)

    def per_head(b, h, q, k):
        return torch.where(h < 2, docs[q] == docs[k], q - k < 24) & (k <= q)

    def window(b, h, q, k):
        return (q - k).abs() < 40

    fn, per = {"documents": (documents, None), "per_head": (per_head, heads), "window": (window, None)}[kind]
    return create_block_mask(fn, None, per, seq, seq, device="cpu", BLOCK_SIZE=size)


@contextlib.contextmanager
def _cpu_backward(grads: bool) -> Iterator[None]:
    check = flex._validate_device
    if grads:
        flex._validate_device = lambda *args: None
    try:
        yield
    finally:
        flex._validate_device = check


def run(
    rank: int,
    world: int,
    variant: str,
    cases: list[tuple[str, int]],
    seq: int,
    *,
    lse: bool = False,
    grads: bool = False,
    backend: str = "aot_eager",
    block: int = 16,
    options: dict | None = None,
    sac: bool | str = "auto",
    heads: int = HEADS,
    dim: int = 32,
) -> dict:
    import autosp

    results = {}
    for kind, kv_heads in cases:
        torch.manual_seed(0)
        model = SdpaThenFlex(kv_heads, dim=dim, heads=heads, lse=lse, contiguous=backend == "inductor")
        mask = block_mask(kind, seq, block, heads)
        args = (torch.randint(0, VOCAB, (2, seq)), mask, torch.randint(0, VOCAB, (2, seq)))
        grad_mode = contextlib.nullcontext() if grads else torch.no_grad()
        # Inductor's CPU Flex kernel has vectorized code only: the suite's scalar C++ setting breaks it.
        kernels = inductor_config.patch({"cpp.simdlen": None, "cpp.vec_isa_ok": None})
        with grad_mode, _cpu_backward(grads), kernels, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # flex_attention's own "called without torch.compile" note
            reference = model(*args)
            if grads:
                reference.backward()
                expected = {n: p.grad.clone() for n, p in model.named_parameters()}
                model.zero_grad(set_to_none=True)
            compiled = autosp.compile(
                model, sp_size=world, backend=backend, variant=variant, variant_options=options or {}, sac=sac
            )
            loss = compiled(*args)
            if grads:
                loss.backward()
        reports = compiled.autosp_reports
        results[kind, kv_heads] = {
            "loss": loss.detach(),
            "reference": reference.detach(),
            "grads": {n: p.grad for n, p in model.named_parameters()} if grads else {},
            "expected": expected if grads else {},
            "notes": [n for r in reports for n in r.notes],
            "fallbacks": [f for r in reports for f in r.fallbacks],
            "sites": [s.spec.name for r in reports for s in r.sites],
            "collectives": sum((r.collectives for r in reports), start=Counter()),
            "sac": [r.sac for r in reports],
        }
    return results


class FlexCaptures(torch.nn.Module):
    """Flex whose mods read tensors they capture: a learned bias per (head, distance), a parameter, in
    ``score_mod``; document ids made from the input tokens (a new document after each token 0) in
    ``score_mod``; a causal block mask."""

    def __init__(self, seq: int, dim: int = 32, heads: int = HEADS) -> None:
        super().__init__()
        self.seq, self.heads = seq, heads
        self.emb = torch.nn.Embedding(VOCAB, dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, dim)
        self.head = torch.nn.Linear(dim, VOCAB)
        self.bias = torch.nn.Parameter(torch.randn(heads, 2 * seq - 1) * 0.3)

    def forward(self, idx: torch.Tensor, block_mask, labels: torch.Tensor) -> torch.Tensor:
        from torch.nn.attention.flex_attention import flex_attention

        x = self.emb(idx)
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        docs = (idx == 0).cumsum(-1)
        bias, far = self.bias, self.seq - 1

        def mod(score, b, h, q_idx, kv_idx):
            same = docs[b, q_idx] == docs[b, kv_idx]
            return torch.where(same, score + bias[h, q_idx - kv_idx + far], -float("inf"))

        y = flex_attention(q, k, v, score_mod=mod, block_mask=block_mask)
        x = x + self.out(y.transpose(1, 2).reshape(b, s, d))
        return torch.nn.functional.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def run_captures(
    rank: int, world: int, variant: str, seq: int, heads: int = HEADS, dim: int = 32, options: dict | None = None
) -> dict:
    import autosp

    torch.manual_seed(0)
    model = FlexCaptures(seq, dim, heads)
    idx = torch.randint(1, VOCAB, (2, seq))
    idx[0, seq // 3] = idx[1, seq // 5] = idx[1, seq // 2 + 3] = 0
    causal = create_block_mask(lambda b, h, q, k: k <= q, None, None, seq, seq, device="cpu", BLOCK_SIZE=16)
    args = (idx, causal, torch.randint(0, VOCAB, (2, seq)))
    with _cpu_backward(True), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = model(*args)
        reference.backward()
        expected = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        compiled = autosp.compile(
            model, sp_size=world, backend="aot_eager", variant=variant, variant_options=options or {}
        )
        loss = compiled(*args)
        loss.backward()
    return {
        "loss": loss.detach(),
        "reference": reference.detach(),
        "grads": {n: p.grad for n, p in model.named_parameters()},
        "expected": expected,
        "notes": [n for r in compiled.autosp_reports for n in r.notes],
        "fallbacks": [f for r in compiled.autosp_reports for f in r.fallbacks],
    }
