"""Fake tensors held as graph constants: a compile-time value leaked into the program.

A pass or rule that runs an op on a fake tensor (a node's ``meta["val"]``) while a graph is traced
gets it recorded as a constant, which the compiled program then takes as an input on every call:
unused on CPU, so nothing fails there, while Inductor on CUDA reads its data pointer and crashes.
A program compiled on fake parameters (``autosp-plan``) holds fake constants of its own: only
constants that were not in the program before count.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake


def constants(gm: torch.fx.GraphModule) -> list[Any]:
    """The values ``gm``'s ``get_attr`` nodes read."""
    return [getattr(gm, str(n.target), None) for n in gm.graph.nodes if n.op == "get_attr"]


def fake_constants(gm: torch.fx.GraphModule, known: Iterable[Any] = ()) -> list[str]:
    """``"name (used by ...)"`` for every ``get_attr`` of ``gm`` holding a fake tensor not in ``known``."""
    seen = {id(x) for x in known}
    found = []
    for node in gm.graph.nodes:
        value = getattr(gm, str(node.target), None) if node.op == "get_attr" else None
        if is_fake(value) and id(value) not in seen:
            users = ", ".join(f"{u.name} ({u.target})" for u in node.users) or "nothing"
            found.append(f"{node.target} (used by {users})")
    return found


__all__ = ["constants", "fake_constants"]
