"""Public entry points: ``autosp.compile``, ``autosp.backend``, ``autosp.explain``."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypedDict, cast

import torch
import torch.distributed as dist

from autosp import peer_failure
from autosp.canonical import inputs_in_canonical_order, permuted
from autosp.compile_agreement import (
    WHOLE_MARK,
    CapturedDigest,
    CollectiveMismatch,
    SameProgramOnEveryRun,
    agree_on_compile_joining_runs,
    program_text,
)
from autosp.embedding_renorm import write_out_renorms
from autosp.errors import ConfigError, first_line
from autosp.guards import CALL_INPUTS, GraphRuns, GuardedCall, guard_compiled, guard_graph, naming_comm_failures
from autosp.hardware import load_profile
from autosp.hardware_select import HardwareOption
from autosp.inductor_options import inductor_config
from autosp.input_check import CheckMode, InputCheck
from autosp.options import Backend, SPOptions, compile_sync_group, resolve_group
from autosp.param_check import ParameterCheck, StateDigest, check_state_on_first_run, state_name
from autosp.registry import get_registry
from autosp.report import Report
from autosp.rng_check import refuse_divergent_rng
from autosp.straight_through import ExplicitWrites, make_writes_explicit
from autosp.untracked_writes import writes_held_tensors
from autosp.weak_group import WeakGroup
from autosp.whole import (
    compile_after_crash,
    compile_holding_writes,
    is_crash,
    torch_state_restored,
    untouched_copy,
    warn_whole,
    whole_report,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from typing_extensions import Unpack  # typing.Unpack from Python 3.11 on

VERIFY_ENV = "AUTOSP_VERIFY"  # "1": the first call of an autosp.compile'd module verifies it first


class TorchCompileOptions(TypedDict, total=False):
    """The keywords ``autosp.compile`` passes on to ``torch.compile`` (all but ``backend``)."""

    fullgraph: bool
    dynamic: bool | None
    mode: str | None
    options: dict[str, str | int | bool | Callable[..., Any]] | None
    disable: bool


class VerifyOptions(TorchCompileOptions, total=False):
    """The keywords of ``autosp.compile`` but ``sp_size`` and ``group`` (``autosp.verify`` has its own)."""

    variant: str
    sac: bool | Literal["auto"]
    backend: Backend
    disable_passes: tuple[str, ...]
    grad_bucket_mb: float
    variant_options: dict[str, Any] | None
    check_inputs: CheckMode | bool
    timeout: float | timedelta | None
    hardware: HardwareOption
    tile_loss: bool | int
    tile_mlp: bool | int | Literal["auto"]
    memory_budget: int | float | None
    outputs: Literal["whole", "sharded"]


class CompileOptions(VerifyOptions, total=False):
    """The keywords of ``autosp.compile``, for functions that take them all (``autosp.explain``)."""

    sp_size: int | None
    group: ProcessGroup | None


class SPProgram(Protocol):
    """What ``autosp.compile`` returns: called like the model (a compiled module stays an ``nn.Module``)."""

    autosp_reports: list[Report]

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...


class AutoSPBackend:
    """A Dynamo backend that makes each compiled graph sequence-parallel.

    Options are checked, the variant looked up and the SP group resolved when the
    backend is made, so bad input fails before any graph runs.  ``reports`` holds
    one ``Report`` per compiled graph.

    Used directly with ``torch.compile``, each compiled graph checks its inputs across the SP
    ranks when it runs (``check_inputs``); ``autosp.compile`` checks once per call instead,
    before Dynamo runs, and sets ``check_graphs`` to False.
    """

    group = WeakGroup()
    sync_group = WeakGroup()

    def __init__(self, options: SPOptions) -> None:
        self.options = options
        self.registry = get_registry()
        self.group, self.world = resolve_group(options)
        self.registry.variant(options.variant)
        self.registry.require_sac(options.sac)
        if options.hardware is not None:
            load_profile(options.hardware)  # a missing file or unknown name fails here, not at the first call
        self.reports: list[Report] = []
        self.sync_group = compile_sync_group(options, self.world)
        self.runs = GraphRuns()
        self.check_graphs = True
        self.input_check = (
            # SPOptions has turned check_inputs=True/False into its mode.
            InputCheck(self.group, cast("CheckMode", options.check_inputs))
            if self.world > 1 and options.check_inputs != "off"
            else None
        )
        # Contents are compared where the inputs' contents are: by default, and with "hash".
        self.param_check = (
            ParameterCheck(self.group) if self.world > 1 and options.check_inputs in ("tokens", "hash") else None
        )

    def _apply_torch_options(self, mode: str | None = None, options: dict[str, Any] | None = None) -> None:
        if self._torch_options != (mode, options):
            config = inductor_config(self.options.backend, mode, options, None)
            self.options = replace(self.options, inductor_config=config)
            self._torch_options = (mode, options)

    _torch_options: tuple[str | None, dict[str, Any] | None] = (None, None)

    def __deepcopy__(self, memo: dict[int, Any]) -> AutoSPBackend:
        # copy.deepcopy of a compiled module rebuilds it from its model and Dynamo's context, this
        # backend in it: the copy would run without the call's checks, sharing nothing that makes
        # it the same program on every rank. Say what works instead.
        raise ConfigError(
            "copy.deepcopy of an AutoSP-compiled model is not supported: deep-copy the model and compile the "
            "copy (copy.deepcopy(compiled._orig_mod), then autosp.compile with the same options), or deep-copy "
            "the model before compiling it."
        )

    def __reduce__(self) -> Any:
        # torch.save or pickle of a compiled module pickles its backend (this): its process groups and
        # compiled graphs do not pickle, and torch's own words name neither the model nor the way out.
        raise ConfigError(
            "an AutoSP-compiled model cannot be saved or pickled (torch.save, pickle): save the model itself "
            "(compiled._orig_mod) or its state_dict, and call autosp.compile again after loading it."
        )

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any], **torch_options: Any) -> Callable[..., Any]:
        if torch_options:
            # torch.compile(model, backend=autosp.backend(...), mode=..., options=...) hands both here.
            self._apply_torch_options(**torch_options)

        _refuse_ddp_optimizer()
        if self.world == 1:
            _refuse_late_process_group(self.options)
            return self._compile(gm, example_inputs)
        # Inputs in an order every rank shares, whatever order this rank's trace lifted them in
        # (autosp.canonical); the graph compiled here reorders Dynamo's arguments (outermost).
        with inputs_in_canonical_order(gm) as order:
            if order is not None:
                example_inputs = [example_inputs[i] for i in order]
            return permuted(self._compile(gm, example_inputs), order)

    def _compile(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        """``_compile_once``, and once more without SAC where the ranks' recomputed collectives parted.

        Under SAC the partitioner places each recomputed collective before its first use in the
        backward, and the ranks' backward graphs differ in rank-dependent compute (a rolled piece
        that wraps on one rank only), so the ranks may recompute their collectives in different
        orders: the compile agreement then refuses it on every rank at once. Without recompute tags
        no collective is recomputed, and the backward's collectives keep the joint graph's order on every rank.
        """
        spare = untouched_copy(gm) if self.world > 1 and self.options.sac is not False else None
        before = len(self.reports)
        try:
            return self._compile_once(gm, example_inputs)
        except CollectiveMismatch as mismatch:
            if spare is None:
                raise
            del self.reports[before:]
            asked = self.options
            self.options = replace(asked, sac=False)
            try:
                fn = self._compile_once(spare, example_inputs)
            finally:
                self.options = asked
            self.reports[-1].notes.append(
                f"compiled with sac=False (asked: sac={asked.sac!r}): with recompute, the SP ranks' backward graphs "
                f"issued their recomputed collectives in different orders ({first_line(mismatch)}); exact, with the "
                "activations saved for the backward instead of recomputed (more memory)"
            )
            return fn

    def _compile_once(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        from autosp.compiler import _is_param, compile_graph

        compile_id = torch._guards.CompileContext.current_compile_id()
        what = f"graph [{compile_id}]" if compile_id is not None else "a graph"
        reported = len(self.reports)
        # Lowering would run writes into real tensors the graph holds: left to torch, whole.
        held = writes_held_tensors(gm) if self.world > 1 else []
        untouched = untouched_copy(gm) if not held else None
        if self.world > 1 and not held:
            write_out_renorms(gm)  # nn.Embedding(max_norm=...)'s write into the table, for the next step
        # Before the passes: a written input's final values become an output (see autosp.straight_through).
        explicit = make_writes_explicit(gm) if not held else ExplicitWrites()

        def compile_it() -> Callable[..., Any]:
            if held:
                return self._compile_holding_writes(gm, example_inputs, held, what)
            try:
                # No graph of an SP program comes from AOT autograd's cache: a hit skips the partition
                # and the passes, so the compile agreement would have no collective sequence to compare
                # (a rank whose cached graph parted from its peers' would wait in a collective until the
                # timeout). Inductor's FX graph cache, the costly part, still applies.
                no_cache = (
                    torch._functorch.config.patch(enable_autograd_cache=False) if self.world > 1 else nullcontext()
                )
                with torch_state_restored(), no_cache:
                    fn = compile_graph(
                        gm, example_inputs, self.options, self.registry, self.group, self.world, self.reports
                    )
                if explicit.writes:
                    self.reports[-1].notes.append(
                        f"{explicit.writes} in-place write(s) that autograd does not record made explicit "
                        "(autosp::straight_through): later reads see the written values, the gradient flows as in eager"
                    )
                return explicit.write_back(fn)
            except Exception as error:
                if untouched is None or not is_crash(error):
                    raise
                return self._compile_whole(untouched, example_inputs, error, reported, what)

        names = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
        params = [_is_param(n, x) for n, x in zip(names, example_inputs)]
        captured = captured_inputs(names, example_inputs, params, CALL_INPUTS.get())
        digest = CapturedDigest(captured if self.param_check is not None else ())
        joined_runs, agreeing = False, None
        if self.world == 1:
            fn = compile_it()
        else:
            # The backward compiles now, not at the first backward, so that a rank whose backward
            # fails to compile fails here, agreed with its peers (see autosp.compile_agreement).
            @functools.cache
            def program() -> str:
                # After the compile: the lowered graph's canonical form is compared (autosp.canonical).
                report = self.reports[reported] if len(self.reports) > reported else None
                text = program_text(gm, example_inputs, self.options, report.lowered if report else None)
                # A rank whose compile failed where its peers' did not runs whole: another program.
                return text + (WHOLE_MARK if report and report.compiled_whole else "")

            agreeing = self.sync_group if self.sync_group is not None else self.group
            with torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
                fn, joined_runs = agree_on_compile_joining_runs(
                    compile_it,
                    agreeing,
                    what,
                    program,
                    digest.fingerprints(example_inputs),
                    group_ops=lambda: self.reports[-1].group_ops,
                )
            # An error of this graph on this rank only would leave the others in its collectives.
            # Its backward too, where a collective that fails for want of a peer is named (the group
            # read at that time: it is held weakly).
            fn = peer_failure.announcing(
                fn, lambda: naming_comm_failures("a collective of the SP program's backward", self.group)
            )
            report = self.reports[-1]  # compile_graph's, appended as it began
            if report.random_ops and self.input_check is not None:
                fn = refuse_divergent_rng(fn, report.random_ops, self.input_check.rng_split, what)
        # Ranks that ran their graph met this rank's agreement in their run exchange (Dynamo
        # recompiled on this rank only, into the same program): they go on into the graph's
        # collectives, so this rank skips its first run's exchange and parameter check (their
        # weights were checked at their first run and are at every call).
        skip = joined_runs and agreeing is self.group
        if self.param_check is not None and not skip:
            fn = check_state_on_first_run(fn, names, params, self.param_check)
        if self.check_graphs and self.input_check is not None:
            fn = guard_graph(fn, names, params, self.input_check)
        if self.world > 1:
            # Outermost: the first collective of every run, so a rank that compiled anew pairs with it.
            # On the SP group: a run's collectives keep to timeout= (the world's may be 30 minutes).
            fn = SameProgramOnEveryRun(fn, self.group, what, program(), digest, skip_first=skip)
        return self.runs.wrap(fn)

    def _compile_holding_writes(
        self, gm: torch.fx.GraphModule, example_inputs: list[Any], held: list[str], what: str
    ) -> Callable[..., Any]:
        """``gm`` writes into tensors it holds (``writes_held_tensors``): torch compiles it, whole."""
        from autosp.compiler import new_graph_id

        report = Report(new_graph_id(), self.options.variant, self.world, self._rank(), self.options.backend)
        self.reports.append(report)
        return compile_holding_writes(gm, example_inputs, self.options, report, held, what)

    def _compile_whole(
        self, gm: torch.fx.GraphModule, example_inputs: list[Any], error: Exception, reported: int, what: str
    ) -> Callable[..., Any]:
        """``gm`` compiled by torch alone after AutoSP's compile of it raised ``error`` (``autosp.whole``)."""
        failed = self.reports[reported] if len(self.reports) > reported else None
        report = whole_report(failed, self.options, self.world, self._rank(), error)
        fn = compile_after_crash(gm, example_inputs, self.options, report, error)
        if failed is not None:
            self.reports[reported] = report
        else:
            self.reports.append(report)
        warn_whole(report, error, what)
        return fn

    def _rank(self) -> int:
        return dist.get_rank(self.group) if self.world > 1 else 0


