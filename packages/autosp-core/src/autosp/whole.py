"""A graph AutoSP fails to compile runs whole on every rank, compiled by torch alone (exact, warned).

AutoSP lowers each Dynamo graph itself (``autosp.lowering``), rewrites it and hands it to AOT
autograd; torch's own compile takes the graph as Dynamo made it. Programs exist that torch compiles
and AutoSP's machinery cannot (today ``torch.cond`` over parameters, whose backward AutoSP's lowering
traces into branches torch rejects; ``nested_compile_region`` and ``torch.func.vjp`` in the model were
such crashes until the lowering learnt them). A crash used to end the user's step with an internal
error of torch, a refusal that names no way out.

Every rank computing the whole program on the same full inputs is the program itself, so the
graph is compiled as ``torch.compile`` would (the same backend, no AutoSP pass) and runs whole: its
outputs and its parameters' gradients are the single-device ones on every rank, and the graphs
around it still exchange whole values (a graph's outputs are whole, ``autosp.sharded_outputs``
aside, which this graph refuses like any other). Only its memory and time are one device's. It
says so: a ``CompiledWhole`` warning naming the error and the pass it came from, and the graph's
report. ``warnings.simplefilter("error", autosp.CompiledWhole)`` turns the fallback into an error,
``CompileCrashed`` from the original one (AutoSP's own tests run so, where a fallback would hide a
bug of a pass).

Errors AutoSP raises on purpose (``AutoSPError``: a refusal, a mismatch between ranks) and failed
collectives are never taken for such a crash. A graph torch cannot compile either raises AutoSP's
error, as before.

A graph that writes into tensors it holds (an optimizer's state, ``writes_held_tensors``) is never
lowered at all: the lowering would run those writes on the real tensors. It is compiled here too
(``compile_holding_writes``), said in its report, and warned only where the graph holds attention
(an optimizer's graph holds no sequence work).
"""

from __future__ import annotations

import contextlib
import copy
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import torch

from autosp.errors import AutoSPError, add_note, first_line
from autosp.options import SPOptions
from autosp.passes.collective_order import group_op_sequence, group_size_label
from autosp.peer_failure import is_comm_failure
from autosp.report import Report
from autosp.rng_check import python_draws, random_ops


class CompiledWhole(UserWarning):
    """AutoSP failed to compile a graph; torch compiled it, and it runs whole on every rank (exact, no SP)."""


class CompileCrashed(AutoSPError):
    """AutoSP's compile of a graph raised, and ``CompiledWhole`` warnings are errors: no fallback.

    ``error`` is the original exception (Dynamo raises AutoSP's errors without their cause).
    """

    def __init__(self, message: str, error: BaseException) -> None:
        super().__init__(message)
        self.error = error


def untouched_copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule | None:
    """A copy of ``gm`` for the fallback: its graphs (and its subgraphs') copied, its tensors shared.

    AutoSP's passes edit the Dynamo graph in place before lowering it (attention calls pointed at
    their leaf ops, custom Functions and tensor hooks wrapped), so the graph torch compiles in the
    fallback is taken before they run. ``None`` where the graph does not copy (an attribute that
    deep-copies badly): no fallback then, the error is raised.
    """
    memo: dict[int, Any] = {}
    for module in gm.modules():
        for value in [*module._parameters.values(), *module._buffers.values(), *vars(module).values()]:
            if isinstance(value, torch.Tensor):
                memo[id(value)] = value
    try:
        return copy.deepcopy(gm, memo)
    except Exception:  # noqa: BLE001 - any failure only means no fallback
        return None


@contextlib.contextmanager
def torch_state_restored() -> Iterator[None]:
    """Torch's thread state as it was, after a compile that raised part-way.

    A compile that fails inside a functorch transform (``torch.func.vjp`` in the model, traced under
    functionalization) leaves that transform's levels on functorch's stack: every tensor made after
    it, even the compile agreement's flag, comes out a wrapper without storage. Dynamo restores
    the same state around each frame it runs.
    """
    depth = torch._C._functorch.get_dynamic_layer_stack_depth()
    include, exclude = torch._C._dispatch_tls_local_include_set(), torch._C._dispatch_tls_local_exclude_set()
    with torch._C._ForceDispatchKeyGuard(include, exclude):
        try:
            yield
        except BaseException:
            torch._C._functorch.pop_dynamic_layer_stack_and_undo_to_depth(depth)
            raise


def has_attention(gm: torch.fx.GraphModule) -> bool:
    """Whether ``gm`` (or a subgraph) calls SDPA or FlexAttention, as Dynamo records them."""
    from autosp.lowering import FLEX, SDPA

    targets = (*SDPA.targets, *FLEX.targets)
    return any(
        n.op == "call_function" and n.target in targets
        for m in gm.modules()
        if isinstance(m, torch.fx.GraphModule)
        for n in m.graph.nodes
    )


def is_crash(error: BaseException) -> bool:
    """Whether ``error`` is a failure of AutoSP's machinery, not a refusal or a failed collective."""
    return (
        isinstance(error, Exception)
        and not isinstance(error, (AutoSPError, MemoryError))
        and not is_comm_failure(error)
    )


