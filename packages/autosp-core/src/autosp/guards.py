"""Guards around AutoSP's compiled calls, so an SP run fails loudly instead of silently or never.

Three failures are caught here, on every rank of the SP group:

* the ranks were called with different inputs (``input_check``), checked before any collective
  of the SP program runs;
* Dynamo would run the call without AutoSP: at its recompile limit it falls back to eager for
  good (no sequence parallelism, the whole sequence's memory on every rank), and with
  ``suppress_errors`` so does any compile error. Both become errors for AutoSP's own calls only;
  a call that ran no AutoSP graph at all (``torch.compiler.set_stance("force_eager")``, a disabled
  Dynamo) is an error after the fact;
* a collective that fails because another rank is gone, raised or hangs (after the group's
  timeout) is reported as such, naming the group's ranks.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import re
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
from torch._dynamo.exc import FailOnRecompileLimitHit
from torch.fx.experimental.symbolic_shapes import ConstraintViolationError
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from autosp import arrivals, dynamo_fixes, peer_failure
from autosp.eager_work import eager_work, eager_work_message
from autosp.errors import AutoSPError, CollectiveFailure
from autosp.input_check import (
    GradientMismatchError,
    InputCheck,
    InputMismatchError,
    Leaf,
    StateMismatchError,
    StepMismatchError,
    flatten_inputs,
    program_state,
    signature_of,
    tensor_meta,
)
from autosp.options import timeout_phrase
from autosp.peer_failure import is_comm_failure
from autosp.rng_check import refuse_eager_draws
from autosp.sharded_outputs import SHARDED_ACROSS_BREAK
from autosp.weak_group import WeakGroup

_MAX_SEEN = 12


class InputMismatch(AutoSPError):
    """The SP ranks were called with different inputs (shapes, dtypes or contents, as ``check_inputs`` compares)."""


class StepMismatch(AutoSPError):
    """Some SP ranks ran a backward of the compiled program while others called it: their steps differ."""


class GradientMismatch(AutoSPError):
    """The SP ranks backpropagated different gradients into the compiled program (another loss per rank)."""


class EagerFallback(AutoSPError):
    """Dynamo would run (or ran) the call without AutoSP, so without sequence parallelism."""


class NotSequenceParallel(UserWarning):
    """Every graph of the program runs whole on every rank: exact, but nothing is sequence-parallel."""


class RanInEager(UserWarning):
    """Parameters or attention were used by code Dynamo ran in eager: it ran whole on every rank (exact)."""


class AttentionNotSharded(UserWarning):
    """An attention call runs whole on every rank (exact, no memory saving for it); the rest stays SP."""


def not_sharded_message(world: int, reports: Sequence[Any]) -> str:
    failed = [r for r in reports if r.compiled_whole]
    if len(failed) == len(reports):
        return (
            f"sp_size={world}, but none of the {len(reports)} compiled graph(s) of this program is "
            f"sequence-parallel: AutoSP failed to compile them ({failed[0].compiled_whole}), so torch compiled "
            "them as they are and every rank computes the whole sequence (the results are exact, the memory and "
            "time are one device's on every rank). The CompiledWhole warning says where it failed; please "
            "report it with the program."
        )
    notes = [n for r in reports if not r.compiled_whole for n in r.notes if "runs whole" in n or "no attention" in n]
    found = (
        f"AutoSP failed to compile {len(failed)} of them ({failed[0].compiled_whole}; see the CompiledWhole warning) "
        "and no attention was found in the others"
        if failed
        else "no attention was found in them"
    )
    return (
        f"sp_size={world}, but none of the {len(reports)} compiled graph(s) of this program is sequence-parallel: "
        f"{found}, so every rank computes the whole sequence (the results are exact, the "
        "memory and time are one device's on every rank)"
        + (f" ({notes[0]})" if notes else "")
        + ". If the model computes attention in a form AutoSP does not recognise (written attention is found as "
        "two matmuls around a softmax over the last axis, through @, torch.matmul, bmm, baddbmm or einsum), call "
        "it through torch.nn.functional.scaled_dot_product_attention (Hugging Face: attn_implementation='sdpa'); "
        "compiled.autosp_reports says what each graph holds."
        + (
            f" Dynamo split this program into {len(reports)} graphs: attention that runs at a graph break (a "
            "print or warnings.warn inside it, as nn.MultiheadAttention warns when given a float attn_mask with "
            "a bool key_padding_mask) is compiled by none of them; TORCH_LOGS=graph_breaks names each break."
            if len(reports) > 1
            else ""
        )
    )


def comm_failure_message(where: str, group: Any, e: BaseException) -> str:
    ranks = dist.get_process_group_ranks(group)
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    within = timeout_phrase(group)
    note = peer_failure.peer_note(group)
    cause = f" (global rank {note[0]}: {note[1]})" if note else ""
    late = arrivals.behind(group)
    never = f" {arrivals.not_begun(late)}" if late else ""
    return (
        f"global rank {dist.get_rank()}: {where} did not complete ({first}). Another rank of the SP group "
        f"(global ranks {ranks}) did not take part within {within}: it raised an error{cause}, exited or hangs, "
        f"and its own log holds the first error.{never} Every rank of the SP group must call the compiled model, with "
        "the same inputs, at every step (autosp.compile(timeout=...) sets how long the others wait)."
    )


@contextlib.contextmanager
def naming_comm_failures(where: str, group: Any) -> Iterator[None]:
    """A collective in this block that fails for want of a peer raises ``CollectiveFailure``, saying ``where``."""
    try:
        yield
    except AutoSPError:
        raise
    except Exception as e:
        if is_comm_failure(e):
            raise CollectiveFailure(comm_failure_message(where, group, e)) from e
        raise


_PLAIN = ("int ", "float ", "bool ", "str ")


def _shapes(leaves: Sequence[Leaf]) -> str:
    """The tensors' shapes and, after " with ", the plain values: Dynamo compiles a graph per value
    of a plain argument (under SP, ``dynamic=False``), so either can be what asked for a new graph."""
    shapes = ", ".join(f"{leaf.path} {list(leaf.tensor.shape)}" for leaf in leaves if leaf.tensor is not None)
    plain = [leaf for leaf in leaves if leaf.tensor is None and leaf.meta.startswith(_PLAIN)]
    values = ", ".join(f"{leaf.path}={leaf.meta.split(' ', 1)[1]}" for leaf in plain)
    return f"{shapes} with {values}" if values else shapes


def _changed_values(now: str, seen: Sequence[str]) -> str:
    """Why a call (``_shapes`` of it) whose tensors have an earlier call's shapes still needs a graph."""
    tensors, _, values = now.partition(" with ")
    if not values or not any(entry.partition(" with ")[0] == tensors for entry in seen):
        return ""
    return (
        f"Its tensors have the shapes of an earlier call: a plain value differs ({values}), "
        "and each new value of a plain int or float argument compiles another graph. Pass a value that "
        "changes from call to call as a tensor (torch.tensor(n)), or keep it constant. "
    )


