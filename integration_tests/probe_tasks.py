"""The eleventh round of held-out probes: what a training script does around the model, not inside attention.

Random numbers drawn in the forward (MAE's shuffle by ``argsort(rand)``, BERT's masking done in the
model, noise and a Bernoulli token drop); the caller's own tensors (ids and a mask written in place,
a float input whose gradient is read); a sequence-first ``nn.TransformerEncoderLayer``; statistics
over the sequence (``std``, ``var_mean``, ``F.normalize``, a norm over two dims, ``cumprod``,
``logcumsumexp``, ``x.sum(1) / x.size(1)``); sentence-transformers' masked mean and max pooling;
``nn.EmbeddingBag``; pooling into segments by ``scatter_add``; one encoder called on two inputs; a
LoRA adapter on a frozen model; tied input and output embeddings; Python reading values
(``.item()`` deciding a branch, ``.tolist()`` lengths, boolean indexing, graph breaks); and Hugging
Face's task heads: question answering (a cross-entropy whose classes are the sequence's positions,
start positions past the end clamped), token classification, multiple choice (a [B, choices, S] input).

``probe_models.build`` and ``probe_models.inputs`` find these by name.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from probe_models import CLASSES, DIM, HD, HEADS, VOCAB, Attn, LMBase

# --- random numbers drawn in the forward ---------------------------------------------------------


class MAEMasking(nn.Module):
    """MAE: a random 1/4 of the tokens kept by ``argsort(rand)``, encoded, unshuffled among mask tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.randn(1, 64, DIM) * 0.02)
        self.enc, self.dec = Attn(causal=False), Attn(causal=False)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, DIM))
        self.pred = nn.Linear(DIM, DIM)

    def forward(self, ids):
        x = self.embed(ids) + self.pos[:, : ids.shape[1]]
        B, S, D = x.shape
        keep = S // 4
        shuffle = torch.argsort(torch.rand(B, S), dim=1)
        restore = torch.argsort(shuffle, dim=1)
        kept = torch.gather(x, 1, shuffle[:, :keep, None].expand(-1, -1, D))
        full = torch.cat([kept + self.enc(kept), self.mask_token.expand(B, S - keep, D)], 1)
        full = torch.gather(full, 1, restore[:, :, None].expand(-1, -1, D))
        out = self.pred(full + self.dec(full))
        masked = torch.gather(torch.cat([torch.zeros(B, keep), torch.ones(B, S - keep)], 1), 1, restore)
        return (((out - self.embed(ids).detach()) ** 2).mean(-1) * masked).sum() / masked.sum()


class MLMInside(LMBase):
    """BERT's masking done in the model: ``rand < 0.3`` picks the tokens to hide and to predict."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = Attn(causal=False)

    def forward(self, ids):
        hidden = torch.rand(ids.shape) < 0.3
        x = self.embed(ids.masked_fill(hidden, 0))
        x = x + self.attn(self.ln(x))
        return F.cross_entropy(self.head(x).view(-1, VOCAB), ids.masked_fill(~hidden, -100).view(-1))


class NoiseInjection(LMBase):
    def forward(self, ids):
        x = self.embed(ids)
        x = x + 0.1 * torch.randn_like(x)
        x = x + self.attn(self.ln(x))
        kept = torch.bernoulli(torch.full(x.shape[:2], 0.8))[..., None]
        return self.lm_loss(x * kept, ids)


# --- the caller's tensors ------------------------------------------------------------------------


class InputMutation(LMBase):
    """Writes into the caller's ids and float mask, which the caller sees after the call."""

    def forward(self, ids, mask):
        ids.clamp_(max=VOCAB - 8)
        mask.mul_(0.5).add_(0.5)
        x = self.embed(ids) * mask[..., None]
        x = x + self.attn(self.ln(x))
        return self.lm_loss(x, ids)


class InputGrad(LMBase):
    """Called on embeddings that require grad (saliency, adversarial training read their gradient)."""

    def forward(self, x):
        x = x + self.attn(self.ln(x))
        return self.head(x).logsumexp(-1).mean()


# --- layouts and statistics over the sequence ------------------------------------------------------