def captured_inputs(
    names: Sequence[str], example_inputs: Sequence[Any], params: Sequence[bool], given: frozenset[int] | None
) -> list[tuple[int, str]]:
    """(index, name) of the graph inputs that are tensors the call was not given and not parameters or
    buffers, read from the model or the module's globals: plain tensor attributes (``self.mask = ...``,
    Dynamo's ``L_self_...``) and globals (``G_...``). A local crossing a graph break (``L_x_``) is the
    call's own value, computed alike on every rank from what was compared, and is not one.

    Only inside a guarded call (``given``: its tensors' ids); under ``torch.compile(backend=...)``
    the graph's input check compares every input that is not a parameter or buffer already.
    """
    if given is None:
        return []
    return [
        (i, state_name(name))
        for i, (name, x, p) in enumerate(zip(names, example_inputs, params))
        if not p
        and name.startswith(("L_self_", "G_"))
        and type(x) in (torch.Tensor, torch.nn.Parameter)
        and x.device.type != "meta"
        and id(x) not in given
    ]


def backend(
    *,
    sp_size: int | None = None,
    variant: str = "ulysses",
    sac: bool | Literal["auto"] = "auto",
    group: ProcessGroup | None = None,
    backend: Backend = "inductor",
    disable_passes: tuple[str, ...] = (),
    grad_bucket_mb: float = 25.0,
    check_inputs: CheckMode | bool = "tokens",
    timeout: float | timedelta | None = None,
    hardware: HardwareOption = None,
    tile_loss: bool | int = True,
    tile_mlp: bool | int | Literal["auto"] = "auto",
    memory_budget: int | float | None = None,
    outputs: Literal["whole", "sharded"] = "whole",
    **variant_options: Any,
) -> AutoSPBackend:
    """A Dynamo backend for ``torch.compile(model, backend=autosp.backend(...))``.

    Args:
        sp_size: ranks that share one sequence; ``None``: the size of ``group``.
        variant: SP variant ("ulysses"; others come with their packages).
        sac: "auto", True or False (see ``SPOptions``).
        group: SP process group; default: the world, or subgroups of ``sp_size``.
        backend: "inductor", "aot_eager" or "eager": the compiler after AutoSP.
        disable_passes: names of passes to skip.
        grad_bucket_mb: MiB per gradient all-reduce bucket (0: one collective per gradient).
        check_inputs: "tokens" (default), "shapes", "hash" or "off"/False: what the SP ranks
            compare before each compiled graph runs (see ``SPOptions``).
        timeout: seconds or ``timedelta`` for the SP group AutoSP creates (see ``SPOptions``).
        hardware: profile name, JSON profile path or ``HardwareProfile`` for the cost models
            (``None``: detect the device; see ``SPOptions``).
        tile_loss: LM head + cross entropy in token chunks: True (where it saves memory), False,
            or the rows of one chunk (see ``SPOptions``).
        tile_mlp: token-wise MLPs in token chunks, forward and backward: "auto" (default: with
            ``sac=True``), True, False, or the rows of one chunk (see ``SPOptions``).
        memory_budget: bytes, or a fraction of the device's memory, that ``sac="auto"`` fits into.
        outputs: "whole" (default) or "sharded": sequence-sharded outputs as DTensors (see ``SPOptions``).
        **variant_options: passed to the variant (for example ``ring_degree``).
    """
    options = SPOptions(
        sp_size=sp_size,
        variant=variant,
        sac=sac,
        group=group,
        backend=backend,
        disable_passes=tuple(disable_passes),
        grad_bucket_mb=grad_bucket_mb,
        variant_options=variant_options,
        check_inputs=check_inputs,
        timeout=timeout,
        tile_loss=tile_loss,
        tile_mlp=tile_mlp,
        memory_budget=memory_budget,
        hardware=hardware,
        outputs=outputs,
    )
    return AutoSPBackend(options)


