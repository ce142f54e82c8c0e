"""Who reads a node in a lowered graph, leaving out what make_fx leaves behind for autograd."""

from __future__ import annotations

import torch

aten = torch.ops.aten


def live_users(node: torch.fx.Node) -> list[torch.fx.Node]:
    """``node``'s users but the ``detach`` nodes nothing reads (make_fx's bookkeeping after softmax)."""
    return [u for u in node.users if not (u.target is aten.detach.default and not u.users)]


__all__ = ["live_users"]