class SeqFirst(nn.Module):
    """``nn.TransformerEncoderLayer(batch_first=False)``: [S, B, D], the sequence on dim 0."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layer = nn.TransformerEncoderLayer(DIM, HEADS, 2 * DIM, dropout=0.0, batch_first=False)
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, ids, y):
        x = self.embed(ids).transpose(0, 1)
        causal = nn.Transformer.generate_square_subsequent_mask(x.shape[0])
        return F.cross_entropy(self.head(self.layer(x, src_mask=causal, is_causal=True).mean(0)), y)


class SeqStats(LMBase):
    def forward(self, ids, y):
        x = self.embed(ids)
        x = x + self.attn(self.ln(x))
        var, mean = torch.var_mean(x, dim=1, correction=1)
        feats = x.std(dim=1) + var + mean + F.normalize(x, dim=1).sum(1)
        feats = feats + torch.linalg.vector_norm(x, dim=(1, 2))[:, None] + torch.cumprod(torch.sigmoid(x), 1).mean(1)
        feats = feats + torch.logcumsumexp(x, dim=1)[:, -1] + x.sum(1) / x.size(1) * x.shape[1] ** -0.5
        return F.cross_entropy(feats[:, :CLASSES], y)


class MaskedPool(LMBase):
    """sentence-transformers: masked mean and max pooling, a token count, a cosine loss across the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = Attn(causal=False)
        self.cls = nn.Linear(2 * DIM, CLASSES)

    def forward(self, ids, mask):
        x = self.embed(ids)
        B, S, _ = x.shape
        bias = torch.zeros(B, 1, S, S).masked_fill(mask[:, None, None, :] == 0, float("-inf"))
        x = x + self.attn(self.ln(x), bias)
        m = mask.unsqueeze(-1).float()
        mean = (x * m).sum(1) / torch.clamp(m.sum(1), min=1e-9)
        top = x.masked_fill(m == 0, -1e9).max(1).values
        emb = torch.cat([mean, top], -1) * (torch.count_nonzero(mask, dim=1).float()[:, None] / S)
        a, b = F.normalize(emb, dim=-1), F.normalize(emb.flip(0), dim=-1)
        return (1 - (a * b).sum(-1)).mean() + self.cls(emb).logsumexp(-1).mean()


