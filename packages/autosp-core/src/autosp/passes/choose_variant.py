"""``variant="auto"``: pick the SP variant (and hybrid's degrees) once the attention sites are known.

Candidates are the installed variants whose own ``check`` accepts every site (so a head count
that a variant cannot split simply leaves it out), plus every hybrid degree that divides the
heads; the cheapest by ``autosp.variant_cost`` wins, ties going to the simpler variant. The
report lists each candidate with its estimated communication and time, and why others were left
out. ``variant="hybrid"`` without degrees gets its degrees the same way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from autosp import variant_cost as cost
from autosp.analysis.attention import AttentionSite
from autosp.context import CompileContext
from autosp.errors import AutoSPError, ConfigError
from autosp.passes.manager import Pass, Stage
from autosp.variants import SPVariant, refuses_length

AUTO = "auto"
DEGREE_KEYS = ("ulysses_degree", "ring_degree")
PREFERENCE = ("ulysses", "hybrid", "ring")  # ties: fewer moving parts first

Estimator = Callable[..., cost.Estimate]


def _unresolved(*args: object) -> None:
    raise AutoSPError(
        "variant='auto' was not resolved: the autosp.choose_variant pass was disabled; enable it or name a variant"
    )


AUTO_VARIANT = SPVariant(
    name=AUTO,
    attention_rule=_unresolved,  # type: ignore[arg-type]
    doc="choose ulysses, ring or hybrid (and its degrees) per compiled graph from heads, sizes and the hardware",
)


@dataclasses.dataclass(frozen=True)
class Choice:
    """What ``variant="auto"`` (or hybrid's default degrees) chose, and what it compared."""

    chosen: cost.Estimate
    candidates: tuple[cost.Estimate, ...]
    excluded: tuple[str, ...]
    asked: str = AUTO


def _length(n: int | torch.SymInt) -> int | None:
    value = n.node.maybe_as_int() if isinstance(n, torch.SymInt) else n
    return value if isinstance(value, int) else None


def sequence_sites(ctx: CompileContext) -> list[AttentionSite]:
    """The sites over the graph's longest length: the ones a variant rewrites.

    Attention over a shorter length (a chunk of a sorted sequence, pooled tokens) is computed by the
    engine's rules once the sequence is settled (``core._longest``, ``core.leave_to_engine``): it
    decides no variant nor its degrees. With a symbolic length among them, all of them.
    """
    lengths = [_length(s.seq_len) for s in ctx.sites]
    known = [n for n in lengths if n is not None]
    if len(known) < len(lengths) or not known:
        return list(ctx.sites)
    return [s for s, n in zip(ctx.sites, lengths) if n == max(known)]


def _accepts(variant: SPVariant, ctx: CompileContext) -> str | None:
    """Why ``variant`` refuses a site of this graph, or None."""
    for site in sequence_sites(ctx):
        why = refuses_length(variant, site.seq_len, ctx.world)
        if why is not None:
            return why
        if not site.spec.rewritten_by(variant.name):
            continue  # runs whole under this variant: exact, so no reason to leave the variant out
        try:
            variant.check(site, ctx.world)
        except AutoSPError as e:
            return str(e)
    return None


def candidates(ctx: CompileContext, only: str | None = None) -> tuple[list[cost.Estimate], list[str]]:
    """Estimates of every installed variant that takes this graph's sites, and why the others were left out."""
    installed = ctx.registry.variants
    found, excluded = [], []
    for name in PREFERENCE:
        if only is not None and name != only:
            continue
        if name not in installed:
            excluded.append(f"{name}: not installed")
            continue
        why = _accepts(installed[name], ctx)
        if why is not None:
            excluded.append(f"{name}: {why}")
            continue
        sites = sequence_sites(ctx)
        if name == "ulysses":
            found.append(cost.ulysses(sites, ctx.world, ctx.hardware))
        elif name == "ring":
            found.append(cost.ring(sites, ctx.world, ctx.hardware))
        else:
            degrees = cost.hybrid_degrees(sites, ctx.world)
            if not degrees:
                proper = [u for u in range(2, ctx.world) if ctx.world % u == 0]
                excluded.append(
                    f"hybrid: sp_size={ctx.world} has no ulysses_degree strictly between 1 and {ctx.world}"
                    if not proper
                    else f"hybrid: no ulysses_degree in {proper} divides the heads of every attention op that "
                    "cannot be padded (a plugin's)"
                )
            found += [cost.hybrid(sites, ctx.world, ctx.hardware, u) for u in degrees]
    if only is None:
        excluded += [f"{n}: no cost model" for n in installed if n not in PREFERENCE]
    return found, excluded


def choose(ctx: CompileContext, only: str | None = None) -> Choice:
    found, excluded = candidates(ctx, only)
    if not found:
        ring = (
            "install autosp-ring (ring takes any head count)"
            if "ring" not in ctx.registry.variants
            else "use variant='ring' (it takes any head count)"
        )
        raise AutoSPError(
            f"variant={ctx.options.variant!r}: no installed variant takes this graph at sp_size={ctx.world} ("
            + "; ".join(excluded)
            + f"); {ring} or change sp_size"
        )
    rank = {name: i for i, name in enumerate(PREFERENCE)}
    best = min(found, key=lambda e: (e.seconds, rank[e.variant]))
    return Choice(best, tuple(found), tuple(excluded))


def needs_choice(ctx: CompileContext) -> bool:
    opts = ctx.options
    hybrid_default = opts.variant == "hybrid" and not any(k in opts.variant_options for k in DEGREE_KEYS)
    return ctx.sp and (opts.variant == AUTO or hybrid_default)


def choose_variant(gm: torch.fx.GraphModule, ctx: CompileContext) -> None:
    _choose(ctx, ctx.options.variant)


def choose_again(ctx: CompileContext) -> None:
    """After lowering, where attention Dynamo kept inside a kernel call (``nn.MultiheadAttention``)
    became a site too: choose again if the variant chosen from the Dynamo graph refuses one."""
    choice = ctx.get_state(Choice)
    if choice is None:
        return
    why = _accepts(ctx.variant, ctx) or _refuses_degree(choice.chosen, ctx)
    if why is not None:
        ctx.report.notes.append(f"{choice.chosen.label} refuses a site found after lowering ({why}): choosing again")
        _choose(ctx, choice.asked)


def _refuses_degree(chosen: cost.Estimate, ctx: CompileContext) -> str | None:
    """Why the chosen hybrid degree does not split some site's heads (hybrid's own check cannot know the degree)."""
    u = chosen.options.get("ulysses_degree")
    if u is None or u in cost.hybrid_degrees(sequence_sites(ctx), ctx.world):
        return None
    return f"ulysses_degree={u} does not divide every site's query heads"


def _choose(ctx: CompileContext, asked: str) -> None:
    choice = dataclasses.replace(choose(ctx, only=None if asked == AUTO else "hybrid"), asked=asked)
    best = choice.chosen
    variant_options = {**ctx.options.variant_options, **best.options}
    try:
        ctx.options = dataclasses.replace(ctx.options, variant=best.variant, variant_options=variant_options)
    except ConfigError as e:  # pragma: no cover - the options were valid before; only the variant changed
        raise AutoSPError(f"variant {asked!r}: {e}") from e
    ctx.variant = ctx.registry.variant(best.variant)
    ctx.put_state(choice)
    ctx.report.variant = f"{best.label} (chosen by variant={asked!r})"
    profile = ctx.hardware.name
    ctx.report.notes.append(
        f"variant={asked!r} chose {best.label} on {profile}; candidates (attention only, per step):"
    )
    ctx.report.notes += [f"  {'*' if e is best else ' '} {e.describe()}" for e in choice.candidates]
    ctx.report.notes += [f"    left out: {x}" for x in choice.excluded]


CHOOSE_VARIANT = Pass(
    "autosp.choose_variant",
    Stage.GRAPH,
    choose_variant,
    requires=("autosp.find_attention",),
    before=("autosp.lower", "autosp.unrepeat_kv", "autosp.shard"),
    applies=needs_choice,
    doc="variant='auto' (and hybrid without degrees): pick the variant and degrees from the sites and the hardware",
)

__all__ = [
    "AUTO",
    "AUTO_VARIANT",
    "CHOOSE_VARIANT",
    "Choice",
    "candidates",
    "choose",
    "choose_again",
    "choose_variant",
    "needs_choice",
]
