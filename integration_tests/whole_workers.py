"""Pool task for test_compiled_whole: graphs whose AutoSP compile raises run whole, compiled by torch."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch
import torch.nn as nn
from cases import caches_off
from probe_models import DIM, VOCAB, Attn, LMBase
from probe_workers import differences, step

import autosp
from autosp.passes.manager import Pass, Stage
from autosp.registry import get_registry


class TwoGraphs(LMBase):
    """Two attention blocks with a graph break between them: an SP graph and another one, which the
    failing pass may leave whole; the activations and their gradients cross the break."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Attn() for _ in range(2))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        x = x + self.blocks[0](x)
        torch._dynamo.graph_break()
        x = x + self.blocks[1](x)
        return self.lm_loss(x, ids)


class CondBranch(LMBase):
    """``torch.cond`` on a parameter between two branches over the sequence-sharded activations: AutoSP's
    lowering traced its backward into branches of different strides (torch refused it)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Parameter(torch.tensor([0.3]))
        self.up, self.down = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        x = x + self.attn(x)
        x = torch.cond(self.gate.sum() > 0, lambda t: t + self.up(t), lambda t: t - self.down(t), (x,))
        return self.lm_loss(x, ids)


PROGRAMS = {"two-graphs": TwoGraphs, "cond": CondBranch}


def run_failing(
    rank: int,
    world: int,
    cases: list[tuple[str, str, frozenset[tuple[int, int]], bool]],
    variant: str = "ulysses",
    backend: str = "aot_eager",
) -> dict[str, dict[str, Any]]:
    """Per case ``(label, program, failing, strict)``: the compile of graph ``i`` raises on rank ``r`` for
    every ``(r, i)`` in ``failing`` (a pass registered for the run); ``strict``: CompiledWhole is an error.
    Returns ``{"problems", "whole", "sharded", "warned"}`` against single-device eager, or ``{"error"}``."""
    results: dict[str, dict[str, Any]] = {}
    passes = get_registry().passes
    for label, program, failing, strict in cases:
        compiled_graphs = [0]

        def fail(gm: torch.fx.GraphModule, ctx: Any, failing: frozenset[tuple[int, int]] = failing) -> None:
            graph, compiled_graphs[0] = compiled_graphs[0], compiled_graphs[0] + 1
            if (rank, graph) in failing:
                raise RuntimeError(f"pass failed on rank {rank}, graph {graph}")

        torch._dynamo.reset()
        torch.manual_seed(0)
        model = PROGRAMS[program]()
        ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
        ref = step(copy.deepcopy(model), (ids,))
        passes["test.fail"] = Pass("test.fail", Stage.GRAPH, fail, doc="raises for the graphs it is told")
        try:
            compiled = autosp.compile(model, variant=variant, backend=backend)
            with caches_off(), warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("error" if strict else "always", autosp.CompiledWhole)
                warnings.simplefilter("always", autosp.NotSequenceParallel)
                got = step(compiled, (ids,))
        except Exception as e:  # noqa: BLE001 - the verdict of the case
            results[label] = {"error": f"{type(e).__name__}: {str(e)[:1500]}"}
            continue
        finally:
            del passes["test.fail"]
        reports = compiled.autosp_reports
        results[label] = {
            "problems": differences(got, ref),
            "whole": [r.compiled_whole for r in reports],
            "sharded": [r.seq_len for r in reports],
            "warned": [(w.category.__name__, str(w.message)) for w in caught],
        }
    return results


def run_train_step(rank: int, world: int, steps: int, variant: str, backend: str) -> dict[str, Any]:
    """A whole training step compiled (forward, backward, SGD with momentum, zero_grad), ``steps`` times,
    against the same step in eager: the losses, and every parameter after the last step."""

    def train_step(model: nn.Module, opt: torch.optim.Optimizer) -> Any:
        def step(ids: torch.Tensor) -> torch.Tensor:
            loss = model(ids)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        return step

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TwoGraphs()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
    eager = train_step(reference, torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9))
    compiled = autosp.compile(
        train_step(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)), variant=variant, backend=backend
    )
    losses = []
    with caches_off():
        for _ in range(steps):
            losses.append((float(eager(ids)), float(compiled(ids))))
    errors = {n: (p - q).abs().max().item() for (n, p), q in zip(model.named_parameters(), reference.parameters())}
    return {
        "losses": losses,
        "worst": max(errors.items(), key=lambda kv: kv[1]),
        "notes": [n for r in compiled.autosp_reports for n in r.notes if "holds as attributes" in n],
        "sharded": [r.seq_len for r in compiled.autosp_reports],
    }