_make_backend = backend  # compile()'s parameter ``backend`` (the inner compiler's name) hides this function there


def compile(  # noqa: A001 - mirrors torch.compile
    model: Callable[..., Any],
    *,
    sp_size: int | None = None,
    variant: str = "ulysses",
    sac: bool | Literal["auto"] = "auto",
    group: ProcessGroup | None = None,
    backend: Backend = "inductor",
    disable_passes: tuple[str, ...] = (),
    grad_bucket_mb: float = 25.0,
    variant_options: dict[str, Any] | None = None,
    check_inputs: CheckMode | bool = "tokens",
    timeout: float | timedelta | None = None,
    hardware: HardwareOption = None,
    tile_loss: bool | int = True,
    tile_mlp: bool | int | Literal["auto"] = "auto",
    memory_budget: int | float | None = None,
    outputs: Literal["whole", "sharded"] = "whole",
    **torch_compile_kwargs: Unpack[TorchCompileOptions],
) -> SPProgram:
    """Compile ``model`` into a sequence-parallel program.

    Every rank of the SP group calls the result with the same full-length inputs
    and gets what ``model`` returns on one device; after ``.backward()`` every
    parameter's ``.grad`` equals the single-device gradient on every rank.
    The AutoSP reports are on ``compiled.autosp_reports``. With ``AUTOSP_VERIFY=1`` the first
    call first runs ``autosp.verify`` on its inputs (an SP and a single-device step more; the compile is shared).

    With ``sp_size > 1`` each call first checks, in one small all-gather, that the SP ranks got
    inputs of the same shapes, dtypes and contents (integer and boolean tensors whole, a sample of
    each floating-point one; with ``check_inputs="hash"`` every tensor whole), and a call
    that Dynamo would run without AutoSP (its recompile limit) raises ``AutoSPError`` instead of
    running in eager. ``timeout`` bounds every collective of AutoSP (see ``SPOptions``).
    """
    be = _make_backend(
        sp_size=sp_size,
        variant=variant,
        sac=sac,
        group=group,
        backend=backend,
        disable_passes=disable_passes,
        grad_bucket_mb=grad_bucket_mb,
        check_inputs=check_inputs,
        timeout=timeout,
        tile_loss=tile_loss,
        tile_mlp=tile_mlp,
        memory_budget=memory_budget,
        hardware=hardware,
        outputs=outputs,
        **(variant_options or {}),
    )
    # Inductor's config, applied by AutoSP (torch.compile would hand these to the backend as keywords);
    # refused here, before any collective, where AutoSP cannot keep them.
    be._apply_torch_options(torch_compile_kwargs.pop("mode", None), torch_compile_kwargs.pop("options", None))
    if be.world > 1:
        # Static by default: each new length compiles once. The symbolic path refuses some models
        # (learned position tables) and its Inductor steps measured 1.9x slower; past Dynamo's
        # recompile limit the guarded call raises, saying to mark the length dynamic or bucket.
        torch_compile_kwargs.setdefault("dynamic", False)
    compiled: Any = torch.compile(model, backend=be, **torch_compile_kwargs)
    if be.world > 1:
        be.check_graphs = False  # checked once per call, before Dynamo, by the guarded call
        call = GuardedCall(
            compiled.forward if isinstance(compiled, torch.nn.Module) else compiled,
            model,
            be.group,
            be.input_check,
            be.runs,
            be.reports,
            # Later calls compare the weights too (optimizer steps, checkpoint loads), with content checks.
            StateDigest(model) if be.param_check is not None and isinstance(model, torch.nn.Module) else None,
        )
        compiled = guard_compiled(compiled, model, call)
    # On the compiled module itself: OptimizedModule's setattr would put it on the user's model,
    # where its graphs would travel with every torch.save and deepcopy of the model (and fail).
    try:
        object.__setattr__(compiled, "autosp_reports", be.reports)
    except AttributeError:
        pass
    if os.environ.get(VERIFY_ENV, "0") not in ("", "0"):
        from autosp.verify import verify_on_first_call

        verify_on_first_call(compiled, model, be, torch_compile_kwargs)
    return cast(SPProgram, compiled)


