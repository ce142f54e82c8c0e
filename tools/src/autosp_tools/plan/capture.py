"""Compile one rank's program of P without allocating anything, and keep its graphs.

The model is built under a fake tensor mode (parameters are FakeTensors), a fake process
group of ``sp`` ranks stands in for the others (``torch.testing``'s ``FakeStore`` + backend
"fake": collectives return tensors of the right shape and move nothing), and Dynamo traces
the model once with the sequence length symbolic. Each mode then runs AutoSP's own
``compile_graph`` on a copy of that graph, with the same passes and partitioner as a real
run, plus two passes of ours that run last in the forward and backward stages and record
the partitioned graphs; the one in the backward stage stops the compile there, so no inner
compiler runs and nothing executes.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import fx
from torch._functorch.aot_autograd import aot_module_simplified

from autosp.compiler import _Partitioner, make_context
from autosp.errors import ConfigError
from autosp.options import SPOptions
from autosp.passes.manager import PassManager, Stage
from autosp.registry import Registry, get_registry
from autosp.report import Report


@dataclass(frozen=True)
class Mode:
    """One way to run the model: an AutoSP variant, a SAC setting and the compiler after AutoSP.

    ``backend`` decides the partitioner as AutoSP's compile does: "inductor" always partitions by
    min-cut; "aot_eager" uses AOT's default partitioner unless a pass (SAC) asks for min-cut.
    ``handwritten``: a program written by hand (hand-written Ulysses, or no SP) that keeps and frees
    activations as eager autograd does; it is traced as SAC off with "aot_eager" (AOT's default
    partitioner keeps what eager keeps).
    """

    name: str
    variant: str = "ulysses"
    sac: bool | str = False
    backend: str = "inductor"
    variant_options: tuple[tuple[str, Any], ...] = ()
    hardware: str | None = None  # the profile core's cost models read (variant="auto")
    handwritten: bool = False

    @property
    def holds_backward_inputs(self) -> bool:
        """AutoSP compiled by "aot_eager": its backward holds the saved tensors until it returns."""
        return self.backend == "aot_eager" and not self.handwritten


@dataclass
class Captured:
    """The partitioned graphs of one mode, or why it could not compile."""

    mode: Mode
    forward: fx.GraphModule | None = None
    backward: fx.GraphModule | None = None
    num_user_outputs: int = 0
    param_inputs: set[int] = field(default_factory=set)
    error: str | None = None
    sac_report: dict[str, Any] = field(default_factory=dict)


class _Captured(Exception):
    """Raised once every mode's partition is kept: AOT need not compile anything."""


class _AllDone(Exception):
    """Raised by the planning backend so Dynamo never runs the fake program."""


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    # graph_copy copies node.meta shallowly (a new dict per node): tags set on the copy stay on it.
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    return fx.GraphModule(gm, graph)


def _options(mode: Mode, sp: int) -> SPOptions:
    extra = {"hardware": mode.hardware} if mode.hardware is not None else {}
    return SPOptions(
        sp_size=sp if sp > 1 else None,
        variant=mode.variant,
        sac=mode.sac,
        backend="aot_eager",
        variant_options=dict(mode.variant_options),
        check_inputs="off",
        # One graph stage serves every SAC mode, so nothing at that stage may depend on SAC: the plan
        # models the MLPs whole (tile_mlp="auto" would tile them for sac=True only).
        tile_mlp=False,
        **extra,
    )


