"""Workers for the ring/hybrid tests (module level: spawned ranks import them by name)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

import autosp
from autosp.sharding.placement import even_ranges
from autosp.testing import Config, GPT2Block, GPT2Like, LlamaBlock, LlamaLike, SavedBytes


class EncoderBlock(GPT2Block):
    """GPT2Block without the causal flag: bidirectional attention."""

    causal = False


class Encoder(GPT2Like):
    def __init__(self, c: Config) -> None:
        super().__init__(c)
        self.blocks = torch.nn.ModuleList(EncoderBlock(c) for _ in range(c.layers))


class WindowBlock(LlamaBlock):
    """LlamaBlock calling the autosp-window op on un-repeated GQA k/v."""

    def attention(self, q, k, v, mask):
        return torch.ops.autosp_window.sliding_window_attention(q, k, v, self.c.window)


class WindowLlama(LlamaLike):
    def __init__(self, c: Config) -> None:
        super().__init__(Config(**{**c.__dict__, "window": None}))
        self.c = c
        self.blocks = torch.nn.ModuleList(WindowBlock(c) for _ in range(c.layers))


class AlibiBlock(LlamaBlock):
    """LlamaBlock with ALiBi: a per-head additive bias [1, H, S, S] (causal in it) as SDPA's mask."""

    def attention(self, q, k, v, mask):
        heads, s = q.shape[1], q.shape[2]
        k, v = (x.repeat_interleave(heads // x.shape[1], 1) for x in (k, v))
        i = torch.arange(s, device=q.device)
        slopes = 2.0 ** -torch.arange(1, heads + 1, device=q.device, dtype=q.dtype)
        bias = -(i[:, None] - i[None, :]).to(q.dtype) * slopes[:, None, None]
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=bias.masked_fill(i[None, :] > i[:, None], -torch.inf)[None]
        )


class AlibiLlama(LlamaLike):
    def __init__(self, c: Config) -> None:
        super().__init__(c)
        self.blocks = torch.nn.ModuleList(AlibiBlock(c) for _ in range(c.layers))


def build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "llama":  # causal, GQA 4:2 (repeat_kv in the model)
        return LlamaLike(Config(dim=32, hidden=64))
    if name == "llama-h3":  # 3 heads: divisible by neither 2 nor 4 ranks; MQA
        return LlamaLike(Config(dim=24, heads=3, kv_heads=1, hidden=48))
    if name == "alibi-h3":  # 3 heads with a per-head bias: hybrid pads the bias's heads too
        return AlibiLlama(Config(dim=24, heads=3, kv_heads=1, hidden=48))
    if name == "llama-mqa":
        return LlamaLike(Config(dim=32, heads=4, kv_heads=1, hidden=64))
    if name == "gpt2":
        return GPT2Like(Config(dim=32, heads=4))
    if name == "encoder-h6":  # non-causal, 6 heads
        return Encoder(Config(dim=48, heads=6))
    if name == "llama-mask":  # sliding window through a boolean attn_mask the model builds
        return LlamaLike(Config(dim=32, hidden=64, window=9))
    if name == "window-op":  # the same window through the autosp-window plugin op
        import autosp_window  # noqa: F401

        return WindowLlama(Config(dim=32, hidden=64, window=9))
    if name == "window-op-h3":  # a plugin op over 3 heads: hybrid pads SDPA's heads only
        import autosp_window  # noqa: F401

        return WindowLlama(Config(dim=24, heads=3, kv_heads=1, hidden=48, window=9))
    raise KeyError(name)


def batch(seq: int, rows: int = 2) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 96, (rows, seq), generator=gen)
    labels = ids.clone()
    labels[0, 3:11] = -100
    return {"ids": ids, "labels": labels}


def call(model: Any, name: str, b: dict[str, torch.Tensor]) -> torch.Tensor:
    out = model(b["ids"], b["labels"])
    if isinstance(out, tuple):  # GPT2Like: (loss, logits); fold the sequence output in
        return out[0] + out[1].float().pow(2).mean() * 1e-3
    return out


def step(model: Any, name: str, b: dict[str, torch.Tensor]) -> dict[str, Any]:
    loss = call(model, name, b)
    loss.backward()
    params = model._orig_mod if hasattr(model, "_orig_mod") else model
    return {
        "loss": loss.detach(),
        "grads": {n: p.grad.detach().clone() for n, p in params.named_parameters() if p.grad is not None},
    }


def reference(name: str, b: dict[str, torch.Tensor]) -> dict[str, Any]:
    return step(build(name), name, b)


