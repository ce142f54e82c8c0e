"""Small random programs over ``[B, S, ...]`` tensors, for whole-program fuzzing of AutoSP.

A program is a *spec*: a plain JSON-able dict, so a failing one can be written out literally
as a regression test. ``build(spec)`` turns it into the same ``nn.Module`` and inputs in any
process (parameters from ``spec["seed"]``, the inputs of each call from it too). The vocabulary
is what real models do along the sequence: token-wise linear/norm/activation, residuals,
attention (causal, masks built from ``arange``, padding, RoPE, GQA), shifts/rolls/slices,
reductions and selections, cumsum, and losses over tokens and over the batch.

Spec keys: ``seed``, ``batch``, ``seq``, ``dim``, ``heads``, ``input`` ("ids" [B, S], "float"
[B, S, D], or "float_sbd" [S, B, D]), ``proj`` (False: a float input is used without an input layer),
``body`` (a list of ops, each ``{"op": name, ...options}``, applied to ``x`` in order) and
``losses`` (a list of heads, each reading ``x`` after ``tap`` body ops, -1 meaning the end;
the program returns their weighted sum).
"""

from __future__ import annotations

from typing import Any

import torch
from fuzz_ops import (
    ACTS,
    BODY,
    CLASSES,
    LOSSES,
    MASKS,
    POOL_HEADS,
    POOLS,
    SEQ_OPS,
    TENSOR_MASKS,
    VOCAB,
    Attention,
    PosEmbed,
    Spec,
    length_after,
)
from hypothesis import assume
from hypothesis import strategies as st
from torch import nn

INPUTS = ("inp", "labels", "y", "w", "pos", "keep", "ref", "doc", "pos_ids")


def lengths(spec: Spec) -> list[int]:
    """The sequence length of ``x`` before the body and after each body op."""
    out = [spec["seq"]]
    for op in spec["body"]:
        out.append(length_after(op, out[-1]))
    return out


class FuzzProgram(nn.Module):
    def __init__(self, spec: Spec) -> None:
        super().__init__()
        d = spec["dim"]
        self.ids, self.seq_first = spec["input"] == "ids", spec["input"] == "float_sbd"
        # A float input enters through a linear layer, or (``"proj": False``) as the activations themselves.
        self.inp = nn.Embedding(VOCAB, d) if self.ids else nn.Linear(d, d) if spec.get("proj", True) else nn.Identity()
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
        for head, loss in zip(spec["losses"], self.losses):
            if head.get("tied") and self.ids:  # GPT-2 style: the LM head's weight is the embedding's
                loss.tie(self.inp)

    def forward(self, inp, labels, y, w, pos, keep, ref, doc, pos_ids) -> torch.Tensor:  # noqa: ANN001 - see INPUTS
        batch = {"labels": labels, "y": y, "w": w, "pos": pos, "keep": keep, "ref": ref, "doc": doc, "pos_ids": pos_ids}
        x = self.inp(inp.transpose(0, 1) if self.seq_first else inp)
        xs = [x]
        for layer in self.body:
            x = layer(x, batch)
            xs.append(x)
        total = None
        for tap, coef, loss in zip(self.taps, self.coefs, self.losses):
            term = coef * loss(xs[tap], batch)
            total = term if total is None else total + term
        return total


# Two calls per program: the second reuses the compiled graph on new inputs, and gradients accumulate.
STEPS = 2


def make_inputs(spec: Spec, step: int = 0) -> tuple[torch.Tensor, ...]:
    """The program's inputs for one call, in ``INPUTS`` order, from ``spec["seed"] + 1 + 1000 * step``."""
    g = torch.Generator().manual_seed(spec["seed"] + 1 + 1000 * step)
    b, s, d = spec["batch"], spec["seq"], spec["dim"]
    if spec["input"] == "ids":
        inp = torch.randint(0, VOCAB, (b, s), generator=g)
    else:
        inp = torch.randn(b, s, d, generator=g)
    if spec["input"] == "float_sbd":  # Megatron's layout: sequence first
        inp = inp.transpose(0, 1).contiguous()
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
    # Packed documents: ids rise at random boundaries, positions restart at each one.
    starts = torch.rand(b, s, generator=g) < 0.15
    starts[:, 0] = False
    doc = starts.long().cumsum(dim=1)
    idx = torch.arange(s).expand(b, s)
    pos_ids = idx - torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values
    return inp, labels, y, w, pos, keep, ref, doc, pos_ids


Batches = list[tuple[torch.Tensor, ...]]


def build(spec: Spec) -> tuple[FuzzProgram, Batches]:
    """The program (parameters from ``spec["seed"]``) and its inputs for each of the ``STEPS`` calls."""
    torch.manual_seed(spec["seed"])
    return FuzzProgram(spec), [make_inputs(spec, step) for step in range(STEPS)]


def run_steps(model: nn.Module, params: nn.Module, batches: Batches) -> dict[str, Any]:
    """A forward and backward per batch; the losses and every parameter's accumulated gradient (or None)."""
    losses = []
    for inputs in batches:
        loss = model(*inputs)
        loss.backward()
        losses.append(loss.detach().clone())
    return {
        "losses": torch.stack(losses),
        "grads": {n: None if p.grad is None else p.grad.detach().clone() for n, p in params.named_parameters()},
    }


