"""Test a sharding rule against the unsharded op, with P ranks simulated in one process.

``check_op(op, args, placements=..., world=P)`` is the rule-level oracle for rule and
plugin authors.  For one aten op it

1. runs the op on whole inputs in eager (the reference), values and gradients;
2. builds the one-node graph of the op (``meta["val"]`` from fake tensors, node named ``"op"``);
3. on each of P ranks (threads joined by torch's threaded process group, so the real
   collectives of ``autosp.sharding.collectives`` run) gives every tensor input its local
   piece for its placement -- ``Replicate``: the whole value; ``Shard``: this rank's
   intervals (``slice_to``); ``HeadShard``: this rank's slice of the head dim; ``Partial``:
   a random summand ``c_r * x + n_r`` with ``sum c_r = 1`` and ``sum n_r = 0`` -- traces
   ``evaluate`` and ``finish`` under ``make_fx`` on fake tensors, as ``autosp.shard`` does,
   and runs the traced program on the pieces;
4. checks that every rank's (finished, whole) outputs equal the reference, and that the
   gradients of ``sum(out * w)`` (``w`` random, the same on every rank) with respect to
   the whole inputs, summed over the ranks, equal the reference gradients.  That sum is
   what AutoSP's gradient all-reduce produces for inputs that arrive whole on every rank,
   so the check holds a rule to the gradient convention of ``collectives``: gradients of
   ``Replicate`` values are partial, of ``Shard``/``HeadShard`` values true on the local
   piece, of ``Partial`` values the true gradient (random ``c_r`` make a wrong share visible).

It also checks what a later rule relies on: each output's local shape and dtype agree
with its placement and its global value, and every rank issued the same collectives
(kind and shapes) in the same order; a real process group would hang or mix them up.

``simulate(fn, world)`` is the underlying P-thread runner, usable for whole programs.
Only one simulation runs at a time in a process: the threaded process group swaps
torch.distributed's world for a thread-local one while it runs.
"""

from __future__ import annotations

import threading
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from autosp.sharding.context import SPContext, SPValue
from autosp.sharding.placement import (
    HeadShard, Layout, Partial, Placement, Replicate, SeqAxis, Shard, even_ranges, zigzag_ranges,
)
from autosp.sharding.propagate import evaluate, finish
from autosp.sharding.redistribute import slice_to

T = TypeVar("T")
# A placement, or how to build one from the whole input tensor and the world size.
PlacementSpec = Placement | Callable[[torch.Tensor, int], Placement] | None
LayoutFn = Callable[[int, int], Layout]

_BACKEND = "autosp_threaded"
_LOCK = threading.Lock()
_CALLS = threading.local()


class SimulationError(RuntimeError):
    """A rank raised, or the ranks did not finish (they waited on different collectives)."""


class RuleMismatch(AssertionError):
    """The sharded program disagrees with the unsharded op."""


# --- layouts ------------------------------------------------------------------------------------


def sliced_layout(layout: Layout, start: int, end: int) -> Layout:
    """The layout of ``x[start:end]`` along the sequence when ``x`` has ``layout`` (as ``slice`` keeps it)."""
    return tuple(
        tuple((min(max(lo, start), end) - start, min(max(hi, start), end) - start) for lo, hi in pieces)
        for pieces in layout
    )


def uneven_layout(length: int, world: int) -> Layout:
    """Contiguous pieces of different sizes: an even split of ``length + 1`` with the last token dropped."""
    return sliced_layout(even_ranges(length + 1, world), 0, length)


def first_rank_empty_layout(length: int, world: int) -> Layout:
    """Rank 0 holds nothing, the others split the sequence (``x[:, k:]`` with k past rank 0's piece)."""
    rest = even_ranges(length, world - 1)
    return (((0, 0),), *rest)