def explain(model: Callable[..., Any], *example_inputs: Any, **options: Unpack[CompileOptions]) -> str:
    """Compile and run ``model`` once on ``example_inputs``; return what AutoSP found and did.

    Takes the options of ``autosp.compile``; with ``sp_size > 1`` every rank of the
    group must call it, as the program runs once.
    """
    options.setdefault("backend", "aot_eager")
    compiled = compile(model, **options)
    compiled(*example_inputs)
    return "\n\n".join(str(r) for r in compiled.autosp_reports)


def _refuse_late_process_group(options: SPOptions) -> None:
    """``autosp.compile`` before ``init_process_group`` chose one device; called after it, that would
    silently run the whole sequence on every rank of a group the user meant to share it."""
    if options.sp_size is not None or options.group is not None:
        return  # sp_size=1 is one device on purpose
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise ConfigError(
            "autosp.compile ran before torch.distributed.init_process_group, so it compiled for one device, "
            f"but the process group now has {dist.get_world_size()} ranks: every rank would compute the whole "
            "sequence. Call autosp.compile after init_process_group, or pass sp_size=1 to compile for one "
            "device on purpose."
        )


def _refuse_ddp_optimizer() -> None:
    """Dynamo's DDPOptimizer hands the backend one piece of a DDP model per gradient bucket, and
    runs each compiled piece first on fake tensors; neither works for a program made SP as a whole."""
    tracing = torch._guards.TracingContext.try_get()
    if tracing is not None and getattr(tracing, "ddp_optimizer_ctx", None) is not None:
        raise ConfigError(
            "torch.compile of a DistributedDataParallel model with AutoSP's backend: Dynamo's DDPOptimizer "
            "splits the graph at DDP's gradient buckets, which AutoSP cannot make sequence-parallel piece by "
            "piece. Use autosp.compile (it traces the DDP model whole), set torch._dynamo.config.optimize_ddp "
            "= False, or wrap the compiled model in DDP instead."
        )


def dynamo_backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
    """``torch.compile(model, backend="autosp")``: AutoSP with default options."""
    return AutoSPBackend(SPOptions())(gm, example_inputs)


__all__ = [
    "AutoSPBackend",
    "CompileOptions",
    "SPProgram",
    "TorchCompileOptions",
    "VerifyOptions",
    "backend",
    "compile",
    "dynamo_backend",
    "explain",
]
