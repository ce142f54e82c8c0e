"""Small models written the way people write them, not for AutoSP.

None of them knows about sequence parallelism: positions come from ``arange`` inside the
model, masks are built from positions, labels are shifted inside. The tests of every
package and the tools' built-in model use these, so "the Llama-style model" means one
thing everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass
class Config:
    vocab: int = 96
    dim: int = 64
    heads: int = 4
    kv_heads: int = 2
    layers: int = 2
    hidden: int = 128
    max_len: int = 256
    window: int | None = None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class LlamaBlock(nn.Module):
    def __init__(self, c: Config) -> None:
        super().__init__()
        self.c = c
        hd = c.dim // c.heads
        self.q = nn.Linear(c.dim, c.heads * hd, bias=False)
        self.k = nn.Linear(c.dim, c.kv_heads * hd, bias=False)
        self.v = nn.Linear(c.dim, c.kv_heads * hd, bias=False)
        self.o = nn.Linear(c.dim, c.dim, bias=False)
        self.gate = nn.Linear(c.dim, c.hidden, bias=False)
        self.up = nn.Linear(c.dim, c.hidden, bias=False)
        self.down = nn.Linear(c.hidden, c.dim, bias=False)
        self.n1, self.n2 = RMSNorm(c.dim), RMSNorm(c.dim)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        B, S, _ = x.shape
        c = self.c
        hd = c.dim // c.heads
        h = self.n1(x)
        q = self.q(h).view(B, S, c.heads, hd).transpose(1, 2)  # [B, H, S, D]
        k = self.k(h).view(B, S, c.kv_heads, hd).transpose(1, 2)
        v = self.v(h).view(B, S, c.kv_heads, hd).transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        a = self.attention(q, k, v, mask)  # [B, H, S, D]
        x = x + self.o(a.transpose(1, 2).reshape(B, S, c.dim))
        h = self.n2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Causal (or ``mask``ed) attention of ``[B, H, S, D]`` q on un-repeated ``[B, kv, S, D]`` k/v.

        A subclass overrides this alone to try another attention op in the same block.
        """
        B, kv, S, hd = k.shape
        heads = q.shape[1]
        # repeat_kv as HF writes it: the variants must find GQA through this.
        k = k[:, :, None].expand(B, kv, heads // kv, S, hd).reshape(B, heads, S, hd)
        v = v[:, :, None].expand(B, kv, heads // kv, S, hd).reshape(B, heads, S, hd)
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class LlamaLike(nn.Module):
    """RoPE from arange, RMSNorm, SwiGLU, GQA via repeat_kv, loss with labels shifted inside.

    ``init_std`` re-initialises every linear and embedding weight from N(0, init_std) after
    PyTorch's default init (HF Llama uses 0.02), so the model trains like HF's.
    """

    inv_freq: torch.Tensor

    def __init__(self, c: Config | None = None, init_std: float | None = None) -> None:
        super().__init__()
        c = Config() if c is None else c
        self.c = c
        self.embed = nn.Embedding(c.vocab, c.dim)
        self.blocks = nn.ModuleList(LlamaBlock(c) for _ in range(c.layers))
        self.norm = RMSNorm(c.dim)
        self.head = nn.Linear(c.dim, c.vocab, bias=False)
        hd = c.dim // c.heads
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd)), persistent=False)
        if init_std is not None:
            for m in self.modules():
                if isinstance(m, (nn.Linear, nn.Embedding)):
                    nn.init.normal_(m.weight, std=init_std)

    def forward(
        self, input_ids: torch.Tensor, labels: torch.Tensor, padding_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        B, S = input_ids.shape
        pos = torch.arange(S, device=input_ids.device)
        freqs = torch.outer(pos.float(), self.inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos()[None, None], emb.sin()[None, None]
        mask = None
        if self.c.window is not None or padding_mask is not None:
            mask = pos[None, :] <= pos[:, None]
            if self.c.window is not None:
                mask = mask & (pos[:, None] - pos[None, :] < self.c.window)
            mask = mask[None, None]
            if padding_mask is not None:
                mask = mask & padding_mask[:, None, None, :].bool()
                # A fully padded query row would make SDPA return NaN; let it see itself.
                mask = mask | torch.eye(S, dtype=torch.bool, device=input_ids.device)
        x = self.embed(input_ids)
        # The angles in fp32 (as HF does), applied in the activations' dtype: bf16 q/k stay bf16.
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        for block in self.blocks:
            x = block(x, cos, sin, mask)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits[:, :-1].reshape(-1, self.c.vocab), labels[:, 1:].reshape(-1), ignore_index=-100)


class GPT2Block(nn.Module):
    causal = True  # a subclass with False is a bidirectional encoder block

    def __init__(self, c: Config) -> None:
        super().__init__()
        self.c = c
        self.ln1, self.ln2 = nn.LayerNorm(c.dim), nn.LayerNorm(c.dim)
        self.qkv = nn.Linear(c.dim, 3 * c.dim)
        self.proj = nn.Linear(c.dim, c.dim)
        self.fc = nn.Linear(c.dim, 4 * c.dim)
        self.out = nn.Linear(4 * c.dim, c.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(D, dim=2)
        q, k, v = (t.view(B, S, self.c.heads, D // self.c.heads).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        x = x + self.proj(a.transpose(1, 2).contiguous().view(B, S, D))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT2Like(nn.Module):
    """Learned positions, LayerNorm, GELU MLP, tied head; returns (loss, logits)."""

    def __init__(self, c: Config | None = None) -> None:
        super().__init__()
        c = Config() if c is None else c
        self.c = c
        self.wte = nn.Embedding(c.vocab, c.dim)
        self.wpe = nn.Embedding(c.max_len, c.dim)
        self.blocks = nn.ModuleList(GPT2Block(c) for _ in range(c.layers))
        self.ln = nn.LayerNorm(c.dim)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, S = idx.shape
        pos = torch.arange(0, S, dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln(x), self.wte.weight)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), targets[:, 1:].reshape(-1))
        return loss, logits


class MeanPoolClassifier(nn.Module):
    """A reduction over the sequence: mean-pooled tokens and the last token feed a classifier."""

    def __init__(self, c: Config | None = None) -> None:
        super().__init__()
        c = Config() if c is None else c
        self.c = c
        self.embed = nn.Embedding(c.vocab, c.dim)
        self.block = GPT2Block(c)
        self.cls = nn.Linear(2 * c.dim, 3)

    def forward(self, idx: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = self.block(self.embed(idx))
        feats = torch.cat([x.mean(dim=1), x[:, -1]], dim=-1)
        return F.cross_entropy(self.cls(feats), y)


class SdpaThenFlex(nn.Module):
    """Causal SDPA in one layer, FlexAttention in the next: a slope per global head (``score_mod``),
    GQA when ``kv_heads < heads``, and the block mask passed in (made outside the compiled call).

    ``lse=True`` also feeds Flex's log-sum-exp per head into the residual stream, so its value and
    gradient count. ``contiguous=True`` copies q, k and v before Flex: torch 2.13's CPU Flex kernel
    (Inductor) fails to compile on a view of a matmul's output, on one device too."""

    def __init__(
        self, kv_heads: int, vocab: int = 50, dim: int = 32, heads: int = 4, lse: bool = False, contiguous: bool = False
    ) -> None:
        super().__init__()
        self.kv_heads, self.heads, self.head_dim = kv_heads, heads, dim // heads
        self.contiguous = contiguous
        self.from_lse = nn.Linear(heads, dim) if lse else None
        self.emb = nn.Embedding(vocab, dim)
        self.qkv1 = nn.Linear(dim, 3 * dim)
        self.q2 = nn.Linear(dim, dim)
        self.kv2 = nn.Linear(dim, 2 * kv_heads * self.head_dim)
        self.out = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor, block_mask: Any, labels: torch.Tensor) -> torch.Tensor:
        from torch.nn.attention.flex_attention import flex_attention

        x = self.emb(idx)
        b, s, d = x.shape
        h, hd, kvh = self.heads, self.head_dim, self.kv_heads
        q, k, v = self.qkv1(x).view(b, s, 3, h, hd).permute(2, 0, 3, 1, 4)
        x = x + F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        q = self.q2(x).view(b, s, h, hd).transpose(1, 2)
        k, v = self.kv2(x).view(b, s, 2, kvh, hd).permute(2, 0, 3, 1, 4)
        if self.contiguous:
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()

        def head_slope(score, b, h, q_idx, kv_idx):
            return score - (h + 1) * 0.05 * (q_idx - kv_idx).abs()  # a different slope per global head

        gqa = kvh != h
        if self.from_lse is not None:
            y, lse = flex_attention(
                q, k, v, score_mod=head_slope, block_mask=block_mask, enable_gqa=gqa, return_lse=True
            )
            x = x + self.from_lse(lse.transpose(1, 2))
        else:
            y = flex_attention(q, k, v, score_mod=head_slope, block_mask=block_mask, enable_gqa=gqa)
        x = x + self.out(y.transpose(1, 2).reshape(b, s, d))
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def hf_causal_lm(
    kind: Literal["llama", "qwen2"] = "llama",
    *,
    vocab: int = 96,
    dim: int = 64,
    hidden: int = 128,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    max_len: int = 256,
) -> PreTrainedModel:
    """A randomly initialised ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` from a tiny config built in code.

    SDPA attention (AutoSP finds attention through ``F.scaled_dot_product_attention``), no KV
    cache, untied head; seed the RNG before calling for reproducible weights. Needs transformers.
    """
    import transformers

    sizes: dict[str, Any] = dict(
        vocab_size=vocab,
        hidden_size=dim,
        intermediate_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_len,
        tie_word_embeddings=False,
        use_cache=False,
        attn_implementation="sdpa",
    )
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**sizes))
    if kind == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**sizes))
    raise ValueError(f"unknown HF model kind {kind!r}; use 'llama' or 'qwen2'")


__all__ = [
    "Config",
    "GPT2Block",
    "GPT2Like",
    "LlamaBlock",
    "LlamaLike",
    "MeanPoolClassifier",
    "RMSNorm",
    "SdpaThenFlex",
    "hf_causal_lm",
    "rope",
]
