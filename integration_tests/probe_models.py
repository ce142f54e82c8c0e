"""Programs written the way others write them, outside the other suites: the engine's held-out probes.

Each builder returns a module whose ``forward`` takes the tensors of ``inputs(name, ...)`` and
returns a scalar loss, or a tuple of a loss and other outputs (hidden states, a pooled vector).
Hand-written ones cover what real code does to the sequence axis: complex rotary, einsum
attention, relative-position bias, normalisations whose statistics span the sequence, scans,
selections by computed indices, in-place updates, windows and strides.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

VOCAB, DIM, HEADS, CLASSES = 64, 32, 4, 3
HD = DIM // HEADS


class Attn(nn.Module):
    """Multi-head self-attention through SDPA; ``bias`` is an additive [1 or B, H, S, S] tensor."""

    def __init__(self, causal: bool = True) -> None:
        super().__init__()
        self.causal = causal
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.out = nn.Linear(DIM, DIM)

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, S, _ = x.shape
        q, k, v = self.qkv(x).view(B, S, 3, HEADS, HD).permute(2, 0, 3, 1, 4)
        return q, k, v

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        B, S, _ = x.shape
        q, k, v = self.heads(x)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, is_causal=self.causal and bias is None)
        return self.out(a.transpose(1, 2).reshape(B, S, DIM))


class LMBase(nn.Module):
    """Embedding, one attention block, an LM head with a shifted token loss."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.ln = nn.LayerNorm(DIM)
        self.attn = Attn()
        self.head = nn.Linear(DIM, VOCAB)

    def lm_loss(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        logits = self.head(x)
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


# --- position encodings ------------------------------------------------------------------------


def freqs_cis(seq: int, dim: int = HD) -> torch.Tensor:
    freqs = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    return torch.polar(torch.ones(seq, dim // 2), torch.outer(torch.arange(seq).float(), freqs))


class ComplexRope(LMBase):
    """Meta's original Llama: rotary through ``view_as_complex`` on [B, S, H, D/2] complex values."""

    def forward(self, ids):
        x = self.embed(ids)
        B, S, _ = x.shape
        q, k, v = self.attn.qkv(self.ln(x)).view(B, S, 3, HEADS, HD).unbind(2)
        f = freqs_cis(S)[None, :, None, :]
        q = torch.view_as_real(torch.view_as_complex(q.reshape(B, S, HEADS, -1, 2)) * f).flatten(3)
        k = torch.view_as_real(torch.view_as_complex(k.reshape(B, S, HEADS, -1, 2)) * f).flatten(3)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.attn.out(a.transpose(1, 2).reshape(B, S, DIM))
        return self.lm_loss(x, ids)


class InterleavedRope(LMBase):
    """GPT-J / CodeGen: rotary on interleaved pairs (``x[..., ::2]``, ``x[..., 1::2]``), sin/cos gathered by position."""

    def forward(self, ids):
        x = self.embed(ids)
        B, S, _ = x.shape
        q, k, v = self.attn.qkv(self.ln(x)).view(B, S, 3, HEADS, HD).unbind(2)
        pos = torch.arange(S)[None].expand(B, S)
        inv = 1.0 / (10000 ** (torch.arange(0, HD, 2).float() / HD))
        table = torch.einsum("i,j->ij", torch.arange(64).float(), inv)
        sincos = torch.cat([table.sin(), table.cos()], -1)[pos]  # [B, S, HD]
        sin, cos = (
            torch.repeat_interleave(sincos[..., : HD // 2], 2, -1),
            torch.repeat_interleave(sincos[..., HD // 2 :], 2, -1),
        )

        def rotate(t):
            x1, x2 = t[..., ::2], t[..., 1::2]
            rot = torch.stack((-x2, x1), dim=-1).flatten(-2)
            return t * cos[:, :, None] + rot * sin[:, :, None]

        q, k = rotate(q), rotate(k)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.attn.out(a.transpose(1, 2).reshape(B, S, DIM))
        return self.lm_loss(x, ids)


class EinsumAttention(LMBase):
    """Attention written with einsum and a ``masked_fill`` of a tril mask."""

    def forward(self, ids):
        x = self.embed(ids)
        B, S, _ = x.shape
        q, k, v = self.attn.heads(self.ln(x))
        scores = torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(HD)
        keep = torch.ones(S, S, dtype=torch.bool).tril()
        probs = scores.masked_fill(~keep, float("-inf")).softmax(-1)
        a = torch.einsum("bhqk,bhkd->bqhd", probs, v)
        x = x + self.attn.out(a.reshape(B, S, DIM))
        return self.lm_loss(x, ids)


class StridedTokens(LMBase):
    """Every other token mixed and handed back to its pair (``x[:, ::2]``, ``repeat_interleave``, as
    hourglass models pool), and a penalty on every third token (``x[:, 1::3]``)."""

    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Linear(DIM, DIM)

    def forward(self, ids):
        x = self.embed(ids)
        x = x + self.attn(self.ln(x))
        x = x + self.mix(x[:, ::2]).repeat_interleave(2, dim=1)
        return self.lm_loss(x, ids) + x[:, 1::3].pow(2).mean()


class TokenWrites(LMBase):
    """Writes and copies along other dims than the sequence: q filled into a ``new_empty`` by halves (as
    DeepSeek's MLA joins its rotary and plain halves), k and v of half the heads ``repeat``ed, and a
    ``scatter`` of ones over the features each token picks."""

    def forward(self, ids):
        x = self.embed(ids)
        B, S, _ = x.shape
        q, k, v = self.attn.heads(self.ln(x))
        full = q.new_empty(B, HEADS, S, HD)
        full[..., : HD // 2] = q[..., : HD // 2]
        full[..., HD // 2 :] = k[..., HD // 2 :] * 0.5
        k, v = k[:, : HEADS // 2].repeat(1, 2, 1, 1), v[:, : HEADS // 2].repeat(1, 2, 1, 1)
        a = F.scaled_dot_product_attention(full, k, v, is_causal=True).transpose(1, 2).reshape(B, S, DIM)
        picked = torch.zeros(B, S, DIM).scatter(2, (ids % DIM).unsqueeze(-1), 1.0)
        return self.lm_loss(x + self.attn.out(a) * (1 + picked), ids)


class AttentionSinks(LMBase):
    """GPT-OSS's eager attention, the model's only attention: a learned logit per head joins the keys
    in the softmax (the row's max subtracted first) and is dropped after it."""

    def __init__(self) -> None:
        super().__init__()
        self.sinks = nn.Parameter(torch.linspace(-1.0, 1.0, HEADS))

    def forward(self, ids):
        x = self.embed(ids)
        B, S, _ = x.shape
        q, k, v = self.attn.heads(self.ln(x))
        keep = torch.ones(S, S, dtype=torch.bool).tril()
        scores = torch.matmul(q, k.transpose(2, 3)) * HD**-0.5 + torch.where(keep, 0.0, float("-inf"))
        sinks = self.sinks.reshape(1, -1, 1, 1).expand(B, -1, S, -1)
        combined = torch.cat([scores, sinks], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = F.softmax(combined, dim=-1)[..., :-1]
        a = torch.matmul(probs, v).transpose(1, 2).reshape(B, S, DIM)
        return self.lm_loss(x + self.attn.out(a), ids)


def t5_bucket(rel: torch.Tensor, buckets: int = 8, max_distance: int = 32) -> torch.Tensor:
    """T5's bidirectional relative-position bucket."""
    buckets //= 2
    out = (rel > 0).long() * buckets
    rel = rel.abs()
    exact = buckets // 2
    large = exact + (torch.log(rel.float() / exact + 1e-6) / math.log(max_distance / exact) * (buckets - exact)).long()
    large = torch.min(large, torch.full_like(large, buckets - 1))
    return out + torch.where(rel < exact, rel, large)


class T5Bias(nn.Module):
    """T5 encoder: a learned relative-position bias [1, H, S, S] from buckets, added to unscaled scores."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.rel = nn.Embedding(8, HEADS)
        self.attn = Attn(causal=False)
        self.cls = nn.Linear(DIM, CLASSES)

    def forward(self, ids, y):
        x = self.embed(ids)
        S = ids.shape[1]
        ctx = torch.arange(S)[:, None]
        mem = torch.arange(S)[None, :]
        bias = self.rel(t5_bucket(mem - ctx)).permute(2, 0, 1).unsqueeze(0)
        x = x + self.attn(x, bias)
        return F.cross_entropy(self.cls(x.mean(1)), y)


class Alibi(LMBase):
    """BLOOM: ALiBi from the padding mask's cumsum, added to the causal mask as a [B, H, 1, S] bias."""

    def forward(self, ids, mask):
        x = self.embed(ids)
        B, S = ids.shape
        slopes = torch.tensor([2 ** (-8 * (i + 1) / HEADS) for i in range(HEADS)])
        pos = ((mask.cumsum(-1) - 1) * mask)[:, None, :].float()
        alibi = slopes[None, :, None, None] * pos[:, :, None, :]
        causal = torch.ones(S, S, dtype=torch.bool).tril()
        allowed = causal[None, None] & mask[:, None, None, :].bool()
        allowed = allowed | torch.eye(S, dtype=torch.bool)
        bias = alibi.masked_fill(~allowed, torch.finfo(x.dtype).min)
        x = x + self.attn(self.ln(x), bias)
        logits = self.head(x)[:, :-1]
        labels = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
        return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


class OptPositions(LMBase):
    """OPT: learned positions at ``cumsum(mask) * mask - 1 + 2`` (an offset of 2), left padding."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Embedding(64 + 2, DIM)

    def forward(self, ids, mask):
        positions = (torch.cumsum(mask, dim=1).type_as(mask) * mask).long() - 1
        x = self.embed(ids) + self.pos(positions + 2)
        x = x + self.attn(self.ln(x))
        return self.lm_loss(x, ids)


# --- sequence mixing without attention -----------------------------------------------------------


class WhisperFront(nn.Module):
    """Whisper-like: two conv1d over the sequence, the second with stride 2, then positions and a pooled loss."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(8, DIM, 3, padding=1)
        self.conv2 = nn.Conv1d(DIM, DIM, 3, stride=2, padding=1)
        self.pos = nn.Parameter(torch.randn(64, DIM) * 0.02)
        self.attn = Attn(causal=False)
        self.cls = nn.Linear(DIM, CLASSES)

    def forward(self, feats, y):  # feats [B, 8, S]
        x = F.gelu(self.conv2(F.gelu(self.conv1(feats)))).transpose(1, 2)
        x = x + self.pos[: x.shape[1]]
        x = x + self.attn(x)
        return F.cross_entropy(self.cls(x.mean(1)), y)


class RwkvShift(LMBase):
    """RWKV's token shift with ``nn.ZeroPad2d((0, 0, 1, -1))`` (a negative pad) and a learned mix."""

    def __init__(self) -> None:
        super().__init__()
        self.shift = nn.ZeroPad2d((0, 0, 1, -1))
        self.mix = nn.Parameter(torch.rand(DIM))

    def forward(self, ids):
        x = self.embed(ids)
        x = x * self.mix + self.shift(x) * (1 - self.mix)
        x = x + self.attn(self.ln(x))
        return self.lm_loss(x, ids)


class LinearAttentionScan(LMBase):
    """Causal linear attention by cumsum of k v outer products, with a cumprod decay."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(DIM, 1)

    def forward(self, ids):
        x = self.embed(ids)
        B, S, _ = x.shape
        q, k, v = self.attn.qkv(self.ln(x)).chunk(3, -1)
        q, k = F.elu(q) + 1, F.elu(k) + 1
        decay = torch.sigmoid(self.gate(x)).squeeze(-1).cumprod(1)[..., None]  # [B, S, 1]
        kv = torch.cumsum(k.unsqueeze(-1) * v.unsqueeze(-2) * 0.1, dim=1)  # [B, S, D, D]
        z = torch.cumsum(k, dim=1)
        num = torch.einsum("bsd,bsde->bse", q, kv)
        den = torch.einsum("bsd,bsd->bs", q, z)[..., None] + 1.0
        x = x + self.attn.out(num / den) * (0.5 + decay)
        return self.lm_loss(x, ids)


class Norms(nn.Module):
    """Statistics over the batch and the sequence (BatchNorm1d), or over the sequence (InstanceNorm, LayerNorm)."""

    def __init__(self, kind: str, seq: int) -> None:
        super().__init__()
        self.kind = kind
        self.embed = nn.Embedding(VOCAB, DIM)
        self.attn = Attn(causal=False)
        if kind == "batchnorm":
            self.norm = nn.BatchNorm1d(DIM)
        elif kind == "instancenorm":
            self.norm = nn.InstanceNorm1d(DIM, affine=True)
        elif kind == "groupnorm":
            self.norm = nn.GroupNorm(4, DIM)
        else:
            self.norm = nn.LayerNorm(seq)
        self.cls = nn.Linear(DIM, CLASSES)

    def forward(self, ids, y):
        x = self.embed(ids)
        x = x + self.attn(x)
        x = self.norm(x.transpose(1, 2)).transpose(1, 2)
        return F.cross_entropy(self.cls(x.amax(1)), y)


# --- losses and selections ---------------------------------------------------------------------


class PerSequenceLoss(LMBase):
    """``reduction='none'`` token loss, masked, normalised per sequence, then averaged over sequences."""

    def forward(self, ids, loss_mask):
        x = self.embed(ids)
        x = x + self.attn(self.ln(x))
        logits = self.head(x)[:, :-1]
        per_token = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")  # [B, S-1]
        m = loss_mask[:, 1:]
        return ((per_token * m).sum(1) / m.sum(1).clamp(min=1)).mean()


class Selections(LMBase):
    """Pools by computed indices along the sequence: argmax, top-k, index_select, repeat_interleave, unfold."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.score = nn.Linear(DIM, 1)
        self.cls = nn.Linear(DIM, CLASSES)

    def forward(self, ids, y):
        x = self.embed(ids)
        x = x + self.attn(self.ln(x))
        B, S, _ = x.shape
        s = self.score(x).squeeze(-1)  # [B, S]
        if self.kind == "argmax":
            idx = s.argmax(dim=1)
            h = x[torch.arange(B), idx] * torch.sigmoid(s.max(dim=1).values)[:, None]
        elif self.kind == "topk":
            vals, idx = s.topk(3, dim=1)
            picked = torch.gather(x, 1, idx[..., None].expand(-1, -1, DIM))
            h = (picked * vals.softmax(-1)[..., None]).sum(1)
        elif self.kind == "index_select":
            idx = (torch.arange(S) * 5 + 3) % S
            h = x.index_select(1, idx)[:, : S // 2].mean(1)
        elif self.kind == "repeat_interleave":
            h = x.repeat_interleave(2, dim=1)[:, 1::3].mean(1)
        elif self.kind == "unfold":
            w = x.unfold(1, 4, 2)  # [B, windows, D, 4]
            h = w.amax(-1).mean(1)
        elif self.kind == "avgpool":
            h = F.avg_pool1d(x.transpose(1, 2), 3, stride=2).amax(-1)
        elif self.kind == "sort":
            h = x.sort(dim=1).values[:, S // 2]
        elif self.kind == "diff":
            h = torch.diff(x, dim=1).abs().mean(1)
        elif self.kind == "scatter":
            seg = (torch.arange(S) * 3) // S  # three segments
            pooled = torch.zeros(B, 3, DIM).index_add(1, seg, x)
            h = pooled.flatten(1)[:, :DIM]
        else:  # gram: x^T x contracted over the sequence
            h = torch.einsum("bsd,bse->bde", x, x).diagonal(dim1=1, dim2=2) / S
        return F.cross_entropy(self.cls(h), y)


class Mixers(LMBase):
    """Token mixing beyond attention: FFT (FNet), a causal depthwise conv (Mamba), a dilated conv
    without padding whose shorter output is padded back (on some ranks it holds no position),
    recurrences (``nn.GRU``, a Python loop over positions), flips, rolls, running maxima, CTC, medians."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.conv = nn.Conv1d(DIM, DIM, 4, groups=DIM)
        self.rnn = nn.GRU(DIM, DIM, batch_first=True) if kind == "gru" else None
        self.valid = nn.Conv1d(DIM, DIM, 5, dilation=2) if kind == "valid-conv" else None
        self.cls = nn.Linear(DIM, CLASSES)

    def forward(self, ids, y):
        x = self.embed(ids)
        x = x + self.attn(self.ln(x))
        B, S, D = x.shape
        if self.kind == "fnet":
            x = x + torch.fft.fft(torch.fft.fft(x, dim=-1), dim=1).real
        elif self.kind == "causal-conv":  # left pad, depthwise conv, crop
            x = x + self.conv(F.pad(x.transpose(1, 2), (3, 0)))[..., :S].transpose(1, 2)
        elif self.kind == "valid-conv":  # 8 positions shorter, padded back on both sides
            x = x + F.pad(self.valid(x.transpose(1, 2)), (4, 4)).transpose(1, 2)
        elif self.kind == "gru":  # Dynamo breaks the graph around it
            x = x + self.rnn(x)[0]
        elif self.kind == "position-loop":
            # One select per position: on the ranks that do not hold position t each is an all-reduce
            # of equal zeros, which CSE once merged on one rank only (collectives paired wrongly).
            h, outs = torch.zeros(B, D), []
            for t in range(S):
                h = 0.9 * h + x[:, t]
                outs.append(h)
            x = x + torch.stack(outs, 1)
        elif self.kind == "flip-roll":
            x = x + x.flip(1) * 0.5 + torch.roll(x, 1, dims=1)
        elif self.kind == "cummax":
            x = x + torch.cummax(x, dim=1).values + torch.logcumsumexp(x, dim=1) * 0.1
        elif self.kind == "ctc":
            logp = self.head(x).log_softmax(-1).transpose(0, 1)  # [S, B, V]
            target = ids[:, : S // 4] % (VOCAB - 1) + 1
            return F.ctc_loss(logp, target, torch.full((B,), S), torch.full((B,), S // 4))
        elif self.kind == "median":
            return F.cross_entropy(self.cls(x.median(dim=1).values + x.std(dim=1)), y)
        return self.lm_loss(x, ids)


class Routes(LMBase):
    """Tokens routed, sorted, resampled or counted over the whole sequence: MoE routing by expert
    choice (top-k over the sequence) and by capacity (a running count of each expert's tokens),
    Reformer's bucket sort, linear resampling, pooling windows, a strided conv and its transpose,
    tokens paired by a reshape, the sequence's halves gating each other, a loss weighted by the
    batch's label counts, and span extraction (a cross entropy over positions)."""

    EXPERTS = 4

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.router = nn.Linear(DIM, self.EXPERTS)
        self.expert = nn.Linear(DIM, DIM)
        self.down = nn.Conv1d(DIM, DIM, 4, stride=2, padding=1)
        self.up = nn.ConvTranspose1d(DIM, DIM, 4, stride=2, padding=1)
        self.span = nn.Linear(DIM, 2)

    def forward(self, ids, y):
        x = self.embed(ids)
        x = x + self.attn(self.ln(x))
        B, S, D = x.shape
        E = self.EXPERTS
        if self.kind == "expert-choice":
            gates, idx = self.router(x).softmax(-1).transpose(1, 2).topk(S // 4, dim=-1)  # [B, E, k] tokens
            where = idx.unsqueeze(-1).expand(B, E, S // 4, D)
            chosen = torch.gather(x.unsqueeze(1).expand(B, E, S, D), 2, where)
            out = torch.zeros(B, E, S, D).scatter_add(2, where, torch.tanh(self.expert(chosen)) * gates.unsqueeze(-1))
            x = x + out.sum(1)
        elif self.kind == "capacity":
            probs = self.router(x).softmax(-1)
            top = probs.argmax(-1)
            onehot = F.one_hot(top, E)
            keep = ((onehot.cumsum(1) * onehot).sum(-1) <= S // 4).float()  # each expert takes its first S/4
            x = x + torch.tanh(self.expert(x)) * (probs.gather(-1, top.unsqueeze(-1)).squeeze(-1) * keep).unsqueeze(-1)
        elif self.kind in ("bucket-sort", "bucket-sdpa"):
            order = (self.router(x).argmax(-1) * S + torch.arange(S)).argsort(dim=1)
            xs = x.gather(1, order.unsqueeze(-1).expand(B, S, D)).view(B, S // 4, 4, D)
            # Attention within each chunk of 4 (the chunks where SDPA expects heads), written out or SDPA.
            if self.kind == "bucket-sdpa":
                ys = F.scaled_dot_product_attention(xs, xs, xs)
            else:
                ys = ((xs @ xs.transpose(-1, -2)) / D**0.5).softmax(-1) @ xs
            back = order.argsort(dim=1).unsqueeze(-1).expand(B, S, D)
            x = x + ys.reshape(B, S, D).gather(1, back)
        elif self.kind == "resample":
            half = F.interpolate(x.transpose(1, 2), scale_factor=0.5, mode="linear")
            x = x + F.interpolate(half, size=S, mode="linear", align_corners=True).transpose(1, 2)
        elif self.kind == "pool-windows":
            t = x.transpose(1, 2)
            x = x + (F.avg_pool1d(t, 3, 1, 1) + F.max_pool1d(t, 5, 1, 2)).transpose(1, 2)
        elif self.kind == "conv-transpose":
            x = x + self.up(torch.relu(self.down(x.transpose(1, 2)))).transpose(1, 2)
        elif self.kind == "pairs":
            pairs = self.expert(x).reshape(B, S // 2, 2 * D)
            x = x + (pairs[..., :D] * pairs[..., D:]).repeat_interleave(2, dim=1)
        elif self.kind == "halves":
            a, b = x.chunk(2, dim=1)
            gated = a * torch.sigmoid(b)
            x = x + torch.cat([gated, gated.flip(1)], 1)
        elif self.kind == "label-counts":
            target = ids[:, 1:].reshape(-1)
            weight = (1.0 / torch.bincount(target, minlength=VOCAB).float())[target]
            token = F.cross_entropy(self.head(x)[:, :-1].reshape(-1, VOCAB), target, reduction="none")
            return (token * weight).sum() / weight.sum()
        elif self.kind == "span":  # HF *ForQuestionAnswering: positions past the end are ignored
            start_logits, end_logits = self.span(x).unbind(-1)
            start = ids[:, 0] % S
            end = torch.cat([torch.full((1,), S + 3), (start[1:] + 1) % S]).clamp(0, S)  # row 0's: ignored
            return (
                F.cross_entropy(start_logits, start, ignore_index=S) + F.cross_entropy(end_logits, end, ignore_index=S)
            ) / 2
        return self.lm_loss(x, ids)


ROUTES = (
    "expert-choice",
    "capacity",
    "bucket-sort",
    "bucket-sdpa",
    "resample",
    "pool-windows",
    "conv-transpose",
    "pairs",
    "halves",
    "label-counts",
    "span",
)


class InPlace(LMBase):
    """In-place updates of activations: a masked position zeroed, a running add, a scaled slice."""

    def forward(self, ids, mask):
        x = self.embed(ids)
        x[:, 0] = 0.0
        x.mul_(mask[..., None])
        x[:, 1:] += 0.5 * x[:, :-1]
        x = x + self.attn(self.ln(x))
        h = x.clone()
        h[:, -1] *= 2.0
        return self.lm_loss(h, ids)


class MultiOutput(LMBase):
    """Returns the loss, the hidden states and a pooled vector, as HF's outputs do."""

    def forward(self, ids):
        x = self.embed(ids)
        x = x + self.attn(self.ln(x))
        return self.lm_loss(x, ids), x, x[:, -1] + x.mean(1)


BUILDERS: dict[str, Callable[[int], nn.Module]] = {
    "complex-rope": lambda s: ComplexRope(),
    "interleaved-rope": lambda s: InterleavedRope(),
    "einsum-attention": lambda s: EinsumAttention(),
    "attention-sinks": lambda s: AttentionSinks(),
    "strided-tokens": lambda s: StridedTokens(),
    "token-writes": lambda s: TokenWrites(),
    "t5-bias": lambda s: T5Bias(),
    "alibi": lambda s: Alibi(),
    "opt-positions": lambda s: OptPositions(),
    "whisper-front": lambda s: WhisperFront(),
    "rwkv-shift": lambda s: RwkvShift(),
    "linear-scan": lambda s: LinearAttentionScan(),
    "batchnorm": lambda s: Norms("batchnorm", s),
    "instancenorm": lambda s: Norms("instancenorm", s),
    "groupnorm": lambda s: Norms("groupnorm", s),
    "layernorm-seq": lambda s: Norms("layernorm", s),
    "per-seq-loss": lambda s: PerSequenceLoss(),
    "in-place": lambda s: InPlace(),
    "multi-output": lambda s: MultiOutput(),
    **{
        f"mix-{k}": (lambda s, k=k: Mixers(k))
        for k in ("fnet", "causal-conv", "valid-conv", "gru", "position-loop", "flip-roll", "cummax", "ctc", "median")
    },
    **{f"route-{k}": (lambda s, k=k: Routes(k)) for k in ROUTES},
    **{
        f"select-{k}": (lambda s, k=k: Selections(k))
        for k in (
            "argmax",
            "topk",
            "index_select",
            "repeat_interleave",
            "unfold",
            "avgpool",
            "sort",
            "diff",
            "scatter",
            "gram",
        )
    },
}
NAMES = list(BUILDERS)


def build(name: str, seq: int) -> nn.Module:
    from probe_routing import PROGRAMS as ROUTING  # they build on this module's blocks
    from probe_sequence import PROGRAMS
    from probe_tasks import TASKS

    torch.manual_seed(0)
    return (TASKS.get(name) or PROGRAMS.get(name) or ROUTING.get(name) or BUILDERS[name])(seq)


def inputs(name: str, seq: int = 16, batch: int = 2) -> tuple[torch.Tensor, ...]:
    import probe_routing
    from probe_sequence import PROGRAMS, program_inputs
    from probe_tasks import TASKS, task_inputs

    if name in TASKS:
        return task_inputs(name, seq, batch)
    if name in PROGRAMS:
        return program_inputs(name, seq, batch)
    if name in probe_routing.PROGRAMS:
        return probe_routing.program_inputs(name, seq, batch)
    if name.startswith("hf-"):
        return hf_inputs(name, seq, batch)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
    y = torch.randint(0, CLASSES, (batch,), generator=g)
    if name in ("alibi", "opt-positions", "in-place"):
        mask = torch.ones(batch, seq, dtype=torch.long)
        mask[0, : seq // 3] = 0  # left padding
        return ids, (mask.float() if name == "in-place" else mask)
    if name == "per-seq-loss":
        m = torch.ones(batch, seq)
        m[:, : seq // 4] = 0
        return ids, m
    if name == "class-conditioned":
        return ids, y, torch.linspace(0.5, 1.5, batch)
    if name.startswith("torch-mha"):
        pad = torch.zeros(batch, seq, dtype=torch.bool)
        pad[0, seq - seq // 4 :] = True  # right padding
        return ids, pad
    if name.startswith("loss-"):
        labels = ids.clone()
        labels[0, : seq // 3] = -100
        labels[1, seq // 2 + 1] = -100
        return ids, labels
    if name == "whisper-front":
        return torch.randn(batch, 8, seq, generator=g), y
    if name == "encoder-decoder":
        return ids, torch.randint(0, VOCAB, (batch, seq // 2), generator=g)
    if name in (
        "complex-rope",
        "interleaved-rope",
        "einsum-attention",
        "attention-sinks",
        "strided-tokens",
        "token-writes",
        "rwkv-shift",
        "linear-scan",
        "multi-output",
        "ema-buffer",
        "no-grad-target",
        "reverse-attention",
        "last-queries",
        "rotated",
        "custom-function",
        "custom-function-disabled",
        "eager-layer",
        "buffer-moved",
        "buffer-returned",
        "vmap-tokens",
        "vmap-batch",
        "vmap-associative-scan",
        "expert-loop",
        "chunk-local",
        "chunk-local-mask",
        "embedding-freq-scaled",
        "embedding-max-norm-plain",
        "embedding-max-norm-tied",
        "embedding-max-norm-twice",
        "embedding-max-norm-bag",
        "complex-output",
        "attention-dropout",
        "written-dropout",
        "landmarks",
        "wide-value-heads",
        "token-wise-functions",
        "set-order",
        "set-order-dropout",
        "nested-regions",
        "functorch-inside",
    ) or name.startswith(("hook-", "sdpa-3d", "act-", "param-data", "head-bias")):
        return (ids,)
    return ids, y


__all__ = ["NAMES", "build", "inputs"]


# --- Hugging Face models outside the matrix, from tiny configs (no downloads) --------------------


class HF(nn.Module):
    """An HF model called with ids, labels and (optionally) an attention mask; returns (loss, logits)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.m = model

    def forward(self, ids, labels, mask=None):
        out = self.m(input_ids=ids, labels=labels, attention_mask=mask)
        return out.loss, out.logits


def _hf(kind: str) -> nn.Module:
    import transformers as t

    common = dict(vocab_size=VOCAB, use_cache=False, tie_word_embeddings=False)
    llama_like = dict(
        hidden_size=DIM,
        intermediate_size=2 * DIM,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        max_position_embeddings=64,
        **common,
    )
    if kind == "opt":
        cfg = t.OPTConfig(
            hidden_size=DIM,
            ffn_dim=2 * DIM,
            num_hidden_layers=2,
            num_attention_heads=HEADS,
            word_embed_proj_dim=DIM,
            max_position_embeddings=64,
            dropout=0.0,
            attention_dropout=0.0,
            **common,
        )
        return t.OPTForCausalLM(cfg)
    if kind == "bloom":
        cfg = t.BloomConfig(
            hidden_size=DIM, n_layer=2, n_head=HEADS, hidden_dropout=0.0, attention_dropout=0.0, **common
        )
        return t.BloomForCausalLM(cfg)
    if kind == "falcon":
        cfg = t.FalconConfig(
            hidden_size=DIM,
            num_hidden_layers=2,
            num_attention_heads=HEADS,
            new_decoder_architecture=False,
            multi_query=True,
            parallel_attn=True,
            alibi=False,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            **common,
        )
        return t.FalconForCausalLM(cfg)
    if kind == "gptj":
        cfg = t.GPTJConfig(
            n_embd=DIM,
            n_layer=2,
            n_head=HEADS,
            rotary_dim=4,
            n_positions=64,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            **common,
        )
        return t.GPTJForCausalLM(cfg)
    if kind == "codegen":
        cfg = t.CodeGenConfig(
            n_embd=DIM,
            n_layer=2,
            n_head=HEADS,
            rotary_dim=4,
            n_positions=64,
            n_ctx=64,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            **common,
        )
        return t.CodeGenForCausalLM(cfg)
    if kind == "gpt-bigcode":
        cfg = t.GPTBigCodeConfig(
            n_embd=DIM,
            n_layer=2,
            n_head=HEADS,
            n_positions=64,
            multi_query=True,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            **common,
        )
        return t.GPTBigCodeForCausalLM(cfg)
    if kind == "stablelm":
        return t.StableLmForCausalLM(t.StableLmConfig(num_key_value_heads=2, partial_rotary_factor=0.5, **llama_like))
    if kind == "starcoder2":
        return t.Starcoder2ForCausalLM(t.Starcoder2Config(num_key_value_heads=2, residual_dropout=0.0, **llama_like))
    if kind == "olmo":
        return t.OlmoForCausalLM(t.OlmoConfig(num_key_value_heads=2, clip_qkv=8.0, **llama_like))
    if kind == "gemma":
        return t.GemmaForCausalLM(t.GemmaConfig(num_key_value_heads=1, head_dim=HD, **llama_like))
    if kind == "distilbert":
        cfg = t.DistilBertConfig(
            dim=DIM,
            hidden_dim=2 * DIM,
            n_layers=2,
            n_heads=HEADS,
            max_position_embeddings=64,
            dropout=0.0,
            attention_dropout=0.0,
            seq_classif_dropout=0.0,
            num_labels=CLASSES,
            vocab_size=VOCAB,
        )
        return t.DistilBertForSequenceClassification(cfg)
    if kind == "t5-encoder":
        cfg = t.T5Config(
            d_model=DIM,
            d_kv=HD,
            d_ff=2 * DIM,
            num_layers=2,
            num_heads=HEADS,
            dropout_rate=0.0,
            relative_attention_num_buckets=8,
            relative_attention_max_distance=32,
            vocab_size=VOCAB,
        )
        return t.T5EncoderModel(cfg)
    if kind == "modernbert":
        cfg = t.ModernBertConfig(
            hidden_size=DIM,
            intermediate_size=2 * DIM,
            num_hidden_layers=3,
            num_attention_heads=HEADS,
            max_position_embeddings=64,
            local_attention=8,
            global_attn_every_n_layers=2,
            vocab_size=VOCAB,
            pad_token_id=0,
            embedding_dropout=0.0,
            attention_dropout=0.0,
            mlp_dropout=0.0,
        )
        return t.ModernBertForMaskedLM(cfg)
    raise KeyError(kind)


class T5Pool(nn.Module):
    """T5 encoder (relative-position bias [1, H, S, S]) with a padding mask, mean-pooled into a classifier."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.m = model
        self.cls = nn.Linear(DIM, CLASSES)

    def forward(self, ids, y, mask):
        h = self.m(input_ids=ids, attention_mask=mask).last_hidden_state
        pooled = (h * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        return F.cross_entropy(self.cls(pooled), y), h


HF_KINDS = (
    "opt",
    "bloom",
    "falcon",
    "gptj",
    "codegen",
    "gpt-bigcode",
    "stablelm",
    "starcoder2",
    "olmo",
    "gemma",
    "distilbert",
    "t5-encoder",
    "modernbert",
)
for _kind in HF_KINDS:
    BUILDERS[f"hf-{_kind}"] = lambda s, k=_kind: T5Pool(_hf(k)) if k == "t5-encoder" else HF(_hf(k))
NAMES = list(BUILDERS)
HF_MASKED = ("hf-opt", "hf-bloom", "hf-t5-encoder", "hf-distilbert")  # called with left/right padding


def hf_inputs(name: str, seq: int, batch: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, VOCAB, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    if name in HF_MASKED:
        mask[0, : seq // 4] = 0  # left padding (right padding for the encoders makes no difference to them)
    if name in ("hf-distilbert", "hf-t5-encoder"):
        y = torch.randint(0, CLASSES, (batch,), generator=g)
        return (ids, y, mask) if name == "hf-t5-encoder" else (ids, y, mask)
    labels = ids.clone().masked_fill(mask == 0, -100)
    labels[-1, seq // 2 + 1] = -100
    return (ids, labels, mask) if name in HF_MASKED else (ids, labels)


class ClassConditioned(nn.Module):
    """A class embedding from per-example labels added first, so with B == S the [B] labels look like a sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.cond = nn.Embedding(CLASSES, DIM)
        self.attn = Attn()
        self.head = nn.Linear(DIM, VOCAB)
        self.w = nn.Parameter(torch.ones(1))

    def forward(self, ids, y, weights):
        x = self.cond(y)[:, None, :] + self.embed(ids)
        x = x + self.attn(x)
        per_token = F.cross_entropy(self.head(x)[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")
        return (per_token.mean(1) * weights * self.w).sum()


BUILDERS["class-conditioned"] = lambda s: ClassConditioned()
NAMES = list(BUILDERS)


class TorchMHA(nn.Module):
    """``nn.MultiheadAttention`` (batch_first, need_weights as given) with a key padding mask, or ``nn.TransformerEncoder``."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.embed = nn.Embedding(VOCAB, DIM)
        if kind == "encoder":
            layer = nn.TransformerEncoderLayer(DIM, HEADS, 2 * DIM, dropout=0.0, batch_first=True, norm_first=True)
            self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        else:
            self.mha = nn.MultiheadAttention(DIM, HEADS, dropout=0.0, batch_first=True)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids, pad):
        x = self.embed(ids)
        S = ids.shape[1]
        causal = torch.ones(S, S, dtype=torch.bool).triu(1)
        if self.kind == "encoder":
            h = self.enc(x, mask=causal, src_key_padding_mask=pad)
            weights = h.mean(-1)
        else:
            h, weights = self.mha(x, x, x, key_padding_mask=pad, attn_mask=causal, need_weights=self.kind == "weights")
            weights = weights.sum(1) if weights is not None else h.mean(-1)
        logits = self.head(x + h)[:, :-1]
        labels = ids[:, 1:].masked_fill(pad[:, 1:], -100)
        return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1)), weights


for _kind in ("weights", "no-weights", "encoder"):
    BUILDERS[f"torch-mha-{_kind}"] = lambda s, k=_kind: TorchMHA(k)
NAMES = list(BUILDERS)


class LossVariants(LMBase):
    """Token losses beyond the plain mean: label smoothing, class weights, soft targets, a z-loss, KL to a teacher."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.register_buffer("class_weight", torch.linspace(0.5, 2.0, VOCAB))

    def forward(self, ids, labels):
        x = self.embed(ids)
        x = x + self.attn(self.ln(x))
        logits = self.head(x)[:, :-1].reshape(-1, VOCAB)
        target = labels[:, 1:].reshape(-1)
        if self.kind == "smoothing":
            return F.cross_entropy(logits, target, label_smoothing=0.1)
        if self.kind == "class-weight":
            return F.cross_entropy(logits, target, weight=self.class_weight)
        if self.kind == "soft":
            soft = F.one_hot(target.clamp(min=0), VOCAB).float() * 0.8 + 0.2 / VOCAB
            return F.cross_entropy(logits, soft)
        if self.kind == "soft-classes-first":
            # Classes on dim 1 ([B, V, S]): its backward once failed under aot_eager ("view size is
            # not compatible"), the log-softmax backward's meta layout not being the kernel's.
            per_token = self.head(x).transpose(1, 2)
            soft = F.one_hot(labels.clamp(min=0), VOCAB).float().transpose(1, 2) * 0.8 + 0.2 / VOCAB
            return F.cross_entropy(per_token, soft)
        if self.kind == "z-loss":
            lse = torch.logsumexp(logits, -1)
            return F.cross_entropy(logits, target) + 1e-2 * (lse**2).mean()
        teacher = torch.roll(logits.detach(), 1, 0)
        return F.kl_div(logits.log_softmax(-1), teacher.log_softmax(-1), log_target=True, reduction="batchmean")


for _kind in ("smoothing", "class-weight", "soft", "soft-classes-first", "z-loss", "kl"):
    BUILDERS[f"loss-{_kind}"] = lambda s, k=_kind: LossVariants(k)
NAMES = list(BUILDERS)


# --- grad mode, several lengths, collectives that differ per rank -------------------------------


class EmaBuffer(LMBase):
    """A buffer updated under ``no_grad`` with the sequence's mean activation, then read by the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("ema", torch.zeros(DIM))

    def forward(self, ids):
        x = self.embed(ids)
        x = x + self.attn(x)
        with torch.no_grad():
            self.ema.mul_(0.9).add_(0.1 * x.mean(dim=(0, 1)))
        return self.lm_loss(x - self.ema, ids)


class NoGradTarget(LMBase):
    """Self-distillation: a target made under ``no_grad`` from the model's own logits (no gradient through it)."""

    def forward(self, ids):
        x = self.embed(ids)
        x = x + self.attn(x)
        logits = self.head(x)
        with torch.no_grad():
            target = (logits / 2.0).softmax(-1)
        return -(target * logits.log_softmax(-1)).sum(-1).mean() + self.lm_loss(x, ids)


class ReverseAttention(LMBase):
    """Attention over the sequence and over its reverse: two exchanges with no dependency between them."""

    def forward(self, ids):
        x = self.embed(ids)
        x = x + self.attn(x) + self.attn(x.flip(1)).flip(1)
        return self.lm_loss(x, ids)


class LastQueries(LMBase):
    """The last 4 queries attend causally to every key: under SP those queries sit on the last rank only."""

    def forward(self, ids):
        x = self.embed(ids)
        x = x + self.attn(x)
        B, _, D = x.shape
        q, k, v = self.attn.heads(x)
        o = F.scaled_dot_product_attention(q[:, :, -4:], k, v, is_causal=True)
        return self.head(o.transpose(1, 2).reshape(B, 4, D)).logsumexp(-1).mean() + self.lm_loss(x, ids)


class Rotated(LMBase):
    """The sequence rotated by half before attention and back after it (a cyclic shift).

    At sp=2 each half lies whole on one rank, so every gradient piece of a reduce-scatter in the
    backward is empty on one rank: Inductor removed the empty result there, and with it the edge
    that kept that rank's collectives in order.
    """

    def forward(self, ids):
        x = self.embed(ids)
        half = x.shape[1] // 2

        def rotate(t):
            return torch.cat([t[:, half:], t[:, :half]], 1)

        x = x + rotate(self.attn(self.ln(rotate(x))))
        return self.lm_loss(x, ids)


class EncoderDecoder(nn.Module):
    """An encoder over the source and a causal decoder over a target of half its length, with cross-attention."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.enc, self.dec = Attn(causal=False), Attn(causal=True)
        self.q, self.kv = nn.Linear(DIM, DIM), nn.Linear(DIM, 2 * DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, src, tgt):
        m = self.embed(src)
        m = m + self.enc(m)
        x = self.embed(tgt)
        x = x + self.dec(x)
        B, T, _ = x.shape
        q = self.q(x).view(B, T, HEADS, HD).transpose(1, 2)
        k, v = self.kv(m).view(B, m.shape[1], 2, HEADS, HD).permute(2, 0, 3, 1, 4)
        x = x + F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, T, DIM)
        return F.cross_entropy(self.head(x)[:, :-1].reshape(-1, VOCAB), tgt[:, 1:].reshape(-1))


class Funnel(LMBase):
    """Funnel-Transformer: pairs of tokens averaged, then attention over the half-length sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.attn2 = Attn()
        self.cls = nn.Linear(DIM, CLASSES)

    def forward(self, ids, y):
        x = self.embed(ids)
        x = x + self.attn(x)
        B, S, D = x.shape
        x = x.view(B, S // 2, 2, D).mean(2)
        x = x + self.attn2(x)
        return F.cross_entropy(self.cls(x[:, -1]), y)


class LatentQueries(nn.Module):
    """Perceiver / set-transformer pooling: 3 learned queries attend to the whole sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.attn = Attn()
        self.latents = nn.Parameter(torch.randn(1, HEADS, 3, HD))
        self.kv = nn.Linear(DIM, 2 * DIM)
        self.cls = nn.Linear(DIM, CLASSES)

    def forward(self, ids, y):
        x = self.embed(ids)
        x = x + self.attn(x)
        B, S, _ = x.shape
        k, v = self.kv(x).view(B, S, 2, HEADS, HD).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(self.latents.expand(B, -1, -1, -1), k, v)
        return F.cross_entropy(self.cls(o.transpose(1, 2).reshape(B, 3, DIM).mean(1)), y)


BUILDERS.update(
    {
        "ema-buffer": lambda s: EmaBuffer(),
        "no-grad-target": lambda s: NoGradTarget(),
        "reverse-attention": lambda s: ReverseAttention(),
        "last-queries": lambda s: LastQueries(),
        "rotated": lambda s: Rotated(),
        "encoder-decoder": lambda s: EncoderDecoder(),
        "funnel": lambda s: Funnel(),
        "latent-queries": lambda s: LatentQueries(),
    }
)
NAMES = list(BUILDERS)


# --- custom autograd Functions -------------------------------------------------------------------


class _ScaleGrad(torch.autograd.Function):
    """Identity forward, gradient scaled by -0.5 (a gradient reversal layer): the backward is not
    the forward's derivative, so it cannot be left to autograd."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * -0.5


@torch.compiler.disable
def _scale_grad_outside(x):
    return _ScaleGrad.apply(x)


class CustomFunction(LMBase):
    """A custom ``torch.autograd.Function`` between attention and the head, in the graph or behind a break."""

    def __init__(self, outside: bool) -> None:
        super().__init__()
        self.outside = outside

    def forward(self, ids):
        x = self.embed(ids)
        x = x + self.attn(x)
        x = x + (_scale_grad_outside(x) if self.outside else _ScaleGrad.apply(x))
        return self.lm_loss(x + self.attn(x), ids)


class _EagerAttn(Attn):
    """An attention layer Dynamo runs in eager (a user's ``torch.compiler.disable``)."""

    @torch.compiler.disable
    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward(x, bias)


class EagerLayer(LMBase):
    """The second of two attention layers runs in eager, between the graphs (its parameters with it)."""

    def __init__(self) -> None:
        super().__init__()
        self.eager = _EagerAttn()

    def forward(self, ids):
        x = self.embed(ids)
        x = x + self.attn(x)
        return self.lm_loss(x + self.eager(self.ln(x)), ids)


BUILDERS["eager-layer"] = lambda s: EagerLayer()


class BufferMoved(LMBase):
    """A position table kept as an ``nn.Buffer`` and moved to the activations' dtype in every forward (HF CTRL).

    ``reassign``: ``self.pe = self.pe.to(...)``, where Dynamo breaks the graph inside
    ``Module.__setattr__``; the code after the break reads ``value.persistent``, which only the
    buffer itself has. Else the moved table is returned beside the loss, as the model's own tensor.
    """

    def __init__(self, seq: int, reassign: bool) -> None:
        super().__init__()
        self.reassign = reassign
        self.pe = nn.Buffer(0.1 * torch.randn(2 * seq, DIM), persistent=False)

    def forward(self, ids):
        x = self.embed(ids)
        pe = self.pe.to(device=x.device, dtype=x.dtype)
        if self.reassign:
            self.pe = pe
        x = x + pe[: ids.shape[1]]
        loss = self.lm_loss(x + self.attn(self.ln(x)), ids)
        return loss if self.reassign else (loss, pe)


BUILDERS["buffer-moved"] = lambda s: BufferMoved(s, reassign=True)
BUILDERS["buffer-returned"] = lambda s: BufferMoved(s, reassign=False)


class VmapInside(LMBase):
    """``torch.func.vmap`` inside the program: over positions, over the batch, and ``associative_scan``'s
    generic path (a gated linear recurrence along the sequence; HF Mamba's scan under ``torch.compile``)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.up, self.down, self.gate = nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM), nn.Linear(DIM, DIM)

    def mlp(self, t: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(t)))

    def forward(self, ids):
        x = self.embed(ids)
        x = x + self.attn(self.ln(x))
        if self.kind == "tokens":
            x = x + torch.vmap(self.mlp, in_dims=1, out_dims=1)(x)
        elif self.kind == "batch":  # each sequence's own mean, per example
            x = x + torch.vmap(lambda t: self.mlp(t) * t.mean(0, keepdim=True))(x)
        else:
            from torch._higher_order_ops.associative_scan import associative_scan

            a = torch.sigmoid(self.gate(x))

            def combine(left, right):
                return left[0] * right[0], right[0] * left[1] + right[1]

            _, h = associative_scan(combine, (a, x * (1 - a)), dim=1, combine_mode="generic")
            x = x + h
        return self.lm_loss(x, ids)


for _kind in ("tokens", "batch", "associative-scan"):
    BUILDERS[f"vmap-{_kind}"] = lambda s, k=_kind: VmapInside(k)


class ExpertLoop(LMBase):
    """Experts over tokens as HF's DBRX writes them: a ``zeros_like`` of the folded ``[B * S, D]`` tokens,
    then a loop over the experts hit (a graph break) that ``index_add_``s each expert's tokens into it."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, 3)
        self.experts = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(3))

    def forward(self, ids):
        x = self.embed(ids)
        x = x + self.attn(self.ln(x))
        B, S, _ = x.shape
        h = x.reshape(-1, DIM)
        out = torch.zeros_like(h)
        top = self.router(h).argmax(-1)
        with torch.no_grad():
            hit = torch.bincount(top, minlength=3).nonzero()
        for e in hit:
            (tokens,) = torch.where(top == e[0])
            out.index_add_(0, tokens, self.experts[int(e[0])](h[tokens]))
        return self.lm_loss(x + out.view(B, S, DIM), ids)


BUILDERS["expert-loop"] = lambda s: ExpertLoop()


class _ClipGrad(torch.autograd.Function):
    """Identity forward; the backward clamps the gradient: not linear in it, so a rank's share of
    the gradient clamped is not its share of the clamped gradient."""

    @staticmethod
    def forward(ctx, x, bound: float):
        ctx.bound = bound
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.clamp(-ctx.bound, ctx.bound), None


class _GatedLinear(torch.autograd.Function):
    """A memory-saving SwiGLU written as a Function (Liger, Unsloth): parameters among its inputs,
    the input and a product saved, two results, one of them marked non-differentiable."""

    @staticmethod
    def forward(ctx, x, w_gate, w_up):
        gate, up = x @ w_gate.t(), x @ w_up.t()
        act = F.silu(gate)
        ctx.save_for_backward(x, w_gate, w_up, gate, up)
        positive = (gate > 0).to(x.dtype)
        ctx.mark_non_differentiable(positive)
        return act * up, positive

    @staticmethod
    def backward(ctx, grad, _grad_positive):
        x, w_gate, w_up, gate, up = ctx.saved_tensors
        sig = torch.sigmoid(gate)
        d_gate = grad * up * sig * (1 + gate * (1 - sig))
        d_up = grad * gate * sig
        dx = d_gate @ w_gate + d_up @ w_up
        return dx, d_gate.flatten(0, -2).t() @ x.flatten(0, -2), d_up.flatten(0, -2).t() @ x.flatten(0, -2)


class _Dropout(torch.autograd.Function):
    """Dropout written as a Function: it draws its mask inside, and saves it for the backward."""

    @staticmethod
    def forward(ctx, x):
        keep = (torch.rand_like(x) > 0.25).to(x.dtype) / 0.75
        ctx.save_for_backward(keep)
        return x * keep

    @staticmethod
    def backward(ctx, grad):
        (keep,) = ctx.saved_tensors
        return grad * keep


class CustomFunctions(LMBase):
    """Custom Functions in the graph: a clamped gradient before attention (its result feeds q/k/v), a
    gated MLP with its own backward after it, a gradient reversal on a pooled vector; ``checkpointed``:
    the layer under ``torch.utils.checkpoint`` (the Functions inside its higher-order op); ``dropout``:
    a dropout written as a Function after the gated MLP (its mask drawn inside, saved for the backward)."""

    def __init__(self, checkpointed: bool = False, dropout: bool = False) -> None:
        super().__init__()
        self.checkpointed = checkpointed
        self.dropout = dropout
        self.w_gate = nn.Parameter(torch.randn(2 * DIM, DIM) * DIM**-0.5)
        self.w_up = nn.Parameter(torch.randn(2 * DIM, DIM) * DIM**-0.5)
        self.down = nn.Linear(2 * DIM, DIM)
        self.cls = nn.Linear(DIM, CLASSES)

    def layer(self, x):
        x = x + self.attn(self.ln(_ClipGrad.apply(x, 2e-3)))
        hidden, positive = _GatedLinear.apply(self.ln(x), self.w_gate, self.w_up)
        if self.dropout:
            hidden = _Dropout.apply(hidden)
        return x + self.down(hidden * (1 + 0.1 * positive))

    def forward(self, ids, y):
        x = self.embed(ids)
        if self.checkpointed:
            x = torch.utils.checkpoint.checkpoint(self.layer, x, use_reentrant=False)
        else:
            x = self.layer(x)
        pooled = _ScaleGrad.apply(x.mean(1))
        return self.lm_loss(x, ids) + F.cross_entropy(self.cls(pooled), y)


class _BloomGelu(torch.autograd.Function):
    """BLOOM's GeLU (``BloomGelu`` in training): the tanh approximation, its derivative written out."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        t = torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))
        return grad * (0.5 * x * ((1 - t * t) * (0.79788456 + 0.1070322243 * x * x)) + 0.5 * (1 + t))


class _RoundStraightThrough(torch.autograd.Function):
    """Quantisation-aware training's straight-through estimator: rounds forward, passes the gradient."""

    @staticmethod
    def forward(ctx, x):
        return (x * 8).round() / 8

    @staticmethod
    def backward(ctx, grad):
        return grad


class _Gate(torch.autograd.Function):
    """Two inputs of one shape, both saved, both given a gradient."""

    @staticmethod
    def forward(ctx, x, gate):
        ctx.save_for_backward(x, gate)
        return x * torch.sigmoid(gate)

    @staticmethod
    def backward(ctx, grad):
        x, gate = ctx.saved_tensors
        s = torch.sigmoid(gate)
        return grad * s, grad * x * s * (1 - s)


class TokenWiseFunctions(LMBase):
    """Custom Functions and a hook that are elementwise forward and backward: each rank runs them on
    its own positions (autosp.token_wise_body), nothing gathered. BLOOM's GeLU in the MLP, a
    straight-through round, a gate over two inputs, a clamped gradient (``_ClipGrad``: not linear in
    the gradient, so it must see the true one) before attention, and a clamping gradient hook."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, 2 * DIM)
        self.gate = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)

    def forward(self, ids):
        x = self.embed(ids)
        x = x + self.attn(self.ln(_ClipGrad.apply(x, 2e-3)))
        h = _Gate.apply(_BloomGelu.apply(self.up(x)), self.gate(x))
        h.register_hook(lambda g: (g * 2).clamp(-1e-3, 1e-3))
        x = x + self.down(_RoundStraightThrough.apply(h))
        return self.lm_loss(x + self.attn(self.ln(x)), ids)


BUILDERS["token-wise-functions"] = lambda s: TokenWiseFunctions()


BUILDERS.update(
    {
        "custom-function": lambda s: CustomFunction(outside=False),
        "custom-function-disabled": lambda s: CustomFunction(outside=True),
        "custom-functions": lambda s: CustomFunctions(),
        "custom-functions-checkpointed": lambda s: CustomFunctions(checkpointed=True),
        "custom-functions-dropout": lambda s: CustomFunctions(dropout=True),
    }
)
NAMES = list(BUILDERS)


class ChunkLocal(LMBase):
    """Block-local attention: the sequence cut into chunks, SDPA on ``[B, chunks, H, chunk, d]`` (5-D) inside each.

    Causal within a chunk (``is_causal``) or with an explicit ``[chunk, chunk]`` boolean mask that
    SDPA broadcasts over the batch and chunk dims; a global attention layer follows.
    """

    def __init__(self, chunk: int, masked: bool) -> None:
        super().__init__()
        self.chunk, self.masked = chunk, masked
        self.local = nn.Linear(DIM, 3 * DIM)

    def forward(self, ids):
        x = self.embed(ids)
        B, S, _ = x.shape
        q, k, v = self.local(x).view(B, S // self.chunk, self.chunk, 3, HEADS, HD).permute(3, 0, 1, 4, 2, 5)
        if self.masked:
            keep = torch.ones(self.chunk, self.chunk, dtype=torch.bool).tril()
            o = F.scaled_dot_product_attention(q, k, v, keep)
        else:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + o.permute(0, 1, 3, 2, 4).reshape(B, S, DIM)
        return self.lm_loss(x + self.attn(x), ids)


BUILDERS.update(
    {
        "chunk-local": lambda s: ChunkLocal(4, masked=False),
        "chunk-local-mask": lambda s: ChunkLocal(4, masked=True),
    }
)
NAMES = list(BUILDERS)


# --- found by the third round of held-out probes: each once silently wrong or an unclear crash -----


class FirstTokenBroadcast(LMBase):
    """The first and last token copied along the sequence (``x[:, :1].expand(-1, S, -1)``) and mixed in.

    Once silently wrong: the one-position piece kept its sharding through the broadcast, so each
    rank's copy was a piece of one element (a pooled vector a factor S too small)."""

    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Linear(2 * DIM, DIM)
        self.cls = nn.Linear(DIM, CLASSES)

    def forward(self, ids, y):
        x = self.embed(ids)
        x = x + self.attn(self.ln(x))
        S = x.shape[1]
        x = self.mix(torch.cat([x, x[:, :1].expand(-1, S, -1)], -1)) + x[:, -1:]
        return F.cross_entropy(self.cls(x.mean(1)), y)


class FreqScaledEmbedding(LMBase):
    """``nn.Embedding(scale_grad_by_freq=True)``: once each rank divided by its own tokens' counts."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM, scale_grad_by_freq=True)

    def forward(self, ids):
        x = self.embed(ids % 7)  # few distinct tokens, each on several ranks
        return self.lm_loss(x + self.attn(self.ln(x)), ids)


class MaxNormEmbedding(LMBase):
    """``nn.Embedding(max_norm=...)`` (its lookup renormalises the rows it reads, in place): once refused.

    ``tied``: the head reads the renormalised table too; ``twice``: a second lookup after the first read
    the table; ``bag``: ``nn.EmbeddingBag(max_norm=...)`` pooling every row's tokens.
    """

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.embed = nn.Embedding(VOCAB, DIM, max_norm=1.0)  # rows start near norm 5.7: every lookup renorms
        self.bag = nn.EmbeddingBag(VOCAB, DIM, max_norm=0.5, mode="mean")

    def forward(self, ids):
        x = self.embed(ids)
        if self.kind == "twice":
            x = x + self.embed(ids.flip(1) % 7)
        if self.kind == "bag":
            x = x + self.bag(ids)[:, None]
        x = x + self.attn(self.ln(x))
        if self.kind != "tied":
            return self.lm_loss(x, ids)
        logits = x @ self.embed.weight.T
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


class ComplexOutput(LMBase):
    """A complex output (an FFT of the logits) differentiated outside: its gradient once came back P times."""

    def forward(self, ids):
        x = self.embed(ids)
        x = x + self.attn(self.ln(x))
        return self.lm_loss(x, ids), torch.fft.rfft(self.head(x.mean(1)), dim=-1)


class CircularPad(LMBase):
    """A circular convolution over the sequence: ``F.pad(mode="circular")`` fills slices of a new tensor
    in place inside its decomposition (once refused with advice about the user's own in-place ops)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(DIM, DIM, 3)
        self.cls = nn.Linear(DIM, CLASSES)

    def forward(self, ids, y):
        x = self.embed(ids)
        x = x + self.attn(self.ln(x))
        h = self.conv(F.pad(x.transpose(1, 2), (1, 1), mode="circular")).transpose(1, 2)
        return F.cross_entropy(self.cls((x + h).mean(1)), y)


class AttentionDropout(LMBase):
    """Attention dropout inside SDPA, or written out after the softmax: the masks must be the program's.

    SDPA's was once drawn per rank for its own heads (the same mask on every rank), so the result
    matched no single-device run; now that call runs whole on every rank. Written out, the dropout
    draws the whole weights tensor and the attention stays as written."""

    def __init__(self, written: bool) -> None:
        super().__init__()
        self.written = written

    def forward(self, ids):
        x = self.embed(ids)
        B, S, _ = x.shape
        q, k, v = self.attn.heads(self.ln(x))
        if self.written:
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(HD)
            scores = scores.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
            a = F.dropout(scores.softmax(-1), p=0.2, training=self.training) @ v
        else:
            a = F.scaled_dot_product_attention(q, k, v, dropout_p=0.2, is_causal=True)
        x = x + self.attn.out(a.transpose(1, 2).reshape(B, S, DIM))
        return self.lm_loss(x + self.attn(x), ids)


class SelectedPositions(LMBase):
    """Positions chosen by ``torch.where(cond)`` (a data-dependent size): once a crash in SAC's memory plan."""

    def __init__(self) -> None:
        super().__init__()
        self.cls = nn.Linear(DIM, CLASSES)

    def forward(self, ids, y):
        x = self.embed(ids)
        x = x + self.attn(self.ln(x))
        picked = torch.where(torch.arange(x.shape[1]) % 5 == 1)[0]
        return F.cross_entropy(self.cls(x[:, picked].mean(1)), y)


class EosPool(LMBase):
    """BART's classifier: the hidden state at the last ``<eos>`` of each row, picked by a boolean mask
    (``x[ids == eos].view(B, -1, D)[:, -1]``), a size that depends on the data (once an internal crash:
    the reshape read its size from the lowering's trace)."""

    def __init__(self) -> None:
        super().__init__()
        self.cls = nn.Linear(DIM, CLASSES)

    def forward(self, ids, y):
        ids = ids.clone()
        ids[:, -1] = 2  # every row ends with <eos> (token 2), as BART's tokenizer makes it
        ids[:, ids.shape[1] // 3] = 2
        x = self.embed(ids)
        x = x + self.attn(self.ln(x))
        pooled = x[ids == 2, :].view(x.shape[0], -1, DIM)[:, -1, :]
        return F.cross_entropy(self.cls(pooled), y)


BUILDERS.update(
    {
        "eos-pool": lambda s: EosPool(),
        "first-token-broadcast": lambda s: FirstTokenBroadcast(),
        "embedding-freq-scaled": lambda s: FreqScaledEmbedding(),
        **{f"embedding-max-norm-{k}": (lambda s, k=k: MaxNormEmbedding(k)) for k in ("plain", "tied", "twice", "bag")},
        "complex-output": lambda s: ComplexOutput(),
        "circular-pad": lambda s: CircularPad(),
        "attention-dropout": lambda s: AttentionDropout(written=False),
        "written-dropout": lambda s: AttentionDropout(written=True),
        "selected-positions": lambda s: SelectedPositions(),
    }
)
NAMES = list(BUILDERS)


# --- found by the fifth round of held-out probes: each once silently wrong or a crash -------------


class LeftPadFinfo(LMBase):
    """Left padding and a causal mask as Hugging Face builds them (additive ``finfo(fp32).min``), mean
    pooled over every position, pads included: the pad rows, every key masked by a finite value,
    attend uniformly and their gradients reach the loss.

    Once silently wrong: ring merged those rows' blocks through log-sum-exps that had lost ``log(n)``
    (SDPA form), and written out the attention became SDPA, whose fused backward gives such rows n
    times the program's gradient (written form)."""

    def __init__(self, written: bool) -> None:
        super().__init__()
        self.written = written
        self.cls = nn.Linear(DIM, CLASSES)

    def forward(self, ids, y):
        B, S = ids.shape
        pos = torch.arange(S)
        pad = (pos[None] < S // 3) & (torch.arange(B)[:, None] == 0)  # row 0 left-padded
        allowed = (pos[None, :] <= pos[:, None])[None] & ~pad[:, None, :]
        mask = torch.zeros(B, 1, S, S).masked_fill(~allowed[:, None], torch.finfo(torch.float32).min)
        x = self.embed(ids)
        q, k, v = self.attn.heads(self.ln(x))
        if self.written:
            a = (q @ k.transpose(-1, -2) / math.sqrt(HD) + mask).softmax(-1) @ v
        else:
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.attn.out(a.transpose(1, 2).reshape(B, S, DIM))
        return F.cross_entropy(self.cls(x.mean(1)), y)


class Landmarks(LMBase):
    """Nystrom attention: segment means of q and k as landmarks, three softmaxes chained through them.

    Once a gloo abort at P=3: the landmark attention (its length not the sequence's) was taken as a
    ring site and split unevenly, and the ranks exchanged pieces of different sizes."""

    def __init__(self, landmarks: int = 3) -> None:
        super().__init__()
        self.n = landmarks

    def forward(self, ids):
        x = self.embed(ids)
        B, S, _ = x.shape
        q, k, v = self.attn.heads(self.ln(x))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        ql, kl = (t.reshape(B, HEADS, self.n, S // self.n, HD).mean(3) for t in (q, k))
        k1 = (q @ kl.transpose(-1, -2)).softmax(-1)
        k2 = (ql @ kl.transpose(-1, -2)).softmax(-1)
        k3 = (ql @ k.transpose(-1, -2)).softmax(-1)
        o = a + k1 @ (k2 @ (k3 @ v))
        return self.lm_loss(x + self.attn.out(o.transpose(1, 2).reshape(B, S, DIM)), ids)


class WideValueHeads(LMBase):
    """MLA-style SDPA: value heads twice as wide as query and key heads.

    Once a crash under ring: its fused block kernel takes one head size."""

    def __init__(self) -> None:
        super().__init__()
        self.qk = nn.Linear(DIM, 2 * DIM)
        self.v = nn.Linear(DIM, 2 * DIM)
        self.o = nn.Linear(2 * DIM, DIM)

    def forward(self, ids):
        x = self.embed(ids)
        B, S, _ = x.shape
        q, k = self.qk(self.ln(x)).view(B, S, 2, HEADS, HD).permute(2, 0, 3, 1, 4)
        v = self.v(x).view(B, S, HEADS, 2 * HD).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.lm_loss(x + self.o(a.transpose(1, 2).reshape(B, S, 2 * DIM)), ids)


class ThreeDimAttention(LMBase):
    """SDPA on 3-D ``[batch * heads, S, d]`` q/k/v, as code written before 4-D SDPA calls it: causal,
    or (``bias``) with a 3-D additive bias of one slope per batch-times-head entry. Once refused
    ("q has 3 dims but layout 'BHSD' of sdpa expects 4")."""

    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.bias = bias

    def forward(self, ids):
        x = self.embed(ids)
        B, S, _ = x.shape
        q, k, v = (t.reshape(B * HEADS, S, HD) for t in self.attn.heads(self.ln(x)))
        if self.bias:
            pos = torch.arange(S)
            slopes = torch.arange(1, B * HEADS + 1, dtype=x.dtype).view(-1, 1, 1) / (B * HEADS)
            mask = torch.where(pos[None, :] <= pos[:, None], -(pos[:, None] - pos[None, :]) * slopes, float("-inf"))
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        a = a.view(B, HEADS, S, HD).transpose(1, 2).reshape(B, S, DIM)
        return self.lm_loss(x + self.attn.out(a), ids)


BUILDERS.update({"sdpa-3d": lambda s: ThreeDimAttention(False), "sdpa-3d-bias": lambda s: ThreeDimAttention(True)})


class HeadBias3d(LMBase):
    """4-D SDPA with a 3-D ``[H, S, S]`` additive mask (SDPA broadcasts it over the batch): causal
    ``-inf`` fills plus a learned per-head distance slope. Ring and hybrid once refused it (a mask
    they took as 2-D or 4-D only)."""

    def __init__(self) -> None:
        super().__init__()
        self.slopes = nn.Parameter(torch.linspace(0.1, 0.4, HEADS).view(HEADS, 1, 1))

    def forward(self, ids):
        x = self.embed(ids)
        B, S, _ = x.shape
        q, k, v = self.attn.heads(self.ln(x))
        pos = torch.arange(S)
        dist = (pos[:, None] - pos[None, :]).to(x.dtype)
        mask = torch.where(dist >= 0, -dist * self.slopes, float("-inf"))
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.lm_loss(x + self.attn.out(a.transpose(1, 2).reshape(B, S, DIM)), ids)


BUILDERS["head-bias-3d"] = lambda s: HeadBias3d()


class ClampNoGrad(LMBase):
    """Writes autograd does not record into tensors that require grad (``autosp.straight_through``):
    later reads see the written values, eager's gradient flows on as if the writes had not happened.

    ``clamp``: an activation clamped in place under ``torch.no_grad()`` (once a silently wrong
    gradient, the lowered graph taking the clamp's derivative; then refused). ``setitem``: tokens
    zeroed and a slice scaled through indexing under ``no_grad``. ``param-data``: a parameter clamped
    through ``.data`` in the forward, before its use (Gemma-3n's AltUp; once refused), which must
    hold the clamped values after the call. ``view-read-after``: a view that requires grad, taken
    before the write and read after it: refused (its history is not the tensor's).
    """

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.coef = nn.Linear(DIM, DIM, bias=False)
        with torch.no_grad():
            self.coef.weight.mul_(40.0)  # well past the clamp

    def forward(self, ids):
        if self.kind == "param-data":
            self.coef.weight.data.clamp_(-0.2, 0.2)
        x = self.embed(ids)
        x = x + self.attn(self.ln(x))
        if self.kind == "clamp":
            with torch.no_grad():
                x.clamp_(-0.5, 0.5)
        elif self.kind == "setitem":
            with torch.no_grad():
                x[ids == 3] = 0.0
                x[:, :2] *= 0.5
        elif self.kind == "view-read-after":
            first = x[:, :1]
            with torch.no_grad():
                x.mul_(0.5)
            x = x + first
        return self.lm_loss(x + self.coef(x), ids)


BUILDERS.update({f"act-{k}-no-grad": (lambda s, k=k: ClampNoGrad(k)) for k in ("clamp", "setitem", "view-read-after")})
BUILDERS["param-data-clamp"] = lambda s: ClampNoGrad("param-data")


class GradientHooks(LMBase):
    """Gradient hooks (``Tensor.register_hook``) on activations, none of them token-wise.

    ``order``: two hooks on one value that do not commute (a clamp, then the mean over the sequence
    taken out), the value also read before they are registered (that gradient reaches them too);
    ``captured``: a hook scaled by a tensor computed from the value itself (detached) and normalised
    by the largest gradient along the sequence; ``checkpointed``: a norm-scaled hook inside a
    ``torch.utils.checkpoint``ed layer. Once a crash while lowering ("cannot register a hook on a
    tensor that doesn't require gradient"); run on a rank's shard they would compute other values.
    ``module``: a module's full backward hook (the attention's input gradient norm-scaled) and a
    backward pre-hook (the mean over the sequence taken out of the head's output gradient); once an
    ``UnboundLocalError`` from Dynamo's nested graph breaks."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.mlp = nn.Linear(DIM, DIM)
        if kind == "module":
            self.attn.register_full_backward_hook(lambda m, gin, gout: (gin[0] / (gin[0].norm() + 1e-6), *gin[1:]))
            self.head.register_full_backward_pre_hook(lambda m, gout: (gout[0] - gout[0].mean(1, keepdim=True),))

    def layer(self, x):
        h = x + self.attn(self.ln(x))
        if self.kind == "checkpointed":
            h.register_hook(lambda g: g / (g.norm() + 1e-6))
        return h

    def forward(self, ids):
        x = self.embed(ids)
        if self.kind == "checkpointed":
            x = torch.utils.checkpoint.checkpoint(self.layer, x, use_reentrant=False)
        else:
            x = self.layer(x)
        if self.kind == "order":
            y = self.mlp(x)
            x.register_hook(lambda g: (g * 3).clamp(-2e-3, 2e-3))
            x.register_hook(lambda g: g - g.mean(1, keepdim=True))
            x = x + y
        if self.kind == "captured":
            scale = self.mlp(x).detach().abs().mean()
            x.register_hook(lambda g: g * scale / (g.abs().amax(1, keepdim=True) + 1e-6))
        return self.lm_loss(x, ids)


HOOKS = ("order", "captured", "checkpointed", "module")
BUILDERS.update({f"hook-{k}": (lambda s, k=k: GradientHooks(k)) for k in HOOKS})


BUILDERS.update(
    {
        "leftpad-finfo": lambda s: LeftPadFinfo(written=False),
        "leftpad-finfo-written": lambda s: LeftPadFinfo(written=True),
        "landmarks": lambda s: Landmarks(),
        "wide-value-heads": lambda s: WideValueHeads(),
    }
)


class SetOrder(LMBase):
    """Branches computed in the order of a set, as HF Gemma-3 and Gemma-4 compute their rotary tables
    ``for layer_type in set(config.layer_types)``: the order follows Python's string hashes, which
    differ per process unless ``PYTHONHASHSEED`` is set, so per rank. Here the order is the rank's
    own (reversed on odd ranks), so that every launch has the ranks disagree. Each branch reads a
    table buffer and a projection of its own (lifted as graph inputs in the order used: the same
    shapes, so buckets of gradients in the trace's order would sum the wrong ones) and attends (its
    collectives, the same shapes on both branches, in the trace's order would pair the wrong ones).
    ``dropout``: each branch draws a dropout mask, so the ranks draw in another order: other programs.
    """

    KINDS = ("sliding", "full")

    def __init__(self, seq: int, dropout: bool) -> None:
        super().__init__()
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
        self.order = self.KINDS if rank % 2 == 0 else self.KINDS[::-1]
        self.dropout = dropout
        self.proj = nn.ModuleDict({k: nn.Linear(DIM, DIM) for k in self.KINDS})
        self.mix = nn.ModuleDict({k: Attn() for k in self.KINDS})
        for i, k in enumerate(self.KINDS):
            self.register_buffer(f"{k}_table", torch.linspace(0.5 + i, 1.5 + i, 2 * seq)[:, None] * torch.ones(DIM))

    def forward(self, ids):
        x = self.embed(ids)
        h, branch = self.ln(x), {}
        for kind in self.order:
            y = self.proj[kind](h) * getattr(self, f"{kind}_table")[: ids.shape[1]]
            if self.dropout:
                y = F.dropout(y, 0.1, training=self.training)
            branch[kind] = self.mix[kind](y)
        return self.lm_loss(x + branch["sliding"] + 0.5 * branch["full"], ids)


BUILDERS["set-order"] = lambda s: SetOrder(s, dropout=False)
BUILDERS["set-order-dropout"] = lambda s: SetOrder(s, dropout=True)


def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))


@torch.compiler.nested_compile_region
def _region(ln: nn.Module, attn: nn.Module, mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    x = x + attn(ln(x))
    return x + mlp(x)


class Regions(LMBase):
    """Blocks called through one ``torch.compiler.nested_compile_region`` (torch traces the body once:
    an ``invoke_subgraph`` op per call, each block's weights its operands), attention inside. AutoSP's
    lowering could not trace the op; the body is inlined at each call."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"ln": nn.LayerNorm(DIM), "attn": Attn(), "mlp": _mlp()}) for _ in range(2)
        )

    def forward(self, ids):
        x = self.embed(ids)
        for b in self.blocks:
            x = _region(b["ln"], b["attn"], b["mlp"], x)
        return self.lm_loss(x, ids)


class FunctorchInside(LMBase):
    """``torch.func`` transforms inside the model (a penalty or curvature term): a ``vjp`` and a ``jvp``
    of an MLP, and ``grad`` of a norm of it, on the sequence-sharded activations. Dynamo inlines
    them as functorch levels, which functionalization could not trace (an internal assert)."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = _mlp()

    def forward(self, ids):
        x = self.embed(ids)
        h = self.ln(x)
        y, vjp = torch.func.vjp(self.mlp, h)
        (gh,) = vjp(torch.ones_like(y))
        _, tangent = torch.func.jvp(self.mlp, (h,), (gh,))
        penalty = torch.func.grad(lambda t: self.mlp(t).square().sum())(h)
        x = x + self.attn(y) + 0.1 * tangent + 0.01 * penalty
        return self.lm_loss(x, ids)


BUILDERS["nested-regions"] = lambda s: Regions()
BUILDERS["functorch-inside"] = lambda s: FunctorchInside()
NAMES = list(BUILDERS)


def _rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


class FeatureReductions(LMBase):
    """Reductions along features, token by token: cosine attention (F.normalize of q and k, a vector
    norm over the head dim), a router's max and argmax over experts and a lookup of the chosen
    expert's vector (``experts[pick]``), a per-token log-sum-exp z-loss, a norm written with var/std
    over the hidden dim, a running max over heads; and Cohere's and GLM's rotary on interleaved pairs,
    ``stack((-x2, x1), -1).flatten(-2)`` on q and k; the token loss over ``logits.permute(0, 2, 1)``
    (classes on dim 1, as sequence-tagging code writes it; once gathered the logits whole)."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, 4)
        self.experts = nn.Parameter(torch.randn(4, DIM) * 0.1)
        self.scale = nn.Parameter(torch.tensor(3.0))
        self.cls = nn.Linear(DIM, CLASSES)

    def forward(self, ids, y):
        x = self.embed(ids)
        B, S, _ = x.shape
        q, k, v = self.attn.heads(self.ln(x))
        q, k = F.normalize(q, dim=-1) * self.scale, F.normalize(k, dim=-1)
        angle = torch.arange(S)[:, None] * 0.1 ** torch.arange(HD // 2).repeat_interleave(2)
        q, k = (t * angle.cos() + _rotate_pairs(t) * angle.sin() for t in (q, k))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn.out(a.transpose(1, 2).reshape(B, S, DIM))
        logits = self.router(x)
        top, pick = logits.max(-1)
        x = x + top[..., None] * self.experts[pick] + self.experts[logits.argmax(-1)]
        h = (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, keepdim=True, unbiased=False) + 1e-5)
        h = h * x.std(-1, keepdim=True).detach()
        h = h + torch.cummax(h.view(B, S, HEADS, HD), dim=2).values.reshape(B, S, DIM)
        z = torch.logsumexp(self.head(h), dim=-1).pow(2).mean()
        tagged = F.cross_entropy(self.head(h).permute(0, 2, 1)[..., :-1], ids[:, 1:], reduction="sum") / (B * S)
        return tagged + 1e-3 * z + F.cross_entropy(self.cls((h.amax(-1, keepdim=True) * h).mean(1)), y)


BUILDERS["feature-reductions"] = lambda s: FeatureReductions()
NAMES = list(BUILDERS)
