"""``autosp.verify``: check on short inputs that the SP program is the single-device program.

Every rank of the SP group runs two deep copies of the model on the same inputs from the same
RNG state: one through ``autosp.compile`` (the SP program), one eagerly on this device alone
(the reference). Outputs, buffers after the step and every gradient are compared
(``autosp.verify_compare``); the user's model, its ``.grad`` and the RNG state stay as they were.
"""

from __future__ import annotations

import contextlib
import copy
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree

from autosp.errors import ConfigError, VerificationError
from autosp.options import SPOptions, resolve_group
from autosp.report import Report
from autosp.verify_compare import DEFAULT_TOLERANCES, Run, TensorCheck, VerifyReport, compare_runs, tolerances

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from typing_extensions import Unpack

    from autosp.api import TorchCompileOptions, VerifyOptions

_PLAIN = (int, float, bool, complex, str, type(None), torch.dtype, torch.device)
_WEIGHT_SEED = 0x5EED
# Compiles a deep copy of the model; returns the compiled copy and the list its AutoSP reports go to.
CompileCopy = Callable[[torch.nn.Module], tuple[Callable[..., Any], list[Report]]]


# --- checks made before anything runs ------------------------------------------------------------


def _check_model(model: Any) -> None:
    from torch._dynamo.eval_frame import OptimizedModule

    if isinstance(model, OptimizedModule):
        raise ConfigError(
            "autosp.verify got an already compiled model: pass the nn.Module itself (compiled._orig_mod) "
            "with the options of autosp.compile; verify compiles a copy with them"
        )
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(
            f"autosp.verify needs a torch.nn.Module (it runs deep copies, so the model's parameters and .grad "
            f"stay untouched); got a {type(model).__name__}"
        )
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.training and m.p > 0:
            raise ConfigError(
                f"dropout is active in {name or 'the model'} (p={m.p}): its random mask differs between the SP "
                "program and the single-device reference; verify with model.eval() or p=0"
            )


def _input_name(path: tuple[Any, ...]) -> str:
    """``input[0]`` for a positional input, ``input['mask']`` for a keyword one (path into (args, kwargs))."""
    return "input" + pytree.keystr(path[1:])


def _check_inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[str, Any]]:
    """Named leaves of the inputs; refuses anything that cannot be fed twice, identically."""
    named = []
    for path, leaf in pytree.tree_flatten_with_path((args, kwargs))[0]:
        name = _input_name(path)
        if isinstance(leaf, torch.Tensor):
            if leaf.device.type == "meta" or torch._subclasses.fake_tensor.is_fake(leaf):
                raise ConfigError(f"{name} is a meta or fake tensor: autosp.verify runs the model on real data")
        elif not isinstance(leaf, _PLAIN):
            raise ConfigError(
                f"{name} is a {type(leaf).__name__}: autosp.verify feeds the same inputs to two copies of the model, "
                "so pass tensors, numbers, strings, None, or tuples/lists/dicts of them"
            )
        named.append((name, leaf))
    return named


def _check_tolerance(name: str, value: float | None) -> float | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0):
        raise ConfigError(f"{name}={value!r}; it must be a number >= 0 (or None for the default of the dtype)")
    return None if value is None else float(value)


# --- running one copy ----------------------------------------------------------------------------