class _RecompileReason(logging.Handler):
    """Keeps Dynamo's reason for the recompile that hit the limit: Dynamo only logs it."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.last: str | None = None
        self.function: str | None = None  # "'name' (file:line)" of the code that hit the limit

    def emit(self, record: logging.LogRecord) -> None:
        if isinstance(record.msg, str) and record.msg.startswith("torch._dynamo hit config.") and record.args:
            args = record.args if isinstance(record.args, tuple) else ()
            if len(args) >= 4 and args[3]:
                self.last = " ".join(str(args[3]).split())[:600]
            if len(args) >= 3 and args[2]:
                self.function = str(args[2])[:400]


_DYNAMO_LOG = logging.getLogger("torch._dynamo.convert_frame")


def _same_inputs(now: str, seen: Sequence[str], reason: str | None) -> str:
    """Why a call with an earlier call's inputs exactly still needs a graph: something else it reads."""
    if now not in seen:
        return ""
    return (
        "Its inputs are an earlier call's, so the code recompiles for something else it reads: an int or "
        "float attribute of a module that changes (a step counter: self.step += 1), a global, a Python flag"
        + (f"; Dynamo's reason: {reason}" if reason else "")
        + ". Keep such a value in a tensor (a buffer) or constant across calls. "
    )


def _within_one_call(limit: int, now: str, reason: str | None, function: str | None) -> str:
    """The limit reached in the program's first call: code it runs over and over (a loop calling a
    function with another Python number each time) is compiled once per value."""
    return (
        f"Dynamo's recompile limit (torch._dynamo.config.recompile_limit={limit}) is reached inside the first "
        f"call ({now or 'no tensor inputs'}): Dynamo has compiled {function or 'a function'} that many times "
        "(counting earlier compiles of the same code in this process), once for each value of something it reads "
        f"(Dynamo's reason: {reason or 'not logged'}), as when a loop calls a function with another Python number "
        "each time. Past the limit Dynamo would run it in eager, unannounced. Raise torch._dynamo.config.recompile_limit above the number of values it "
        "takes, or mark that function torch.compiler.disable: it then runs in eager on whole tensors (exact, "
        "not sequence-parallel), and compiled.autosp_reports names the parameters it reads. "
        "TORCH_LOGS=recompiles says why each graph recompiled."
    )


