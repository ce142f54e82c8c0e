"""SP variants: how attention sites are rewritten, and what a variant needs checked."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from autosp.analysis.attention import AttentionSite
    from autosp.context import CompileContext
    from autosp.sharding.context import AttentionRule
    from autosp.sharding.placement import IntLike, Layout


@dataclass(frozen=True)
class SPVariant:
    """A sequence-parallel strategy.

    Attributes:
        name: the ``variant=`` value that selects it.
        attention_rule: rewrites one attention site on this rank (see ``autosp.sharding``).
        check: raises ``AutoSPError`` for sites the variant cannot handle exactly, with
            what to do instead; runs at compile time, before any collective.
        layout: how to split the sequence where sharding starts, from (length, world,
            variant options); ``None`` (or a ``None`` result) keeps contiguous even intervals.
        prepare: runs once per compile before the rewrite (after ``check``); what it returns
            reaches the attention rule as ``SPContext.variant_state`` (subgroups, say).
        uneven: the attention rule takes a sequence whose (concrete) length the ranks do not
            split evenly, laid out by ``even_ranges`` (pieces one token apart). A variant
            without it gets a clear refusal for such a length, never an uneven site.
        dynamic_uneven: with ``uneven``, also a length marked dynamic (a ``torch.SymInt``): the
            rule works with symbolic piece sizes. The graph is guarded on the length's remainder
            modulo sp_size, so each remainder compiles once. Without it such a length is refused.
        doc: one line for reports.
    """

    name: str
    attention_rule: AttentionRule
    check: Callable[[AttentionSite, int], None] = lambda site, world: None
    layout: Callable[[IntLike, int, dict[str, Any]], Layout | None] | None = None
    prepare: Callable[[CompileContext], Any] | None = None
    uneven: bool = False
    dynamic_uneven: bool = False
    doc: str = ""


def refuses_length(variant: SPVariant, length: object, world: int) -> str | None:
    """Why ``variant`` cannot take a sequence of ``length`` over ``world`` ranks, or None.

    A concrete length that ``world`` does not divide needs a variant that declares ``uneven``; a
    symbolic one (marked dynamic) ``dynamic_uneven`` too. Deciding on a symbolic length guards the
    graph on its remainder modulo ``world``, as the rewrite does anyway.
    """
    if isinstance(length, torch.SymInt):
        if length % world == 0 or (variant.uneven and variant.dynamic_uneven):
            return None
        return (
            f"variant {variant.name!r} takes no uneven pieces of a length marked dynamic, and this call's "
            f"{length.node.hint} tokens do not split over sp_size={world}"
        )
    if not isinstance(length, int) or length % world == 0 or variant.uneven:
        return None
    return (
        f"variant {variant.name!r} splits the sequence into equal pieces and {length} tokens do not split over "
        f"sp_size={world}"
    )


# Where the first-party variants live, so a missing one can be named.
KNOWN_PACKAGES = {"ulysses": "autosp-ulysses", "ring": "autosp-ring", "hybrid": "autosp-ring"}

__all__ = ["KNOWN_PACKAGES", "SPVariant", "refuses_length"]