def _fresh(tree: Any) -> Any:
    """Copies of the input tensors; those that require grad become leaves, so their gradient is compared.

    A tensor passed twice (``model(ids, ids)``) is copied once: the copies alias as the inputs do,
    and Dynamo's guards match the user's later calls, which then reuse verify's compiled graph.
    """
    copies: dict[int, torch.Tensor] = {}

    def copy_leaf(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if id(x) not in copies:
            c = x.detach().clone()
            copies[id(x)] = c.requires_grad_() if x.requires_grad else c
        return copies[id(x)]

    return pytree.tree_map(copy_leaf, tree)


def _weight(index: int, out: torch.Tensor, lone_scalar: bool) -> torch.Tensor | float:
    """The fixed weight of output ``index`` in the scalar that is differentiated (same on every rank)."""
    if lone_scalar:
        return 1.0
    gen = torch.Generator().manual_seed(_WEIGHT_SEED + index)
    w = torch.rand(out.shape, generator=gen, dtype=torch.float64)
    # A scalar keeps a weight near 1; a tensor's elements get +-1/numel, as a mean over tokens would,
    # so neither a loss nor a large output drowns the other's gradient.
    w = 0.5 + w if out.numel() == 1 else (2 * w - 1) / out.numel()
    return w.to(device=out.device, dtype=torch.float64 if out.dtype == torch.float64 else torch.float32)


def _run(
    call: Callable[..., Any],
    module: torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    selected: tuple[list[int], bool] | None,
    problems: list[str],
) -> tuple[Run, tuple[list[int], bool]]:
    """One forward and backward.

    ``selected``: the outputs the differentiated scalar sums, and whether it is one scalar loss
    taken as is; None (the reference): every floating output that requires grad.
    """
    args, kwargs = _fresh((args, kwargs))
    with torch.enable_grad():
        out = call(*args, **kwargs)
        # outputs="sharded" returns DTensors: compared (and differentiated) whole, as the reference's.
        out = pytree.tree_map(lambda v: v.full_tensor() if isinstance(v, DTensor) else v, out)
        flat, spec = pytree.tree_flatten_with_path(out)
        outputs = [("output" + pytree.keystr(p), v) for p, v in flat]
        if selected is None:
            chosen = [
                i
                for i, (_, v) in enumerate(outputs)
                if isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex()) and v.requires_grad
            ]
            selected = (chosen, len(chosen) == 1 and outputs[chosen[0]][1].numel() == 1)
        indices, lone = selected
        terms = []
        for i in indices:
            name, v = outputs[i] if i < len(outputs) else (f"output #{i}", None)
            if not (isinstance(v, torch.Tensor) and v.requires_grad):
                problems.append(f"{name} has a gradient path in the reference but not in the SP program")
                continue
            v = torch.view_as_real(v) if v.is_complex() else v  # both parts carry gradients
            w = _weight(i, v, lone)
            terms.append(((v * w).sum() if isinstance(w, torch.Tensor) else v * w).to(torch.float64))
        if terms:
            torch.stack(terms).sum().backward()
    grads = {n: (None if p.grad is None else p.grad.detach().clone()) for n, p in module.named_parameters()}
    for path, x in pytree.tree_flatten_with_path((args, kwargs))[0]:
        if isinstance(x, torch.Tensor) and x.requires_grad:
            grads[_input_name(path)] = None if x.grad is None else x.grad.detach().clone()
    buffers = {n: b.detach().clone() for n, b in module.named_buffers()}
    outputs = [(n, v.detach() if isinstance(v, torch.Tensor) else v) for n, v in outputs]
    return Run(outputs, spec, grads, buffers), selected


# --- agreement across ranks ----------------------------------------------------------------------


def _comm_device(group: Any) -> torch.device:
    if "gloo" in str(dist.get_backend(group)) or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _fingerprint(named: list[tuple[str, Any]]) -> torch.Tensor:
    """Two numbers per input, parameter and buffer: enough to tell differently seeded ranks apart."""
    rows = []
    for _, x in named:
        if isinstance(x, torch.Tensor):
            d = x.detach()
            d = (torch.view_as_real(d) if d.is_complex() else d).to(torch.float64)
            rows.append(torch.stack([d.sum(), d.square().sum()]).cpu())
        else:
            rows.append(torch.tensor([float(zlib.crc32(repr(x).encode())), 0.0], dtype=torch.float64))
    return torch.stack(rows) if rows else torch.zeros(0, 2, dtype=torch.float64)