def recompile_message(
    leaves: Sequence[Leaf], seen: Sequence[str], reason: str | None = None, function: str | None = None
) -> str:
    limit = torch._dynamo.config.recompile_limit
    if not seen:
        return _within_one_call(limit, _shapes(leaves), reason, function)
    tensors = [leaf for leaf in leaves if leaf.tensor is not None and leaf.tensor.dim() > 0]
    example = "input_ids, 1"
    if tensors:
        t = tensors[0]
        example = f"{t.path}, {1 if t.tensor is not None and t.tensor.dim() > 1 else 0}"
    earlier = "; ".join(seen) if seen else "none recorded"
    now = _shapes(leaves)
    what = (
        f"Dynamo's recompile limit is reached (torch._dynamo.config.recompile_limit={limit}): this call "
        f"({now or 'no tensor inputs'}) needs another graph, and Dynamo would run it and every later "
        "new shape in eager, without sequence parallelism and with the whole sequence's memory on every rank. "
        f"Inputs of the earlier calls: {earlier}. "
    )
    same = _same_inputs(now, seen, reason)
    if same:
        return what + same + "TORCH_LOGS=recompiles says why each graph recompiled."
    return (
        what + f"{_changed_values(now, seen)}Mark the sequence length "
        f"dynamic so one graph serves every length (torch._dynamo.mark_dynamic({example}) on each batch before "
        "the call), pad batches to a few bucket lengths (multiples of sp_size), or raise "
        "torch._dynamo.config.recompile_limit. TORCH_LOGS=recompiles says why each graph recompiled."
    )


class _BackwardHooks:
    """Whether a module's backward hooks run in a call of ``model`` (``register_full_backward_hook``, ...).

    Asked on every call: the module list is walked again only after a hook handle was made anywhere
    (torch numbers them all), since walking a 32-layer Llama's 423 modules costs ~0.3 ms and reading
    their hook dicts from a list a tenth of it.
    """

    def __init__(self, model: Any) -> None:
        self.model = model
        self.stamp = -1
        self.modules: list[torch.nn.Module] = []

    def __call__(self) -> bool:
        from torch.nn.modules import module as nn_module
        from torch.utils.hooks import RemovableHandle

        if nn_module._global_backward_hooks or nn_module._global_backward_pre_hooks:
            return True
        if RemovableHandle.next_id != self.stamp:
            self.stamp = RemovableHandle.next_id
            self.modules = list(self.model.modules()) if isinstance(self.model, torch.nn.Module) else []
        return any(m._backward_hooks or m._backward_pre_hooks for m in self.modules)


