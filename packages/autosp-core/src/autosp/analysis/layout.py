"""Whether a chain of layout ops moves every element where a plain reshape would.

``torch.einsum`` and hand-written permutes reach the lowered graph as chains of ``unsqueeze``,
``permute``, ``clone`` and ``view`` around a ``bmm``, with size-1 axes coming and going. Reading
such a chain op by op would be a pattern per spelling. Instead the chain is followed as a map of
indices: each axis of a value is a list of *atoms*, pieces of the source's axes, ``(source axis,
size, stride within that axis)`` from outer to inner. Permutes reorder axes, views regroup the
row-major sequence of atoms (splitting one where a new size cuts it), copies keep the map. Two
chains move every element alike exactly when their maps are equal, whatever the sizes (no tensor is
materialised, so a 128k-token score matrix costs nothing). Only concrete sizes are followed; a
broadcast, or a size that is symbolic, ends the check with "not known", and the caller keeps the
graph as written.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch

aten = torch.ops.aten

LAYOUT = frozenset(
    {
        aten.view.default,
        aten._unsafe_view.default,
        aten.reshape.default,
        aten.permute.default,
        aten.transpose.int,
        aten.unsqueeze.default,
        aten.squeeze.dim,
        aten.squeeze.dims,
        aten.squeeze.default,
        aten.clone.default,
        aten.contiguous.default,
        aten.expand.default,
        aten.alias.default,
    }
)
# Ops that change values elementwise but never move them: a cast, dropout's output.
ELEMENTWISE = frozenset({aten._to_copy.default, aten.native_dropout.default, operator.getitem})
_COPIES = frozenset({aten.clone.default, aten.contiguous.default, aten.alias.default}) | ELEMENTWISE
_VIEWS = frozenset({aten.view.default, aten._unsafe_view.default, aten.reshape.default})

Atom = tuple[int, int, int]  # (source axis, size, stride of this piece within that axis)
Layout = list[list[Atom]]


def chain_between(src: torch.fx.Node, dst: Any, through: frozenset = LAYOUT, limit: int = 16) -> list | None:
    """The ops from ``src`` (excluded) to ``dst``, each taking the one before as its first argument, or
    None when ``dst`` is not reached from ``src`` that way through ops in ``through``."""
    chain: list[torch.fx.Node] = []
    node = dst
    while node is not src:
        if not isinstance(node, torch.fx.Node) or node.op != "call_function" or node.target not in through:
            return None
        if node.target is operator.getitem and node.args[1] != 0:
            return None
        if len(chain) >= limit:
            return None
        chain.append(node)
        node = node.args[0]
    return chain[::-1]


def _concrete(x: Any) -> bool:
    if isinstance(x, (list, tuple)):
        return all(_concrete(y) for y in x)
    return not isinstance(x, (torch.fx.Node, torch.SymInt))


def static(node: Any) -> bool:
    """Whether ``node``'s value has concrete sizes (the map needs them)."""
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return isinstance(val, torch.Tensor) and _concrete(tuple(val.shape))


def _start(shape: tuple[int, ...]) -> Layout:
    return [[(d, n, 1)] if n != 1 else [] for d, n in enumerate(shape)]


def _size(axis: list[Atom]) -> int:
    return math.prod(a[1] for a in axis)


def _regroup(layout: Layout, sizes: list[int]) -> Layout | None:
    """The map after a view to ``sizes``: the row-major atoms cut into the new axes."""
    total = math.prod(_size(a) for a in layout)
    if sizes.count(-1) == 1:
        known = math.prod(s for s in sizes if s != -1)
        sizes = [total // known if s == -1 else s for s in sizes] if known else sizes
    if math.prod(sizes) != total:
        return None
    queue = [a for axis in layout for a in axis]
    out: Layout = []
    for n in sizes:
        axis: list[Atom] = []
        while n > 1:
            if not queue:
                return None
            d, s, inner = queue.pop(0)
            if s <= n:
                if n % s:
                    return None
                axis.append((d, s, inner))
                n //= s
            else:  # the atom is cut: its outer part ends this axis, its inner part starts the next
                if s % n:
                    return None
                axis.append((d, n, inner * (s // n)))
                queue.insert(0, (d, s // n, inner))
                n = 1
        out.append(axis)
    return None if queue else out


def _apply(layout: Layout, node: torch.fx.Node) -> Layout | None:
    t = node.target
    args: tuple[Any, ...] = tuple(node.args[1:])
    if t in _COPIES:
        return layout
    if not _concrete(args):
        return None
    n = len(layout)
    if t in _VIEWS:
        return _regroup(layout, list(args[0]))
    if t is aten.permute.default:
        return [layout[d % n] for d in args[0]]
    if t is aten.transpose.int:
        a, b = args[0] % n, args[1] % n
        out = list(layout)
        out[a], out[b] = out[b], out[a]
        return out
    if t is aten.unsqueeze.default:
        d = args[0] % (n + 1)
        return [*layout[:d], [], *layout[d:]]
    if t in (aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default):
        dims = set(range(n)) if not args else {d % n for d in (args[0] if isinstance(args[0], list) else [args[0]])}
        return [axis for i, axis in enumerate(layout) if not (i in dims and _size(axis) == 1)]
    if t is aten.expand.default:
        sizes = list(args[0])
        lead = len(sizes) - n
        if lead < 0 or any(s != 1 for s in sizes[:lead]):
            return None
        for axis, s in zip(layout, sizes[lead:]):
            if s not in (-1, _size(axis)):
                return None  # a broadcast: one element in several places, no index map
        return [*([[]] * lead), *layout]
    return None


def _canonical(layout: Layout) -> list[list[Atom]]:
    out = []
    for axis in layout:
        merged: list[Atom] = []
        for d, s, inner in axis:
            if merged and merged[-1][0] == d and merged[-1][2] == s * inner:
                merged[-1] = (d, merged[-1][1] * s, inner)
            else:
                merged.append((d, s, inner))
        out.append(merged)
    return out


def moves_like_reshape(src: torch.fx.Node, chain: list[torch.fx.Node], shape: tuple) -> bool:
    """Whether ``chain`` run on ``src`` puts every element where ``src.reshape(shape)`` does."""
    if not static(src) or not _concrete(shape):
        return False
    start = _start(tuple(int(d) for d in src.meta["val"].shape))
    layout: Layout | None = start
    for node in chain:
        layout = _apply(layout, node) if layout is not None else None
    want = _regroup(start, [int(s) for s in shape])
    if layout is None or want is None:
        return False
    return [_size(a) for a in layout] == [_size(a) for a in want] and _canonical(layout) == _canonical(want)


__all__ = ["ELEMENTWISE", "LAYOUT", "chain_between", "moves_like_reshape", "static"]