def saved_bytes(model: Any, name: str, b: dict[str, torch.Tensor]) -> int:
    """Bytes autograd saves for backward in one forward of ``model`` (parameters excluded)."""
    saved = SavedBytes(model.parameters(), distinct=False)
    with saved.record():
        loss = call(model, name, b)
    loss.backward()
    return saved.total


def compile_model(name: str, variant: str, world: int, options: dict | None, sac: Any = "auto") -> Any:
    torch._dynamo.reset()  # each model compiles once; stay under Dynamo's recompile limit
    model = build(name)
    return autosp.compile(
        model,
        sp_size=world if world > 1 else None,
        variant=variant,
        backend="aot_eager",
        sac=sac,
        variant_options=options,
        fullgraph=True,
    )


def op_case(cfg: tuple, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Full q, k, v, dout and SDPA's output and gradients for (B, H, Hkv, S, D, causal, window[, dtype])."""
    bsz, heads, kv_heads, seq, dim, causal, window = cfg[:7]
    dtype = cfg[7] if len(cfg) > 7 else torch.float32
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(bsz, heads, seq, dim, generator=gen, dtype=dtype).requires_grad_()
    k = torch.randn(bsz, kv_heads, seq, dim, generator=gen, dtype=dtype).requires_grad_()
    v = torch.randn(bsz, kv_heads, seq, dim, generator=gen, dtype=dtype).requires_grad_()
    dout = torch.randn(bsz, heads, seq, dim, generator=gen, dtype=dtype)
    if window:
        pos = torch.arange(seq)
        mask = (pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] < window)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    else:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    out.backward(dout)
    return q.detach(), k.detach(), v.detach(), dout, out.detach(), q.grad, k.grad, v.grad


def op_errors(rank: int, world: int, cfg: tuple) -> list[float]:
    """Max abs error of the ring op's out, dq, dk, dv on this rank's chunk against SDPA."""
    import torch.distributed as dist

    q, k, v, dout, out, dq, dk, dv = op_case(cfg)
    sizes = _sizes(q.shape[2], world)
    ((lo, hi),) = even_ranges(q.shape[2], world)[rank]
    part = slice(lo, hi)
    ql, kl, vl = (t[:, :, part].clone().requires_grad_() for t in (q, k, v))
    got, _ = torch.ops.autosp_ring.ring_attention(
        ql, kl, vl, bool(cfg[5]), q.shape[-1] ** -0.5, cfg[6], False, dist.group.WORLD.group_name, None, 0, sizes
    )
    got.backward(dout[:, :, part])
    pairs = [(got, out), (ql.grad, dq), (kl.grad, dk), (vl.grad, dv)]
    return [(a - full[:, :, part]).abs().max().item() for a, full in pairs]


def _sizes(seq: int, world: int) -> list[int] | None:
    """Each rank's contiguous piece when the ranks do not split ``seq`` evenly (the ring op's ``sizes``)."""
    return None if seq % world == 0 else [hi - lo for ((lo, hi),) in even_ranges(seq, world)]