@contextlib.contextmanager
def _hard_dynamo_failures(nested: bool = True) -> Iterator[None]:
    """Dynamo's recompile limit and compile errors raise instead of falling back to eager, a
    DDP-wrapped model is traced whole, and module hooks are guarded.

    Dynamo by default does not guard on modules' hook dicts (``skip_nnmodule_hook_guards``): a hook
    registered after the first call would be silently ignored, or, registered on some ranks only,
    run on none. Guarded, a new hook recompiles, and the compile agreement compares the programs.

    Dynamo's DDPOptimizer would cut the graph at DDP's gradient buckets and run each piece's
    compiled program once on fake tensors: AutoSP's pieces would each lose the others' attention,
    and a fake gradient reached DDP's reducer. Whole, DDP's own hooks reduce the gradients.

    A checkpointed layer (HF's ``gradient_checkpointing_enable()``) whose forward sets a Python
    variable (transformers 5's hub-kernel layers set and reset a context variable around attention)
    is traced as one checkpoint op with its side effects applied once, in the forward
    (``skip_fwd_side_effects_in_bwd_under_checkpoint``). Otherwise Dynamo refuses the checkpoint op
    and runs the layer in eager, outside every graph: the attention of Qwen3, Gemma, Granite and
    others then ran whole on every rank. Eager checkpointing would apply those Python side effects
    again in the recomputation; the recomputed tensors are the traced forward's, so values and
    gradients keep.

    A graph break inside code Dynamo does not compile as a frame of its own (torch's own modules:
    ``nn.TransformerEncoder`` reads ``.item()`` to tell whether its mask is causal) resumes inside that
    code (``nested_graph_breaks``). Otherwise Dynamo runs the whole call that holds the break in
    eager: the encoder's layers ran outside every graph, whole on every rank, with nothing sharded.
    ``nested=False`` leaves it off: a module with backward hooks breaks the graph inside a list
    comprehension of torch's hook setup, which Dynamo 2.13 cannot resume (an ``UnboundLocalError``;
    plain ``torch.compile`` fails the same way with nested breaks on). That module's call then runs
    in eager, which ``autosp.RanInEager`` reports.

    The inference fast path of ``nn.TransformerEncoderLayer`` and ``nn.MultiheadAttention`` (taken in
    eval under ``torch.no_grad()``) is switched off: it computes attention inside one fused kernel
    (``aten._transformer_encoder_layer_fwd``), which no rule can split, so the whole program ran on
    every rank. The other path computes the same function through SDPA (equal to fp32 rounding). A
    module global, not a context variable: eager code in another thread during the call takes the
    slow path too, with the same results.

    Nested breaks need Dynamo fixes torch 2.13 lacks (``autosp.dynamo_fixes``): a module hook
    registered inside the call (transformers' output capturing) crashed otherwise. They hold for
    this context only, not for other compiles in the process.

    Set and restored by hand: ``config.patch`` costs ~0.1 ms a call, an attribute ~10 us. The
    values are context variables in torch 2.13, so other threads are not affected.
    """
    fixes = dynamo_fixes.applied() if nested else contextlib.nullcontext()
    cfg = torch._dynamo.config
    names = (
        "fail_on_recompile_limit_hit",
        "suppress_errors",
        "optimize_ddp",
        "skip_nnmodule_hook_guards",
        "skip_fwd_side_effects_in_bwd_under_checkpoint",
        "nested_graph_breaks",
    )
    saved = [getattr(cfg, n) for n in names]
    for name, value in zip(names, (True, False, False, False, True, nested)):
        setattr(cfg, name, value)
    fastpath = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with fixes:
            yield
    finally:
        for name, value in zip(names, saved):
            setattr(cfg, name, value)
        torch.backends.mha.set_fastpath_enabled(fastpath)


# The ids of the tensors the current guarded call was given (None outside one): the backend tells
# them from tensors its graphs read that the call was not given (plain tensor attributes, globals).
CALL_INPUTS: contextvars.ContextVar[frozenset[int] | None] = contextvars.ContextVar("autosp_call_inputs", default=None)


