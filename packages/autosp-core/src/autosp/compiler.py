"""The Dynamo backend: run the passes stage by stage around AOT autograd and the inner compiler."""

from __future__ import annotations

import functools
import hashlib
import inspect
import itertools
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import torch
import torch.distributed as dist
from torch._functorch.aot_autograd import aot_module_simplified
from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition
from torch._guards import detect_fake_mode
from torch._inductor.custom_graph_pass import CustomPartitionerFn

from autosp.context import CompileContext
from autosp.discarded_outputs import drop_discarded, reach_alone
from autosp.hardware_select import resolve as resolve_hardware
from autosp.options import SPOptions
from autosp.passes.collective_order import group_op_sequence, group_size_label, never_merged
from autosp.passes.manager import PassManager, Stage
from autosp.registry import Registry
from autosp.report import Report
from autosp.rng_check import python_draws, random_ops
from autosp.sharded_outputs import refuse_dtensor_inputs, wrap_outputs
from autosp.torch_compat import saved_tensor_hooks_off

_graph_ids = itertools.count()
_P = ParamSpec("_P")
_R = TypeVar("_R")


def _fake_inputs(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> tuple[list[Any], Any]:
    """Fake inputs to trace with, and their fake mode.

    With symbolic shapes, Dynamo's own fakes (placeholder ``example_value``) carry the
    sizes as symbols of its ShapeEnv, so the rewrite stays valid for every length.
    """
    values = [n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"]
    symbolic = any(isinstance(v, torch.SymInt) for v in values) or any(
        isinstance(v, torch.Tensor) and any(not isinstance(s, int) for s in v.shape) for v in values
    )
    if symbolic:
        mode = next(v.fake_mode for v in values if isinstance(v, torch.Tensor))
        fakes = [v if v is not None else mode.from_tensor(x) for v, x in zip(values, example_inputs)]
        return fakes, mode
    # The backend's fake mode (the tracing context's), not the one Dynamo traced with.
    fake_mode = detect_fake_mode(example_inputs)
    if fake_mode is None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        fake_mode = FakeTensorMode()
    fakes = [fake_mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in example_inputs]
    return fakes, fake_mode


def _is_param(name: str, x: Any) -> bool:
    # Parameters and buffers (RoPE tables, position tables) are never sequence-shaped inputs.
    return isinstance(x, torch.nn.Parameter) or "_parameters_" in name or "_buffers_" in name


def make_context(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    options: SPOptions,
    registry: Registry,
    group: Any,
    world: int,
) -> CompileContext:
    rank = dist.get_rank(group) if world > 1 else 0
    names = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
    fakes, fake_mode = _fake_inputs(gm, example_inputs)
    variant = registry.variant(options.variant) if world > 1 else None
    graph_id = new_graph_id()
    report = Report(graph_id, options.variant, world, rank, options.backend)
    ctx = CompileContext(
        options=options,
        registry=registry,
        variant=variant,
        group=group,
        world=world,
        rank=rank,
        graph_id=graph_id,
        hardware=None,  # set below, once the device is known
        example_inputs=list(example_inputs),
        fake_inputs=fakes,
        fake_mode=fake_mode,
        is_param=[_is_param(n, x) for n, x in zip(names, example_inputs)],
        input_names=names,
        report=report,
    )
    ctx.hardware, report.hardware = resolve_hardware(options.hardware, ctx.device, registry)
    return ctx


def new_graph_id() -> int:
    """The id of a graph compiled now (``Report.graph_id``), in the order of compiles."""
    return next(_graph_ids)


def _package_dir(fn: Callable[..., Any]) -> Path:
    """Directory of the top-level package that defines ``fn``."""
    top = sys.modules[fn.__module__.split(".")[0]]
    return Path(inspect.getsourcefile(top) or top.__file__).parent


class _Partitioner:
    """Joint-stage passes, then the partitioner the passes asked for."""

    def __init__(self, manager: PassManager, ctx: CompileContext) -> None:
        self.manager, self.ctx = manager, ctx

    @functools.cached_property
    def _key(self) -> str:
        ctx = self.ctx
        digest = hashlib.sha256()
        # Whole packages, not the pass functions' files: a pass's policy often lives beside its registration.
        for root in sorted({_package_dir(p.fn) for p in self.manager.passes}):
            for path in sorted(root.rglob("*.py")):
                digest.update(path.read_bytes())
        opts = ctx.options
        # The group's name is baked into the collectives, so a graph cached for another group must not match.
        group = ctx.group_name if ctx.sp else None
        digest.update(
            repr(
                (
                    opts.sac,
                    opts.variant,
                    sorted(opts.variant_options.items()),
                    opts.grad_bucket_mb,
                    ctx.world,
                    ctx.rank,
                    group,
                    repr(ctx.hardware),
                    opts.memory_budget,
                    opts.outputs,
                    opts.tile_loss,
                    opts.tile_mlp,
                    [p.name for p in self.manager.passes],
                )
            ).encode()
        )
        return "autosp-" + digest.hexdigest()

    def cache_key(self) -> str:
        """Everything the partition depends on besides the joint graph: Inductor and AOT caches key on it."""
        return self._key

    def __call__(self, joint: torch.fx.GraphModule, joint_inputs: Any, **kwargs: Any):
        self.ctx.num_fwd_outputs = kwargs["num_fwd_outputs"]
        joint = self.manager.run(Stage.JOINT, joint, self.ctx)
        kwargs.pop("compiler", None)
        if self.ctx.min_cut or self.ctx.options.backend == "inductor":
            with never_merged(joint.graph):
                return min_cut_rematerialization_partition(joint, joint_inputs, compiler="inductor", **kwargs)
        kwargs.pop("static_lifetime_input_nodes", None)
        return default_partition(joint, joint_inputs, **kwargs)


class InductorPartitioner(CustomPartitionerFn):
    """Inductor's custom-partitioner hook around ``_Partitioner``."""

    def __init__(self, partition: _Partitioner) -> None:
        self.partition = partition

    def __call__(self, gm, joint_inputs, **kwargs):
        return self.partition(gm, joint_inputs, **kwargs)

    def uuid(self) -> str:
        return self.partition.cache_key()

    def __reduce__(self):
        # Inductor pickles its config into cache keys; what makes partitions differ is the uuid.
        return (str, (self.uuid(),))


def _without_saved_tensor_hooks(compile_fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """Dynamo compiles inside the call, so under the caller's saved-tensor hooks: non-reentrant
    torch.utils.checkpoint around the compiled model counts the tensors its forward saves, and the
    passes' traces (the lowering, the sharding propagation) would add theirs to the first call's
    count only (the recomputation then refused, "a different number of tensors was saved");
    save_on_cpu would pack the traces' tensors. The hooks stay for the compiled program, which
    applies them at run time."""

    @functools.wraps(compile_fn)
    def compile_without_hooks(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        with saved_tensor_hooks_off():
            return compile_fn(*args, **kwargs)

    return compile_without_hooks


@_without_saved_tensor_hooks
def compile_graph(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    options: SPOptions,
    registry: Registry,
    group: Any,
    world: int,
    reports: list[Report] | None = None,
) -> Callable[..., Any]:
    if world > 1:
        refuse_dtensor_inputs(example_inputs)
    ctx = make_context(gm, example_inputs, options, registry, group, world)
    # Graphs of one program compile in the order they first run: a piece after a graph break
    # learns the sequence length from the last piece with attention before it, and runs whole where
    # that one did (a decoding step's head must not shard by the length of the prefill before it).
    last = next((r for r in reversed(reports or []) if r.sites or r.seq_len is not None), None)
    ctx.known_seq_len = last.seq_len if last is not None else None
    manager = PassManager(list(registry.passes.values()), options.disable_passes)
    ctx.report.passes = manager.records
    if reports is not None:
        reports.append(ctx.report)
    draws = python_draws(gm)  # read before the passes: the lowering renames the graph's inputs
    if world == 1:  # autosp.lower sets it under SP
        ctx.reach = reach_alone(gm, ctx.fake_inputs, ctx.fake_mode)
    gm = manager.run(Stage.GRAPH, gm, ctx)
    ctx.report.random_ops = random_ops(gm) + draws
    partition = _Partitioner(manager, ctx)

    if options.backend == "inductor":
        from torch._inductor.compile_fx import compile_fx, compile_fx_inner

        from autosp.passes.collective_order import inductor_patches, keep_collectives

        def inner(g: torch.fx.GraphModule, ex: Sequence[Any], **kw: Any):
            g = manager.run(Stage.BACKWARD if kw.get("is_backward") else Stage.FORWARD, g, ctx)
            _record_group_ops(ctx, g)
            with keep_collectives(g.graph):
                return compile_fx_inner(g, ex, **kw)

        compiled = compile_fx(
            gm,
            list(example_inputs),
            inner_compile=inner,
            # The user's config (mode=, options=) first: AutoSP's own patches keep its collectives' order.
            config_patches={
                **options.inductor_config,
                "custom_partitioner_fn": InductorPartitioner(partition),
                **inductor_patches(),
            },
        )
        return wrap_outputs(drop_discarded(compiled, ctx.reach), ctx.output_shards, group)

    from torch._functorch.aot_autograd import make_boxed_func

    def stage_compiler(stage: Stage):
        def compile_stage(g: torch.fx.GraphModule, ex: Sequence[Any]):
            if stage is Stage.BACKWARD:
                donate_nothing()
            g = manager.run(stage, g, ctx)
            _record_group_ops(ctx, g)
            views_as_reshapes(g)
            return make_boxed_func(g.forward)

        return compile_stage

    compiled = aot_module_simplified(
        gm,
        list(example_inputs),
        fw_compiler=stage_compiler(Stage.FORWARD),
        bw_compiler=stage_compiler(Stage.BACKWARD),
        partition_fn=partition,
    )
    return wrap_outputs(drop_discarded(compiled, ctx.reach), ctx.output_shards, group)


def _record_group_ops(ctx: CompileContext, g: torch.fx.GraphModule) -> None:
    """The stage's group ops, for the compile agreement to compare between the SP ranks."""
    ctx.report.group_ops = [*(ctx.report.group_ops or []), *group_op_sequence(g.graph, group_size_label)]


_VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)


def views_as_reshapes(g: torch.fx.GraphModule) -> None:
    """Run the graph's ``view``s as ``reshape``s: a view where the real tensor allows one, a copy where not.

    AOT autograd chose each ``view`` for a layout its fake tensors predicted, and some meta functions
    predict another layout than the kernel makes (on CPU, ``_log_softmax_backward_data`` given a
    transposed gradient: fake keeps the transpose, the kernel returns a contiguous result), so the
    eager-run graph failed with "view size is not compatible" (a soft-label cross entropy over
    ``logits.transpose(1, 2)``, even at ``sp_size=1``). Where the view works, ``reshape`` is that view;
    Inductor plans its own layouts, so only the graphs run as they are get this.
    """
    changed = False
    for node in g.graph.nodes:
        if node.op == "call_function" and node.target in _VIEWS:
            node.target = torch.ops.aten.reshape.default
            changed = True
    if changed:
        g.recompile()


def donate_nothing() -> None:
    """``backward(retain_graph=True)`` keeps working on a backward compiled with the forward.

    Lazily, torch decides at the first backward whether the backward may reuse the memory of its
    saved activations (donated buffers): not with ``retain_graph=True``. Compiled with the forward
    (under SP, see ``autosp.compile_agreement``), the donated list is fixed before that call, and a
    non-empty one refuses ``retain_graph``, as does the ``None`` a disabled config leaves. Only
    Inductor reuses donated memory, so other backends donate nothing (an empty list). Inductor keeps
    donating: torch's error names the switch, ``torch._functorch.config.donated_buffer=False``.
    """
    tracing = torch._guards.TracingContext.try_get()
    if tracing is not None and tracing.fw_metadata is not None:
        tracing.fw_metadata.bw_donated_idxs = []


__all__ = ["compile_graph", "donate_nothing", "make_context", "new_graph_id", "views_as_reshapes"]
