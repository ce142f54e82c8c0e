"""Sizes of fake tensors as expressions in the symbolic sequence length."""

from __future__ import annotations

from typing import Any

import sympy
import torch


def expr(x: Any) -> sympy.Expr:
    if isinstance(x, torch.SymInt):
        return sympy.sympify(x.node.expr)
    return sympy.Integer(int(x))


def shape_exprs(val: Any) -> list[sympy.Expr]:
    return [expr(s) for s in val.shape] if isinstance(val, torch.Tensor) else []


def tensor_bytes(val: Any) -> sympy.Expr:
    """Bytes of a fake tensor, or of the tensors in a tuple of them (0 for anything else)."""
    if isinstance(val, torch.Tensor):
        numel = sympy.Integer(1)
        for s in val.shape:
            numel *= expr(s)
        return numel * val.element_size()
    if isinstance(val, (tuple, list)):
        return sympy.Add(*[tensor_bytes(v) for v in val]) if val else sympy.Integer(0)
    return sympy.Integer(0)


__all__ = ["expr", "shape_exprs", "tensor_bytes"]