def refuse_dispatch_modes() -> None:
    """Refuse a call under a ``TorchDispatchMode`` that Dynamo does not compile under, before Dynamo sees it.

    Dynamo runs such a frame in eager and marks its code skipped until ``torch._dynamo.reset()``:
    every later call of the same forward, outside the mode too and through a new ``autosp.compile``,
    would run in eager.
    Refused here, before the input check's collective, the forward's code is never marked.
    """
    modes = [
        type(m).__name__
        for m in _get_current_dispatch_mode_stack()
        # ignore_compile_internals is newer than some GPU images' torch
        if not m.is_infra_mode() and not getattr(m, "ignore_compile_internals", lambda: False)()
    ]
    if not modes:
        return
    error = EagerFallback(
        f"the compiled model was called under a TorchDispatchMode ({', '.join(modes)}): Dynamo does not compile "
        "under one, so the call would run in eager, the whole sequence on every rank, and Dynamo would skip this "
        "forward's code in every later call too. Call the compiled model outside the mode (count FLOPs or trace "
        "ops on the model itself, uncompiled, or with sp_size=1); torch.utils.checkpoint(..., debug=True) "
        "is such a mode."
    )
    peer_failure.announce(error)  # the ranks without the mode wait in the input check: they fail at once
    raise error


class GraphRuns:
    """Counts the runs of AutoSP's compiled graphs, to tell a call that ran none of them."""

    def __init__(self) -> None:
        self.count = 0

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return fn(*args, **kwargs)

        return run


class GuardedCall:
    """What ``autosp.compile`` returns runs through this on every SP rank.

    Per call: the input check (one all-gather of five int64 per rank: the inputs' digests, the
    model's weights' (``param_check.StateDigest``, with content checks) and the RNG states', unless
    ``check_inputs="off"``),
    then the compiled call with Dynamo's recompile limit and suppressed errors made hard errors
    (only during this call, in this thread), then a check that an AutoSP graph ran.
    """

    group = WeakGroup()
    # A compiled program called inside another torch.compile: Dynamo would inline the model (an
    # OptimizedModule's _orig_mod, or this call's body) under the outer backend, without AutoSP and
    # silently whole on every rank. Disabled, Dynamo breaks the graph at the call and runs it here.
    _torchdynamo_disable = True
    _torchdynamo_disable_msg = "an autosp.compile'd program runs as AutoSP compiled it, not inlined into another graph"

    def __init__(
        self,
        fn: Callable[..., Any],
        model: Any,
        group: Any,
        check: InputCheck | None,
        runs: GraphRuns,
        reports: Sequence[Any] = (),
        state: Any = None,
    ) -> None:
        self.fn = fn
        self.state = state  # a param_check.StateDigest, or None
        self.group = group
        self.check = check
        self.runs = runs
        self.reports = reports
        self.warned = False
        self.warned_eager = False
        self.signature = signature_of(model)
        self.model = model
        self.seen: list[str] = []
        self.backward_hooks = _BackwardHooks(model)
        functools.update_wrapper(self, fn)

    @torch.compiler.disable(reason=_torchdynamo_disable_msg)  # type: ignore[untyped-decorator]
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        arrivals.arrive()  # first: a rank that refuses below has still begun the call its peers wait in
        refuse_dispatch_modes()
        leaves = flatten_inputs(args, kwargs, self.signature)
        if self.check is not None:
            state = self.state.fingerprints() if self.state is not None else None
            run_check(self.check, [*leaves, *program_state(self.model)], state)
        before = self.runs.count
        compiled_before = len(self.reports)
        reasons = _RecompileReason()
        _DYNAMO_LOG.addHandler(reasons)
        try:
            given = CALL_INPUTS.set(frozenset(id(leaf.tensor) for leaf in leaves if leaf.tensor is not None))
            try:
                with _hard_dynamo_failures(nested=not self.backward_hooks()):
                    out = self.fn(*args, **kwargs)
            except BaseException as e:
                # Raised between graphs too (code Dynamo runs in eager): the others wait in the next.
                peer_failure.announce(e)
                raise
            finally:
                CALL_INPUTS.reset(given)
                _DYNAMO_LOG.removeHandler(reasons)
        except FailOnRecompileLimitHit as e:
            raise EagerFallback(recompile_message(leaves, self.seen, reasons.last, reasons.function)) from e
        except AutoSPError:
            raise
        except ConstraintViolationError as e:
            # A length marked dynamic that the graph fixed: AutoSP's lowering can specialise it
            # (a projection's bias broadcast over it), as can an unmarked input of that length.
            raise AutoSPError(
                "a length marked dynamic (torch._dynamo.mark_dynamic) was fixed to this call's value while "
                "compiling: AutoSP's lowering specialised it for this model, or another input of that length "
                "was not marked. Compile without marking it dynamic (each new length compiles once, up to "
                "the recompile limit), or mark every input that carries the length. Dynamo's error: "
                + str(e).strip().splitlines()[0]
            ) from e
        except Exception as e:
            if is_comm_failure(e):
                raise CollectiveFailure(comm_failure_message("a collective of the SP program", self.group, e)) from e
            if "DTensor" in str(e) and any("outputs='sharded'" in o for r in self.reports for o in r.outputs):
                # Dynamo traced code after a graph break with a DTensor from the graph before it: it
                # fails there, before any AutoSP graph could refuse the DTensor input itself.
                raise AutoSPError(SHARDED_ACROSS_BREAK + f" ({type(e).__name__}: {str(e).splitlines()[0]})") from e
            raise
        if self.runs.count == before:
            raise EagerFallback(
                "this call ran without AutoSP: no AutoSP graph ran, so Dynamo ran the model in eager: every rank "
                "computed the whole sequence, without sequence parallelism. Either Dynamo skipped the forward "
                "(a graph break it cannot resume from, such as one inside a loop over layers, or a data-dependent "
                "branch there: TORCH_LOGS=graph_breaks shows where; move it out of the loop or make it a tensor "
                "op), or the forward ran uncompiled on purpose (torch.compiler.set_stance('force_eager'), "
                "torch._dynamo.config.disable, a torch.compiler.disable'd forward). Call the model compiled, or "
                "compile it with sp_size=1."
            )
        if not self.warned and self.reports and all(r.seq_len is None for r in self.reports):
            self.warned = True  # once per program: its first call compiled what it runs
            warnings.warn(not_sharded_message(dist.get_world_size(self.group), self.reports), NotSequenceParallel, 2)
        if not self.warned_eager and len(self.reports) > compiled_before and isinstance(self.model, torch.nn.Module):
            # Walked only when this call compiled something: a call's first run shows its eager code.
            eager = eager_work(out, self.model.named_parameters(), [leaf.tensor for leaf in leaves])
            if eager:
                self.warned_eager = True
                message = eager_work_message(dist.get_world_size(self.group), eager)
                self.reports[-1].notes.append(message)
                warnings.warn(message, RanInEager, 2)
        shapes = _shapes(leaves)
        if len(self.seen) < _MAX_SEEN and shapes not in self.seen:
            self.seen.append(shapes)
        if self.check is not None:
            refuse_eager_draws(self.check.rng_mine, self.check.rng_split)
            check_backward(self.check, out)
        return out


