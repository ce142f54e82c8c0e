"""Bytes AutoSP's collectives allocate inside their ops, besides their results.

The liveness walk sees a collective as one node allocating its result. Its implementation
(``autosp.sharding.collectives``) allocates more: a send buffer, receive pieces, contiguous
copies. They are allocations like any other (CUDA's ``memory_allocated`` and the CPU allocator's
profiler events count them), so the walk adds them: ``transient`` bytes are live together with
the result at the op's highest moment and freed when it returns; ``held`` bytes are allocated by
an exchange's start and freed by its wait once the data has arrived, before the wait lays out its
result (the start keeps its send buffer referenced while the data is in flight). Each term names the buffer of the implementation it stands for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import sympy
from torch import fx

from autosp.sharding import collectives as C
from autosp_tools.plan.sizes import shape_exprs, tensor_bytes

# Ops whose result is the tensor they were given: a functional collective's wait.
ALIAS_OPS = frozenset({"_c10d_functional.wait_tensor.default"})
WAIT_OPS: frozenset[Any] = getattr(C, "WAIT_OPS", frozenset())
ZERO = sympy.Integer(0)


@dataclass(frozen=True)
class InOp:
    transient: sympy.Expr = ZERO
    held: sympy.Expr = ZERO


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _contiguous(val: Any) -> bool:
    try:
        return bool(val.is_contiguous())
    except Exception:  # noqa: BLE001 - a symbolic stride it cannot decide: the common case
        return True


def _movedim_copies(shape: list[sympy.Expr], src: int, dst: int) -> bool:
    """Whether ``t.movedim(src, dst).contiguous()`` copies a contiguous ``t`` of ``shape``: it does not
    when the dimensions of more than one element keep their order (size-1 dimensions have no stride)."""
    n = len(shape)
    if n == 0:
        return False
    order = list(range(n))
    order.insert(dst % n, order.pop(src % n))
    kept = [d for d in order if shape[d] != 1]
    return kept != sorted(kept)


def buffers(node: fx.Node, comm_backend: str) -> InOp:
    """What an AutoSP collective allocates besides its result; nothing for any other node.

    ``comm_backend``: the process group's backend ("nccl" on GPUs, "gloo" on CPU), which picks
    ``reduce_scatter``'s implementation.
    """
    if node.op != "call_function" or node.target not in C.COLLECTIVE_OPS:
        return InOp()
    name = node.target._opname
    x = _val(node.args[0])
    inp, out = tensor_bytes(x), tensor_bytes(_val(node))
    x_shape = shape_exprs(x)
    if name == "all_to_all":
        if any(u.target in WAIT_OPS for u in node.users):
            # all_to_all_start: ``send`` (x.new_empty of the input's size) stays in _PENDING until the
            # wait has waited; its result is the receive buffer itself.
            return InOp(held=inp)
        # One op that exchanges and lays out: its send copy and receive buffer, then the cat (its result).
        return InOp(transient=2 * out)
    if name == "all_gather":
        dim = int(node.args[1])  # type: ignore[arg-type]
        # moved: x.movedim(dim, 0).contiguous(); pieces: one per rank, together the result's size (even
        # split); the communication's flat buffer (gloo and NCCL flatten a list all-gather) exists
        # before the cat, while only moved and the pieces do, so it adds nothing to the highest moment.
        moved = inp if not _contiguous(x) or _movedim_copies(x_shape, dim, 0) else ZERO
        full_shape = shape_exprs(_val(node))
        full_shape = [full_shape[dim], *(s for d, s in enumerate(full_shape) if d != dim)]
        # full: the cat of the pieces, a separate buffer when moving the dimension back copies.
        full = out if _movedim_copies(full_shape, 0, dim) else ZERO
        return InOp(transient=moved + out + full)
    if name == "reduce_scatter":
        dim = int(node.args[1])  # type: ignore[arg-type]
        sizes = node.args[2]
        even = not isinstance(sizes, (list, tuple)) or len({str(s) for s in sizes}) == 1
        copy = ZERO if _contiguous(x) else inp
        if comm_backend == "nccl" and even:
            # moved: x.movedim(dim, 0).contiguous(); out: reduce_scatter_tensor's output, separate from
            # the result when moving the dimension back copies.
            moved = inp if copy != ZERO or _movedim_copies(x_shape, dim, 0) else ZERO
            out_shape = shape_exprs(_val(node))
            out_shape = [out_shape[dim], *(s for d, s in enumerate(out_shape) if d != dim)]
            return InOp(transient=moved + (out if _movedim_copies(out_shape, 0, dim) else ZERO))
        # gloo: total = x.contiguous().clone() (the whole input) is all-reduced, the result a slice's copy.
        return InOp(transient=copy + inp)
    if name == "all_reduce":
        # x.contiguous() copies a strided input before the clone that is the result.
        return InOp(transient=ZERO if _contiguous(x) else inp)
    return InOp()


def is_alias(node: fx.Node) -> bool:
    return node.op == "call_function" and str(node.target) in ALIAS_OPS


__all__ = ["ALIAS_OPS", "WAIT_OPS", "InOp", "buffers", "is_alias"]
