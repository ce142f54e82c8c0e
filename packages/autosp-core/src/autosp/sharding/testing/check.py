"""``check_op``: one op's sharding rule on P simulated ranks against the op on whole values."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from autosp.sharding.context import SPContext, SPValue
from autosp.sharding.placement import HeadShard, Partial, Placement, Replicate, Shard
from autosp.sharding.propagate import evaluate, finish, refuse_traced_global_values
from autosp.sharding.redistribute import slice_to
from autosp.sharding.testing.invariants import placement_problem
from autosp.sharding.testing.layouts import LayoutFn, PlacementSpec, layout_fn, resolve
from autosp.sharding.testing.threads import SimulationError, collectives_issued, simulate

Summand = tuple[float | int, torch.Tensor]  # rank r's summand of a Partial input x is c_r * x + n_r


class RuleMismatch(AssertionError):
    """The sharded program disagrees with the unsharded op (or breaks a placement's invariants)."""


@dataclass
class OpReport:
    """What ``check_op`` saw on rank 0: output placements (before ``finish``), fallbacks, collectives."""

    output_placements: list[str]
    fallbacks: list[str]
    collectives: list[str]
    max_value_error: float = 0.0
    max_grad_error: float = 0.0


@dataclass
class _RankRun:
    outputs: list[Any]
    grads: list[torch.Tensor | None]
    placements: list[str]
    kinds: list[type | None]
    problems: list[str]
    fallbacks: list[str]
    collectives: list[str]


@dataclass
class _Args:
    """The op's arguments as pytree leaves, so tensors can be swapped for other values."""

    leaves: list[Any]
    spec: Any
    tensor_at: list[int]

    @classmethod
    def of(cls, args: Sequence[Any], kwargs: Mapping[str, Any]) -> _Args:
        leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
        return cls(leaves, spec, [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)])

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [self.leaves[i] for i in self.tensor_at]

    def rebuild(self, tensors: Sequence[Any]) -> tuple[tuple, dict]:
        flat = list(self.leaves)
        for i, x in zip(self.tensor_at, tensors):
            flat[i] = x
        return pytree.tree_unflatten(flat, self.spec)


def _leaf(x: torch.Tensor, grad: bool) -> torch.Tensor:
    return x.detach().clone().requires_grad_(grad)


def _weights(outputs: Sequence[Any], seed: int) -> list[torch.Tensor | None]:
    gen = torch.Generator().manual_seed(seed + 7919)
    return [
        torch.randn(o.shape, generator=gen, dtype=o.dtype)
        if isinstance(o, torch.Tensor) and o.is_floating_point()
        else None
        for o in outputs
    ]