def run_check(check: InputCheck, leaves: list[Leaf], state: list[tuple[str, int]] | None = None) -> None:
    """The input check, its failures as AutoSP errors (it is the first collective of a call)."""
    try:
        with naming_comm_failures("the input check (the first collective of every call)", check.group):
            check(leaves, state)
    except InputMismatchError as e:
        raise InputMismatch(str(e)) from None
    except StepMismatchError as e:
        raise StepMismatch(str(e)) from None
    except StateMismatchError as e:
        from autosp.param_check import ParameterMismatch, mismatch_message  # it imports this module

        raise ParameterMismatch(mismatch_message(e.gathered, e.ranks, "that the model holds")) from None


def check_backward(check: InputCheck, out: Any) -> None:
    """Start each backward through ``out`` with the input check's all-gather, marked as a backward,
    carrying statistics of the incoming gradient.

    A rank that skipped a backward (or ran an extra forward) would otherwise pair its next call's
    collectives with the other ranks' backward ones and wait until the timeout; meeting in the
    same all-gather, every rank raises ``StepMismatch`` at once. And the outputs are the same on
    every rank, so their gradients must be: a loss scaled or labelled per rank would give every
    rank the gradients of another loss, silently (``GradientMismatch``). A hook on the outputs, not
    an op in the backward graph: it runs before any of the call's graphs' backwards, graph breaks
    included. On the outputs' nodes, not the tensors: a node's pre-hook sees the gradient after
    every hook on the tensor (``loss.register_hook(lambda g: g * scale)``, a scale per rank too).
    """
    # Plain tensors the program computed: a DTensor's gradient arrives through its own local tensor,
    # and a leaf returned as it came (a tensor passed in) lives on, so hooks on it would pile up.
    tensors = [t for t in pytree.tree_leaves(out) if type(t) is torch.Tensor and t.grad_fn is not None]
    if not tensors:
        return
    slots: dict[int, tuple[Any, list[int]]] = {}  # the outputs' nodes, and which of their outputs they are
    for t in tensors:
        slots.setdefault(id(t.grad_fn), (t.grad_fn, []))[1].append(t.output_nr)
    checked: list[int] = []  # the backward (graph task) that ran the check: once per backward

    def before(nrs: list[int]) -> Callable[[tuple[Any, ...]], None]:
        def at_backward(grads: tuple[Any, ...]) -> None:
            task = torch._C._current_graph_task_id()
            if checked and checked[0] == task:
                return
            checked[:] = [task]
            grad = next((grads[i] for i in nrs if i < len(grads) and isinstance(grads[i], torch.Tensor)), None)
            try:
                with naming_comm_failures("the backward's step check (its first collective)", check.group):
                    check.backward(grad)
            except StepMismatchError as e:
                raise StepMismatch(str(e)) from None
            except GradientMismatchError as e:
                raise GradientMismatch(str(e)) from None

        # Not traced by Dynamo when the backward runs from a compiled frame (see peer_failure's wrapper).
        return cast("Callable[[tuple[Any, ...]], None]", torch.compiler.disable(at_backward, recursive=True))

    for node, nrs in slots.values():
        node.register_prehook(before(nrs))


