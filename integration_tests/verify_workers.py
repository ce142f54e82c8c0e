"""The worker of test_verify.py: everything ``autosp.verify`` does at sp=2, in one spawn.

A module-level function, since spawned processes import it by name. The deliberately broken
rule is patched last, and undone before returning.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

import autosp
from autosp.errors import ConfigError, VerificationError
from autosp.sharding import collectives
from autosp.testing.models import Config, GPT2Like, LlamaLike, MeanPoolClassifier

VERIFY = sys.modules["autosp.verify"]  # ``autosp.verify`` is the function; its module holds the hook


def _batch(seq: int = 16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 96, (2, seq), generator=gen)
    labels = ids.clone()
    labels[0, 2:6] = -100  # ignored tokens, all on rank 0's half
    return ids, labels, torch.tensor([0, 2])


def _pool() -> MeanPoolClassifier:
    torch.manual_seed(0)
    return MeanPoolClassifier(Config(layers=1))


def _untouched(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> bool:
    return all(p.grad is None and torch.equal(p, before[n]) for n, p in model.named_parameters())


def _raises(fn: Any, *args: Any, **kwargs: Any) -> BaseException | None:
    try:
        fn(*args, **kwargs)
    except (ConfigError, VerificationError) as e:
        return e
    return None


def correct_and_bad_input(rank: int, ids: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
    torch.manual_seed(0)
    llama = LlamaLike(Config(layers=1))
    before = {n: p.detach().clone() for n, p in llama.named_parameters()}
    rng = torch.get_rng_state()
    report = autosp.verify(llama, ids, labels, backend="aot_eager")
    out: dict[str, Any] = {
        "llama": report,
        "llama_untouched": _untouched(llama, before),
        "rng_untouched": torch.equal(rng, torch.get_rng_state()),
        "params": sum(1 for _ in llama.parameters()),
    }
    # Different inputs, or differently seeded parameters, on the two ranks: refused before anything runs.
    e = _raises(autosp.verify, llama, (ids + rank) % 96, labels)
    out["different_inputs"] = str(e) if isinstance(e, ConfigError) else repr(e)
    torch.manual_seed(rank)
    e = _raises(autosp.verify, MeanPoolClassifier(Config(layers=1)), ids, torch.tensor([0, 2]))
    out["different_params"] = str(e) if isinstance(e, ConfigError) else repr(e)
    return out


def first_call_only(ids: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
    calls: list[int] = []
    real = VERIFY._verify

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    VERIFY._verify = counting
    os.environ["AUTOSP_VERIFY"] = "1"
    try:
        model = _pool()
        compiled = autosp.compile(model, backend="aot_eager")
        loss = compiled(ids, y)
        after_first = len(calls)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        compiled(ids, y)
        after_second = len(calls)
    finally:
        VERIFY._verify = real
        del os.environ["AUTOSP_VERIFY"]
    reference = _pool()
    ref_loss = reference(ids, y)
    ref_loss.backward()
    return {
        "calls": (after_first, after_second),
        "graphs": len(compiled.autosp_reports),
        "loss": (loss.detach(), ref_loss.detach()),
        "grads": (grads, {n: p.grad for n, p in reference.named_parameters()}),
    }


def broken_rule(ids: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
    """A Partial value used without its all-reduce: what a wrong sharding rule does, silently."""
    hits: list[int] = []
    real = collectives.all_reduce

    def dropped(x: torch.Tensor, group_name: str, grad_replicated: bool) -> torch.Tensor:
        hits.append(1)
        return x.clone()

    collectives.all_reduce = dropped
    try:
        e = _raises(autosp.verify, _pool(), ids, y, backend="aot_eager")
        os.environ["AUTOSP_VERIFY"] = "1"
        model = _pool()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        user_calls: list[bool] = []
        model.register_forward_pre_hook(lambda m, args: user_calls.append(m is model))
        compiled = autosp.compile(model, backend="aot_eager")
        armed = [_raises(compiled, ids, y) for _ in range(2)]  # stays armed: fails again, never runs
    finally:
        collectives.all_reduce = real
        os.environ.pop("AUTOSP_VERIFY", None)
    return {
        "hits": len(hits),
        "error": e if isinstance(e, VerificationError) else repr(e),
        "armed": [type(a).__name__ for a in armed],
        "user_ran": any(user_calls),
        "untouched": _untouched(model, before),
    }


def run_all(rank: int, world: int) -> dict[str, Any]:
    ids, labels, y = _batch()
    out = correct_and_bad_input(rank, ids, labels)
    out["first_call"] = first_call_only(ids, y)
    out["broken"] = broken_rule(ids, y)
    torch.manual_seed(0)  # GPT2Like returns its logits too: DTensors with outputs="sharded"
    out["sharded"] = autosp.verify(
        GPT2Like(Config(heads=4, layers=1)), ids, labels, backend="aot_eager", outputs="sharded"
    )
    return out