def _check_same_on_every_rank(named: list[tuple[str, Any]], group: Any, world: int) -> None:
    """Every rank must hold the same inputs and parameters, or there is no single reference."""
    mine = _fingerprint(named).to(_comm_device(group))
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine, group=group)
    for r, theirs in enumerate(everyone):
        close = (theirs - mine).abs() <= 1e-6 * (theirs.abs() + mine.abs()) + 1e-12
        bad = (~close.all(dim=1)).nonzero().flatten().tolist()
        if bad:
            raise ConfigError(
                f"{named[bad[0]][0]} differs between SP ranks (rank {r} and rank {dist.get_rank(group)}): every rank "
                "of the SP group must call with the same full-length inputs and hold the same parameters (seed the "
                "model identically on every rank, or broadcast its state)"
            )


def _failed_ranks(failed: bool, group: Any, world: int) -> list[int]:
    if world == 1:
        return [0] if failed else []
    flags = torch.zeros(world, device=_comm_device(group))
    flags[dist.get_rank(group)] = float(failed)
    dist.all_reduce(flags, group=group)
    return [r for r in range(world) if flags[r] > 0]


# --- RNG and caches ------------------------------------------------------------------------------


class _RNGState:
    def __init__(self) -> None:
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)


@contextlib.contextmanager
def _compile_fresh() -> Iterator[None]:
    """Run the passes for real: an on-disk cache hit skips them (and the report with them), and its
    key covers the passes' source files, not a rule patched or registered at run time."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        yield


_verifying = False  # set while verify compiles its copy: that compile must not arm AUTOSP_VERIFY again


@contextlib.contextmanager
def _inside_verify() -> Iterator[None]:
    global _verifying
    previous, _verifying = _verifying, True
    try:
        yield
    finally:
        _verifying = previous


# --- the check -----------------------------------------------------------------------------------


def _verify(
    model: torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    named_inputs: list[tuple[str, Any]],
    group: Any,
    world: int,
    rtol: float | None,
    atol: float | None,
    compile_copy: CompileCopy,
) -> VerifyReport:
    try:
        sp_model, ref_model = copy.deepcopy(model), copy.deepcopy(model)
    except Exception as e:
        raise ConfigError(f"autosp.verify runs deep copies of the model, and copying it failed: {e}") from e
    for p in (*sp_model.parameters(), *ref_model.parameters()):
        p.grad = None
    compiled, reports = compile_copy(sp_model)
    first_report = len(reports)
    rank = dist.get_rank(group) if world > 1 else 0
    if world > 1:
        state: list[tuple[str, torch.Tensor]] = [(f"parameter {n}", p) for n, p in model.named_parameters()]
        state += [(f"buffer {n}", b) for n, b in model.named_buffers()]
        _check_same_on_every_rank(named_inputs + state, group, world)

    problems: list[str] = []
    rng = _RNGState()
    try:
        ref, selected = _run(ref_model, ref_model, args, kwargs, None, problems)
        rng.restore()
        with _compile_fresh():
            sp, _ = _run(compiled, sp_model, args, kwargs, selected, problems)
    finally:
        rng.restore()

    dtypes = [p.dtype for p in model.parameters()] + [x.dtype for _, x in named_inputs if isinstance(x, torch.Tensor)]
    dtypes += [v.dtype for _, v in ref.outputs if isinstance(v, torch.Tensor)]
    rtol, atol, tol_dtype = tolerances(dtypes, rtol, atol)
    mine = reports[first_report:]
    report = VerifyReport(
        ok=False,
        rank=rank,
        sp_size=world,
        rtol=rtol,
        atol=atol,
        tolerance_dtype=tol_dtype,
        problems=problems,
        graphs=len(mine),
        collectives=dict(sum((Counter(r.collectives) for r in mine), Counter())),
        fallbacks=[f for r in mine for f in r.fallbacks],
    )
    if not mine:
        problems.append(
            "AutoSP compiled no graph: Dynamo ran the model eagerly, so the SP program was not checked (each "
            "autosp.compile or verify of a model adds a compiled entry to its forward, and Dynamo stops at "
            "torch._dynamo.config.recompile_limit; TORCH_LOGS=recompiles shows why)"
        )
    compare_runs(report, sp, ref)
    report.failed_ranks = _failed_ranks(bool(problems), group, world)
    report.ok = not report.failed_ranks
    if not report.ok:
        raise VerificationError(report)
    return report


def verify(
    model: torch.nn.Module,
    *inputs: Any,
    sp_size: int | None = None,
    group: ProcessGroup | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    input_kwargs: dict[str, Any] | None = None,
    **options: Unpack[VerifyOptions],
) -> VerifyReport:
    """Run ``model`` as the SP program and on one device, on every rank; compare outputs and gradients.

    Call it on every rank of the SP group with the same (short) inputs and the options you give
    ``autosp.compile``. It compiles a deep copy with those options and runs it forward and
    backward, runs another deep copy eagerly on this device alone from the same RNG state, and
    compares every output, every buffer after the step and every parameter's gradient. Outputs
    other than one scalar loss are reduced to a scalar with fixed pseudo-random weights (the same
    on every rank), so the gradients through all of them are checked. ``model``, its ``.grad``
    and the RNG state are left as they were.

    Element i of a tensor passes when ``|sp_i - ref_i| <= rtol * |ref_i| + atol * scale``, where
    ``scale`` is the tensor's largest ``|ref|`` (for gradients: the largest of any gradient).

    Args:
        model: the ``nn.Module`` (not compiled), with dropout off.
        *inputs: positional inputs of ``model``; ``input_kwargs``: its keyword inputs.
        sp_size, group: as in ``autosp.compile``.
        rtol, atol: tolerances; by default those of the least precise floating dtype among
            parameters, inputs and outputs (``DEFAULT_TOLERANCES``).
        **options: the other options of ``autosp.compile`` (``variant``, ``backend``, ``sac``, ...).

    Returns:
        The ``VerifyReport`` (``ok`` is True).

    Raises:
        VerificationError: on every rank when any rank finds a difference; ``.report`` holds it.
        ConfigError: bad options or inputs (before any collective), or inputs or parameters
            that differ between the ranks.
    """
    from autosp.api import compile as autosp_compile

    _check_model(model)
    kwargs = dict(input_kwargs or {})
    named_inputs = _check_inputs(inputs, kwargs)
    rtol, atol = _check_tolerance("rtol", rtol), _check_tolerance("atol", atol)
    group, world = resolve_group(SPOptions(sp_size=sp_size, group=group))

    def compile_copy(sp_model: torch.nn.Module) -> tuple[Callable[..., Any], list[Report]]:
        with _inside_verify():
            compiled = autosp_compile(sp_model, sp_size=world, group=group, **options)
        return compiled, compiled.autosp_reports

    return _verify(model, inputs, kwargs, named_inputs, group, world, rtol, atol, compile_copy)


def verify_on_first_call(compiled: Any, model: Any, backend: Any, torch_compile_kwargs: TorchCompileOptions) -> None:
    """``AUTOSP_VERIFY=1``: the first call of ``compiled`` first verifies ``model`` on its inputs.

    The copy is compiled with ``compiled``'s own backend, so the user's call reuses that graph
    when Dynamo's guards match (they do for a plain module; state that Dynamo guards by identity
    costs one more compile). The check adds one SP and one single-device forward and backward on
    those inputs; it stays armed until it passes, so a program that fails it never runs.
    """
    if _verifying:
        return
    if not isinstance(model, torch.nn.Module) or not isinstance(compiled, torch.nn.Module):
        raise ConfigError(
            f"AUTOSP_VERIFY=1 verifies nn.Module models and a {type(model).__name__} is not one: unset AUTOSP_VERIFY, "
            "or call autosp.verify on the module that holds the parameters"
        )
    handle: Any = None

    def compile_copy(sp_model: torch.nn.Module) -> tuple[Callable[..., Any], list[Report]]:
        return torch.compile(sp_model, backend=backend, **torch_compile_kwargs), backend.reports

    def first_call(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        _check_model(model)
        named_inputs = _check_inputs(args, kwargs)
        _verify(model, args, kwargs, named_inputs, backend.group, backend.world, None, None, compile_copy)
        handle.remove()

    handle = compiled.register_forward_pre_hook(first_call, with_kwargs=True)


__all__ = ["DEFAULT_TOLERANCES", "TensorCheck", "VerifyReport", "verify", "verify_on_first_call"]