def _graph_input_name(name: str) -> str:
    # Dynamo names placeholders after their source: L_input_ids_, L_batch_ids_.
    match = re.fullmatch(r"L_(.+)_", name)
    return match.group(1) if match else name


def guard_graph(
    fn: Callable[..., Any], names: Sequence[str], is_param: Sequence[bool], check: InputCheck
) -> Callable[..., Any]:
    """For ``torch.compile(backend=autosp.backend(...))``: the input check inside each compiled graph.

    It runs after Dynamo's guards, so ranks whose shapes differ may first compile different
    graphs; a shape that one rank cannot compile leaves the others waiting until the timeout.
    """
    keep = [i for i, p in enumerate(is_param) if not p]

    @functools.wraps(fn)
    def run(*args: Any) -> Any:
        leaves = []
        for i in keep:
            x = args[i]
            name = _graph_input_name(names[i])
            if isinstance(x, torch.Tensor):
                leaves.append(Leaf(name, tensor_meta(x), x))
            elif isinstance(x, (int, float, bool, torch.SymInt)):
                leaves.append(Leaf(name, f"{type(x).__name__} {int(x) if isinstance(x, torch.SymInt) else x!r}"))
        run_check(check, leaves)
        with naming_comm_failures("a collective of the SP program", check.group):
            out = fn(*args)
        check_backward(check, out)
        return out

    return run


def guard_compiled(compiled: Any, model: Any, call: GuardedCall) -> Any:
    """Route calls of ``torch.compile``'s result through ``call``, keeping its type and attributes.

    A compiled module keeps being the ``OptimizedModule`` (hooks, ``state_dict``, ``_orig_mod``):
    only its ``forward`` is replaced. A compiled function becomes ``call`` itself.
    """
    if isinstance(compiled, torch.nn.Module):
        compiled.forward = call
        return compiled
    return call


__all__ = [
    "CALL_INPUTS",
    "AttentionNotSharded",
    "CollectiveFailure",
    "EagerFallback",
    "GradientMismatch",
    "GraphRuns",
    "GuardedCall",
    "InputMismatch",
    "NotSequenceParallel",
    "RanInEager",
    "StepMismatch",
    "check_backward",
    "comm_failure_message",
    "guard_compiled",
    "guard_graph",
    "is_comm_failure",
    "naming_comm_failures",
    "recompile_message",
    "run_check",
]
