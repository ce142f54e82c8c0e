"""What ``autosp.verify`` compares, how, and the report it returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

# (rtol, atol) by the least precise floating dtype among parameters, inputs and outputs.
# atol is relative to a scale (see ``compare``), so the check does not depend on the loss scale.
DEFAULT_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-7, 1e-9),
    torch.float32: (1e-4, 1e-5),
    torch.float16: (1e-2, 1e-3),
    torch.bfloat16: (5e-2, 1e-2),
}


@dataclass(frozen=True)
class TensorCheck:
    """One compared tensor: an output, a buffer after the step, or a gradient.

    Attributes:
        name: ``output``, ``output[1]``, ``output['logits']``, ``buffer:<name>``, a parameter's
            name, or ``input[0]`` for the gradient of an input that requires grad.
        max_abs: the largest ``|sp - reference|``.
        max_rel: ``max_abs`` over the largest ``|reference|`` of the tensor.
        ratio: the largest ``|sp - reference| / allowed`` over elements; above 1 is outside tolerance.
    """

    name: str
    max_abs: float
    max_rel: float
    ratio: float

    @property
    def ok(self) -> bool:
        return self.ratio <= 1.0

    def describe(self) -> str:
        verdict = "ok" if self.ok else "OUTSIDE TOLERANCE"
        return (
            f"{self.name}: max abs {self.max_abs:.3g}, rel {self.max_rel:.3g} "
            f"({self.ratio:.3g}x the tolerance) {verdict}"
        )


@dataclass
class VerifyReport:
    """What ``autosp.verify`` compared on this rank, and whether it matched.

    ``ok`` is the same on every rank of the group: False when any rank found a difference
    (``failed_ranks``). ``problems`` lists every reason in words; ``worst_grad`` names the
    parameter whose gradient is furthest from the reference.
    """

    ok: bool
    rank: int
    sp_size: int
    rtol: float
    atol: float
    tolerance_dtype: str
    outputs: list[TensorCheck] = field(default_factory=list)
    grads: list[TensorCheck] = field(default_factory=list)
    grad_only_in_reference: list[str] = field(default_factory=list)
    grad_only_in_sp: list[str] = field(default_factory=list)
    collectives: dict[str, int] = field(default_factory=dict)
    fallbacks: list[str] = field(default_factory=list)
    graphs: int = 0
    problems: list[str] = field(default_factory=list)
    failed_ranks: list[int] = field(default_factory=list)

    @property
    def worst_grad(self) -> TensorCheck | None:
        """The gradient furthest outside (or closest to) its tolerance."""
        return max(self.grads, key=lambda c: c.ratio, default=None)

    @property
    def worst_output(self) -> TensorCheck | None:
        return max(self.outputs, key=lambda c: c.ratio, default=None)

    def __str__(self) -> str:
        verdict = "ok" if self.ok else f"FAILED on rank(s) {self.failed_ranks}"
        lines = [
            f"AutoSP verify: {verdict} (rank {self.rank} of sp_size={self.sp_size}; tolerance for "
            f"{self.tolerance_dtype}: rtol={self.rtol:g}, atol={self.atol:g})",
            f"  graphs compiled: {self.graphs}; collectives inserted: "
            + (", ".join(f"{k} x{v}" for k, v in sorted(self.collectives.items())) or "none"),
        ]
        lines += [f"  gathered for an op without a sharding rule: {f}" for f in self.fallbacks]
        lines += [f"  {c.describe()}" for c in self.outputs]
        worst = self.worst_grad
        if worst is not None:
            bad = sorted((c for c in self.grads if not c.ok), key=lambda c: -c.ratio)
            lines.append(f"  worst gradient: {worst.describe()}")
            lines.append(f"  gradients outside tolerance: {len(bad)} of {len(self.grads)}")
            lines += [f"    {c.describe()}" for c in bad[:10]]
        lines += [f"  problem: {p}" for p in self.problems]
        return "\n".join(lines)


@dataclass
class Run:
    """What one copy produced: named output leaves (and their tree), gradients, buffers."""

    outputs: list[tuple[str, Any]]
    spec: Any
    grads: dict[str, torch.Tensor | None]
    buffers: dict[str, torch.Tensor]


def tolerances(dtypes: list[torch.dtype], rtol: float | None, atol: float | None) -> tuple[float, float, str]:
    """``(rtol, atol, dtype name)``: the defaults of the least precise floating dtype, unless given."""
    floating = [d for d in dtypes if d.is_floating_point]
    dtype = max(floating, key=lambda d: torch.finfo(d).eps, default=torch.float32)
    d_rtol, d_atol = DEFAULT_TOLERANCES.get(dtype, DEFAULT_TOLERANCES[torch.float16])
    return (d_rtol if rtol is None else rtol), (d_atol if atol is None else atol), str(dtype).removeprefix("torch.")


def magnitude(x: torch.Tensor) -> float:
    """The largest finite ``|x|`` (0 for an empty tensor)."""
    a = x.detach().abs().to(torch.float64)
    a = a.masked_fill(~a.isfinite(), 0)
    return float(a.max()) if a.numel() else 0.0


def compare(name: str, sp: torch.Tensor, ref: torch.Tensor, rtol: float, atol: float, scale: float) -> TensorCheck:
    """Element i passes when ``|sp_i - ref_i| <= rtol * |ref_i| + atol * scale``.

    ``scale`` is the largest ``|ref|`` of an output itself, and for gradients that of every
    gradient: a gradient that is zero in exact arithmetic (a key bias under softmax) holds only
    rounding noise of the size of the others. Non-floating tensors must be equal; NaN and
    infinities must be where the reference has them.
    """
    if not ref.is_floating_point() and not ref.is_complex():
        rtol = atol = 0.0
    wide = torch.complex128 if ref.is_complex() or sp.is_complex() else torch.float64
    a, b = sp.detach().to(device=ref.device, dtype=wide), ref.detach().to(wide)
    same = (a.isnan() & b.isnan()) | (a == b)
    diff = (a - b).abs().masked_fill(same, 0).nan_to_num(nan=float("inf"))
    allowed = rtol * b.abs().nan_to_num(nan=0.0, posinf=0.0) + atol * scale + torch.finfo(torch.float64).tiny
    max_abs = float(diff.max()) if diff.numel() else 0.0
    ref_max = magnitude(ref)
    max_rel = max_abs / ref_max if ref_max > 0 else (0.0 if max_abs == 0 else float("inf"))
    ratio = float((diff / allowed).max()) if diff.numel() else 0.0
    return TensorCheck(name, max_abs, max_rel, ratio)


def _compare_value(
    name: str, sp: Any, ref: Any, rtol: float, atol: float, scale: float | None, problems: list[str]
) -> TensorCheck | None:
    if isinstance(ref, torch.Tensor) != isinstance(sp, torch.Tensor):
        problems.append(f"{name}: the reference gives a {type(ref).__name__}, the SP program a {type(sp).__name__}")
        return None
    if not isinstance(ref, torch.Tensor):
        if sp != ref:
            problems.append(f"{name}: the reference gives {ref!r}, the SP program {sp!r}")
        return None
    if sp.shape != ref.shape or sp.dtype != ref.dtype:
        problems.append(
            f"{name}: the reference gives {ref.dtype} {list(ref.shape)}, the SP program {sp.dtype} {list(sp.shape)}"
        )
        return None
    return compare(name, sp, ref, rtol, atol, magnitude(ref) if scale is None else scale)


def compare_runs(report: VerifyReport, sp: Run, ref: Run) -> None:
    """Fill ``report``'s outputs, gradients and problems from the two runs."""
    rtol, atol, problems = report.rtol, report.atol, report.problems
    checks: list[TensorCheck | None] = []
    if sp.spec != ref.spec:
        problems.append(f"the SP program returns {sp.spec}, the reference {ref.spec}")
    else:
        for (name, s), (_, r) in zip(sp.outputs, ref.outputs):
            checks.append(_compare_value(name, s, r, rtol, atol, None, problems))
    for name, r in ref.buffers.items():
        checks.append(_compare_value(f"buffer:{name}", sp.buffers[name], r, rtol, atol, None, problems))
    report.outputs = [c for c in checks if c is not None]

    scale = max((magnitude(g) for g in ref.grads.values() if g is not None), default=0.0)
    for name, r in ref.grads.items():
        s = sp.grads.get(name)
        if s is None and r is not None:
            report.grad_only_in_reference.append(name)
        elif r is None and s is not None:
            report.grad_only_in_sp.append(name)
        elif r is not None and s is not None:
            check = _compare_value(name, s, r, rtol, atol, scale, problems)
            if check is not None:
                report.grads.append(check)
    if report.grad_only_in_reference:
        problems.append(f"no gradient in the SP program for {report.grad_only_in_reference}")
    if report.grad_only_in_sp:
        problems.append(f"a gradient only in the SP program for {report.grad_only_in_sp}")
    bad_outputs = [c.name for c in report.outputs if not c.ok]
    if bad_outputs:
        problems.append(f"{len(bad_outputs)} output(s) outside tolerance: {', '.join(bad_outputs)}")
    bad = [c for c in report.grads if not c.ok]
    if bad:
        worst = max(bad, key=lambda c: c.ratio)
        problems.append(f"{len(bad)} of {len(report.grads)} gradients outside tolerance, the worst {worst.name}")


__all__ = [
    "DEFAULT_TOLERANCES",
    "Run",
    "TensorCheck",
    "VerifyReport",
    "compare",
    "compare_runs",
    "magnitude",
    "tolerances",
]
