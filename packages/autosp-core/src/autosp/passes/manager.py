"""Passes and the manager that orders, runs, times and dumps them.

A pass is a plain function ``fn(gm, ctx) -> gm | None`` with a stable name, the
stage it runs at, and the passes it requires.  ``None`` means "changed in
place or not at all".  Ordering follows ``requires`` (hard) and ``after``
(soft: only when that pass is present).
"""

from __future__ import annotations

import enum
import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from autosp.analysis.constants import constants, fake_constants
from autosp.errors import AutoSPError, ConfigError, add_note

if TYPE_CHECKING:
    from autosp.context import CompileContext

log = logging.getLogger("autosp.passes")

DEBUG_DIR_ENV = "AUTOSP_DEBUG_DIR"
DISABLE_ENV = "AUTOSP_DISABLE_PASSES"


class Stage(enum.Enum):
    """Where in the compile a pass runs."""

    GRAPH = "graph"  # the Dynamo (Torch-IR) graph, lowered to aten, before AOT autograd
    JOINT = "joint"  # the joint forward+backward graph, right before partitioning
    FORWARD = "forward"  # the partitioned forward graph
    BACKWARD = "backward"  # the partitioned backward graph


PassFn = Callable[[torch.fx.GraphModule, "CompileContext"], "torch.fx.GraphModule | None"]


@dataclass(frozen=True)
class Pass:
    """A graph transformation.

    Attributes:
        name: stable, unique name (``package.what``); used to order and to disable it.
        stage: when it runs.
        fn: the transformation.
        requires: passes that must run before it; missing ones are an error.
        after: passes it runs after when they are present.
        before: passes it runs before when they are present.
        applies: whether it runs for a given compile (variant, sp_size, ...).
        doc: one line for reports.
    """

    name: str
    stage: Stage
    fn: PassFn
    requires: tuple[str, ...] = ()
    after: tuple[str, ...] = ()
    before: tuple[str, ...] = ()
    applies: Callable[[CompileContext], bool] = lambda ctx: True
    doc: str = ""


def order_passes(passes: Iterable[Pass]) -> list[Pass]:
    """Topological order by ``requires``/``after``/``before``; ties keep registration order."""
    passes = list(passes)
    by_name = {p.name: p for p in passes}
    for p in passes:
        for req in p.requires:
            if req not in by_name:
                raise ConfigError(
                    f"pass {p.name!r} requires pass {req!r}, which is not registered or was disabled; "
                    f"install the package that provides it or stop disabling it"
                )
    deps = {p.name: [d for d in (*p.requires, *p.after) if d in by_name] for p in passes}
    for p in passes:
        for later in p.before:
            if later in by_name:
                deps[later].append(p.name)
    done: list[Pass] = []
    state: dict[str, int] = {}

    def visit(name: str, path: list[str]) -> None:
        if state.get(name) == 2:
            return
        if state.get(name) == 1:
            cycle = " -> ".join([*path[path.index(name) :], name])
            raise ConfigError(f"pass ordering has a cycle: {cycle}; fix the requires/after of these passes")
        state[name] = 1
        for dep in deps[name]:
            visit(dep, [*path, name])
        state[name] = 2
        done.append(by_name[name])

    for p in passes:
        visit(p.name, [])
    return done


def disabled_from_env() -> set[str]:
    return {n.strip() for n in os.environ.get(DISABLE_ENV, "").split(",") if n.strip()}


@dataclass
class PassRecord:
    name: str
    stage: str
    seconds: float
    nodes_before: int
    nodes_after: int


class PassManager:
    """Runs the passes of one compile stage by stage."""

    def __init__(self, passes: Sequence[Pass], disabled: Iterable[str] = ()) -> None:
        self.disabled = set(disabled) | disabled_from_env()
        known = {p.name for p in passes}
        unknown = self.disabled - known
        if unknown:
            raise ConfigError(f"cannot disable unknown passes {sorted(unknown)}; known passes: {sorted(known)}")
        self.passes = order_passes(p for p in passes if p.name not in self.disabled)
        self.records: list[PassRecord] = []

    def selected(self, stage: Stage, ctx: CompileContext) -> list[Pass]:
        return [p for p in self.passes if p.stage is stage and p.applies(ctx)]

    def run(self, stage: Stage, gm: torch.fx.GraphModule, ctx: CompileContext) -> torch.fx.GraphModule:
        debug_dir = os.environ.get(DEBUG_DIR_ENV)
        for p in self.selected(stage, ctx):
            before = len(gm.graph.nodes)
            if debug_dir:
                _dump(debug_dir, ctx, p, "before", gm)
            held = constants(gm)
            start = time.perf_counter()
            try:
                out = p.fn(gm, ctx)
            except Exception as e:
                add_note(e, f"in AutoSP pass {p.name} ({stage.value})")
                raise
            seconds = time.perf_counter() - start
            if out is not None:
                if not isinstance(out, torch.fx.GraphModule):
                    raise TypeError(f"pass {p.name} returned {type(out).__name__}, not a GraphModule")
                gm = out
            leaked = fake_constants(gm, held)
            if leaked:
                raise AutoSPError(
                    f"internal: pass {p.name} left fake tensors in the program: {'; '.join(leaked)} (an op run on a "
                    "node's meta value while tracing); disable it with AUTOSP_DISABLE_PASSES and report this."
                )
            after = len(gm.graph.nodes)
            self.records.append(PassRecord(p.name, stage.value, seconds, before, after))
            log.info("pass %s: %.3fs, %d -> %d nodes", p.name, seconds, before, after)
            if debug_dir:
                _dump(debug_dir, ctx, p, "after", gm)
        return gm


def _dump(root: str, ctx: Any, p: Pass, when: str, gm: torch.fx.GraphModule) -> None:
    folder = Path(root) / f"rank{ctx.rank}" / f"graph{ctx.graph_id}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{p.stage.value}.{p.name}.{when}.py").write_text(gm.print_readable(print_output=False))


__all__ = ["Pass", "PassManager", "PassRecord", "Stage", "order_passes"]