def zigzag_sliced_layout(length: int, world: int) -> Layout:
    """A zigzag layout with its first tokens sliced off: uneven pieces, two per rank, out of rank order."""
    chunk = -(-(length + 1) // (2 * world))
    full = 2 * world * chunk
    return sliced_layout(zigzag_ranges(full, world), full - length, full)


def _zigzag(length: int, world: int) -> Layout:
    if length % (2 * world):
        raise ValueError(f"a zigzag layout needs a length divisible by 2 * world = {2 * world}, got {length}")
    return zigzag_ranges(length, world)


LAYOUTS: dict[str, LayoutFn] = {
    "even": even_ranges,
    "uneven": uneven_layout,
    "zigzag": _zigzag,
    "zigzag_sliced": zigzag_sliced_layout,
    "first_empty": first_rank_empty_layout,
}


def shard(dim: int, layout: str | LayoutFn = "even", *, length: int | None = None, inner: int = 1) -> PlacementSpec:
    """A ``Shard`` of the input's ``dim`` built for each world size.

    ``length`` is the sequence length when ``dim`` folds more than the sequence
    (``[B * S, D]``: ``length=S``); by default ``dim`` holds ``length * inner`` elements.
    ``layout`` names one of ``LAYOUTS`` or maps ``(length, world)`` to per-rank intervals.
    """
    make = LAYOUTS[layout] if isinstance(layout, str) else layout

    def build(x: torch.Tensor, world: int) -> Placement:
        n = length if length is not None else x.shape[dim] // inner
        return Shard(SeqAxis(dim, n, inner), make(n, world))

    build.__qualname__ = f"shard({dim}, {layout if isinstance(layout, str) else layout.__name__})"
    return build


def head_shard(dim: int) -> PlacementSpec:
    """A ``HeadShard`` of ``dim``, split into balanced blocks."""

    def build(x: torch.Tensor, world: int) -> Placement:
        n = x.shape[dim]
        return HeadShard(dim, tuple((r * n // world, (r + 1) * n // world) for r in range(world)))

    build.__qualname__ = f"head_shard({dim})"
    return build


def describe(spec: PlacementSpec) -> str:
    if spec is None:
        return "R"
    if callable(spec) and not isinstance(spec, (Replicate, Shard, HeadShard, Partial)):
        return spec.__qualname__
    return str(spec)


# --- the P-thread runner ------------------------------------------------------------------------


def _logging_group_class() -> type:
    from torch.testing._internal.distributed.multi_threaded_pg import ProcessLocalGroup

    def logged(kind: str, method: Callable) -> Callable:
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            shapes = [tuple(t.shape) for t in pytree.tree_leaves(args) if isinstance(t, torch.Tensor)]
            log = getattr(_CALLS, "log", None)
            if log is not None:
                log.append(f"{kind}{shapes}")
            return method(self, *args, **kwargs)

        return call

    methods = {
        "allreduce": "all_reduce", "allgather": "all_gather", "all_to_all_single": "all_to_all",
        "alltoall": "all_to_all", "reduce_scatter": "reduce_scatter", "broadcast": "broadcast",
        "allreduce_coalesced": "all_reduce", "all_gather_single": "all_gather",
        "reduce_scatter_single": "reduce_scatter",
    }
    body = {name: logged(kind, getattr(ProcessLocalGroup, name)) for name, kind in methods.items()}
    return type("LoggingThreadedGroup", (ProcessLocalGroup,), body)


_GROUP_CLASS: type | None = None


def _ensure_backend() -> None:
    global _GROUP_CLASS
    if _GROUP_CLASS is not None:
        return
    from torch.distributed.distributed_c10d import _store_based_barrier

    cls = _logging_group_class()

    def create(prefix_store: Any, rank: int, world_size: int, timeout: Any) -> Any:
        pg = cls(rank, world_size)
        _store_based_barrier(rank, prefix_store, "", world_size, timeout)
        return pg

    dist.Backend.register_backend(_BACKEND, create, devices=["cpu"])
    _GROUP_CLASS = cls


def simulate(fn: Callable[[int, str], T], world: int, *, timeout: float = 120.0) -> list[T]:
    """Run ``fn(rank, group_name)`` for every rank of a ``world``-rank group, one thread each.

    The group is torch's threaded process group: collectives (and so AutoSP's collective
    ops, forward and backward) really exchange data between the threads.  Returns the
    results in rank order; raises ``SimulationError`` naming the rank that failed, or the
    collectives each rank issued when they did not all finish.
    """
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    from torch.testing._internal.distributed import multi_threaded_pg as mtpg

    with _LOCK:
        _ensure_backend()
        torch._C._distributed_c10d._set_thread_isolation_mode(True)
        mtpg._install_threaded_pg()
        store = dist.HashStore()
        results: list[Any] = [None] * world
        errors: list[BaseException | None] = [None] * world
        tracebacks: list[str] = [""] * world
        logs: list[list[str]] = [[] for _ in range(world)]

        def worker(rank: int) -> None:
            _CALLS.log = logs[rank]
            try:
                dist.init_process_group(_BACKEND, rank=rank, world_size=world, store=store)
                results[rank] = fn(rank, dist.group.WORLD.group_name)
            except BaseException as e:  # noqa: BLE001 - reported below, with the rank; SystemExit wakes peers
                errors[rank] = e
                tracebacks[rank] = traceback.format_exc()
                mtpg.ProcessLocalGroup.exception_handle(e)
            finally:
                _CALLS.log = None
                if dist.is_initialized():
                    dist.destroy_process_group()

        threads = [threading.Thread(target=worker, args=(r,), daemon=True, name=f"sp-rank-{r}") for r in range(world)]
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout)
            hung = [r for r, t in enumerate(threads) if t.is_alive()]
            if hung:
                mtpg.ProcessLocalGroup.exception_handle(TimeoutError())
                for t in threads:
                    t.join(5.0)
        finally:
            mtpg.ProcessLocalGroup.reset()
            mtpg._uninstall_threaded_pg()
            torch._C._distributed_c10d._set_thread_isolation_mode(False)

    calls = "\n".join(f"  rank {r}: {log}" for r, log in enumerate(logs))
    failed = [r for r, e in enumerate(errors) if e is not None and not isinstance(e, SystemExit)]
    if failed:
        r = failed[0]
        raise SimulationError(
            f"rank {r} of {world} raised {type(errors[r]).__name__}: {errors[r]}\n{tracebacks[r]}"
            f"collectives issued:\n{calls}"
        ) from errors[r]
    if hung or any(e is not None for e in errors):
        raise SimulationError(f"ranks {hung} did not finish in {timeout:.0f} s; collectives issued:\n{calls}")
    if any(log != logs[0] for log in logs):
        raise SimulationError(f"the ranks issued different collectives:\n{calls}")
    return results


# --- one op ---------------------------------------------------------------------------------------


@dataclass
class OpReport:
    """What ``check_op`` saw: per output, its placement; the fallbacks and collectives of rank 0."""

    output_placements: list[str]
    fallbacks: list[str]
    collectives: list[str]
    max_value_error: float = 0.0
    max_grad_error: float = 0.0
    notes: list[str] = field(default_factory=list)


@dataclass
class _RankRun:
    outputs: list[Any]
    grads: list[torch.Tensor | None]
    placements: list[str]
    fallbacks: list[str]
    problems: list[str]


def _no_attention(*_: Any) -> Any:
    raise NotImplementedError("check_op builds no attention sites; pass attention_rule= and sites= to test one")


def _one_node_graph(op: Callable, args: Any, kwargs: Any, fake_mode: Any) -> tuple[torch.fx.Node, Any, Any]:
    """The graph ``placeholders -> op`` with ``meta["val"]`` set, as the lowered graph has it."""
    graph = torch.fx.Graph()
    count = iter(range(1 << 30))

    def placeholder(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        node = graph.placeholder(f"x{next(count)}")
        node.meta["val"] = fake_mode.from_tensor(x)
        return node

    node_args, node_kwargs = pytree.tree_map(placeholder, (tuple(args), dict(kwargs)))
    node = graph.create_node("call_function", op, node_args, node_kwargs, name="op")
    fake_args, fake_kwargs = torch.fx.node.map_arg((node_args, node_kwargs), lambda n: n.meta["val"])
    with fake_mode:
        node.meta["val"] = op(*fake_args, **fake_kwargs)
    graph.output(node)
    return node, node_args, node_kwargs


def _local_piece(ctx: SPContext, x: torch.Tensor, p: Placement, coeff: tuple[float, torch.Tensor] | None) -> torch.Tensor:
    if isinstance(p, Replicate):
        return x
    if isinstance(p, Shard):
        return slice_to(ctx, x, p.axis.dim, p.axis, p.ranges)
    if isinstance(p, HeadShard):
        lo, hi = p.ranges[ctx.rank]
        return x.narrow(p.dim, lo, hi - lo)
    assert isinstance(p, Partial) and coeff is not None
    scale, noise = coeff
    return x * scale + noise


def _check_placement(ctx: SPContext, v: SPValue) -> str | None:
    """Whether the local tensor of an output agrees with its placement and global value."""
    p, shape, gshape = v.placement, tuple(v.local.shape), tuple(v.gval.shape)
    if v.local.dtype != v.gval.dtype:
        return f"local dtype {v.local.dtype} but global {v.gval.dtype}"
    want = list(gshape)
    if isinstance(p, Shard):
        axis, size = p.axis, gshape[p.axis.dim]
        if size % (axis.length * axis.inner):
            return f"{p}: global dim {axis.dim} of size {size} does not hold length {axis.length} x inner {axis.inner}"
        covered = sorted(span for pieces in p.ranges for span in pieces if span[1] > span[0])
        ends = [lo for lo, _ in covered] + [axis.length]
        if len(p.ranges) != ctx.world or [0] + [hi for _, hi in covered] != ends:
            return f"{p}: ranges {p.ranges} do not cover [0, {axis.length}) once"
        want[axis.dim] = axis.outer(size) * p.local_length(ctx.rank) * axis.inner
    elif isinstance(p, HeadShard):
        lo, hi = p.ranges[ctx.rank]
        want[p.dim] = hi - lo
    elif isinstance(p, Replicate) and p.axis is not None:
        if p.axis.dim >= len(gshape) or gshape[p.axis.dim] % (p.axis.length * p.axis.inner):
            return f"{p}: claims sequence length {p.axis.length} on dim {p.axis.dim} of a {list(gshape)} value"
    if list(shape) != want:
        return f"{p}: local shape {list(shape)}, expected {want} on rank {ctx.rank}"
    return None


def _weights(outputs: Sequence[Any], seed: int) -> list[torch.Tensor | None]:
    gen = torch.Generator().manual_seed(seed + 7919)
    return [
        torch.randn(o.shape, generator=gen, dtype=o.dtype) if isinstance(o, torch.Tensor) and o.is_floating_point() else None
        for o in outputs
    ]


def _loss(outputs: Sequence[Any], weights: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    terms = [(o * w).sum() for o, w in zip(outputs, weights) if w is not None and o.requires_grad]
    return sum(terms[1:], terms[0]) if terms else None


def _grads(loss: torch.Tensor | None, leaves: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
    wanted = [x for x in leaves if x.requires_grad]
    got = iter(torch.autograd.grad(loss, wanted, allow_unused=True) if loss is not None and wanted else [None] * len(wanted))
    return [next(got) if x.requires_grad else None for x in leaves]


def _differentiable(x: torch.Tensor) -> torch.Tensor:
    x = x.detach().clone()
    return x.requires_grad_(x.is_floating_point() or x.is_complex())


def check_op(
    op: Callable,
    args: Sequence[Any],
    kwargs: Mapping[str, Any] | None = None,
    *,
    placements: Sequence[PlacementSpec],
    world: int,
    seq_len: int | None = None,
    layout: str | LayoutFn | None = None,
    atol: float | None = None,
    rtol: float | None = None,
    seed: int = 0,
    check_values: bool = True,
    trace: bool = True,
    context: Mapping[str, Any] | None = None,
    timeout: float = 120.0,
) -> OpReport:
    """Check the sharding rule of ``op`` on ``world`` simulated ranks; raise ``RuleMismatch`` if it is wrong.

    Args:
        op: an aten overload (``torch.ops.aten.mm.default``).
        args, kwargs: the op's arguments with whole (global) tensors.
        placements: one per tensor of ``(args, kwargs)`` in pytree order: a placement, a builder
            such as ``shard(1, "zigzag")``, or None for ``Replicate()``.
        world: number of ranks.
        seq_len: the context's sequence length (``arange`` and where sharding starts);
            by default the length of the first input placement that has a sequence axis.
        layout: the layout chosen where sharding starts (a ``LAYOUTS`` name or function);
            None: contiguous and even, as ``SPContext`` does without a variant.
        atol, rtol: tolerances (``torch.testing.assert_close``'s defaults for the dtype by default).
        check_values: False for ops whose values are unspecified (``empty_like``): shapes only.
        trace: trace ``evaluate`` under ``make_fx`` on fake tensors first, as ``autosp.shard`` does.
        context: extra ``SPContext`` fields (``attention_rule``, ``sites`` keyed by ``"op"``, ...).
    """
    kwargs = dict(kwargs or {})
    leaves, spec = pytree.tree_flatten((tuple(args), kwargs))
    tensor_at = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    if len(placements) != len(tensor_at):
        raise ValueError(f"{len(tensor_at)} tensor inputs but {len(placements)} placements")
    tensors = [leaves[i] for i in tensor_at]
    chosen: list[Placement] = []
    for x, s in zip(tensors, placements):
        p = Replicate() if s is None else s if isinstance(s, (Replicate, Shard, HeadShard, Partial)) else s(x, world)
        if isinstance(p, Partial) and not x.is_floating_point():
            raise ValueError("a Partial input must be floating point: its summands are random")
        chosen.append(p)
    if seq_len is None:
        seq_len = next((p.axis.length for p in chosen if isinstance(p, (Shard, Replicate)) and p.axis), 1)
    layout_fn = None
    if layout is not None:
        make = LAYOUTS[layout] if isinstance(layout, str) else layout
        layout_fn = lambda length, w, _options: make(length, w)  # noqa: E731
    where = (
        f"{op} on {world} ranks, inputs "
        + ", ".join(f"{list(x.shape)}:{p}" for x, p in zip(tensors, chosen))
        + (f", layouts {[p.ranges for p in chosen if isinstance(p, Shard)]}" if any(isinstance(p, Shard) for p in chosen) else "")
        + (f", start layout {layout}" if layout is not None else "")
    )

    def rebuild(new: Sequence[Any]) -> tuple[tuple, dict]:
        flat = list(leaves)
        for i, x in zip(tensor_at, new):
            flat[i] = x
        return pytree.tree_unflatten(flat, spec)

    # The reference: the op on whole values, in eager.
    ref_leaves = [_differentiable(x) for x in tensors]
    ref_args, ref_kwargs = rebuild(ref_leaves)
    ref_out, out_spec = pytree.tree_flatten(op(*ref_args, **ref_kwargs))
    weights = _weights(ref_out, seed)
    ref_grads = _grads(_loss(ref_out, weights), ref_leaves)

    # Random summands of each Partial input: sum_r c_r = 1, sum_r n_r = 0.
    gen = torch.Generator().manual_seed(seed)
    coeffs: list[list[tuple[float, torch.Tensor]] | None] = []
    for x, p in zip(tensors, chosen):
        if not isinstance(p, Partial):
            coeffs.append(None)
            continue
        c = 0.5 + torch.rand(world, generator=gen, dtype=torch.float64)
        c = (c / c.sum()).tolist()
        n = torch.randn((world, *x.shape), generator=gen, dtype=torch.float64).to(x.dtype)
        n = n - n.mean(0)
        coeffs.append([(c[r], n[r]) for r in range(world)])

    trace_lock = threading.Lock()
    options = dict(context or {})
    attention_rule = options.pop("attention_rule", _no_attention)

    def rank_program(rank: int, group_name: str) -> _RankRun:
        from torch._dispatch.python import enable_python_dispatcher
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.proxy_tensor import make_fx

        ctx = SPContext(
            rank=rank, world=world, group_name=group_name, seq_len=seq_len,
            attention_rule=attention_rule, layout_fn=layout_fn, **options,
        )
        fake_mode = FakeTensorMode()
        node, node_args, node_kwargs = _one_node_graph(op, args, kwargs, fake_mode)
        gvals = [n.meta["val"] for n in pytree.tree_leaves((node_args, node_kwargs)) if isinstance(n, torch.fx.Node)]
        mine = [_differentiable(x) for x in tensors]
        pieces = [
            _local_piece(ctx, x, p, None if c is None else c[rank]) for x, p, c in zip(mine, chosen, coeffs)
        ]
        seen: dict[str, Any] = {}

        def program(*local: torch.Tensor) -> list[torch.Tensor]:
            values = [SPValue(t, p, g) for t, p, g in zip(local, chosen, gvals)]
            a, k = rebuild(values)
            out = evaluate(ctx, node, a, k)
            flat, seen["spec"] = pytree.tree_flatten(out, is_leaf=lambda v: isinstance(v, SPValue))
            seen["placements"] = [str(v.placement) if isinstance(v, SPValue) else type(v).__name__ for v in flat]
            seen["problems"] = [
                f"output {i}: {why}" for i, v in enumerate(flat) if isinstance(v, SPValue)
                for why in [_check_placement(ctx, v)] if why
            ]
            done = [finish(ctx, v) for v in flat]
            seen["constants"] = {i: v for i, v in enumerate(done) if not isinstance(v, torch.Tensor)}
            return [v for v in done if isinstance(v, torch.Tensor)]

        if trace:
            # Tracing runs no collective (fake kernels only), so ranks take turns: make_fx keeps global state.
            with trace_lock:
                fakes = [fake_mode.from_tensor(t.detach()) for t in pieces]
                with fake_mode, enable_python_dispatcher():
                    gm = make_fx(program, pre_dispatch=False)(*fakes)
            tensors_out = gm(*pieces)
        else:
            tensors_out = program(*pieces)
        it = iter(tensors_out)
        outputs = [seen["constants"][i] if i in seen["constants"] else next(it) for i in range(len(seen["placements"]))]
        grads = _grads(_loss(outputs, weights) if len(outputs) == len(weights) else None, mine)
        return _RankRun(outputs, grads, seen["placements"], list(ctx.fallbacks), seen["problems"])

    try:
        runs = simulate(rank_program, world, timeout=timeout)
    except SimulationError as e:
        raise RuleMismatch(f"{where}: {e}") from e

    report = OpReport(runs[0].placements, runs[0].fallbacks, [])
    problems = [f"rank {r}: {why}" for r, run in enumerate(runs) for why in run.problems]
    if problems:
        raise RuleMismatch(f"{where}: outputs {runs[0].placements} break their placement:\n" + "\n".join(problems))
    for r, run in enumerate(runs):
        if len(run.outputs) != len(ref_out):
            raise RuleMismatch(f"{where}: rank {r} returned {len(run.outputs)} outputs, the op {len(ref_out)}")
        for i, (got, want) in enumerate(zip(run.outputs, ref_out)):
            what = f"{where}: output {i} ({run.placements[i]}) on rank {r}"
            report.max_value_error = max(report.max_value_error, _compare(what, got, want, check_values, atol, rtol))
    summed: list[torch.Tensor | None] = []
    for i in range(len(tensors)):
        parts = [run.grads[i] for run in runs if run.grads[i] is not None]
        summed.append(torch.stack(parts).sum(0) if parts else None)
    for i, (got, want) in enumerate(zip(summed, ref_grads)):
        if want is None and got is None:
            continue
        got = torch.zeros_like(tensors[i]) if got is None else got
        want = torch.zeros_like(tensors[i]) if want is None else want
        what = f"{where}: gradient of input {i} ({chosen[i]}) summed over ranks, outputs {runs[0].placements}"
        report.max_grad_error = max(report.max_grad_error, _compare(what, got, want, True, atol, rtol))
    return report


def _compare(what: str, got: Any, want: Any, values: bool, atol: float | None, rtol: float | None) -> float:
    if not isinstance(want, torch.Tensor):
        if got != want:
            raise RuleMismatch(f"{what}: got {got!r}, expected {want!r}")
        return 0.0
    if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype:
        desc = f"{list(got.shape)} {got.dtype}" if isinstance(got, torch.Tensor) else repr(got)
        raise RuleMismatch(f"{what}: got {desc}, expected {list(want.shape)} {want.dtype}")
    if not values:
        return 0.0
    try:
        torch.testing.assert_close(got, want, atol=atol, rtol=rtol, equal_nan=True)
    except AssertionError as e:
        raise RuleMismatch(f"{what}: values differ\n{e}") from None
    if not want.is_floating_point() or want.numel() == 0:
        return 0.0
    return float((got.double() - want.double()).abs().nan_to_num().max())


__all__ = [
    "LAYOUTS", "OpReport", "PlacementSpec", "RuleMismatch", "SimulationError", "check_op", "describe",
    "first_rank_empty_layout", "head_shard", "shard", "simulate", "sliced_layout", "uneven_layout",
    "zigzag_sliced_layout",
]