def compile_whole(
    gm: torch.fx.GraphModule, example_inputs: Sequence[Any], options: SPOptions, report: Report
) -> Callable[..., Any]:
    """``gm`` compiled by ``options.backend`` alone; ``report`` gets its group ops and random draws."""
    report.random_ops = python_draws(gm)
    report.group_ops = []

    def record(g: torch.fx.GraphModule, is_backward: bool) -> None:
        # The forward's draws, as the SP graphs report theirs: the ranks' generators must agree
        # (autosp.rng_check) for every rank to draw the program's numbers.
        if not is_backward:
            report.random_ops = random_ops(g) + report.random_ops
        report.group_ops = [*(report.group_ops or []), *group_op_sequence(g.graph, group_size_label)]

    if options.backend == "inductor":
        from torch._inductor.compile_fx import compile_fx, compile_fx_inner

        def inner(g: torch.fx.GraphModule, ex: Sequence[Any], **kw: Any) -> Any:
            record(g, bool(kw.get("is_backward")))
            return compile_fx_inner(g, ex, **kw)

        compiled = compile_fx(
            gm, list(example_inputs), inner_compile=inner, config_patches=dict(options.inductor_config)
        )
        return cast("Callable[..., Any]", compiled)

    from torch._functorch.aot_autograd import aot_module_simplified, make_boxed_func

    from autosp.compiler import donate_nothing, views_as_reshapes

    def stage(is_backward: bool) -> Callable[..., Any]:
        def compile_stage(g: torch.fx.GraphModule, ex: Sequence[Any]) -> Any:
            if is_backward:
                donate_nothing()
            record(g, is_backward)
            views_as_reshapes(g)
            return make_boxed_func(g.forward)

        return compile_stage

    return aot_module_simplified(gm, list(example_inputs), fw_compiler=stage(False), bw_compiler=stage(True))


def compile_after_crash(
    gm: torch.fx.GraphModule, example_inputs: Sequence[Any], options: SPOptions, report: Report, error: Exception
) -> Callable[..., Any]:
    """``compile_whole`` after AutoSP's compile raised ``error``; ``error`` itself where torch fails too.

    A parameter reached only through outputs the caller discards keeps ``.grad`` None here too
    (``autosp.discarded_outputs``): the graph holds no written tensor (else it is not lowered at all),
    so it can be lowered apart for that analysis, which gives up quietly where the lowering fails.
    """
    from autosp.compiler import _fake_inputs
    from autosp.discarded_outputs import drop_discarded, reach_alone

    try:
        fn = compile_whole(gm, example_inputs, options, report)
    except Exception as whole_error:
        add_note(error, f"torch's {options.backend} alone fails on this graph too: {first_line(whole_error)[:300]}")
        raise error from None
    return drop_discarded(fn, reach_alone(gm, *_fake_inputs(gm, example_inputs)))


def compile_holding_writes(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    options: SPOptions,
    report: Report,
    held: Sequence[str],
    what: str,
) -> Callable[..., Any]:
    """``compile_whole`` of a graph that writes into tensors it holds (``writes_held_tensors``), said in
    ``report`` (and warned where the graph holds attention, which then runs whole too)."""
    shown = ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
    report.notes.append(
        f"writes in place into {len(held)} tensor(s) the graph holds as attributes ({shown}; an optimizer's "
        "state and parameters, when a whole training step is compiled): AutoSP's lowering would run those "
        f"writes at compile time, so {why_whole(report)}"
    )
    fn = compile_whole(gm, example_inputs, options, report)
    if has_attention(gm):
        from autosp.guards import AttentionNotSharded

        warnings.warn(f"{what} {report.notes[-1]}", AttentionNotSharded, stacklevel=4)
    return fn


def whole_report(failed: Report | None, options: SPOptions, world: int, rank: int, error: BaseException) -> Report:
    """The report of a graph compiled whole after ``error``: ``failed``'s identity, none of its findings."""
    from autosp.compiler import new_graph_id

    graph_id = failed.graph_id if failed is not None else new_graph_id()
    report = Report(graph_id, options.variant, world, rank, options.backend)
    report.compiled_whole = first_line(error)[:300]
    report.notes.append(f"AutoSP failed to compile this graph ({_where(error)}): {why_whole(report)}")
    return report


def why_whole(report: Report) -> str:
    return (
        f"torch's {report.backend} compiled it as it is, and it runs whole on every rank (exact; no sequence "
        "parallelism and no AutoSP memory saving for it)"
    )


def warn_whole(report: Report, error: BaseException, what: str) -> None:
    """The ``CompiledWhole`` warning; ``CompileCrashed`` (from ``error``) where that warning is an error."""
    try:
        warnings.warn(
            f"AutoSP failed to compile {what} ({_where(error)}); {why_whole(report)}. The other graphs of the "
            "program are not affected. Please report this error with the program; warnings.simplefilter('error', "
            "autosp.CompiledWhole) raises it instead.",
            CompiledWhole,
            stacklevel=3,
        )
    except CompiledWhole:
        # As an AutoSPError, Dynamo raises it as it is, not wrapped in BackendCompilerFailed.
        frames = traceback.extract_tb(error.__traceback__)
        raised_at = f" (raised at {frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""
        raise CompileCrashed(
            f"AutoSP failed to compile {what} ({_where(error)}){raised_at}, and CompiledWhole warnings are errors; "
            "the original exception is this error's .error",
            error,
        ) from error


def _where(error: BaseException) -> str:
    notes = [n for n in getattr(error, "__notes__", ()) if n.startswith("in AutoSP pass")]
    return first_line(error)[:300] + (f", {notes[0]}" if notes else "")


__all__ = [
    "CompileCrashed",
    "CompiledWhole",
    "compile_after_crash",
    "compile_holding_writes",
    "compile_whole",
    "has_attention",
    "is_crash",
    "torch_state_restored",
    "untouched_copy",
    "warn_whole",
    "whole_report",
]