def reference(spec: Spec) -> dict[str, Any]:
    """Single-device eager losses and gradients."""
    model, batches = build(spec)
    return run_steps(model, model, batches)


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
    return st.fixed_dictionaries(
        {
            "op": st.just("attention"),
            "mask": st.sampled_from(masks),
            "kv_heads": st.sampled_from([heads, heads // 2, 1]),
            "residual": st.booleans(),
            "norm": st.sampled_from(["none", "layer", "rms"]),
            "rope": st.booleans(),
            "fused": st.booleans(),
            "positions": st.sampled_from(["arange", "input"]),
            "gqa": st.sampled_from(["repeat", "sdpa"]),
        }
    )


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
        op("seq_stat", kind=st.sampled_from(["gate_mean", "center", "scale_amax", "global_norm"])),
        op("pos_embed"),
        op("mask_tail", k=st.integers(1, 3)),
        op("conv"),
        op("manual_attention", causal=st.booleans()),
        op("linear_attention", kind=st.sampled_from(["tril", "decay", "diagonal"])),
    )
    groups = {
        "tokenwise": tokenwise,
        "attention": attention_ops(heads, masks),
        "seq": op("seq", kind=st.sampled_from(SEQ_OPS)),
        "along_sequence": along_sequence,
    }
    return st.sampled_from(list(groups)).flatmap(groups.__getitem__)


def loss_heads(tap: st.SearchStrategy[int]) -> st.SearchStrategy[Spec]:
    common = {"tap": tap, "coef": st.sampled_from([1.0, 0.5])}
    shift = st.sampled_from(["next", "prev"])
    by_kind = {
        "pool": st.fixed_dictionaries(
            {"kind": st.just("pool"), "pool": st.sampled_from(POOLS), "head": st.sampled_from(POOL_HEADS), **common}
        ),
        "lm": st.fixed_dictionaries(
            {
                "kind": st.just("lm"),
                "reduction": st.sampled_from(["mean", "sum"]),
                "smoothing": st.sampled_from([0.0, 0.1]),
                "z_loss": st.booleans(),
                "tied": st.booleans(),
                "shift": shift,
                **common,
            }
        ),
        "seq_logprob": st.fixed_dictionaries({"kind": st.just("seq_logprob"), "shift": shift, **common}),
        "token_mse": st.fixed_dictionaries({"kind": st.just("token_mse"), **common}),
        "grpo": st.fixed_dictionaries(
            {"kind": st.just("grpo"), "norm": st.sampled_from(["sequence", "token"]), "shift": shift, **common}
        ),
    }
    # Batch-level losses after a sequence reduction are where SP goes wrong most: half of the draws.
    kinds = ["pool", "lm", "pool", "seq_logprob", "pool", "token_mse", "pool", "grpo"]
    return st.sampled_from(kinds).flatmap(by_kind.__getitem__)


@st.composite
def programs(
    draw: st.DrawFn, world: int, masks: tuple[str, ...] = MASKS, max_body: int = 5, uneven: bool = False
) -> Spec:
    """A random program whose sequence length is a multiple of ``2 * world``, with at least one attention.

    ``uneven``: a length ``world`` does not divide instead (pieces one token apart).
    """
    # 6 heads: Ulysses pads them at P=4 (and 4 or 8 heads at P=3); kv heads 3 are repeated first.
    heads = draw(st.sampled_from([4, 8, 6]))
    dim = heads * draw(st.sampled_from([4, 8]))
    seq = 2 * world * draw(st.integers(1, max(1, 32 // (2 * world))))
    if uneven:
        seq = world * draw(st.integers(1, max(1, 32 // world))) + draw(st.integers(1, world - 1))
    body = draw(st.lists(body_ops(heads, masks), max_size=max_body - 1))
    at = draw(st.integers(0, len(body)))
    body.insert(at, draw(attention_ops(heads, masks)))
    spec: Spec = {
        "seed": draw(st.integers(0, 2**16)),
        "batch": draw(st.integers(1, 3)),
        "seq": seq,
        "dim": dim,
        "heads": heads,
        "input": draw(st.sampled_from(["ids", "float", "float_sbd"])),
        "body": body,
        "proj": draw(st.booleans()),
    }
    assume(min(lengths(spec)) >= 3)
    # The first loss reads the end of the program; a second may tap any point (a multi-task or auxiliary loss).
    first = draw(loss_heads(st.just(-1)))
    extra = draw(st.lists(loss_heads(st.integers(0, len(body))), max_size=1))
    spec["losses"] = [first, *extra]
    return spec


__all__ = [
    "INPUTS",
    "MASKS",
    "STEPS",
    "TENSOR_MASKS",
    "FuzzProgram",
    "Spec",
    "build",
    "describe",
    "lengths",
    "make_inputs",
    "programs",
    "reference",
    "run_steps",
]
