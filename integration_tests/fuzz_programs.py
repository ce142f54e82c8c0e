"""Small random programs over ``[B, S, ...]`` tensors, for whole-program fuzzing of AutoSP.

A program is a *spec*: a plain JSON-able dict, so a failing one can be written out literally
as a regression test. ``build(spec)`` turns it into the same ``nn.Module`` and inputs in any
process (parameters from ``spec["seed"]``, inputs from ``spec["seed"] + 1``). The vocabulary
is what real models do along the sequence: token-wise linear/norm/activation, residuals,
attention (causal, masks built from ``arange``, padding, RoPE, GQA), shifts/rolls/slices,
reductions and selections, cumsum, and losses over tokens and over the batch.

Spec keys: ``seed``, ``batch``, ``seq``, ``dim``, ``heads``, ``input`` ("ids" or "float"),
``body`` (a list of ops, each ``{"op": name, ...options}``, applied to ``x`` in order) and
``losses`` (a list of heads, each reading ``x`` after ``tap`` body ops, -1 meaning the end;
the program returns their weighted sum).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from hypothesis import assume
from hypothesis import strategies as st
from torch import nn

Spec = dict[str, Any]
Batch = dict[str, torch.Tensor]

VOCAB = 32  # token ids and LM targets
CLASSES = 3
INPUTS = ("inp", "labels", "y", "w", "pos", "keep", "ref")

# Simplest first in every list: hypothesis shrinks towards the first element.
MASKS = ("none", "causal", "bool_causal", "additive_causal", "window", "padding")
TENSOR_MASKS = MASKS[2:]
SEQ_OPS = ("drop_first", "drop_last", "roll", "cat_token", "token_shift", "flip", "downsample")
POOLS = ("mean", "first", "last", "sum", "amax", "logsumexp", "norm", "index_select", "gather",
         "masked_mean", "last_valid", "attn_pool")
POOL_HEADS = ("ce", "weighted_ce", "margin", "bce", "mse", "contrastive")
BODY_OPS = ("linear", "norm", "act", "mlp", "attention", "seq", "cumsum", "seq_stat", "pos_embed",
            "mask_tail", "conv", "manual_attention")


def length_after(op: Spec, s: int) -> int:
    if op["op"] == "seq" and op["kind"] in ("drop_first", "drop_last"):
        return s - 1
    if op["op"] == "seq" and op["kind"] == "cat_token":
        return s + 1
    if op["op"] == "seq" and op["kind"] == "downsample":
        return s // 2
    return s


def lengths(spec: Spec) -> list[int]:
    """The sequence length of ``x`` before the body and after each body op."""
    out = [spec["seq"]]
    for op in spec["body"]:
        out.append(length_after(op, out[-1]))
    return out


def fit(t: torch.Tensor, n: int) -> torch.Tensor:
    """A per-token input ``[B, S]`` aligned with a sequence of length ``n``: cut at the end, or 1s in front."""
    s = t.shape[1]
    if n <= s:
        return t[:, :n]
    return torch.cat([t.new_ones(t.shape[0], n - s), t], dim=1)


# ---- body ops: each maps x [B, S, D] (and the batch) to x [B, S', D] ----


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim) + 0.1 * torch.randn(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


def make_norm(kind: str, dim: int) -> nn.Module:
    return RMSNorm(dim) if kind == "rms" else nn.LayerNorm(dim)


ACTS = {"gelu": F.gelu, "silu": F.silu, "tanh": torch.tanh}


class Linear(nn.Module):
    def __init__(self, op: Spec, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        return self.lin(x)


class Norm(nn.Module):
    def __init__(self, op: Spec, dim: int) -> None:
        super().__init__()
        self.norm = make_norm(op["kind"], dim)

    def forward(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        return self.norm(x)


class Act(nn.Module):
    def __init__(self, op: Spec, dim: int) -> None:
        super().__init__()
        self.kind = op["kind"]

    def forward(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        return ACTS[self.kind](x)


class MLP(nn.Module):
    def __init__(self, op: Spec, dim: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)
        self.kind, self.residual = op["act"], op["residual"]

    def forward(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        out = self.down(ACTS[self.kind](self.up(x)))
        return x + out if self.residual else out


def rope(t: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``t`` [B, H, S, hd] at positions ``arange(S)``."""
    s, hd = t.shape[-2], t.shape[-1]
    inv = 1.0 / (100.0 ** (torch.arange(0, hd, 2, device=t.device, dtype=torch.float32) / hd))
    ang = torch.arange(s, device=t.device, dtype=torch.float32)[:, None] * inv[None, :]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    a, b = t.chunk(2, dim=-1)
    return t * cos + torch.cat([-b, a], dim=-1) * sin


