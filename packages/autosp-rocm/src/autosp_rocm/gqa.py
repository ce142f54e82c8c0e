"""GQA on ROCm: hand SDPA k/v it can run with a fused kernel, never the silent math fallback.

After the SP exchange, Ulysses calls SDPA on this rank's heads with ``enable_gqa=True`` when k/v
crossed with fewer heads than q (``autosp.unrepeat_kv``). ROCm's memory-efficient kernel takes no
GQA; when the flash kernel cannot take the call either (fp32, head dim over 256), PyTorch runs
the math path, whose [S, S] scores defeat long-context training. Then this pass repeats k/v on
the rank, after the exchange (so the all-to-all still moves only the kv heads), and the call
reaches the memory-efficient kernel. The values are the same: ``enable_gqa`` means exactly this
repeat.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from autosp import Pass, Stage
from autosp.context import CompileContext
from autosp.hardware import HardwareProfile, dtype_name

SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def needs_repeat(profile: HardwareProfile, q: torch.Tensor, k: torch.Tensor, enable_gqa: bool) -> bool:
    """Whether only a kernel without GQA support can run this call as it is."""
    if not enable_gqa or k.shape[-3] == q.shape[-3]:
        return False
    head_dim, dtype = q.shape[-1], dtype_name(q.dtype)
    return (
        profile.kernel_for(head_dim, dtype, gqa=True) is None
        and profile.kernel_for(head_dim, dtype, gqa=False) is not None
    )


class RepeatKVForKernel(TorchFunctionMode):
    """Rewrites SDPA calls with GQA into repeated k/v where ``profile``'s kernels need that."""

    def __init__(self, profile: HardwareProfile, counts: Counter) -> None:
        super().__init__()
        self.profile, self.counts = profile, counts

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is F.scaled_dot_product_attention:
            bound = {**dict(zip(SDPA_ARGS, args)), **kwargs}
            q, k, v = bound["query"], bound["key"], bound["value"]
            if needs_repeat(self.profile, q, k, bool(bound.get("enable_gqa", False))):
                r = q.shape[-3] // k.shape[-3]
                bound["key"] = k.repeat_interleave(r, dim=-3)
                bound["value"] = v.repeat_interleave(r, dim=-3)
                bound["enable_gqa"] = False
                self.counts["repeated"] += 1
                return func(**bound)
        return func(*args, **kwargs)


def wrap_attention_rule(gm: torch.fx.GraphModule, ctx: CompileContext) -> None:
    counts: Counter = Counter()
    assert ctx.variant is not None  # the pass applies only with SP, where a variant is set
    rule = ctx.variant.attention_rule

    def attention_rule(sp: Any, node: torch.fx.Node, site: Any, args: tuple, kwargs: dict) -> Any:
        with RepeatKVForKernel(ctx.hardware, counts):
            return rule(sp, node, site, args, kwargs)

    ctx.variant = dataclasses.replace(ctx.variant, attention_rule=attention_rule)
    ctx.put_state(counts)


def report(gm: torch.fx.GraphModule, ctx: CompileContext) -> None:
    counts = ctx.get_state(Counter)
    if counts and counts["repeated"]:
        ctx.report.notes.append(
            f"rocm: {counts['repeated']} attention call(s) get k/v repeated after the exchange: on "
            f"{ctx.hardware.name} only the memory-efficient kernel runs them, and it takes no GQA"
        )


def _applies(ctx: CompileContext) -> bool:
    return ctx.sp and ctx.hardware.vendor == "amd"


GQA_PASS = Pass(
    "rocm.gqa_kernels",
    Stage.GRAPH,
    wrap_attention_rule,
    requires=("autosp.lower",),
    before=("autosp.shard",),
    applies=_applies,
    doc="repeat k/v after the exchange where ROCm's only fused kernel for the call takes no GQA",
)
GQA_REPORT = Pass(
    "rocm.gqa_report",
    Stage.GRAPH,
    report,
    requires=("autosp.shard", "rocm.gqa_kernels"),
    applies=_applies,
    doc="report the attention calls whose k/v were repeated",
)

__all__ = ["GQA_PASS", "GQA_REPORT", "RepeatKVForKernel", "needs_repeat", "wrap_attention_rule"]