def _loss(outputs: Sequence[Any], weights: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    terms = [(o * w).sum() for o, w in zip(outputs, weights) if w is not None and o.requires_grad]
    return sum(terms[1:], terms[0]) if terms else None


def _grads(loss: torch.Tensor | None, leaves: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
    wanted = [x for x in leaves if x.requires_grad]
    if loss is None or not wanted:
        return [None] * len(leaves)
    got = iter(torch.autograd.grad(loss, wanted, allow_unused=True))
    return [next(got) if x.requires_grad else None for x in leaves]


def _summands(x: torch.Tensor, world: int, gen: torch.Generator) -> list[Summand]:
    """Random ``(c_r, n_r)`` with ``sum c_r = 1`` and ``sum n_r = 0``: a wrong share of a gradient shows.

    Both are multiples of a power of two, so summands of a value with few significant bits (a
    0/1 mask, a count) add up exactly: a test of ``(partial != 0)`` sees no rounding residue.
    An integer value gets whole-number summands (rank 0 holds it, plus noise).
    """
    if not x.is_floating_point():
        n = torch.randint(-3, 4, (world, *x.shape), generator=gen, dtype=x.dtype)
        n[0] -= n.sum(0)
        return [(int(r == 0), n[r]) for r in range(world)]
    unit = 1 << (4 * world).bit_length()
    k = torch.randint(1, 5, (world,), generator=gen)
    k[-1] = unit - k[:-1].sum()
    n = torch.randint(-8, 9, (world, *x.shape), generator=gen, dtype=torch.float64)
    n[-1] -= n.sum(0)
    n = (n / 8).to(x.dtype)
    return [(float(k[r]) / unit, n[r]) for r in range(world)]


def _local_piece(ctx: SPContext, x: torch.Tensor, p: Placement, summand: Summand | None) -> torch.Tensor:
    if isinstance(p, Replicate):
        return x
    if isinstance(p, Shard):
        return slice_to(ctx, x, p.axis.dim, p.axis, p.ranges)
    if isinstance(p, HeadShard):
        lo, hi = p.ranges[ctx.rank]
        return x.narrow(p.dim, lo, hi - lo)
    assert isinstance(p, Partial) and summand is not None
    scale, noise = summand
    return x * scale + noise


def _one_node_graph(op: Callable, call: _Args, fake_mode: Any) -> tuple[torch.fx.Node, list[Any]]:
    """The graph ``placeholders -> op`` with ``meta["val"]`` set as in the lowered graph; the inputs' fake values."""
    graph = torch.fx.Graph()
    holders = []
    for i, x in enumerate(call.tensors):
        holder = graph.placeholder(f"x{i}")
        holder.meta["val"] = fake_mode.from_tensor(x)
        holders.append(holder)
    node_args, node_kwargs = call.rebuild(holders)
    node = graph.create_node("call_function", op, node_args, node_kwargs, name="op")
    fake_args, fake_kwargs = call.rebuild([h.meta["val"] for h in holders])
    with fake_mode:
        node.meta["val"] = op(*fake_args, **fake_kwargs)
    graph.output(node)
    return node, [h.meta["val"] for h in holders]


def _no_attention(*_: Any) -> Any:
    raise NotImplementedError("check_op builds no attention site; pass context={'attention_rule': ..., 'sites': ...}")


@dataclass
class _Plan:
    """Everything each rank needs, fixed before the threads start."""

    op: Callable
    call: _Args
    placements: list[Placement]
    grad_of: list[bool]
    summands: list[list[Summand] | None]
    weights: list[torch.Tensor | None]
    world: int
    seq_len: int
    layout: LayoutFn | None
    context: dict[str, Any]
    trace: bool

    def run_rank(self, rank: int, group_name: str, trace_lock: threading.Lock) -> _RankRun:
        from torch._dispatch.python import enable_python_dispatcher
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.proxy_tensor import make_fx

        context = dict(self.context)
        make = self.layout
        ctx = SPContext(
            rank=rank,
            world=self.world,
            group_name=group_name,
            seq_len=self.seq_len,
            attention_rule=context.pop("attention_rule", _no_attention),
            layout_fn=(lambda length, world, _options: make(length, world)) if make else None,
            **context,
        )
        fake_mode = FakeTensorMode()
        node, gvals = _one_node_graph(self.op, self.call, fake_mode)
        mine = [_leaf(x, g) for x, g in zip(self.call.tensors, self.grad_of)]
        pieces = [
            _local_piece(ctx, x, p, None if s is None else s[rank])
            for x, p, s in zip(mine, self.placements, self.summands)
        ]
        seen: dict[str, Any] = {}

        def program(*local: torch.Tensor) -> list[torch.Tensor]:
            args, kwargs = self.call.rebuild([SPValue(t, p, g) for t, p, g in zip(local, self.placements, gvals)])
            flat = pytree.tree_leaves(evaluate(ctx, node, args, kwargs), is_leaf=lambda v: isinstance(v, SPValue))
            values = [v for v in flat if isinstance(v, SPValue)]
            seen["placements"] = [str(v.placement) if isinstance(v, SPValue) else type(v).__name__ for v in flat]
            seen["kinds"] = [type(v.placement) if isinstance(v, SPValue) else None for v in flat]
            problems = [(i, placement_problem(v, rank, self.world)) for i, v in enumerate(values)]
            seen["problems"] = [f"output {i}: {why}" for i, why in problems if why]
            done = [finish(ctx, v) for v in flat]
            seen["constants"] = {i: v for i, v in enumerate(done) if not isinstance(v, torch.Tensor)}
            return [v for v in done if isinstance(v, torch.Tensor)]

        if self.trace:
            # Tracing issues no collective (fake kernels only), so ranks take turns: make_fx keeps global state.
            with trace_lock:
                fakes = [fake_mode.from_tensor(t.detach()) for t in pieces]
                with fake_mode, enable_python_dispatcher():
                    traced = make_fx(program, pre_dispatch=False)(*fakes)
            refuse_traced_global_values(traced)
            tensors = iter(traced(*pieces))
        else:
            tensors = iter(program(*pieces))
        constants = seen["constants"]
        outputs = [constants[i] if i in constants else next(tensors) for i in range(len(seen["placements"]))]
        grads = _grads(_loss(outputs, self.weights) if len(outputs) == len(self.weights) else None, mine)
        return _RankRun(
            outputs,
            grads,
            seen["placements"],
            seen["kinds"],
            seen["problems"],
            list(ctx.fallbacks),
            collectives_issued(),
        )


def check_op(
    op: Callable,
    args: Sequence[Any],
    kwargs: Mapping[str, Any] | None = None,
    *,
    placements: Sequence[PlacementSpec],
    world: int,
    seq_len: int | None = None,
    layout: str | LayoutFn | None = None,
    expect: Sequence[type | None] | None = None,
    requires_grad: Sequence[bool] | None = None,
    check_values: bool = True,
    atol: float | None = None,
    rtol: float | None = None,
    seed: int = 0,
    trace: bool = True,
    context: Mapping[str, Any] | None = None,
    timeout: float = 120.0,
) -> OpReport:
    """Check the sharding rule of ``op`` on ``world`` simulated ranks; raise ``RuleMismatch`` where it is wrong.

    Args:
        op: an aten (or custom) op overload, ``torch.ops.aten.mm.default``.
        args, kwargs: the op's arguments with whole (global) tensors.
        placements: one per tensor of ``(args, kwargs)`` in pytree order: a placement, a builder
            such as ``shard(1, "zigzag")`` or ``head_shard(1)``, or None for ``Replicate()``.
        world: number of ranks.
        seq_len: the context's sequence length (``arange``'s rule reads it); by default the
            length of the first input placement with a sequence axis.
        layout: the layout where sharding starts (a ``LAYOUTS`` name or a function
            ``(length, world)``); None: contiguous and even, as without a variant.
        expect: the placement class each output must have before ``finish`` (None: any): holds
            a rule to keeping the sequence sharded where it can, not only to being right.
        requires_grad: per tensor input, whether to check its gradient (default: the floating
            ones); False for an argument the op is not differentiable in (``nll_loss``'s weight).
        check_values: False for ops whose values are unspecified (``empty_like``): shapes only.
        atol, rtol: tolerances; ``torch.testing.assert_close``'s defaults for the dtype if None.
        seed: seeds the Partial summands and the loss weights.
        trace: trace ``evaluate`` and ``finish`` under ``make_fx`` on fake tensors, as
            ``autosp.shard`` does (catches a rule that reads tensor data, or runs an op on a
            global value), then run the trace.
        context: further ``SPContext`` fields: ``rules`` (default core's table; pass
            ``autosp.registry.get_registry().sharding_rules`` for the plugins' too),
            ``attention_rule`` and ``sites`` (the op's node is named ``"op"``), ``variant_options``.
    """
    call = _Args.of(args, kwargs or {})
    tensors = call.tensors
    if len(placements) != len(tensors):
        raise ValueError(f"{op} has {len(tensors)} tensor inputs but {len(placements)} placements were given")
    grad_of = list(requires_grad) if requires_grad is not None else [x.is_floating_point() for x in tensors]
    if len(grad_of) != len(tensors) or any(g and not x.is_floating_point() for g, x in zip(grad_of, tensors)):
        raise ValueError("requires_grad takes one flag per tensor input, True only for floating ones")
    chosen = [resolve(s, x, world) for s, x in zip(placements, tensors)]
    if any(isinstance(p, Partial) and x.dtype == torch.bool for p, x in zip(chosen, tensors)):
        raise ValueError("a bool value cannot be Partial (a sum)")
    if seq_len is None:
        seq_len = next((p.axis.length for p in chosen if isinstance(p, (Shard, Replicate)) and p.axis), 1)
    where = f"{op} on {world} ranks, inputs " + ", ".join(f"{list(x.shape)}:{p}" for x, p in zip(tensors, chosen))
    if any(isinstance(p, Shard) for p in chosen):
        where += f", layouts {[p.ranges for p in chosen if isinstance(p, Shard)]}"
    if layout is not None:
        where += f", start layout {layout if isinstance(layout, str) else layout.__name__}"

    # The reference: the op on whole values, in eager.
    ref_leaves = [_leaf(x, g) for x, g in zip(tensors, grad_of)]
    ref_args, ref_kwargs = call.rebuild(ref_leaves)
    ref_out = pytree.tree_leaves(op(*ref_args, **ref_kwargs))
    weights = _weights(ref_out, seed)
    ref_grads = _grads(_loss(ref_out, weights), ref_leaves)

    gen = torch.Generator().manual_seed(seed)
    plan = _Plan(
        op,
        call,
        chosen,
        grad_of,
        [_summands(x, world, gen) if isinstance(p, Partial) else None for x, p in zip(tensors, chosen)],
        weights,
        world,
        seq_len,
        layout_fn(layout) if layout is not None else None,
        dict(context or {}),
        trace,
    )
    lock = threading.Lock()
    try:
        runs = simulate(lambda rank, group: plan.run_rank(rank, group, lock), world, timeout=timeout)
    except SimulationError as e:
        raise RuleMismatch(f"{where}: {e}") from e
    report = OpReport(runs[0].placements, runs[0].fallbacks, runs[0].collectives)
    _verify(where, runs, ref_out, ref_grads, chosen, tensors, report, check_values, atol, rtol)
    if expect is not None:
        kinds = runs[0].kinds
        if len(expect) != len(kinds) or any(e is not None and k is not e for e, k in zip(expect, kinds)):
            names = [e.__name__ if e is not None else "any" for e in expect]
            raise RuleMismatch(
                f"{where}: outputs are {runs[0].placements}, expected {names}; "
                f"fallbacks {runs[0].fallbacks}, collectives {runs[0].collectives}"
            )
    return report


def _verify(
    where: str,
    runs: list[_RankRun],
    ref_out: list[Any],
    ref_grads: list[torch.Tensor | None],
    placements: list[Placement],
    tensors: list[torch.Tensor],
    report: OpReport,
    check_values: bool,
    atol: float | None,
    rtol: float | None,
) -> None:
    first = runs[0]
    # Rank 0's problems, and those of other ranks that rank 0 does not share.
    problems = [
        f"rank {r}: {why}" for r, run in enumerate(runs) for why in run.problems if r == 0 or why not in first.problems
    ]
    if problems:
        raise RuleMismatch(f"{where}: outputs {first.placements} break their placement:\n" + "\n".join(problems))
    for r, run in enumerate(runs):
        if len(run.outputs) != len(ref_out):
            raise RuleMismatch(f"{where}: rank {r} returned {len(run.outputs)} outputs, the op {len(ref_out)}")
        for i, (got, want) in enumerate(zip(run.outputs, ref_out)):
            what = f"{where}: output {i} ({run.placements[i]}) on rank {r}"
            report.max_value_error = max(report.max_value_error, _compare(what, got, want, check_values, atol, rtol))
    for i, want in enumerate(ref_grads):
        reached = [r for r, run in enumerate(runs) if run.grads[i] is not None]
        if reached and len(reached) < len(runs):
            # Contract 5: a rank whose program never reads an input has no gradient for it, so in a
            # real run it would leave that input out of the gradient all-reduce, or skip the backward
            # (and its collectives) altogether when nothing else there needs one.
            raise RuleMismatch(
                f"{where}: the gradient of input {i} ({placements[i]}) reaches ranks {reached} only: every rank's "
                "result must depend on every differentiable input, as a zero on a rank that holds nothing"
            )
        parts = [run.grads[i] for run in runs if run.grads[i] is not None]
        if want is None and not parts:
            continue
        got = torch.stack(parts).sum(0) if parts else torch.zeros_like(tensors[i])
        want = torch.zeros_like(tensors[i]) if want is None else want
        what = f"{where}: gradient of input {i} ({placements[i]}) summed over ranks, outputs {first.placements}"
        report.max_grad_error = max(report.max_grad_error, _compare(what, got, want, True, atol, rtol))


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
    return float((got.detach().double() - want.detach().double()).abs().nan_to_num().max())


__all__ = ["OpReport", "RuleMismatch", "check_op"]