class Attention(nn.Module):
    """A pre-norm (or not) attention block: q/k/v projections (fused or not), GQA, RoPE, a mask kind."""

    def __init__(self, op: Spec, dim: int, heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, op["kv_heads"], dim // heads
        self.mask, self.residual, self.use_rope, self.fused = op["mask"], op["residual"], op["rope"], op["fused"]
        self.norm = make_norm(op["norm"], dim) if op["norm"] != "none" else None
        kv = self.kv_heads * self.hd
        if self.fused:
            self.qkv = nn.Linear(dim, dim + 2 * kv)
        else:
            self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, kv), nn.Linear(dim, kv)
        self.o = nn.Linear(dim, dim)

    def attn_mask(self, s: int, batch: Batch, device: torch.device) -> tuple[torch.Tensor | None, bool]:
        if self.mask == "none":
            return None, False
        if self.mask == "causal":
            return None, True
        i = torch.arange(s, device=device)
        causal = i[:, None] >= i[None, :]
        if self.mask == "bool_causal":
            return causal, False
        if self.mask == "additive_causal":
            return torch.zeros(s, s, device=device).masked_fill(~causal, torch.finfo(torch.float32).min), False
        if self.mask == "window":
            return causal & (i[:, None] - i[None, :] < 3), False
        # Right padding from the ``keep`` input: key 0 is always kept, so no row is fully masked.
        keys = fit(batch["keep"], s).bool()[:, None, None, :]
        return keys & causal, False

    def forward(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        b, s, d = x.shape
        h = self.norm(x) if self.norm is not None else x
        kv = self.kv_heads * self.hd
        if self.fused:
            q, k, v = self.qkv(h).split([d, kv, kv], dim=-1)
        else:
            q, k, v = self.q(h), self.k(h), self.v(h)
        q = q.view(b, s, self.heads, self.hd).transpose(1, 2)  # [B, H, S, hd]
        k = k.view(b, s, self.kv_heads, self.hd).transpose(1, 2)
        v = v.view(b, s, self.kv_heads, self.hd).transpose(1, 2)
        if self.use_rope:
            q, k = rope(q), rope(k)
        if self.kv_heads != self.heads:  # HF's repeat_kv
            n = self.heads // self.kv_heads
            k = k[:, :, None].expand(b, self.kv_heads, n, s, self.hd).reshape(b, self.heads, s, self.hd)
            v = v[:, :, None].expand(b, self.kv_heads, n, s, self.hd).reshape(b, self.heads, s, self.hd)
        mask, causal = self.attn_mask(s, batch, x.device)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
        o = self.o(o.transpose(1, 2).reshape(b, s, d))
        return x + o if self.residual else o


class ManualAttention(nn.Module):
    """Attention written out (GPT-2's eager path): scores [B, S, S], tril mask, softmax, weighted sum."""

    def __init__(self, op: Spec, dim: int) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.causal = op["causal"]

    def forward(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        s = x.shape[1]
        scores = self.q(x) @ self.k(x).transpose(1, 2) / math.sqrt(x.shape[-1])
        if self.causal:
            keep = torch.tril(torch.ones(s, s, dtype=torch.bool, device=x.device))
            scores = scores.masked_fill(~keep, float("-inf"))
        return x + torch.softmax(scores, dim=-1) @ self.v(x)


class SeqOp(nn.Module):
    """Shifts, rolls, slices and flips along the sequence; ``cat_token`` prepends a learned token."""

    def __init__(self, op: Spec, dim: int) -> None:
        super().__init__()
        self.kind = op["kind"]
        if self.kind == "cat_token":
            self.token = nn.Parameter(torch.randn(1, 1, dim))

    def forward(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        if self.kind == "drop_first":
            return x[:, 1:]
        if self.kind == "drop_last":
            return x[:, :-1]
        if self.kind == "roll":
            return torch.roll(x, 1, dims=1)
        if self.kind == "cat_token":
            return torch.cat([self.token.expand(x.shape[0], 1, x.shape[2]), x], dim=1)
        if self.kind == "token_shift":  # RWKV-style: each token mixed with the one before it
            prev = F.pad(x, (0, 0, 1, 0))[:, :-1]
            return 0.5 * (x + prev)
        if self.kind == "downsample":  # hourglass/funnel: mean of adjacent token pairs, half the length
            b, s, d = x.shape
            return x[:, : s - s % 2].reshape(b, s // 2, 2, d).mean(dim=2)
        return torch.flip(x, dims=[1])


class Cumsum(nn.Module):
    def __init__(self, op: Spec, dim: int) -> None:
        super().__init__()
        self.kind = op["kind"]

    def forward(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        c = x.cumsum(dim=1)
        if self.kind == "mean":  # running mean over the prefix
            return c / torch.arange(1, x.shape[1] + 1, device=x.device, dtype=x.dtype)[None, :, None]
        return 0.25 * c


class SeqStat(nn.Module):
    """A sequence statistic broadcast back to every token (squeeze-excite gate, centring)."""

    def __init__(self, op: Spec, dim: int) -> None:
        super().__init__()
        self.kind = op["kind"]

    def forward(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        if self.kind == "gate_mean":
            return x * torch.sigmoid(x.mean(dim=1, keepdim=True))
        if self.kind == "center":
            return x - x.mean(dim=1, keepdim=True)
        return x / (x.amax(dim=1, keepdim=True).abs() + 1.0)


class PosEmbed(nn.Module):
    def __init__(self, op: Spec, dim: int, max_len: int) -> None:
        super().__init__()
        self.table = nn.Embedding(max_len, dim)

    def forward(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        return x + self.table(torch.arange(x.shape[1], device=x.device))[None]


class MaskTail(nn.Module):
    def __init__(self, op: Spec, dim: int) -> None:
        super().__init__()
        self.k = op["k"]

    def forward(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        s = x.shape[1]
        keep = torch.arange(s, device=x.device) < s - self.k
        return x * keep[None, :, None].to(x.dtype)


class Conv(nn.Module):
    """A causal depthwise convolution along the sequence (Mamba/Hyena-style short conv)."""

    def __init__(self, op: Spec, dim: int) -> None:
        super().__init__()
        self.conv = nn.Conv1d(dim, dim, kernel_size=3, padding=2, groups=dim)

    def forward(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        return self.conv(x.transpose(1, 2))[..., : x.shape[1]].transpose(1, 2)


# ---- losses: each maps x [B, S, D] (and the batch) to a scalar ----


def shifted(x: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token alignment inside the model: x at t predicts labels at t+1, whatever x's length."""
    s_x, s = x.shape[1], labels.shape[1]
    n = min(s_x, s) - 1
    return x[:, s_x - n - 1 : s_x - 1], labels[:, s - n :]


class LMLoss(nn.Module):
    def __init__(self, head: Spec, dim: int) -> None:
        super().__init__()
        self.out, self.reduction = nn.Linear(dim, VOCAB), head["reduction"]

    def forward(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        h, tgt = shifted(x, batch["labels"])
        logits = self.out(h)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), tgt.reshape(-1), ignore_index=-100, reduction=self.reduction)
        return loss / tgt.numel() if self.reduction == "sum" else loss


class SeqLogprobLoss(nn.Module):
    """DPO-style: per-sequence sums of token log-probabilities against a reference, over the batch."""

    def __init__(self, head: Spec, dim: int) -> None:
        super().__init__()
        self.out = nn.Linear(dim, VOCAB)

    def forward(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        h, tgt = shifted(x, batch["labels"])
        logp = F.log_softmax(self.out(h), dim=-1)
        valid = tgt != -100
        tok = logp.gather(-1, tgt.clamp(min=0)[..., None]).squeeze(-1) * valid
        return -F.logsigmoid(0.1 * (tok.sum(dim=1) - batch["ref"])).mean()


class TokenMSELoss(nn.Module):
    """A per-token regression averaged over the tokens the ``keep`` mask selects."""

    def __init__(self, head: Spec, dim: int) -> None:
        super().__init__()
        self.out = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        m = fit(batch["keep"], x.shape[1]).to(x.dtype)
        err = (self.out(x).squeeze(-1) - 0.5).pow(2)
        return (err * m).sum() / m.sum()


class PoolLoss(nn.Module):
    """Pool the sequence to [B, D], then a batch-level head and loss over [B] targets."""

    def __init__(self, head: Spec, dim: int) -> None:
        super().__init__()
        self.pool, self.kind = head["pool"], head["head"]
        width = {"ce": CLASSES, "weighted_ce": CLASSES, "contrastive": dim}.get(self.kind, 1)
        self.out = nn.Linear(dim, width)
        if self.pool == "attn_pool":
            self.score = nn.Linear(dim, 1)

    def pooled(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        b, s, d = x.shape
        p = self.pool
        if p == "mean":
            return x.mean(dim=1)
        if p == "first":
            return x[:, 0]
        if p == "last":
            return x[:, -1]
        if p == "sum":
            return x.sum(dim=1)
        if p == "amax":
            return x.amax(dim=1)
        if p == "logsumexp":
            return torch.logsumexp(x, dim=1)
        if p == "norm":
            return x.norm(dim=1)
        if p == "index_select":  # every third token
            return x.index_select(1, torch.arange(0, s, 3, device=x.device)).mean(dim=1)
        if p == "gather":
            return x.gather(1, batch["pos"][:, None, None].expand(b, 1, d)).squeeze(1)
        keep = fit(batch["keep"], s)
        if p == "masked_mean":
            m = keep.to(x.dtype)[..., None]
            return (x * m).sum(dim=1) / m.sum(dim=1)
        if p == "last_valid":  # HF sequence classification: the last non-padding token
            return x[torch.arange(b, device=x.device), keep.sum(dim=1) - 1]
        a = torch.softmax(self.score(x).squeeze(-1), dim=1)
        return (a[..., None] * x).sum(dim=1)

    def forward(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        pooled = self.pooled(x, batch)
        out = self.out(pooled)
        y = batch["y"]
        if self.kind == "ce":
            return F.cross_entropy(out, y)
        if self.kind == "weighted_ce":
            w = batch["w"]
            return (F.cross_entropy(out, y, reduction="none") * w).sum() / w.sum()
        if self.kind == "contrastive":  # in-batch (CLIP-style): each pooled row against every other
            a, b = F.normalize(pooled, dim=-1), F.normalize(out, dim=-1)
            return F.cross_entropy(a @ b.T / 0.5, torch.arange(a.shape[0], device=a.device))
        score, sign = out.squeeze(-1), (y % 2).to(out.dtype)
        if self.kind == "margin":  # reward-model hinge
            return F.relu(1.0 - (2 * sign - 1) * score).mean()
        if self.kind == "bce":
            return F.binary_cross_entropy_with_logits(score, sign)
        return F.mse_loss(score, batch["ref"] * 0.1)


LOSSES = {"lm": LMLoss, "seq_logprob": SeqLogprobLoss, "token_mse": TokenMSELoss, "pool": PoolLoss}


class FuzzProgram(nn.Module):
    def __init__(self, spec: Spec) -> None:
        super().__init__()
        d = spec["dim"]
        self.ids = spec["input"] == "ids"
        self.inp = nn.Embedding(VOCAB, d) if self.ids else nn.Linear(d, d)
        max_len = max(lengths(spec))
        layers: list[nn.Module] = []
        for op in spec["body"]:
            kind = op["op"]
            if kind == "attention":
                layers.append(Attention(op, d, spec["heads"]))
            elif kind == "pos_embed":
                layers.append(PosEmbed(op, d, max_len))
            else:
                layers.append(BODY[kind](op, d))
        self.body = nn.ModuleList(layers)
        self.taps = [h["tap"] for h in spec["losses"]]
        self.coefs = [h["coef"] for h in spec["losses"]]
        self.losses = nn.ModuleList(LOSSES[h["kind"]](h, d) for h in spec["losses"])

    def forward(self, inp, labels, y, w, pos, keep, ref) -> torch.Tensor:  # noqa: ANN001 - see INPUTS
        batch = {"labels": labels, "y": y, "w": w, "pos": pos, "keep": keep, "ref": ref}
        x = self.inp(inp)
        xs = [x]
        for layer in self.body:
            x = layer(x, batch)
            xs.append(x)
        total = None
        for tap, coef, loss in zip(self.taps, self.coefs, self.losses):
            term = coef * loss(xs[tap], batch)
            total = term if total is None else total + term
        return total


BODY = {"linear": Linear, "norm": Norm, "act": Act, "mlp": MLP, "seq": SeqOp, "cumsum": Cumsum,
        "seq_stat": SeqStat, "mask_tail": MaskTail, "conv": Conv, "manual_attention": ManualAttention}


def make_inputs(spec: Spec) -> tuple[torch.Tensor, ...]:
    """The program's inputs, in ``INPUTS`` order, from ``spec["seed"] + 1``."""
    g = torch.Generator().manual_seed(spec["seed"] + 1)
    b, s, d = spec["batch"], spec["seq"], spec["dim"]
    if spec["input"] == "ids":
        inp = torch.randint(0, VOCAB, (b, s), generator=g)
    else:
        inp = torch.randn(b, s, d, generator=g)
    labels = torch.randint(0, VOCAB, (b, s), generator=g)
    labels[torch.rand(b, s, generator=g) < 0.25] = -100
    labels[:, : s // 4] = -100  # a block of ignored tokens on the first rank's side
    labels[:, -1] = torch.randint(0, VOCAB, (b,), generator=g)  # never all ignored
    y = torch.randint(0, CLASSES, (b,), generator=g)
    w = torch.rand(b, generator=g) + 0.5
    pos = torch.randint(0, min(lengths(spec)), (b,), generator=g)
    keep_len = torch.randint(s // 2, s + 1, (b,), generator=g).clamp(min=1)
    keep = (torch.arange(s)[None, :] < keep_len[:, None]).long()
    ref = torch.randn(b, generator=g) * 5
    return inp, labels, y, w, pos, keep, ref


def build(spec: Spec) -> tuple[FuzzProgram, tuple[torch.Tensor, ...]]:
    torch.manual_seed(spec["seed"])
    return FuzzProgram(spec), make_inputs(spec)


def loss_and_grads(model: nn.Module, params: nn.Module, inputs: tuple[torch.Tensor, ...]) -> dict[str, Any]:
    """One forward and backward; the loss and every parameter gradient (None: no gradient)."""
    loss = model(*inputs)
    loss.backward()
    return {
        "loss": loss.detach().clone(),
        "grads": {n: None if p.grad is None else p.grad.detach().clone() for n, p in params.named_parameters()},
    }


def reference(spec: Spec) -> dict[str, Any]:
    """Single-device eager loss and gradients."""
    model, inputs = build(spec)
    return loss_and_grads(model, model, inputs)


def describe(spec: Spec) -> str:
    """A one-line summary of a program, for reports."""
    body = " > ".join(
        op["op"] + ("(" + ",".join(f"{k}={v}" for k, v in op.items() if k != "op") + ")" if len(op) > 1 else "")
        for op in spec["body"]
    )
    heads = " + ".join(
        f"{h['coef']}*{h['kind']}@{h['tap']}" + (f"({h['pool']},{h['head']})" if h["kind"] == "pool" else "")
        for h in spec["losses"]
    )
    return f"B={spec['batch']} S={spec['seq']} D={spec['dim']} H={spec['heads']} {spec['input']}: {body} => {heads}"


# ---- hypothesis strategies ----


def attention_ops(heads: int, masks: tuple[str, ...]) -> st.SearchStrategy[Spec]:
    return st.fixed_dictionaries({
        "op": st.just("attention"),
        "mask": st.sampled_from(masks),
        "kv_heads": st.sampled_from([heads, heads // 2, 1]),
        "residual": st.booleans(),
        "norm": st.sampled_from(["none", "layer", "rms"]),
        "rope": st.booleans(),
        "fused": st.booleans(),
    })


def body_ops(heads: int, masks: tuple[str, ...]) -> st.SearchStrategy[Spec]:
    def op(name: str, **options: st.SearchStrategy[Any]) -> st.SearchStrategy[Spec]:
        return st.fixed_dictionaries({"op": st.just(name), **options})

    # Four groups drawn equally often, so that ops along the sequence (where SP can go wrong)
    # are as frequent as token-wise ones.
    tokenwise = st.one_of(
        op("linear"),
        op("norm", kind=st.sampled_from(["layer", "rms"])),
        op("act", kind=st.sampled_from(sorted(ACTS))),
        op("mlp", act=st.sampled_from(sorted(ACTS)), residual=st.booleans()),
    )
    along_sequence = st.one_of(
        op("cumsum", kind=st.sampled_from(["sum", "mean"])),
        op("seq_stat", kind=st.sampled_from(["gate_mean", "center", "scale_amax"])),
        op("pos_embed"),
        op("mask_tail", k=st.integers(1, 3)),
        op("conv"),
        op("manual_attention", causal=st.booleans()),
    )
    groups = {"tokenwise": tokenwise, "attention": attention_ops(heads, masks),
              "seq": op("seq", kind=st.sampled_from(SEQ_OPS)), "along_sequence": along_sequence}
    return st.sampled_from(list(groups)).flatmap(groups.__getitem__)


def loss_heads(tap: st.SearchStrategy[int]) -> st.SearchStrategy[Spec]:
    common = {"tap": tap, "coef": st.sampled_from([1.0, 0.5])}
    by_kind = {
        "pool": st.fixed_dictionaries({"kind": st.just("pool"), "pool": st.sampled_from(POOLS),
                                       "head": st.sampled_from(POOL_HEADS), **common}),
        "lm": st.fixed_dictionaries({"kind": st.just("lm"), "reduction": st.sampled_from(["mean", "sum"]), **common}),
        "seq_logprob": st.fixed_dictionaries({"kind": st.just("seq_logprob"), **common}),
        "token_mse": st.fixed_dictionaries({"kind": st.just("token_mse"), **common}),
    }
    # Batch-level losses after a sequence reduction are where SP goes wrong most: half of the draws.
    kinds = ["pool", "lm", "pool", "seq_logprob", "pool", "token_mse"]
    return st.sampled_from(kinds).flatmap(by_kind.__getitem__)


@st.composite
def programs(draw: st.DrawFn, world: int, masks: tuple[str, ...] = MASKS, max_body: int = 5) -> Spec:
    """A random program whose sequence length is a multiple of ``2 * world``, with at least one attention."""
    dim = draw(st.sampled_from([16, 32]))
    heads = draw(st.sampled_from([4, 8]))
    seq = 2 * world * draw(st.integers(1, max(1, 32 // (2 * world))))
    body = draw(st.lists(body_ops(heads, masks), max_size=max_body - 1))
    at = draw(st.integers(0, len(body)))
    body.insert(at, draw(attention_ops(heads, masks)))
    spec: Spec = {"seed": draw(st.integers(0, 2**16)), "batch": draw(st.integers(1, 3)), "seq": seq,
                  "dim": dim, "heads": heads, "input": draw(st.sampled_from(["ids", "float"])), "body": body}
    assume(min(lengths(spec)) >= 3)
    # The first loss reads the end of the program; a second may tap any point (a multi-task or auxiliary loss).
    first = draw(loss_heads(st.just(-1)))
    extra = draw(st.lists(loss_heads(st.integers(0, len(body))), max_size=1))
    spec["losses"] = [first, *extra]
    return spec


__all__ = ["INPUTS", "MASKS", "TENSOR_MASKS", "FuzzProgram", "Spec", "build", "describe", "lengths",
           "loss_and_grads", "make_inputs", "programs", "reference"]
