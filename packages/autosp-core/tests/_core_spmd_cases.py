"""Functions that run on every rank of a ``harness.run_spmd`` launch (module-level, so spawn can pickle them)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

COLLECTIVES = (
    "all_gather",
    "all_gather_into_tensor",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "barrier",
    "new_group",
    "new_subgroups",
)


def _error_of(fn) -> tuple[str, str] | None:
    """(type, message) of what ``fn`` raises; Dynamo's wrapper is unwrapped to the backend's error."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        inner = getattr(e, "inner_exception", None)
        if inner is not None:
            return (f"{type(e).__name__}>{type(inner).__name__}", str(inner))
        return (type(e).__name__, str(e))
    return None


def config_errors(rank: int, world: int) -> dict[str, Any]:
    """Every bad-input case on a real process group; collectives are trapped to prove none ran.

    Except one: an error raised while a graph compiles is agreed on by one all-reduce over the SP
    ranks (``autosp.compile_agreement``), let through and recorded per case.
    """
    import os

    import autosp
    from autosp.registry import get_registry, reset_registry
    from autosp.testing.models import Config, GPT2Like

    # Ring must look "not installed" whether or not autosp-ring is: block it.
    os.environ["AUTOSP_BLOCK_PLUGINS"] = "autosp-ring"
    reset_registry()
    # A variant that splits the sequence into equal pieces only (a plugin's case; ring is blocked here).
    variants = get_registry().variants
    variants["equal-pieces"] = dataclasses.replace(variants["ulysses"], name="equal-pieces", uneven=False)
    # A plugin's attention op (it may read its head index): Ulysses does not pad its heads.
    get_registry().attention["heads_op"] = autosp.AttentionSpec("heads_op", targets=(_HEADS_OP, _HEADS_OP.default))
    called: list[str] = []
    saved = {name: getattr(dist, name) for name in COLLECTIVES}

    def trap(name):
        def collective(*args, **kwargs):
            called.append(name)
            if name == "all_reduce":
                return saved[name](*args, **kwargs)
            raise RuntimeError(f"collective {name} called")

        return collective

    for name in COLLECTIVES:
        setattr(dist, name, trap(name))
    torch.manual_seed(0)
    gpt = GPT2Like(Config(heads=4, layers=1))
    results: dict[str, Any] = {}
    try:
        ids8 = torch.randint(0, 96, (1, 8))
        ids9 = torch.randint(0, 96, (1, 9))
        cases = {
            "unknown_variant": lambda: autosp.compile(gpt, variant="nope"),
            "ring_variant": lambda: autosp.compile(gpt, variant="ring"),
            "sp_not_dividing": lambda: autosp.compile(gpt, sp_size=2),
            "sp_too_large": lambda: autosp.compile(gpt, sp_size=world + 1),
            "bad_backend": lambda: autosp.compile(gpt, sp_size=world, backend="tvm"),
            "group_and_smaller_sp": lambda: autosp.compile(gpt, sp_size=1, group=dist.group.WORLD),
            "seq_not_divisible": lambda: autosp.compile(gpt, backend="aot_eager", variant="equal-pieces")(ids8, ids8),
            # SDPA and FlexAttention pad heads the ranks do not split; a plugin's op is refused.
            "heads_not_divisible": lambda: autosp.compile(_plugin_heads, backend="aot_eager")(torch.randn(1, 4, 9, 4)),
            "two_lengths": lambda: autosp.compile(_two_lengths, backend="aot_eager", dynamic=True)(
                torch.randn(1, 9, 12), torch.randn(1, 6, 12)
            ),
            "made_in_model": lambda: autosp.compile(_cls_token_encoder, backend="aot_eager", variant="equal-pieces")(
                torch.randn(1, 12, 3, 3)
            ),
        }
        collectives: dict[str, list[str]] = {}
        for key, case in cases.items():
            torch._dynamo.reset()
            results[key] = _error_of(case)
            collectives[key] = called[:]
            called.clear()
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
    results["collectives_called"] = collectives

    # Dynamic shapes (as after a recompile on a new length): runs for real once it compiles.
    torch._dynamo.reset()
    model = GPT2Like(Config(dim=48, heads=6, layers=1))

    def dynamic():
        loss, _ = autosp.compile(model, backend="aot_eager", dynamic=True)(ids9, ids9)
        results["dynamic_loss"] = (loss.item(), model(ids9, ids9)[0].item())

    results["dynamic"] = _error_of(dynamic)
    return results


def _cls_token_encoder(image):
    """Self-attention over 3x3 patches plus a [CLS] token: 10 tokens, a length no input has."""
    x = image.flatten(2).transpose(1, 2)  # [1, 9, 12]
    x = torch.cat([x.new_ones(1, 1, 12), x], 1)  # [1, 10, 12]
    q = x.view(1, 10, 3, 4).transpose(1, 2)
    return torch.nn.functional.scaled_dot_product_attention(q, q, q)[:, :, 0].sum()


@torch.library.custom_op("autosp_spmd_cases::heads_op", mutates_args=())
def _heads_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.scaled_dot_product_attention(q, k, v)


@_heads_op.register_fake
def _(q, k, v):
    return torch.empty_like(q)


_HEADS_OP = torch.ops.autosp_spmd_cases.heads_op


def _plugin_heads(q):
    """A plugin's attention op over 4 heads."""
    return _heads_op(q, q, q).sum()


def _two_lengths(x, memory):
    """Self-attention over two sequences of different lengths in one graph."""
    q = x.view(1, x.shape[1], 3, 4).transpose(1, 2)
    kv = memory.view(1, memory.shape[1], 3, 4).transpose(1, 2)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    return sdpa(q, q, q).sum() + sdpa(kv, kv, kv).sum()