def _error(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"[:400]


def _compile_variant(
    gm: fx.GraphModule, example_inputs: Sequence[Any], modes: Sequence[Mode], sp: int, group: Any, registry: Registry
) -> dict[str, Captured]:
    """AutoSP's aot_eager pipeline (``autosp.compiler.compile_graph``) with one graph stage and one joint
    trace shared by modes that differ only in SAC and partitioner: each mode partitions its own copy of the
    joint with its own context, and its forward and backward stages run on the result."""
    results = {m.name: Captured(m) for m in modes}
    try:
        for mode in modes:
            registry.require_sac(mode.sac)
        ctx = make_context(gm, example_inputs, _options(modes[0], sp), registry, group, sp)
        manager = PassManager(list(registry.passes.values()), ())
        graph = manager.run(Stage.GRAPH, _copy(gm), ctx)
    except Exception as e:  # noqa: BLE001 - a variant that cannot compile is a row of the plan, not the end of it
        for r in results.values():
            r.error = _error(e)
        return results

    def partition(joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> Any:
        for mode in modes:
            mctx = dataclasses.replace(
                ctx,
                options=_options(mode, sp),
                _plugin_state={},
                report=Report(ctx.graph_id, mode.variant, sp, ctx.rank, "aot_eager"),
            )
            # AutoSP's Inductor path always partitions by min-cut (compile_graph); aot_eager only when asked.
            mctx.min_cut = mode.backend == "inductor"
            r = results[mode.name]
            try:
                fw, bw = _Partitioner(manager, mctx)(_copy(joint), joint_inputs, **kwargs)
                r.num_user_outputs = mctx.num_fwd_outputs or 0
                r.param_inputs = {i for i, p in enumerate(mctx.is_param) if p}
                r.forward = manager.run(Stage.FORWARD, fw, mctx)
                r.backward = manager.run(Stage.BACKWARD, bw, mctx)
                r.sac_report = {k: str(v) for k, v in mctx.report.sac.items()}
            except Exception as e:  # noqa: BLE001
                r.error = _error(e)
        raise _Captured

    try:
        aot_module_simplified(
            graph, list(example_inputs), fw_compiler=_never, bw_compiler=_never, partition_fn=partition
        )
    except _Captured:
        pass
    except Exception as e:  # noqa: BLE001
        if not _caused_by(e, _Captured):
            for r in results.values():
                r.error = r.error or _error(e)
    return results


def _never(gm: fx.GraphModule, example_inputs: Any) -> Any:
    raise AssertionError("the planner stops AOT autograd at the partition")


@contextlib.contextmanager
def fake_group(sp: int) -> Iterator[Any]:
    """A fake process group of ``sp`` ranks in which this process is rank 0 (nothing when ``sp == 1``)."""
    if sp == 1:
        yield None
        return
    if dist.is_initialized():
        raise ConfigError(
            "autosp-plan needs a process without a process group (it makes a fake one of sp ranks); "
            "call it before init_process_group or in a separate process"
        )
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=sp)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


@dataclass
class Traced:
    """What one Dynamo trace of a fake model gave: every mode's graphs and the parameter count."""

    captured: dict[str, Captured]
    param_count: int


def trace_modes(
    build: Any,
    layers: int,
    modes: Sequence[Mode],
    *,
    sp: int,
    group: Any,
    dtype: torch.dtype,
    batch: int,
    seq_hint: int,
) -> Traced:
    """Build the model with ``layers`` layers on fake tensors and capture every mode's graphs.

    Args:
        build: ``build(layers) -> nn.Module`` whose ``forward(input_ids, labels)`` returns the loss.
        layers: how many layers to build.
        modes: what to compile.
        sp: ranks sharing one sequence.
        group: the (fake) process group of ``sp`` ranks from ``fake_group`` (``None`` when ``sp == 1``).
        dtype: parameter (and so activation) dtype.
        batch: rows per step.
        seq_hint: the example length (a multiple of what the variants need); sizes stay symbolic.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    torch._dynamo.reset()
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake, _default_dtype(dtype):
        model = build(layers)
        ids = torch.zeros(batch, seq_hint, dtype=torch.long)
    param_count = sum(p.numel() for p in model.parameters())
    torch._dynamo.mark_dynamic(ids, 1)
    base = get_registry()
    captured: dict[str, Captured] = {}

    def backend(gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
        groups: dict[tuple[str, tuple[tuple[str, Any], ...]], list[Mode]] = {}
        for mode in modes:
            groups.setdefault((mode.variant, mode.variant_options), []).append(mode)
        for same_graph in groups.values():
            captured.update(_compile_variant(gm, example_inputs, same_graph, sp, group, base))
        raise _AllDone

    try:
        torch.compile(model, backend=backend, fullgraph=True)(ids, ids)
    except Exception as e:  # noqa: BLE001 - Dynamo wraps what the backend raised
        if not _caused_by(e, _AllDone):
            raise ConfigError(f"the model could not be traced with a symbolic sequence length: {_error(e)}") from e
    finally:
        torch._dynamo.reset()
    return Traced(captured, param_count)


def _caused_by(e: BaseException | None, kind: type[BaseException]) -> bool:
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, kind):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


__all__ = ["Captured", "Mode", "Traced", "fake_group", "trace_modes"]
