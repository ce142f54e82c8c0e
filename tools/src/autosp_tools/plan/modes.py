"""Which ways of running the model a plan compares."""

from __future__ import annotations

from autosp.registry import get_registry
from autosp_tools.plan.capture import Mode

# Not compiled: SAC "auto" picks between the on and off programs by autosp-sac's cost model at each length.
SAC_AUTO = "ulysses, SAC auto"


def hybrid_degree(sp: int, heads: int) -> int | None:
    """A Ulysses degree for the hybrid: the largest proper divisor of ``sp`` that divides the heads (>= 2)."""
    for u in range(sp // 2, 1, -1):
        if sp % u == 0 and (heads == 0 or heads % u == 0):
            return u
    return None


def _has_auto_variant() -> bool:
    try:
        get_registry().variant("auto")
    except Exception:  # noqa: BLE001 - an autosp-core without variant="auto"
        return False
    return True


def default_modes(sp: int, heads: int, hardware: str | None = None) -> list[Mode]:
    """SAC off and on (auto derived from them), each installed variant, and hand-written Ulysses."""
    if sp == 1:
        return [
            Mode("SAC off", sac=False),
            Mode("SAC on", sac=True),
            Mode("no SP, eager-like", sac=False, backend="aot_eager", handwritten=True),
        ]
    variants = get_registry().variants
    modes = [Mode("ulysses, SAC off", "ulysses", False), Mode("ulysses, SAC on", "ulysses", True)]
    if "ring" in variants:
        modes.append(Mode("ring, SAC on", "ring", True))
    u = hybrid_degree(sp, heads)
    if "hybrid" in variants and u is not None:
        modes.append(Mode(f"hybrid u={u}, SAC on", "hybrid", True, variant_options=(("ulysses_degree", u),)))
    if _has_auto_variant():
        # The variant is chosen at compile time by core's cost model on the plan's hardware profile.
        modes.append(Mode("auto variant, SAC on", "auto", True, hardware=hardware))
    modes.append(Mode("hand-written Ulysses", "ulysses", False, backend="aot_eager", handwritten=True))
    return modes


def seq_unit(mode: Mode, sp: int) -> int:
    """Lengths a mode accepts are multiples of this (ring and hybrid cut the sequence in 2P zigzag chunks)."""
    return 2 * sp if mode.variant in ("ring", "hybrid", "auto") and sp > 1 else sp


__all__ = ["SAC_AUTO", "default_modes", "hybrid_degree", "seq_unit"]