class EmbeddingBagPool(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(VOCAB, DIM, mode="mean")
        self.embed = nn.Embedding(VOCAB, DIM)
        self.attn = Attn()
        self.cls = nn.Linear(DIM, CLASSES)

    def forward(self, ids, y):
        x = self.embed(ids)
        x = x + self.attn(x)
        return F.cross_entropy(self.cls(self.bag(ids) + x.mean(1)), y)


class SegmentPool(LMBase):
    """Tokens pooled into the segments a per-token id names (``scatter_add`` over the sequence), broadcast back."""

    def forward(self, ids, seg):
        x = self.embed(ids)
        x = x + self.attn(self.ln(x))
        B, S, D = x.shape
        pooled = torch.zeros(B, 4, D).scatter_add(1, seg[..., None].expand(-1, -1, D), x)
        count = torch.zeros(B, 4).scatter_add(1, seg, torch.ones(B, S)).clamp(min=1)
        back = torch.gather(pooled / count[..., None], 1, seg[..., None].expand(-1, -1, D))
        return self.lm_loss(x + back, ids)


# --- weights shared, frozen, tied ---------------------------------------------------------------


class Siamese(LMBase):
    """One encoder on two inputs, an in-batch contrastive loss between their pooled vectors."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = Attn(causal=False)

    def encode(self, ids):
        x = self.embed(ids)
        return (x + self.attn(self.ln(x))).mean(1)

    def forward(self, ids, other):
        a, b = F.normalize(self.encode(ids), dim=-1), F.normalize(self.encode(other), dim=-1)
        return F.cross_entropy(a @ b.T / 0.05, torch.arange(a.shape[0]))


class LoRAFrozen(LMBase):
    def __init__(self) -> None:
        super().__init__()
        self.requires_grad_(False)
        self.a = nn.Parameter(torch.randn(DIM, 4) * 0.1)
        self.b = nn.Parameter(torch.randn(4, 3 * DIM) * 0.1)

    def forward(self, ids):
        x = self.embed(ids)
        h = self.ln(x)
        B, S, _ = x.shape
        q, k, v = (self.attn.qkv(h) + h @ self.a @ self.b).view(B, S, 3, HEADS, HD).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.lm_loss(x + self.attn.out(a.transpose(1, 2).reshape(B, S, DIM)), ids)


class Tied(LMBase):
    def __init__(self) -> None:
        super().__init__()
        self.head.weight = self.embed.weight

    def forward(self, ids):
        x = self.embed(ids)
        return self.lm_loss(x + self.attn(self.ln(x)), ids)


# --- Python reading values (graph breaks) -----------------------------------------------------------


class ItemBranch(LMBase):
    """``.item()`` of a value one rank holds (the last token) decides a branch; a count over every token scales."""

    def forward(self, ids):
        x = self.embed(ids)
        x = x + self.attn(self.ln(x))
        if x[:, -1].abs().max().item() > 0.5:
            x = x * 0.5
        return self.lm_loss(x + (ids == 3).sum().item() * 0.01, ids)


class GraphBreaks(LMBase):
    """Two explicit graph breaks; a pooled softmax over the sequence carried across the first."""

    def __init__(self) -> None:
        super().__init__()
        self.attn2 = Attn()

    def forward(self, ids):
        x = self.embed(ids)
        x = x + self.attn(self.ln(x))
        torch._dynamo.graph_break()
        x = x + self.attn2(x) + x.softmax(1).max(1).values[:, None]
        torch._dynamo.graph_break()
        return self.lm_loss(x, ids)


class TolistLengths(LMBase):
    """Per-row true lengths read in Python (``.tolist()``), each row's real tokens mean-pooled."""

    def forward(self, ids, mask):
        x = self.embed(ids)
        x = x + self.attn(self.ln(x))
        pooled = torch.stack([x[i, : int(n)].mean(0) for i, n in enumerate(mask.sum(1).tolist())])
        return self.lm_loss(x, ids) + pooled.pow(2).mean()


class BooleanSelect(LMBase):
    """``x[mask.bool()]``: the real tokens of every row, a size the data decides."""

    def forward(self, ids, mask):
        x = self.embed(ids)
        x = x + self.attn(self.ln(x))
        return self.lm_loss(x, ids) + x[mask.bool()].pow(2).mean()


# --- Hugging Face task heads -----------------------------------------------------------------------


def _hf_config(kind: str) -> object:
    import transformers as t

    common = dict(
        vocab_size=VOCAB,
        hidden_size=DIM,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        intermediate_size=2 * DIM,
        attn_implementation="sdpa",
    )
    if kind == "llama":
        return t.LlamaConfig(num_key_value_heads=2, max_position_embeddings=64, **common)
    if kind == "roberta":
        return t.RobertaConfig(max_position_embeddings=80, pad_token_id=1, **common)
    # BERT keeps its dropout (0.1, attention's too): drawn as on one device, the attention whole.
    return t.BertConfig(max_position_embeddings=64, **common)


class HFTask(nn.Module):
    """A Hugging Face task model; returns its loss and logits."""

    def __init__(self, task: str, kind: str) -> None:
        super().__init__()
        import transformers as t

        model_class = {
            "qa": {"bert": t.BertForQuestionAnswering, "llama": t.LlamaForQuestionAnswering},
            "token": {"roberta": t.RobertaForTokenClassification},
            "choice": {"bert": t.BertForMultipleChoice},
        }[task][kind]
        self.task = task
        self.m = model_class(_hf_config(kind))

    def forward(self, ids, *rest):
        if self.task == "qa":
            start, end, mask = rest
            out = self.m(input_ids=ids, attention_mask=mask, start_positions=start, end_positions=end)
            return out.loss, out.start_logits, out.end_logits
        labels, mask = rest
        out = self.m(input_ids=ids, attention_mask=mask, labels=labels)
        return out.loss, out.logits


TASKS: dict[str, Callable[[int], nn.Module]] = {
    "mae-masking": lambda s: MAEMasking(),
    "mlm-inside": lambda s: MLMInside(),
    "noise-injection": lambda s: NoiseInjection(),
    "input-mutation": lambda s: InputMutation(),
    "input-grad": lambda s: InputGrad(),
    "seq-first": lambda s: SeqFirst(),
    "seq-stats": lambda s: SeqStats(),
    "masked-pool": lambda s: MaskedPool(),
    "embedding-bag": lambda s: EmbeddingBagPool(),
    "segment-pool": lambda s: SegmentPool(),
    "siamese": lambda s: Siamese(),
    "lora-frozen": lambda s: LoRAFrozen(),
    "tied-weights": lambda s: Tied(),
    "item-branch": lambda s: ItemBranch(),
    "graph-breaks": lambda s: GraphBreaks(),
    "tolist-lengths": lambda s: TolistLengths(),
    "boolean-select": lambda s: BooleanSelect(),
    "hf-qa-bert": lambda s: HFTask("qa", "bert"),
    "hf-qa-llama": lambda s: HFTask("qa", "llama"),
    "hf-token-roberta": lambda s: HFTask("token", "roberta"),
    "hf-choice-bert": lambda s: HFTask("choice", "bert"),
}


def task_inputs(name: str, seq: int, batch: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(2, VOCAB, (batch, seq), generator=g)
    y = torch.randint(0, CLASSES, (batch,), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[0, seq - seq // 3 :] = 0  # right padding
    if name == "input-mutation":
        return ids, torch.rand(batch, seq, generator=g)
    if name == "input-grad":
        return (torch.randn(batch, seq, DIM, generator=g).requires_grad_(),)
    if name == "siamese":
        return ids, torch.randint(0, VOCAB, (batch, seq), generator=g)
    if name == "segment-pool":
        return ids, torch.sort(torch.randint(0, 4, (batch, seq), generator=g), dim=1).values
    if name in ("masked-pool", "tolist-lengths", "boolean-select"):
        return ids, mask
    if name.startswith("hf-qa"):
        # The second start lies past the end: HF clamps it to S, the ignored index.
        return ids, torch.tensor([3, seq + 5])[:batch], torch.tensor([seq - 2, 1])[:batch], mask
    if name == "hf-token-roberta":
        ids[0, seq - seq // 3 :] = 1  # the pad token, so RoBERTa's positions skip them
        labels = torch.randint(0, 2, (batch, seq), generator=g).masked_fill(mask == 0, -100)
        return ids, labels, mask
    if name == "hf-choice-bert":
        return torch.randint(2, VOCAB, (batch, 3, seq), generator=g), y % 3, torch.ones(batch, 3, seq, dtype=torch.long)
    if name in ("seq-first", "seq-stats", "embedding-bag"):
        return ids, y
    return (ids,)


__all__ = ["TASKS", "task_inputs"]