def op_mask_errors(rank: int, world: int, kind: str, zigzag: bool, balance: int = 0, seq: int = 16) -> list[float]:
    """The ring op with a model-built mask (whole on every rank) against SDPA with the same mask.

    "bool": causal and right padding as one boolean mask [B, 1, S, S]; "bias": a learned additive
    bias [1, H, S, S] with ``is_causal`` (its gradient too, summed over ranks); "rows": a boolean mask
    that leaves whole tiles empty (block-diagonal documents), which the op skips; "skewed": documents
    of 3/4 and 1/4 of the row, causal, whose work the zigzag layout spreads unevenly; "skewed-bias":
    a learned bias on those documents, -inf elsewhere. ``balance``: the op's smallest chunk for
    balancing query rows by the mask (0: none). ``seq``: one the ranks do not split evenly gives
    them contiguous pieces one token apart (no zigzag).
    """
    import torch.distributed as dist

    from autosp_ring.op import segments

    bsz, heads, kv_heads, dim = 2, 4, 2, 8
    gen = torch.Generator().manual_seed(3)
    q, k, v, dout = (torch.randn(bsz, h, seq, dim, generator=gen) for h in (heads, kv_heads, kv_heads, heads))
    pos = torch.arange(seq)
    causal = pos[None, :] <= pos[:, None]
    if kind == "bias":
        mask = torch.randn(1, heads, seq, seq, generator=gen).requires_grad_()
        ref_mask = mask.masked_fill(~causal, float("-inf"))
    elif kind == "bool":
        keep = torch.ones(bsz, seq, dtype=torch.bool)
        keep[0, -3:] = False
        mask = (causal & keep[:, None, :])[:, None]
        ref_mask = mask
    elif kind.startswith("skewed"):
        doc = (pos >= 3 * seq // 4).long()
        mask = ((doc[None, :] == doc[:, None]) & causal)[None, None]
        if kind == "skewed-bias":
            mask = torch.randn(1, heads, seq, seq, generator=gen).masked_fill(~mask, float("-inf")).requires_grad_()
        ref_mask = mask
    else:
        doc = pos // (seq // 4)
        mask = ((doc[None, :] == doc[:, None]) & causal)[None, None]
        ref_mask = mask
    qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=ref_mask, enable_gqa=True)
    ref.backward(dout)
    learned = kind.endswith("bias")
    ref_dmask = mask.grad.clone() if learned else None
    if learned:
        mask.grad = None
    sizes = _sizes(seq, world)
    pieces = segments(rank, seq // world, world, zigzag, sizes)

    def local(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t[:, :, g : g + n] for g, n, _ in pieces], dim=2)

    ql, kl, vl = (local(t).clone().requires_grad_() for t in (q, k, v))
    got, _ = torch.ops.autosp_ring.ring_attention(
        ql, kl, vl, kind == "bias", dim**-0.5, 0, zigzag, dist.group.WORLD.group_name, mask, balance, sizes
    )
    got.backward(local(dout))
    errs = [
        (a - local(full)).abs().max().item()
        for a, full in [(got, ref), (ql.grad, qf.grad), (kl.grad, kf.grad), (vl.grad, vf.grad)]
    ]
    if learned:
        dmask = mask.grad.clone()
        dist.all_reduce(dmask)
        errs.append((dmask - ref_dmask).abs().max().item())
    return errs


def _resolve(group_name: str) -> Any:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


def run(rank: int, world: int, jobs: list[tuple], b: dict, memory: list[str], ops: list[tuple] = ()) -> dict[str, Any]:
    """Each job (name, variant, options): loss, grads and report; ``memory``: saved bytes per model (sac off);
    ``ops``: op-level configurations checked against SDPA."""
    from autosp_ring import BLOCK_COUNTS

    results: dict[str, Any] = {"ops": [op_errors(rank, world, cfg) for cfg in ops]}
    if ops:
        results["mask_ops"], results["mask_balanced"] = {}, {}
        mask_cases = [(kind, zz, 0) for kind in ("bool", "bias", "rows") for zz in (False, True)]
        mask_cases += [(kind, zz, 1) for kind in ("bool", "skewed", "skewed-bias") for zz in (False, True)]
        for case in mask_cases:
            BLOCK_COUNTS.clear()
            results["mask_ops"][case] = op_mask_errors(rank, world, *case)
            results["mask_balanced"][case] = (BLOCK_COUNTS["forward", "balanced"], BLOCK_COUNTS["backward", "balanced"])
        # 15 tokens: pieces one token apart (balancing asked for, and left out: its chunks need equal pieces).
        results["mask_ops_uneven"] = {
            kind: op_mask_errors(rank, world, kind, False, 1, 15) for kind in ("bool", "bias", "rows")
        }
    for name, variant, options in jobs:
        BLOCK_COUNTS.clear()
        compiled = compile_model(name, variant, world, options)
        try:
            out = step(compiled, name, b)
        except autosp.AutoSPError as e:
            results[f"{name}/{variant}"] = {"error": f"{type(e).__name__}: {e}"}
            continue
        report = compiled.autosp_reports[0]
        out["collectives"] = dict(report.collectives)
        out["fallbacks"] = list(report.fallbacks)
        out["sites"] = len(report.sites)
        out["blocks"] = dict(BLOCK_COUNTS)
        out["sac"] = dict(report.sac)
        out["notes"] = list(report.notes)
        results[f"{name}/{variant}"] = out
    from autosp.options import group_timeout
    from autosp_ring.hybrid import _GROUPS

    # The hybrid subgroups' timeouts, next to the world's (new_group alone would give them 30 minutes).
    results["group_timeouts"] = {
        "world": group_timeout(torch.distributed.group.WORLD),
        "hybrid": [group_timeout(_resolve(n)) for g in _GROUPS.values() for n in (g.ulysses, g.ring)],
    }
    for name in memory:
        compiled = compile_model(name, "ring", world, None, sac=False)
        step(compiled, name, b)
        results[f"saved:{name}"] = saved_bytes(compiled, name, b)
    return results
