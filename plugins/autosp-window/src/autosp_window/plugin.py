"""Declares the op to AutoSP: SP variants then find it as an attention site.

The spec's name, ``sliding_window``, is the contract: variants that know it
(autosp-ring) read the window from the 4th argument; Ulysses calls the op on head shards.
"""

from __future__ import annotations

import torch

import autosp_window.op  # noqa: F401 - defines torch.ops.autosp_window.*
from autosp import AttentionSpec, hookimpl

_OP = torch.ops.autosp_window.sliding_window_attention

SPEC = AttentionSpec(
    name="sliding_window",
    targets=(_OP, _OP.default),
    layout="BHSD",
    qkv=(0, 1, 2),
    mask=None,
    causal=None,
    signature=("q", "k", "v", "window"),
    pads_heads=True,  # each head from its own q, k, v; no head index read: heads may travel padded
)


@hookimpl
def autosp_register_attention(register):
    register(SPEC)


__all__ = ["SPEC"]
