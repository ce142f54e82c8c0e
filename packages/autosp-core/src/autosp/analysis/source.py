"""Where in the user's code a graph node comes from, for messages and reports."""

from __future__ import annotations

import os

import torch

# Frames inside torch itself (flex_attention's wrapper, nn.functional) are never what the user wrote.
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def user_line(node: torch.fx.Node) -> str:
    """The innermost ``File "...", line N, in f`` of the node's stack trace outside torch, or ""."""
    trace = node.meta.get("stack_trace") or ""
    frames = [ln.strip() for ln in trace.splitlines() if ln.strip().startswith("File")]
    outside = [ln for ln in frames if _TORCH_DIR not in ln]
    return (outside or frames or [""])[-1]


__all__ = ["user_line"]
