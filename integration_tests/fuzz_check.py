"""Run a fuzz program under AutoSP on a pool of ranks and judge it against single-device eager.

Outcomes: "ok" (loss and every gradient match on every rank), "refused" (every rank raised
the same ``AutoSPError`` before communicating: a clear refusal is allowed) or a
``FuzzFailure`` (a mismatch, any other exception, an inconsistent refusal, or a hang).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import fuzz_programs as fp
import torch
from spmd_pool import PoolTimeout, RankError, SPMDPool

RTOL = ATOL = 1e-4


class FuzzFailure(AssertionError):
    """A program AutoSP got wrong; the message holds the spec, literally, to paste into a regression test."""


def run_compiled(rank: int, world: int, spec: fp.Spec, options: dict[str, Any]) -> dict[str, Any]:
    """Worker task: build, ``autosp.compile(model, sp_size=world, **options)``, run the steps.

    Returns the losses and accumulated gradients as numpy, and what AutoSP gathered.
    """
    import torch._dynamo

    import autosp

    torch._dynamo.reset()
    model, batches = fp.build(spec)
    compiled = autosp.compile(model, sp_size=world, **options)
    result = fp.run_steps(compiled, model, batches)
    return {
        "losses": result["losses"].numpy(),
        "grads": {n: None if g is None else g.numpy() for n, g in result["grads"].items()},
        "fallbacks": [f for report in compiled.autosp_reports for f in report.fallbacks],
        "notes": [n for report in compiled.autosp_reports for n in report.notes],
    }


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp(min=1e-12))


def compare(got: dict[str, Any], ref: dict[str, Any]) -> list[str]:
    """What differs between one rank's result and the reference (empty: they match)."""
    diffs = []
    losses = torch.as_tensor(got["losses"])
    if not torch.allclose(losses, ref["losses"], rtol=RTOL, atol=ATOL, equal_nan=False):
        diffs.append(f"losses per step {losses.tolist()} vs {ref['losses'].tolist()}")
    for name, want in ref["grads"].items():
        g = got["grads"].get(name)
        if (g is None) != (want is None):
            have = ["None", "a gradient"]
            diffs.append(f"grad of {name}: {have[g is not None]} vs {have[want is not None]} single-device")
        elif want is not None:
            g = torch.as_tensor(g)
            if not torch.allclose(g, want, rtol=RTOL, atol=ATOL):
                ratio = float((g * want).sum() / (want * want).sum().clamp(min=1e-30))
                diffs.append(f"grad of {name}: max rel err {_rel(g, want):.3g}, <g,ref>/<ref,ref> = {ratio:.4g}")
    return diffs


@dataclass
class Stats:
    """What one fuzz run did: programs matched (and how many of them gathered somewhere), refused."""

    ok: int = 0
    refused: int = 0
    gathered: int = 0  # matched programs in which AutoSP gathered for an op without a sharding rule
    refusals: Counter[str] = field(default_factory=Counter)
    fallbacks: Counter[str] = field(default_factory=Counter)

    def summary(self, label: str) -> str:
        top = "; ".join(f"{n}x {m}" for m, n in self.refusals.most_common(3))
        gathers = "; ".join(f"{n}x {m}" for m, n in self.fallbacks.most_common(3))
        return (
            f"{label}: {self.ok + self.refused} programs, {self.ok} matched ({self.gathered} with a gather"
            + (f": {gathers}" if gathers else "")
            + f"), {self.refused} refused"
            + (f" ({top})" if top else "")
        )


def check_program(
    pool: SPMDPool,
    spec: fp.Spec,
    variant: str,
    variant_options: dict[str, Any] | None = None,
    stats: Stats | None = None,
    timeout_s: float = 180.0,
    notes: list[str] | None = None,
    **compile_options: Any,
) -> str:
    """``"ok"`` or ``"refused"``; raises ``FuzzFailure`` saying what went wrong.

    ``notes``: extended with rank 0's report notes when the program ran.

    ``compile_options`` go to ``autosp.compile`` (default ``backend="aot_eager"``, ``fullgraph=True``).
    """
    options = {
        "variant": variant,
        "variant_options": variant_options or {},
        "backend": "aot_eager",
        "fullgraph": True,
        **compile_options,
    }
    shown = {k: v for k, v in options.items() if k not in ("variant", "fullgraph") and v}
    where = f"variant={variant!r} {shown} P={pool.world}\n  {fp.describe(spec)}\n  spec = {json.dumps(spec)}"
    ref = fp.reference(spec)
    try:
        per_rank = pool.run(run_compiled, spec, options, timeout_s=timeout_s)
    except PoolTimeout as e:
        raise FuzzFailure(f"hang or crash: {e}\n{where}") from None
    errors = [v for v in per_rank if isinstance(v, RankError)]
    if errors:
        first = errors[0]
        same = len(errors) == pool.world and len({(e.type_name, e.message) for e in errors}) == 1
        # A refusal, not AutoSP's own bugs that it reports as errors (collectives that differ per
        # rank, a pass that crashed).
        if (
            same
            and first.is_a("AutoSPError")
            and not (first.is_a("CollectiveMismatch") or first.is_a("CompileCrashed"))
        ):
            if stats is not None:
                stats.refused += 1
                stats.refusals[first.message.split(";")[0][:120]] += 1
            return "refused"
        kinds = sorted({f"{e.type_name}: {e.message[:300]}" for e in errors})
        raise FuzzFailure(f"{len(errors)}/{pool.world} ranks raised {kinds}\n{where}\n{first.traceback[-3000:]}")
    for rank, got in enumerate(per_rank):
        diffs = compare(got, ref)
        if diffs:
            raise FuzzFailure(f"rank {rank} differs from single-device eager: {diffs[:6]}\n{where}")
    if notes is not None:
        notes.extend(per_rank[0]["notes"])
    if stats is not None:
        stats.ok += 1
        fallbacks = per_rank[0]["fallbacks"]
        stats.gathered += bool(fallbacks)
        # Without node names: "view_3: reshape ..." and "gather_1 (aten.gather.default) ..." count as one op.
        stats.fallbacks.update({re.sub(r"^\w+: |^\w+ \((aten\.[\w.]+)\)", r"\1", f)[:80] for f in fallbacks})
    return "ok"


__all__ = ["FuzzFailure", "Stats", "check_program", "compare", "run_compiled"]
