"""Pool task for test_discarded_outputs: a compiled program whose caller differentiates only some outputs.

A parameter that feeds only outputs the caller gives no gradient keeps ``.grad`` None in eager;
compiled, it must too (``autosp.discarded_outputs``). Each program runs a sequence of backward
passes, each through a chosen set of outputs, accumulating into ``.grad`` between them as a
training loop with gradient accumulation does; after each one every rank records every
parameter's gradient (``None`` included), and the test compares them with single-device eager.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn as nn
from cases import caches_off
from probe_models import DIM, VOCAB, Attn

import autosp

# (outputs whose sum of squares is the loss, whether .grad is set to None before this backward)
PLAN: list[tuple[tuple[str, ...], bool]] = [
    (("hidden",), True),
    (("pooled",), False),  # accumulates onto the first backward's gradients
    (("hidden", "aux"), True),
    (("hidden_view",), True),  # a view of an output: AOT autograd makes it outside the compiled graph
    (("mask_count",), True),  # an integer output: no parameter gets a gradient at all
]


class Backbone(nn.Module):
    """An encoder returning what backbones return: the hidden states, a pooled [CLS] vector and more."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.attn = Attn(causal=False)
        self.pooler = nn.Linear(DIM, DIM)
        self.aux_head = nn.Linear(DIM, 2)
        self.shared = nn.Linear(DIM, DIM)  # feeds both the hidden states and the pooled vector

    def forward(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        x = self.embed(ids)
        hidden = x + self.attn(x)
        hidden = hidden + self.shared(hidden)
        return {
            "hidden": hidden,
            "pooled": torch.tanh(self.pooler(hidden[:, 0])),
            "aux": self.aux_head(hidden).mean(1),
            "hidden_view": hidden.view(-1),
            "mask_count": (ids > VOCAB // 2).sum(),
        }


def bert() -> nn.Module:
    from transformers import BertConfig, BertModel

    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=DIM,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=2 * DIM,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        attn_implementation="sdpa",
    )
    return BertModel(config)


def _loss(out: Any, names: tuple[str, ...]) -> torch.Tensor:
    total = torch.zeros(())
    for name in names:
        value = out[name] if isinstance(out, dict) else getattr(out, name)
        value = value.full_tensor() if hasattr(value, "full_tensor") else value  # outputs="sharded"
        total = total + (value.float().square().sum() if value.is_floating_point() else value.float())
    return total


def _steps(model: nn.Module, call: Any, plan: list[tuple[tuple[str, ...], bool]]) -> list[dict[str, Any]]:
    params = model._orig_mod if hasattr(model, "_orig_mod") else model
    record = []
    for names, fresh in plan:
        if fresh:
            params.zero_grad(set_to_none=True)
        out = call(model)
        loss = _loss(out, names)
        if loss.requires_grad:
            loss.backward()
        record.append(
            {
                "loss": loss.detach(),
                "grads": {n: None if p.grad is None else p.grad.clone() for n, p in params.named_parameters()},
            }
        )
    # torch.autograd.grad reports an unreached parameter as None (allow_unused) in eager: compiled too.
    out = call(model)
    names = [n for n, _ in params.named_parameters()]
    grads = torch.autograd.grad(_loss(out, plan[0][0]), list(params.parameters()), allow_unused=True)
    record.append({"loss": torch.zeros(()), "grads": dict(zip(names, grads))})
    return record


def run_discarded(
    rank: int, world: int, variant: str, backend: str, outputs: str = "whole"
) -> dict[str, dict[str, Any]]:
    """Per program: the eager record and the compiled one, on this rank (``outputs``: ``autosp.compile``'s)."""
    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (2, 12 + world))
    results = {}
    programs = {
        "backbone": (Backbone, lambda m: m(ids), PLAN),
        "bert": (bert, lambda m: m(input_ids=ids), [(("last_hidden_state",), True), (("pooler_output",), False)]),
    }
    for name, (make, call, plan) in programs.items():
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = make()
        ref = _steps(copy.deepcopy(model), call, plan)
        compiled = autosp.compile(model, variant=variant, backend=backend, outputs=outputs)
        with caches_off():
            got = _steps(compiled, call, plan)
        results[name] = {"ref": ref, "got": got, "sites": sum(len(r.sites) for r in compiled.autosp_reports)}
    return results
