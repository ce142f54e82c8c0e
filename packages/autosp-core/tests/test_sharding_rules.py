"""Every sharding rule against its unsharded op, on 2, 3 and 4 simulated ranks (autosp.sharding.testing).

Each case gives an op, whole inputs and their placements; ``check_op`` runs the rule on
every rank, reassembles the outputs and compares values and summed gradients with the
op in eager.  Layouts: even, uneven (a slice's), zigzag, a sliced zigzag and a rank that
holds nothing.  ``test_every_rule_has_a_case`` fails for a rule in ``RULES`` without a case.
Runtime: about 2500 tests in 26 s on 2 workers (make_fx tracing, the costly part, runs at P = 3 only).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from autosp.linear_cross_entropy import OP as LINEAR_CROSS_ENTROPY
from autosp.sharding.placement import Partial, Replicate, SeqAxis, Shard
from autosp.sharding.rules import RULES
from autosp.sharding.testing import check_op, head_shard, shard
from autosp.tiled_mlp import OP as TILED_MLP
from autosp.user_function import BODIES, Body

aten = torch.ops.aten
B, S, D, C, V = 2, 24, 4, 5, 11  # S = 24: zigzag needs 2P | S for P = 2, 3, 4
END = 9223372036854775807  # what x[:, 1:] lowers to
F64 = torch.float64
WORLDS = (2, 3, 4)
SEQ_LAYOUTS = ("even", "uneven", "zigzag")
ALL_LAYOUTS = (*SEQ_LAYOUTS, "zigzag_sliced", "first_empty")
R = None  # Replicate() without a sequence axis


def rs(dim: int, length: int = S, inner: int = 1) -> Replicate:
    """Replicated, with the sequence on ``dim`` (where a token-wise op may start sharding)."""
    return Replicate(SeqAxis(dim, length, inner))


@dataclass
class Case:
    op: Any
    name: str
    make: Callable[[torch.Generator], tuple]  # -> (args, kwargs)
    placements: tuple
    expect: tuple | None = None
    options: dict = field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"{self.op.__name__}:{self.name}"


CASES: list[Case] = []


def case(
    op: Any,
    name: str,
    make: Callable[[torch.Generator], tuple],
    *placements: Any,
    expect: tuple | None = None,
    **options: Any,
) -> None:
    CASES.append(Case(op, name, make, placements, expect, options))


def randn(g: torch.Generator, *shape: int, dtype: torch.dtype = F64) -> torch.Tensor:
    return torch.randn(shape, generator=g, dtype=dtype)


def ints(g: torch.Generator, high: int, *shape: int) -> torch.Tensor:
    return torch.randint(0, high, shape, generator=g)


def mask(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.rand(shape, generator=g) < 0.4


def x3(g: torch.Generator) -> torch.Tensor:
    return randn(g, B, S, D)


def args(*make: Any, **kw: Any) -> Callable[[torch.Generator], tuple]:
    """A maker from per-argument makers (callables of the generator, also inside a list) and literals."""

    def resolve(m: Any, g: torch.Generator) -> Any:
        if isinstance(m, list):
            return [resolve(i, g) for i in m]
        return m(g) if callable(m) else m

    return lambda g: (tuple(resolve(m, g) for m in make), dict(kw))


def lit(value: Any) -> Callable[[torch.Generator], Any]:
    return lambda g: value


def sq(g: torch.Generator) -> torch.Tensor:
    return randn(g, S, S)


# --- contractions -----------------------------------------------------------------------------------

W = lambda g: randn(g, D, 3)  # noqa: E731
for lay in SEQ_LAYOUTS:
    case(
        aten.mm.default,
        f"tokens[B*S,D]@W-{lay}",
        args(lambda g: randn(g, B * S, D), W),
        shard(0, lay, length=S),
        R,
        expect=(Shard,),
    )
    case(aten.mm.default, f"tokens[S,D]@W-{lay}", args(lambda g: randn(g, S, D), W), shard(0, lay), R, expect=(Shard,))
    case(
        aten.mm.default,
        f"x^T@y-contract-seq-{lay}",
        args(lambda g: randn(g, D, S), lambda g: randn(g, S, 3)),
        shard(1, lay),
        shard(0, lay),
    )
    case(aten.bmm.default, f"tokens@W-{lay}", args(x3, lambda g: randn(g, B, D, 3)), shard(1, lay), R, expect=(Shard,))
    case(
        aten.bmm.default,
        f"q@k^T-{lay}",
        args(x3, lambda g: randn(g, B, D, S)),
        shard(1, lay),
        shard(2, lay),
        expect=(Shard,),
    )
    case(
        aten.bmm.default,
        f"p^T@v-contract-seq-{lay}",
        args(lambda g: randn(g, B, D, S), x3),
        shard(2, lay),
        shard(1, lay),
    )
    # a contracts its sequence, b holds its *columns* in the same layout: no partial product (was a crash).
    case(
        aten.mm.default,
        f"a-contracts-seq-b-sharded-on-m-{lay}",
        args(lambda g: randn(g, 3, S), sq),
        shard(1, lay),
        shard(1, lay),
    )
    case(
        aten.bmm.default,
        f"a-contracts-seq-b-sharded-on-m-{lay}",
        args(lambda g: randn(g, B, 3, S), lambda g: randn(g, B, S, S)),
        shard(2, lay),
        shard(2, lay),
    )
    case(
        aten.addmm.default,
        f"bias+tokens@W-{lay}",
        args(lambda g: randn(g, 3), lambda g: randn(g, B * S, D), W),
        R,
        shard(0, lay, length=S),
        R,
        expect=(Shard,),
    )
    case(
        aten.addmm.default,
        f"bias[S,3]+tokens@W-{lay}",
        args(lambda g: randn(g, S, 3), lambda g: randn(g, S, D), W),
        shard(0, lay),
        shard(0, lay),
        R,
        expect=(Shard,),
    )
    case(
        aten.baddbmm.default,
        f"bias+tokens@W-{lay}",
        args(lambda g: randn(g, 3), x3, lambda g: randn(g, B, D, 3)),
        R,
        shard(1, lay),
        R,
        expect=(Shard,),
    )
    case(
        aten.embedding.default,
        f"ids-shard-{lay}",
        args(lambda g: randn(g, V, D), lambda g: ints(g, V, B, S)),
        R,
        shard(1, lay),
        expect=(Shard,),
    )
for lay in ("even", "zigzag"):
    # A replicated input whose sequence axis meets a token-wise op: sharding starts here, in the variant's layout.
    case(
        aten.mm.default,
        f"start-sharding-{lay}",
        args(lambda g: randn(g, S, D), W),
        rs(0),
        R,
        layout=lay,
        expect=(Shard,),
    )
    case(
        aten.addmm.default,
        f"start-sharding-{lay}",
        args(lambda g: randn(g, 3), lambda g: randn(g, S, D), W),
        R,
        rs(0),
        R,
        layout=lay,
        expect=(Shard,),
    )
    case(
        aten.embedding.default,
        f"start-sharding-{lay}",
        args(lambda g: randn(g, V, D), lambda g: ints(g, V, B, S)),
        R,
        rs(1),
        layout=lay,
        expect=(Shard,),
    )
case(
    aten.mm.default,
    "start-sharding-folded-[B*S,D]",
    args(lambda g: randn(g, B * S, D), W),
    rs(0),
    R,
    layout="zigzag",
    expect=(Shard,),
)
case(
    aten.mm.default,
    "x^T@y-contract-seq-layouts-differ",
    args(lambda g: randn(g, D, S), lambda g: randn(g, S, 3)),
    shard(1, "even"),
    shard(0, "zigzag"),
)
case(aten.mm.default, "partial@W", args(lambda g: randn(g, B, D), W), Partial(), R)
case(aten.mm.default, "W@partial", args(lambda g: randn(g, 3, B), lambda g: randn(g, B, D)), R, Partial())
case(aten.mm.default, "partial@partial", args(lambda g: randn(g, B, D), W), Partial(), Partial())
case(aten.mm.default, "shard@partial", args(lambda g: randn(g, S, D), W), shard(0), Partial())
case(aten.mm.default, "replicated", args(lambda g: randn(g, B, D), W), R, R)
case(aten.mm.default, "head-sharded", args(lambda g: randn(g, S, D), W), head_shard(1), R)
# A per-token matmul: the sequence is bmm's batch dim.
case(
    aten.bmm.default,
    "per-token-batch-dim",
    args(lambda g: randn(g, S, 2, D), lambda g: randn(g, S, D, 3)),
    shard(0, "zigzag"),
    shard(0, "uneven"),
    expect=(Shard,),
)
case(aten.bmm.default, "partial@W", args(lambda g: randn(g, B, 3, D), lambda g: randn(g, B, D, 2)), Partial(), R)
case(aten.bmm.default, "head-sharded", args(x3, lambda g: randn(g, B, D, S)), head_shard(0), head_shard(0))
# A classifier head on a pooled (partial) vector: the bias must be added once, not once per rank.
case(aten.addmm.default, "bias+partial@W", args(lambda g: randn(g, 3), lambda g: randn(g, B, D), W), R, Partial(), R)
case(aten.addmm.default, "bias+W@partial", args(lambda g: randn(g, 3), lambda g: randn(g, B, D), W), R, R, Partial())
case(aten.addmm.default, "partial-bias", args(lambda g: randn(g, 3), lambda g: randn(g, B, D), W), Partial(), R, R)
case(
    aten.addmm.default,
    "partial-bias+tokens@W",
    args(lambda g: randn(g, 3), lambda g: randn(g, S, D), W),
    Partial(),
    shard(0),
    R,
)
case(
    aten.addmm.default,
    "bias[S,3]-shard+replicated",
    args(lambda g: randn(g, S, 3), lambda g: randn(g, S, D), W),
    shard(0),
    R,
    R,
)
case(
    aten.addmm.default,
    "beta-alpha-partial",
    args(lambda g: randn(g, 3), lambda g: randn(g, B, D), W, beta=0.5, alpha=2.0),
    R,
    Partial(),
    R,
)
case(
    aten.baddbmm.default,
    "bias+partial@W",
    args(lambda g: randn(g, 3), lambda g: randn(g, B, 2, D), lambda g: randn(g, B, D, 3)),
    R,
    Partial(),
    R,
)
case(
    aten.baddbmm.default,
    "beta-alpha-shard",
    args(lambda g: randn(g, B, S, 3), x3, lambda g: randn(g, B, D, 3), beta=0.5, alpha=2.0),
    shard(1, "zigzag"),
    shard(1, "zigzag"),
    R,
)
case(
    aten.embedding.default,
    "partial-table",
    args(lambda g: randn(g, V, D), lambda g: ints(g, V, B, S)),
    Partial(),
    rs(1),
)
case(aten.embedding.default, "partial-int-ids", args(lambda g: randn(g, V, D), lambda g: ints(g, V, B)), R, Partial())
case(
    aten.embedding.default,
    "padding-idx",
    args(lambda g: randn(g, V, D), lambda g: ints(g, V, B, S), 0),
    R,
    shard(1, "uneven"),
)
case(aten.embedding.default, "replicated", args(lambda g: randn(g, V, D), lambda g: ints(g, V, B, 3)), R, R)
# scale_grad_by_freq divides each row's gradient by its count in the whole batch, not in one rank's tokens.
for lay in ("even", "zigzag"):
    case(
        aten.embedding.default,
        f"scale-grad-by-freq-{lay}",
        args(lambda g: randn(g, V, D), lambda g: ints(g, 3, B, S), -1, True),
        R,
        shard(1, lay),
    )

# --- elementwise ops with their own entry -------------------------------------------------------------

for lay in SEQ_LAYOUTS:
    case(
        aten.masked_fill.Scalar,
        f"shard-{lay}",
        args(x3, lambda g: mask(g, B, S, 1), -1.5),
        shard(1, lay),
        R,
        expect=(Shard,),
    )
    case(
        aten.masked_fill.Tensor,
        f"shard-{lay}",
        args(x3, lambda g: mask(g, B, S, D), lambda g: randn(g)),
        shard(1, lay),
        shard(1, lay),
        R,
        expect=(Shard,),
    )
    case(
        aten.where.self,
        f"shard-{lay}",
        args(lambda g: mask(g, B, S, 1), x3, lambda g: randn(g, D)),
        shard(1, lay),
        shard(1, lay),
        R,
        expect=(Shard,),
    )
    case(aten.clone.default, f"shard-{lay}", args(x3), shard(1, lay), expect=(Shard,))
    case(
        aten._to_copy.default,
        f"shard-{lay}",
        args(x3, dtype=torch.float32),
        shard(1, lay),
        expect=(Shard,),
        atol=1e-6,
        rtol=1e-5,
    )
    case(aten.clamp.default, f"shard-{lay}", args(x3, -0.5, 0.5), shard(1, lay), expect=(Shard,))
for lay in ALL_LAYOUTS:
    # Position-dependent: each element is kept by its global row and column.
    case(aten.tril.default, f"[S,S]-rows-{lay}", args(sq), shard(0, lay))
    case(aten.triu.default, f"[S,S]-rows-{lay}", args(sq, 1), shard(0, lay))
    case(aten.tril.default, f"[S,S]-cols-{lay}", args(sq, -2), shard(1, lay))
    case(aten.triu.default, f"[S,S]-cols-{lay}", args(sq), shard(1, lay))
case(aten.tril.default, "[B,S,S]-rows-diagonal", args(lambda g: randn(g, B, S, S), 3), shard(1, "zigzag"))
case(aten.triu.default, "[B,S,D]-rows", args(x3, -1), shard(1, "uneven"))
case(aten.tril.default, "[B,S,D]-on-D-rows", args(lambda g: randn(g, S, B, D)), shard(0, "zigzag"))
case(aten.tril.default, "[B*S,S]-folded", args(lambda g: randn(g, B * S, S)), shard(0, length=S))
case(aten.tril.default, "replicated-seq", args(sq), rs(0))
case(aten.triu.default, "partial", args(sq), Partial())
case(aten.triu.default, "shard-on-batch-dim", args(lambda g: randn(g, S, 3, 3)), shard(0, "zigzag"))
case(aten.masked_fill.Scalar, "mask-replicated-seq", args(x3, lambda g: mask(g, S, 1), 0.0), shard(1, "zigzag"), rs(0))
case(aten.masked_fill.Scalar, "partial", args(lambda g: randn(g, B, D), lambda g: mask(g, B, D), 0.0), Partial(), R)
case(
    aten.masked_fill.Tensor,
    "value-partial",
    args(x3, lambda g: mask(g, B, S, D), lambda g: randn(g)),
    shard(1),
    R,
    Partial(),
)
# A causal mask [S,S] (built from arange, replicated) applied to scores sharded on their rows.
case(
    aten.where.ScalarOther,
    "causal-mask-on-score-rows",
    args(lambda g: torch.ones(S, S, dtype=torch.bool).tril(), lambda g: randn(g, B, S, S), float("-inf")),
    rs(0),
    shard(1, "zigzag"),
    expect=(Shard,),
)
case(
    aten.where.self,
    "partial-branches",
    args(lambda g: mask(g, B, D), lambda g: randn(g, B, D), lambda g: randn(g, B, D)),
    R,
    Partial(),
    Partial(),
)
case(
    aten.where.self,
    "layouts-differ",
    args(lambda g: mask(g, B, S, 1), x3, x3),
    shard(1, "even"),
    shard(1, "zigzag"),
    shard(1, "uneven"),
)
case(aten.where.ScalarSelf, "shard", args(lambda g: mask(g, B, S, D), 0.5, x3), shard(1, "zigzag"), shard(1, "zigzag"))
case(aten.where.ScalarSelf, "partial", args(lambda g: mask(g, B, D), 0.5, lambda g: randn(g, B, D)), R, Partial())
case(aten.where.ScalarOther, "shard", args(lambda g: mask(g, B, S, 1), x3, -2.0), R, shard(1, "uneven"))
case(aten.where.ScalarOther, "partial", args(lambda g: mask(g, B, D), lambda g: randn(g, B, D), -2.0), R, Partial())
case(
    aten._to_copy.default,
    "partial-float32",
    args(lambda g: randn(g, B, D), dtype=torch.float32),
    Partial(),
    atol=1e-5,
    rtol=1e-5,
)
# A cast to an integer type is not linear: summands must not be truncated one by one.
# A narrower float rounds each summand before the sum: reduced first. A wider one keeps the partial sum.
F32 = torch.float32
case(
    aten._to_copy.default,
    "partial-to-bf16",
    args(lambda g: randn(g, B, D, dtype=F32), dtype=torch.bfloat16),
    Partial(),
    expect=(Replicate,),
    # The harness splits the gradient of a whole output into P shares, each rounded to bf16.
    atol=2e-2,
    rtol=2e-2,
)
case(
    aten._to_copy.default,
    "partial-to-f64",
    args(lambda g: randn(g, B, D, dtype=F32), dtype=F64),
    Partial(),
    expect=(Partial,),
)
case(aten._to_copy.default, "partial-to-int64", args(lambda g: 3 * randn(g, B, D), dtype=torch.int64), Partial())
case(aten._to_copy.default, "partial-int-to-float", args(lambda g: ints(g, S, B, D), dtype=F64), Partial())
case(aten._to_copy.default, "partial-to-bool", args(lambda g: mask(g, B, D).double(), dtype=torch.bool), Partial())
case(aten.clone.default, "partial", args(lambda g: randn(g, B, D)), Partial())
case(aten.clone.default, "replicated-seq", args(x3), rs(1))
case(aten.clone.default, "head-sharded", args(lambda g: randn(g, B, 4, S, 2)), head_shard(1))
case(aten.alias.default, "shard", args(x3), shard(1, "zigzag"), expect=(Shard,))
case(aten.alias.default, "partial", args(lambda g: randn(g, B, D)), Partial())
case(aten.detach.default, "shard", args(x3), shard(1, "uneven"))
case(aten.detach.default, "partial", args(lambda g: randn(g, B, D)), Partial())
case(aten.lift_fresh_copy.default, "shard", args(x3), shard(1))
case(aten.lift_fresh_copy.default, "replicated", args(lambda g: randn(g, B, D)), R)
# aten.copy has no derivative, so eager cannot be the reference for its gradient here; see
# test_copy_rule_has_a_gradient for the gradient the rule gives it.
case(aten.copy.default, "into-replicated-from-shard", args(x3, x3), R, shard(1, "zigzag"), requires_grad=(False, False))
case(
    aten.copy.default,
    "into-shard-broadcast",
    args(x3, lambda g: randn(g, D)),
    shard(1, "uneven"),
    R,
    requires_grad=(False, False),
)
case(
    aten.copy.default,
    "from-partial",
    args(lambda g: randn(g, B, D), lambda g: randn(g, B, D)),
    R,
    Partial(),
    requires_grad=(False, False),
)
for op in (aten.zeros_like.default, aten.ones_like.default):
    case(op, "shard", args(x3), shard(1, "zigzag"))
    case(op, "partial", args(lambda g: randn(g, B, D)), Partial())
case(aten.full_like.default, "shard", args(x3, 3.0), shard(1, "uneven"))
case(aten.full_like.default, "partial", args(lambda g: randn(g, B, D), 3.0), Partial())
case(aten.empty_like.default, "shard", args(x3), shard(1, "zigzag"), check_values=False)
case(aten.empty_like.default, "partial", args(lambda g: randn(g, B, D)), Partial(), check_values=False)
case(aten.fill.Scalar, "shard", args(x3, 2.0), shard(1, "first_empty"))
case(aten.fill.Scalar, "partial", args(lambda g: randn(g, B, D), 2.0), Partial())
case(aten.clamp.default, "partial", args(lambda g: randn(g, B, D), -0.3, None), Partial())
case(
    aten.clamp.Tensor,
    "shard",
    args(x3, lambda g: randn(g, D) - 1, lambda g: randn(g, B, S, D) + 1),
    shard(1, "zigzag"),
    R,
    shard(1, "even"),
)
case(aten.clamp.Tensor, "partial-bound", args(lambda g: randn(g, B, D), lambda g: randn(g, B, D), None), R, Partial())

# --- reductions, normalisations, the loss, creation ---------------------------------------------------

for lay in ALL_LAYOUTS:
    case(aten.sum.dim_IntList, f"over-seq-{lay}", args(x3, [1]), shard(1, lay))
    case(aten.mean.dim, f"over-seq-{lay}", args(x3, [1]), shard(1, lay))
    case(aten.sum.default, f"all-{lay}", args(x3), shard(1, lay))
    case(aten.mean.default, f"all-{lay}", args(x3), shard(1, lay))
for lay in SEQ_LAYOUTS:
    case(aten.sum.dim_IntList, f"over-D-{lay}", args(x3, [-1], True), shard(1, lay), expect=(Shard,))
    case(aten.mean.dim, f"over-D-{lay}", args(x3, [2]), shard(1, lay), expect=(Shard,))
    case(aten._softmax.default, f"over-D-{lay}", args(x3, -1, False), shard(1, lay), expect=(Shard,))
    case(aten._log_softmax.default, f"over-D-{lay}", args(x3, 2, False), shard(1, lay), expect=(Shard,))
    case(
        aten.native_layer_norm.default,
        f"shard-{lay}",
        args(x3, [D], lambda g: randn(g, D), lambda g: randn(g, D), 1e-5),
        shard(1, lay),
        R,
        R,
        expect=(Shard, None, None),
    )
    case(
        aten._fused_rms_norm.default,
        f"shard-{lay}",
        args(x3, [D], lambda g: randn(g, D), 1e-5),
        shard(1, lay),
        R,
        expect=(Shard, None),
    )
    # A token loss: logits [B*S, C] sharded like the sequence, targets with ignored tokens.
    for reduction in (0, 1, 2):
        case(
            aten.nll_loss_forward.default,
            f"tokens-reduction{reduction}-{lay}",
            args(
                lambda g: randn(g, B * S, C).log_softmax(-1),
                lambda g: torch.where(mask(g, B * S), -100, ints(g, C, B * S)),
                None,
                reduction,
                -100,
            ),
            shard(0, lay, length=S),
            rs(0),
        )
case(aten.sum.dim_IntList, "empty-dims-is-all", args(x3, []), shard(1, "zigzag"))
case(aten.sum.dim_IntList, "over-seq-keepdim", args(x3, [1], True), shard(1, "zigzag"))
case(aten.sum.dim_IntList, "over-seq-and-D", args(x3, [1, 2]), shard(1, "uneven"))
case(
    aten.sum.dim_IntList,
    "over-seq-dtype",
    args(x3, [-2], dtype=torch.float32),
    shard(1, "zigzag"),
    atol=1e-5,
    rtol=1e-5,
)
case(aten.sum.dim_IntList, "over-folded-[B*S,D]", args(lambda g: randn(g, B * S, D), [0]), shard(0, "zigzag", length=S))
case(
    aten.sum.dim_IntList,
    "over-folded-inner-[B,S*2,2]",
    args(lambda g: randn(g, B, S * 2, 2), [1]),
    shard(1, "uneven", inner=2),
)
case(aten.sum.dim_IntList, "count-bool-over-seq", args(lambda g: mask(g, B, S), [1]), shard(1, "zigzag"))
case(aten.sum.dim_IntList, "partial-int", args(lambda g: ints(g, 9, B, 3), [1]), Partial())
case(aten.sum.dim_IntList, "partial", args(lambda g: randn(g, B, 3, D), [1]), Partial())
case(aten.sum.dim_IntList, "replicated-seq", args(x3, [1]), rs(1))
case(aten.sum.dim_IntList, "head-sharded", args(lambda g: randn(g, B, 4, S), [1]), head_shard(1))
case(aten.sum.default, "partial", args(lambda g: randn(g, B, D)), Partial())
case(aten.mean.dim, "over-folded-[B*S,D]", args(lambda g: randn(g, B * S, D), [0]), shard(0, "uneven", length=S))
case(aten.mean.dim, "partial", args(lambda g: randn(g, B, 3, D), [1, 2], True), Partial())
case(aten.mean.dim, "replicated-seq", args(x3, [1]), rs(1))
case(aten.mean.default, "partial", args(lambda g: randn(g, B, D)), Partial())
case(aten._softmax.default, "over-seq", args(x3, 1, False), shard(1, "zigzag"))
case(aten._softmax.default, "partial", args(lambda g: randn(g, B, D), -1, False), Partial())
case(aten._softmax.default, "replicated-seq", args(x3, -1, False), rs(1))
case(aten._log_softmax.default, "over-seq", args(x3, 1, False), shard(1, "uneven"))
case(aten._log_softmax.default, "partial", args(lambda g: randn(g, B, C), -1, False), Partial())
case(
    aten.native_layer_norm.default,
    "over-S-and-D",
    args(x3, [S, D], lambda g: randn(g, S, D), lambda g: randn(g, S, D), 1e-5),
    shard(1, "zigzag"),
    R,
    R,
)
case(aten.native_layer_norm.default, "partial", args(lambda g: randn(g, B, D), [D], None, None, 1e-5), Partial())
case(
    aten.native_layer_norm.default,
    "folded-[B*S,D]",
    args(lambda g: randn(g, B * S, D), [D], lambda g: randn(g, D), None, 1e-5),
    shard(0, "zigzag", length=S),
    R,
    expect=(Shard, None, None),
)
case(
    aten.native_layer_norm.default,
    "weight-partial",
    args(x3, [D], lambda g: randn(g, D), lambda g: randn(g, D), 1e-5),
    shard(1),
    Partial(),
    R,
)
case(aten._fused_rms_norm.default, "partial", args(lambda g: randn(g, B, D), [D], None, 1e-5), Partial())
case(aten._fused_rms_norm.default, "replicated-seq", args(x3, [D], lambda g: randn(g, D), None), rs(1), R)
case(
    aten.nll_loss_forward.default,
    "tokens-class-weight",
    args(
        lambda g: randn(g, B * S, C).log_softmax(-1), lambda g: ints(g, C, B * S), lambda g: randn(g, C).abs(), 1, -100
    ),
    shard(0, "zigzag", length=S),
    rs(0),
    R,
    requires_grad=(True, False, False),
)
case(
    aten.nll_loss_forward.default,
    "tokens-first-half-ignored",
    args(
        lambda g: randn(g, S, C).log_softmax(-1),
        lambda g: torch.cat([torch.full((S // 2,), -100), ints(g, C, S // 2)]),
        None,
        1,
        -100,
    ),
    shard(0, "even"),
    rs(0),
)
case(
    aten.nll_loss_forward.default,
    "tokens-target-sharded",
    args(lambda g: randn(g, S, C).log_softmax(-1), lambda g: ints(g, C, S), None, 1, -100),
    shard(0, "uneven"),
    shard(0, "uneven"),
)
case(
    aten.nll_loss_forward.default,
    "tokens-target-other-layout",
    args(lambda g: randn(g, S, C).log_softmax(-1), lambda g: ints(g, C, S), None, 1, -100),
    shard(0, "zigzag"),
    shard(0, "even"),
)
# Ops that read nearby positions (rules.halo): each rank's output from its piece and a halo from its neighbours.
CONV_X = lambda g: randn(g, B, 3, S)  # noqa: E731 - [B, channels, S], the sequence last
for lay in ALL_LAYOUTS:
    case(aten.constant_pad_nd.default, f"token-shift-{lay}", args(x3, [0, 0, 1, -1]), shard(1, lay))
    case(aten.constant_pad_nd.default, f"causal-left-pad-{lay}", args(CONV_X, [2, 0]), shard(2, lay), expect=(Shard,))
    case(aten.constant_pad_nd.default, f"crop-left-pad-right-{lay}", args(x3, [0, 0, -2, 3], 1.5), shard(1, lay))
    # name, weight [out, in / groups, K], bias, padding, dilation, groups
    for name, weight, bias, padding, dilation, groups in (
        ("same", (4, 3, 3), (4,), 1, 1, 1),
        ("mamba-depthwise-padded", (3, 1, 4), None, 3, 1, 3),
        ("dilated-valid", (2, 3, 3), None, 0, 2, 1),
    ):
        case(
            aten.convolution.default,
            f"{name}-{lay}",
            args(
                CONV_X,
                lambda g, w=weight: randn(g, *w),
                (lambda g, b=bias: randn(g, *b)) if bias else None,
                [1],
                [padding],
                [dilation],
                False,
                [0],
                groups,
            ),
            shard(2, lay),
            *((R, R) if bias else (R,)),
            expect=(Shard,),
        )
case(aten.constant_pad_nd.default, "other-dims-only", args(x3, [1, 2]), shard(1, "zigzag"), expect=(Shard,))
case(aten.constant_pad_nd.default, "seq-and-other-dims", args(x3, [1, 0, 2, 1], -1.0), shard(1, "uneven"))
case(aten.constant_pad_nd.default, "replicated-seq", args(x3, [0, 0, 1, -1]), rs(1))
# Half the output padding: some rank would read only padding however it is cut, so it runs whole.
case(
    aten.constant_pad_nd.default, "pad-as-long-as-input", args(x3, [0, 0, S, 0]), shard(1, "even"), expect=(Replicate,)
)
case(
    aten.constant_pad_nd.default,
    "pad-both-sides",
    args(x3, [0, 0, S // 2, S // 2]),
    shard(1, "zigzag"),
    expect=(Shard,),
)
case(aten.constant_pad_nd.default, "replicated", args(lambda g: randn(g, B, D), [1, 1]), R)
case(
    aten.convolution.default,
    "strided-runs-whole",
    args(CONV_X, lambda g: randn(g, 2, 3, 3), None, [2], [1], [1], False, [0], 1),
    shard(2, "even"),
    R,
)
case(
    aten.convolution.default,
    "weight-partial",
    args(CONV_X, lambda g: randn(g, 2, 3, 3), None, [1], [1], [1], False, [0], 1),
    shard(2, "zigzag"),
    Partial(),
)
# Rotary embeddings through complex numbers (Meta's Llama, torchtitan): [B, S, H, d/2, 2] <-> [B, S, H, d/2].
for lay in ALL_LAYOUTS:
    case(
        aten.view_as_complex.default,
        f"pairs-{lay}",
        args(lambda g: randn(g, B, S, 2, 3, 2, dtype=torch.float32)),
        shard(1, lay),
        expect=(Shard,),
    )
    case(
        aten.view_as_real.default,
        f"pairs-{lay}",
        args(lambda g: randn(g, B, S, 3, dtype=torch.complex64)),
        shard(1, lay),
        expect=(Shard,),
    )
case(aten.view_as_complex.default, "replicated-seq", args(lambda g: randn(g, S, 3, 2, dtype=torch.float32)), rs(0))
case(aten.view_as_real.default, "seq-last", args(lambda g: randn(g, B, S, dtype=torch.complex64)), shard(1, "zigzag"))
case(aten.view_as_complex.default, "replicated", args(lambda g: randn(g, B, 2, dtype=torch.float32)), R)
# Classes on dim 1: cross_entropy(logits.transpose(1, 2), labels) lowers to nll_loss2d on [B, C, S, 1].
for lay in ALL_LAYOUTS:
    for reduction in (0, 1, 2):
        case(
            aten.nll_loss2d_forward.default,
            f"classes-first-reduction{reduction}-{lay}",
            args(
                lambda g: randn(g, B, C, S, 1).log_softmax(1),
                lambda g: torch.where(mask(g, B, S, 1), -100, ints(g, C, B, S, 1)),
                None,
                reduction,
                -100,
            ),
            shard(2, lay),
            rs(1),
        )
case(
    aten.nll_loss2d_forward.default,
    "classes-first-on-W-class-weight",
    args(
        lambda g: randn(g, B, C, 1, S).log_softmax(1),
        lambda g: ints(g, C, B, 1, S),
        lambda g: randn(g, C).abs(),
        1,
        -100,
    ),
    shard(3, "zigzag"),
    shard(2, "even"),
    R,
    requires_grad=(True, False, False),
)
case(
    aten.nll_loss2d_forward.default,
    "sharded-on-classes",
    args(lambda g: randn(g, B, S, 3, 1).log_softmax(1), lambda g: ints(g, S, B, 3, 1), None, 1, -100),
    shard(1, "even"),
    R,
)
# The tiled LM head + loss (autosp.tile_loss): hidden rows [B*S, D] sharded, chunks of 5 rows, ignored tokens.
for lay in ALL_LAYOUTS:
    case(
        LINEAR_CROSS_ENTROPY,
        f"tokens-{lay}",
        args(
            lambda g: randn(g, B * S, D),
            lambda g: randn(g, C, D),
            lambda g: randn(g, C),
            lambda g: torch.where(mask(g, B * S), -100, ints(g, C, B * S)),
            -100,
            "",
            5,
        ),
        shard(0, lay, length=S),
        R,
        R,
        rs(0),
        expect=(Replicate,),
    )
case(
    LINEAR_CROSS_ENTROPY,
    "epilogue-no-bias-target-sharded",
    args(
        lambda g: randn(g, S, D),
        lambda g: randn(g, C, D),
        None,
        lambda g: ints(g, C, S),
        -100,
        "div:2.0,tanh,mul:2.0",
        3,
    ),
    shard(0, "uneven"),
    R,
    shard(0, "zigzag"),
    expect=(Replicate,),
)
case(
    LINEAR_CROSS_ENTROPY,
    "replicated",
    args(lambda g: randn(g, S, D), lambda g: randn(g, C, D), None, lambda g: ints(g, C, S), -100, "", 4),
    rs(0),
    R,
    rs(0),
)
# The tiled MLP (autosp.tile_mlp): rows [B*S, D] sharded, weights whole, chunks of 3 rows; row-wise, so
# the rows keep their layout. Gated (no biases) and plain (biases), and whole rows (run replicated).
for lay in ALL_LAYOUTS:
    case(
        TILED_MLP,
        f"gated-rows-{lay}",
        args(
            lambda g: randn(g, B * S, D),
            lambda g: randn(g, 5, D),
            None,
            lambda g: randn(g, 5, D),
            lambda g: randn(g, D, 5),
            None,
            "silu",
            3,
        ),
        shard(0, lay, length=S),
        R,
        R,
        R,
        expect=(Shard,),
    )
case(
    TILED_MLP,
    "plain-biases-rows",
    args(
        lambda g: randn(g, S, D),
        lambda g: randn(g, 5, D),
        lambda g: randn(g, 5),
        None,
        lambda g: randn(g, D, 5),
        lambda g: randn(g, D),
        "gelu_tanh",
        3,
    ),
    shard(0, "zigzag"),
    R,
    R,
    R,
    R,
    expect=(Shard,),
)
case(
    TILED_MLP,
    "replicated-rows",
    args(lambda g: randn(g, S, D), lambda g: randn(g, 5, D), None, None, lambda g: randn(g, D, 5), None, "relu", 4),
    rs(0),
    R,
    R,
)
# A classifier: pooled logits [B, C] and one target per example.
for reduction in (0, 1, 2):
    case(
        aten.nll_loss_forward.default,
        f"classifier-reduction{reduction}",
        args(lambda g: randn(g, B, C).log_softmax(-1), lambda g: ints(g, C, B), None, reduction, -100),
        R,
        R,
    )
    case(
        aten.nll_loss_forward.default,
        f"classifier-partial-logits-reduction{reduction}",
        args(lambda g: randn(g, B, C), lambda g: ints(g, C, B), None, reduction, -100),
        Partial(),
        R,
    )
case(aten.arange.default, "seq-length", args(S, dtype=torch.int64, device="cpu", pin_memory=False), seq_len=S)
case(aten.arange.default, "other-length", args(7), seq_len=S)
case(aten.arange.start, "seq-length", args(3, S + 3), seq_len=S)
case(aten.arange.start_step, "seq-length-float", args(0, 2 * S, 2, dtype=F64), seq_len=S)

# --- a user's own autograd.Function (autosp.user_function) ------------------------------------------------


def _user_function_body() -> str:
    """A Function's subgraphs as Dynamo makes them: ``x * w`` and its row sums, both saved inputs, and a
    backward that clamps (not linear in the gradient: a rank's partial gradient clamped is wrong)."""

    def fwd(x, w):
        y = x * w
        return (y, y.sum(-1)), (x, w)

    def bwd(g, g_rows, x, w):
        gx = (g * w + g_rows[..., None]).clamp(-0.5, 0.5)
        return gx, (g * x).sum((0, 1))

    body = Body(
        fwd=torch.fx.symbolic_trace(fwd),
        bwd=torch.fx.symbolic_trace(bwd),
        n_out=2,
        tuple_out=True,
        saved_from=(("arg", 0), ("arg", 1)),
        non_differentiable=frozenset(),
    )
    BODIES["test-clamped"] = body
    return "test-clamped"


_USER_FUNCTION = _user_function_body()
for lay in ALL_LAYOUTS:
    case(
        torch.ops.autosp.user_function.default,
        f"clamped-backward-{lay}",
        args([x3, lambda g: randn(g, D)], _USER_FUNCTION),
        shard(1, lay),
        R,
    )


def _token_wise_body() -> str:
    """A gate over two inputs of one shape, elementwise both ways, its backward clamped (not linear in
    the gradient): run on each rank's positions, it must be handed the true gradient of them."""

    def fwd(x, gate):
        return x * torch.sigmoid(gate), (x, gate)

    def bwd(g, x, gate):
        s = torch.sigmoid(gate)
        return (g * s).clamp(-0.3, 0.3), g * x * s * (1 - s)

    BODIES["test-token-wise"] = Body(
        fwd=torch.fx.symbolic_trace(fwd),
        bwd=torch.fx.symbolic_trace(bwd),
        n_out=1,
        tuple_out=False,
        saved_from=(("arg", 0), ("arg", 1)),
        non_differentiable=frozenset(),
        token_wise=True,
    )
    return "test-token-wise"


_TOKEN_WISE = _token_wise_body()
for lay in ALL_LAYOUTS:
    case(
        torch.ops.autosp.user_function.default,
        f"token-wise-{lay}",
        args([x3, x3], _TOKEN_WISE),
        shard(1, lay),
        rs(1),
        expect=(Shard,),
    )
case(
    torch.ops.autosp.user_function.default,
    "token-wise-layouts-differ",
    args([x3, x3], _TOKEN_WISE),
    shard(1, "zigzag"),
    shard(1, "even"),
    expect=(Shard,),
)
case(torch.ops.autosp.user_function.default, "token-wise-replicated", args([x3, x3], _TOKEN_WISE), R, R)
case(
    torch.ops.autosp.user_function.default,
    "clamped-backward-partial",
    args([x3, lambda g: randn(g, D)], _USER_FUNCTION),
    Partial(),
    R,
)


# --- shape ops ------------------------------------------------------------------------------------------

for lay in SEQ_LAYOUTS:
    case(aten.view.default, f"[B,S,D]->[B*S,D]-{lay}", args(x3, [B * S, D]), shard(1, lay), expect=(Shard,))
    case(
        aten.view.default,
        f"[B*S,D]->[B,S,D]-{lay}",
        args(lambda g: randn(g, B * S, D), [B, S, D]),
        shard(0, lay, length=S),
        expect=(Shard,),
    )
    case(aten.view.default, f"split-heads-{lay}", args(x3, [B, S, 2, 2]), shard(1, lay), expect=(Shard,))
    case(
        aten.view.default,
        f"merge-heads-inner-{lay}",
        args(lambda g: randn(g, B, S, 2, 2), [B, S * 2, 2]),
        shard(1, lay),
        expect=(Shard,),
    )
    case(
        aten.expand.default,
        f"[B,S,1]->[B,S,D]-{lay}",
        args(lambda g: randn(g, B, S, 1), [B, S, D]),
        shard(1, lay),
        expect=(Shard,),
    )
    case(
        aten.expand.default,
        f"[S,D]->[B,S,D]-{lay}",
        args(lambda g: randn(g, S, D), [B, -1, -1]),
        shard(0, lay),
        expect=(Shard,),
    )
    case(aten.permute.default, f"shard-{lay}", args(x3, [1, 0, 2]), shard(1, lay), expect=(Shard,))
    case(aten.transpose.int, f"shard-{lay}", args(x3, 1, 2), shard(1, lay), expect=(Shard,))
    case(aten.t.default, f"shard-{lay}", args(lambda g: randn(g, S, D)), shard(0, lay), expect=(Shard,))
    case(
        aten.cat.default,
        f"along-D-{lay}",
        args(lambda g: [x3(g), randn(g, B, S, 2)], 2),
        shard(1, lay),
        R,
        expect=(Shard,),
    )
    case(aten.split.Tensor, f"along-D-{lay}", args(x3, 3, 2), shard(1, lay), expect=(Shard, Shard))
    case(
        aten.unbind.int,
        f"qkv-{lay}",
        args(lambda g: randn(g, B, S, 3, D), 2),
        shard(1, lay),
        expect=(Shard, Shard, Shard),
    )
for lay in ALL_LAYOUTS:
    case(aten.slice.Tensor, f"[:,1:]-{lay}", args(x3, 1, 1, END), shard(1, lay))
    case(aten.slice.Tensor, f"[:,:-1]-{lay}", args(x3, 1, 0, -1), shard(1, lay))
    case(aten.slice.Tensor, f"[:,5:17]-{lay}", args(x3, 1, 5, 17), shard(1, lay))
    case(aten.slice.Tensor, f"[:,-1:]-{lay}", args(x3, 1, -1, END), shard(1, lay))
    # Strided: each rank keeps the kept positions it holds (once gathered whole).
    case(aten.slice.Tensor, f"[:,::2]-{lay}", args(x3, 1, 0, END, 2), shard(1, lay), expect=(Shard,))
    case(aten.slice.Tensor, f"[:,1::3]-{lay}", args(x3, 1, 1, END, 3), shard(1, lay), expect=(Shard,))
    case(aten.slice.Tensor, f"[:,3:20:5]-{lay}", args(x3, 1, 3, 20, 5), shard(1, lay), expect=(Shard,))
    case(aten.slice.Tensor, f"[:,::30]-{lay}", args(x3, 1, 0, END, 30), shard(1, lay), expect=(Shard,))
    case(aten.select.int, f"first-token-{lay}", args(x3, 1, 0), shard(1, lay))
    case(aten.select.int, f"last-token-{lay}", args(x3, 1, -1), shard(1, lay))
    case(aten.select.int, f"token-13-{lay}", args(x3, 1, 13), shard(1, lay))
case(aten.slice.Tensor, "empty-[:,S:]", args(x3, 1, S, END), shard(1, "zigzag"))
case(aten.slice.Tensor, "empty-[:,10:4]", args(x3, 1, 10, 4), shard(1, "even"))
case(aten.slice.Tensor, "along-D", args(x3, 2, 1, 3), shard(1, "zigzag"), expect=(Shard,))
case(aten.slice.Tensor, "partial-on-seq", args(x3, 1, 2, 9), Partial())
case(aten.slice.Tensor, "replicated-seq", args(x3, 1, 0, -1), rs(1))
case(aten.slice.Tensor, "folded-[B*S,D]", args(lambda g: randn(g, B * S, D), 0, 1, END), shard(0, "even", length=S))
case(aten.slice.Tensor, "head-sharded", args(lambda g: randn(g, B, 4, S, 2), 2, 0, 5), head_shard(1))
# Integer and bool values: the zeros of the ranks that do not hold the position must have the value's dtype.
case(aten.select.int, "bool-first-token", args(lambda g: mask(g, B, S), 1, 0), shard(1, "uneven"))
case(aten.select.int, "ids-last-token", args(lambda g: ints(g, V, B, S), 1, -1), shard(1, "zigzag"))
case(aten.select.int, "along-D", args(x3, 2, 1), shard(1, "zigzag"), expect=(Shard,))
case(aten.select.int, "batch", args(x3, 0, 1), shard(1, "uneven"), expect=(Shard,))
case(aten.select.int, "replicated-seq", args(x3, 1, -1), rs(1))
case(aten.select.int, "partial", args(lambda g: randn(g, B, 3, D), 1, 2), Partial())
case(aten.select.int, "folded-[B*S,D]", args(lambda g: randn(g, B * S, D), 0, 5), shard(0, "zigzag", length=S))
case(aten.select.int, "head-sharded-batch", args(lambda g: randn(g, B, 4, S, 2), 0, 1), head_shard(1))
case(aten.select.int, "head-sharded-head", args(lambda g: randn(g, B, 4, S, 2), 1, 2), head_shard(1))
case(
    aten.view.default,
    "[B,S,2,2]->[B*S*2,2]",
    args(lambda g: randn(g, B, S, 2, 2), [B * S * 2, 2]),
    shard(1, "zigzag"),
    expect=(Shard,),
)
case(aten.view.default, "splits-seq", args(x3, [B, 2, S // 2, D]), shard(1, "zigzag"))
case(aten.view.default, "partial", args(lambda g: randn(g, B, 6), [B, 2, 3]), Partial())
case(aten.view.default, "replicated-seq", args(x3, [B * S, D]), rs(1))
case(aten.view.default, "head-sharded", args(lambda g: randn(g, B, 4, S, 2), [B, 4, S * 2]), head_shard(1))
case(aten._unsafe_view.default, "[B,S,D]->[B*S,D]", args(x3, [B * S, D]), shard(1, "zigzag_sliced"), expect=(Shard,))
case(aten._unsafe_view.default, "partial", args(lambda g: randn(g, B, 6), [B * 6]), Partial())
case(aten.reshape.default, "[B,S,D]->[B,S*D]", args(x3, [B, S * D]), shard(1, "uneven"), expect=(Shard,))
case(aten.reshape.default, "partial", args(lambda g: randn(g, B, 6), [3, 4]), Partial())
case(aten.unsqueeze.default, "front", args(x3, 0), shard(1, "zigzag"), expect=(Shard,))
case(aten.unsqueeze.default, "back", args(x3, -1), shard(1, "uneven"), expect=(Shard,))
case(aten.unsqueeze.default, "partial", args(lambda g: randn(g, B, D), 1), Partial())
case(aten.squeeze.dim, "[B,S,1]", args(lambda g: randn(g, B, S, 1), -1), shard(1, "zigzag"), expect=(Shard,))
case(aten.squeeze.dim, "[1,S,D]", args(lambda g: randn(g, 1, S, D), 0), shard(1, "first_empty"), expect=(Shard,))
case(aten.squeeze.dim, "partial", args(lambda g: randn(g, B, 1, D), 1), Partial())
case(aten.squeeze.dims, "[1,S,1]", args(lambda g: randn(g, 1, S, 1), [0, 2]), shard(1, "uneven"), expect=(Shard,))
case(aten.squeeze.default, "[1,S,1]", args(lambda g: randn(g, 1, S, 1)), shard(1, "zigzag_sliced"), expect=(Shard,))
case(aten.squeeze.default, "partial", args(lambda g: randn(g, 1, B, 1)), Partial())
case(aten.flatten.using_ints, "batch-and-seq", args(x3, 0, 1), shard(1, "zigzag"), expect=(Shard,))
case(aten.flatten.using_ints, "seq-and-D", args(x3, 1, 2), shard(1, "uneven"), expect=(Shard,))
case(aten.flatten.using_ints, "partial", args(lambda g: randn(g, B, 3, D), 1, 2), Partial())
case(
    aten.unflatten.int,
    "[B*S,D]->[B,S,D]",
    args(lambda g: randn(g, B * S, D), 0, [B, S]),
    shard(0, "zigzag", length=S),
    expect=(Shard,),
)
case(aten.unflatten.int, "D->heads", args(x3, 2, [2, 2]), shard(1, "uneven"), expect=(Shard,))
case(aten.unflatten.int, "partial", args(lambda g: randn(g, B, 6), 1, [2, 3]), Partial())
case(aten.expand.default, "partial", args(lambda g: randn(g, 1, D), [B, D]), Partial())
case(aten.expand.default, "replicated-seq", args(lambda g: randn(g, S, 1), [S, D]), rs(0))
# A one-position piece of the sequence (x[:, :1], held by one rank) broadcast along it: once a result a
# factor S too small. The replicated one's axis no longer describes the broadcast dim.
for lay in ("even", "first_empty"):
    case(aten.expand.default, f"length-1-shard-{lay}", args(lambda g: randn(g, B, 1, D), [B, S, D]), shard(1, lay))
case(aten.expand.default, "replicated-length-1-seq", args(lambda g: randn(g, B, 1, D), [B, S, D]), rs(1, length=1))
case(aten.expand.default, "head-sharded", args(lambda g: randn(g, B, 4, 1, 2), [B, 4, 3, 2]), head_shard(1))
case(aten.permute.default, "head-sharded", args(lambda g: randn(g, B, 4, S, 2), [0, 2, 1, 3]), head_shard(1))
case(aten.permute.default, "partial", args(lambda g: randn(g, B, 3, D), [2, 0, 1]), Partial())
case(aten.transpose.int, "head-sharded", args(lambda g: randn(g, B, S, 4, 2), 1, 2), head_shard(2))
case(aten.transpose.int, "partial", args(lambda g: randn(g, B, 3, D), 0, -1), Partial())
case(aten.t.default, "partial", args(lambda g: randn(g, B, D)), Partial())
case(aten.t.default, "head-sharded", args(lambda g: randn(g, 4, S)), head_shard(0))
case(aten.split.Tensor, "along-seq", args(x3, 10, 1), shard(1, "zigzag"))
case(aten.split.Tensor, "partial", args(lambda g: randn(g, B, 6), 4, 1), Partial())
case(aten.split.Tensor, "replicated-seq-along-seq", args(x3, 10, 1), rs(1))
case(aten.split_with_sizes.default, "along-D", args(x3, [1, 3], 2), shard(1, "uneven"), expect=(Shard, Shard))
case(aten.split_with_sizes.default, "along-seq", args(x3, [10, 14], 1), shard(1, "even"))
case(aten.split_with_sizes.default, "partial", args(lambda g: randn(g, B, 6), [2, 4], 1), Partial())
case(aten.unbind.int, "along-seq", args(lambda g: randn(g, B, 5, D), 1), shard(1, "uneven", length=5))
case(aten.unbind.int, "replicated-seq-along-seq", args(lambda g: randn(g, B, 6, D), 1), rs(1, 6))
case(aten.unbind.int, "partial", args(lambda g: randn(g, 3, B, D), 0), Partial())
case(aten.unbind.int, "head-sharded", args(lambda g: randn(g, B, 4, 2), 0), head_shard(1))
# Prepending a [CLS] token: a cat along the sequence.
case(aten.cat.default, "prepend-token", args(lambda g: [randn(g, B, 1, D), x3(g)], 1), R, shard(1, "even"))
case(aten.cat.default, "prepend-token-zigzag", args(lambda g: [randn(g, B, 1, D), x3(g)], 1), R, shard(1, "zigzag"))
case(aten.cat.default, "append-token-seq-replicated", args(lambda g: [x3(g), randn(g, B, 1, D)], 1), rs(1), R)
case(
    aten.cat.default,
    "along-D-layouts-differ",
    args(lambda g: [x3(g), x3(g)], -1),
    shard(1, "even"),
    shard(1, "zigzag"),
    expect=(Shard,),
)
case(aten.cat.default, "along-D-partial", args(lambda g: [randn(g, B, D), randn(g, B, 2)], 1), Partial(), R)
case(aten.cat.default, "batch", args(lambda g: [x3(g), x3(g)], 0), shard(1, "uneven"), rs(1), expect=(Shard,))
case(aten.cat.default, "single", args(lambda g: [x3(g)], 1), shard(1, "zigzag"))
case(aten.cat.default, "empty-1d-skipped", args(lambda g: [torch.empty(0, dtype=F64), x3(g)], 1), R, shard(1, "uneven"))
case(aten.cat.default, "head-sharded", args(lambda g: [randn(g, B, 4, S), randn(g, B, 4, S)], 2), head_shard(1), R)
# Interleaved rotary embeddings: stack((-x2, x1), -1) on sequence-sharded halves keeps the shard.
for lay in ALL_LAYOUTS:
    case(aten.stack.default, f"interleave-last-{lay}", args(lambda g: [x3(g), x3(g)], -1), shard(1, lay), shard(1, lay))
case(
    aten.stack.default,
    "new-dim-0",
    args(lambda g: [x3(g), x3(g), x3(g)], 0),
    shard(1, "zigzag"),
    R,
    rs(1),
    expect=(Shard,),
)
case(aten.stack.default, "new-dim-at-seq", args(lambda g: [x3(g), x3(g)], 1), shard(1, "uneven"), R, expect=(Shard,))
case(aten.stack.default, "layouts-differ", args(lambda g: [x3(g), x3(g)], 2), shard(1, "even"), shard(1, "zigzag"))
case(aten.stack.default, "shards-on-other-dims", args(lambda g: [sq(g), sq(g)], 2), shard(0, "even"), shard(1, "even"))
case(
    aten.stack.default,
    "folded-[B*S,D]",
    args(lambda g: [randn(g, B * S, D), randn(g, B * S, D)], -1),
    shard(0, "zigzag", length=S),
    R,
    expect=(Shard,),
)
case(aten.stack.default, "replicated-seq", args(lambda g: [x3(g), x3(g)], 1), rs(1), R, expect=(Replicate,))
case(aten.stack.default, "replicated", args(lambda g: [randn(g, B, D), randn(g, B, D)]), R, R)
case(aten.stack.default, "partial", args(lambda g: [randn(g, B, D), randn(g, B, D)], -1), Partial(), R)
case(aten.sym_size.int, "shard", args(x3, 1), shard(1, "zigzag"))
case(aten.sym_size.int, "head-sharded", args(lambda g: randn(g, B, 4, S), 1), head_shard(1))
case(aten.sym_size.int, "partial", args(lambda g: randn(g, B, D), 0), Partial())

# --- pointwise ops through the default elementwise rule -------------------------------------------------

for lay in SEQ_LAYOUTS:
    case(aten.add.Tensor, f"shard+shard-{lay}", args(x3, x3), shard(1, lay), shard(1, lay), expect=(Shard,))
    case(
        aten.mul.Tensor,
        f"shard*replicated[D]-{lay}",
        args(x3, lambda g: randn(g, D)),
        shard(1, lay),
        R,
        expect=(Shard,),
    )
    case(
        aten.add.Tensor,
        f"shard+positions[S,1]-{lay}",
        args(x3, lambda g: randn(g, S, 1)),
        shard(1, lay),
        rs(0),
        expect=(Shard,),
    )
    case(aten.gelu.default, f"shard-{lay}", args(x3), shard(1, lay), expect=(Shard,))
case(
    aten.add.Tensor,
    "folded+replicated",
    args(lambda g: randn(g, B * S, D), lambda g: randn(g, B * S, D)),
    shard(0, "zigzag", length=S),
    R,
    expect=(Shard,),
)
case(
    aten.add.Tensor,
    "folded-layouts-differ",
    args(lambda g: randn(g, B * S, D), lambda g: randn(g, B * S, D)),
    shard(0, "uneven", length=S),
    shard(0, "zigzag", length=S),
    expect=(Shard,),
)
# An outer-product mask [S,1] x [1,S]: operands sharded on different output dims.
case(
    aten.mul.Tensor,
    "outer-product-shards",
    args(lambda g: randn(g, S, 1), lambda g: randn(g, 1, S)),
    shard(0, "zigzag"),
    shard(1, "uneven"),
)
case(
    aten.add.Tensor,
    "length-1-shard+whole",
    args(lambda g: randn(g, B, 1, D), x3),
    shard(1, "even"),
    rs(1),
)
case(
    aten.add.Tensor, "length-1-shard+shard", args(lambda g: randn(g, B, 1, D), x3), shard(1, "even"), shard(1, "zigzag")
)
case(aten.add.Tensor, "layouts-differ", args(x3, x3), shard(1, "even"), shard(1, "zigzag"), expect=(Shard,))
case(
    aten.add.Tensor, "broadcast-[B,1,D]", args(x3, lambda g: randn(g, B, 1, D)), shard(1, "uneven"), R, expect=(Shard,)
)
case(aten.add.Tensor, "partial+partial", args(lambda g: randn(g, B, D), lambda g: randn(g, B, D)), Partial(), Partial())
case(aten.add.Tensor, "partial+replicated", args(lambda g: randn(g, B, D), lambda g: randn(g, B, D)), Partial(), R)
case(aten.add.Tensor, "partial+scalar", args(lambda g: randn(g, B, D), 1.5), Partial())
case(
    aten.add.Tensor,
    "partial+partial-alpha",
    args(lambda g: randn(g, B, D), lambda g: randn(g, B, D), alpha=2),
    Partial(),
    Partial(),
)
case(aten.add.Tensor, "partial+shard", args(lambda g: randn(g, B, S, D), x3), Partial(), shard(1, "zigzag"))
# A partial count of tokens (int), as in "index of the last real token = mask.sum(1) - 1".
case(aten.sub.Tensor, "partial-int-minus-1", args(lambda g: ints(g, S, B), 1), Partial())
case(
    aten.div.Tensor,
    "partial/partial-int-count",
    args(lambda g: randn(g, B, D), lambda g: ints(g, S, B, 1) + 1),
    Partial(),
    Partial(),
)
case(aten.sub.Tensor, "partial-partial", args(lambda g: randn(g, B, D), lambda g: randn(g, B, D)), Partial(), Partial())
case(aten.sub.Tensor, "partial-scalar", args(lambda g: randn(g, B, D), 2.0), Partial())
case(aten.mul.Tensor, "partial*replicated", args(lambda g: randn(g, B, D), lambda g: randn(g, B, D)), Partial(), R)
case(aten.mul.Tensor, "partial*partial", args(lambda g: randn(g, B, D), lambda g: randn(g, B, D)), Partial(), Partial())
case(aten.mul.Tensor, "partial*scalar", args(lambda g: randn(g, B, D), 3.0), Partial())
case(aten.div.Tensor, "partial/replicated", args(lambda g: randn(g, B, D), lambda g: randn(g, B, D) + 3), Partial(), R)
case(aten.div.Tensor, "replicated/partial", args(lambda g: randn(g, B, D), lambda g: randn(g, B, D) + 3), R, Partial())
case(aten.neg.default, "partial", args(lambda g: randn(g, B, D)), Partial())
case(aten.exp.default, "partial", args(lambda g: randn(g, B, D)), Partial())
case(aten.pow.Tensor_Scalar, "partial", args(lambda g: randn(g, B, D), 2), Partial())
case(aten.rsqrt.default, "shard", args(lambda g: randn(g, B, S, D).abs() + 1), shard(1, "zigzag_sliced"))
case(aten.sigmoid.default, "head-sharded", args(lambda g: randn(g, B, 4, S)), head_shard(1))
# Not tagged pointwise by torch; its second result is a buffer for the backward (the input's shape on CPU).
for lay in ALL_LAYOUTS:
    case(aten.log_sigmoid_forward.default, f"shard-{lay}", args(x3), shard(1, lay), expect=(Shard, Shard))
case(
    aten.log_sigmoid_forward.default,
    "gate-[B,S]",
    args(lambda g: randn(g, B, S)),
    shard(1, "zigzag"),
    expect=(Shard, Shard),
)
case(aten.log_sigmoid_forward.default, "replicated-seq", args(x3), rs(1), expect=(Replicate, Replicate))
case(
    aten.log_sigmoid_forward.default,
    "partial",
    args(lambda g: randn(g, B, D)),
    Partial(),
    expect=(Replicate, Replicate),
)
case(aten.log_sigmoid_forward.default, "head-sharded", args(lambda g: randn(g, B, 4, S)), head_shard(1))
case(aten.eq.Scalar, "partial-int-count", args(lambda g: ints(g, 3, B, D), 0), Partial())
case(
    aten.index_select.default, "partial-int-index", args(x3, 1, lambda g: ints(g, S, 3)), shard(1, "zigzag"), Partial()
)
case(aten.pow.Scalar, "scalar-base-shard", args(2.0, x3), shard(1, "uneven"), expect=(Shard,))
case(aten.eq.Scalar, "shard-bool-out", args(lambda g: ints(g, 3, B, S), 1), shard(1, "zigzag"))
case(aten.lt.Tensor, "shard<replicated", args(x3, lambda g: randn(g, D)), shard(1, "uneven"), R)

# --- position-dependent and sequence-reducing ops without a rule of their own (whatever handles them) ------

for lay in ALL_LAYOUTS:
    case(aten.cumsum.default, f"over-seq-{lay}", args(x3, 1), shard(1, lay))
    # Position ids from a padding mask: attention_mask.cumsum(-1).
    case(aten.cumsum.default, f"int-mask-positions-{lay}", args(lambda g: mask(g, B, S).long(), -1), shard(1, lay))
case(aten.cumsum.default, "bool-over-seq", args(lambda g: mask(g, B, S), 1), shard(1, "zigzag"))
case(aten.cumsum.default, "dtype-over-seq", args(x3, 1, dtype=torch.float32), shard(1, "uneven"), atol=1e-5, rtol=1e-5)
case(aten.cumsum.default, "folded-[B*S,D]", args(lambda g: randn(g, B * S, D), 0), shard(0, "zigzag", length=S))
case(aten.cumsum.default, "replicated-seq", args(x3, 1), rs(1))


def inf_late(g: torch.Generator) -> torch.Tensor:
    """An ``inf`` near the end: one device's running sums before it stay finite."""
    x = randn(g, B, S, D)
    x[:, S - 2] = math.inf
    return x


for lay in ("even", "zigzag"):
    # Once every piece's offset was (totals * before).sum(): inf * 0 made the first pieces NaN.
    case(aten.cumsum.default, f"inf-late-{lay}", args(inf_late, 1), shard(1, lay))
for lay in ALL_LAYOUTS:
    case(aten.logcumsumexp.default, f"over-seq-{lay}", args(x3, 1), shard(1, lay), expect=(Shard,))
case(
    aten.logcumsumexp.default,
    "gate-[B,S]-last",
    args(lambda g: randn(g, B, S), -1),
    shard(1, "uneven"),
    expect=(Shard,),
)


def gates_with_zeros(g: torch.Generator) -> torch.Tensor:
    """Log gates with zeros (``-inf``): scattered, a leading run across pieces (torch's backward is NaN
    where the result is ``-inf``), a run of whole pieces after finite values (gradient 0 there)."""
    x = randn(g, 3, S).masked_fill(mask(g, 3, S), -math.inf)
    x[1, : S // 2 + 1] = -math.inf
    x[2, 2 : S - 2] = -math.inf
    return x


for lay in ALL_LAYOUTS:
    case(
        aten.logcumsumexp.default, f"gates-with-zeros-{lay}", args(gates_with_zeros, 1), shard(1, lay), expect=(Shard,)
    )
case(aten.logcumsumexp.default, "folded-[B*S,D]", args(lambda g: randn(g, B * S, D), 0), shard(0, "zigzag", length=S))
case(aten.logcumsumexp.default, "over-D", args(x3, 2), shard(1, "uneven"), expect=(Shard,))
case(aten.logcumsumexp.default, "replicated-seq", args(x3, 1), rs(1))
case(aten.logcumsumexp.default, "head-sharded", args(lambda g: randn(g, B, 4, S), 2), head_shard(1))

for lay in ("even", "zigzag"):
    case(aten.amax.default, f"over-seq-{lay}", args(x3, [1]), shard(1, lay))
    case(aten.max.dim, f"over-seq-{lay}", args(x3, 1), shard(1, lay))
    case(aten.logsumexp.default, f"over-seq-{lay}", args(x3, [1]), shard(1, lay))
    case(aten.linalg_vector_norm.default, f"over-seq-{lay}", args(x3, 2, [1]), shard(1, lay))
    case(aten.index_select.default, f"seq-{lay}", args(x3, 1, lit(torch.tensor([0, S - 1, 7]))), shard(1, lay), R)
    case(aten.gather.default, f"seq-{lay}", args(x3, 1, lambda g: ints(g, S, B, 3, D)), shard(1, lay), R)
    # Token log-probs: logp.gather(-1, labels[..., None]), labels sharded like logp or whole.
    case(
        aten.gather.default,
        f"token-logp-{lay}",
        args(x3, 2, lambda g: ints(g, D, B, S, 1)),
        shard(1, lay),
        shard(1, lay),
        expect=(Shard,),
    )
    case(
        aten.gather.default,
        f"token-logp-whole-labels-{lay}",
        args(x3, -1, lambda g: ints(g, D, B, S, 2)),
        shard(1, lay),
        rs(1),
        expect=(Shard,),
    )
    case(aten.index.Tensor, f"seq-{lay}", args(x3, [None, lit(torch.tensor([S - 1, 2]))]), shard(1, lay), R)
    case(aten.diagonal.default, f"[S,S]-rows-{lay}", args(sq), shard(0, lay))
    case(aten.argmax.default, f"over-seq-{lay}", args(x3, 1), shard(1, lay))
    # Positions moved along the sequence, values kept where they are (rules/reorder.py).
    case(aten.flip.default, f"seq-{lay}", args(x3, [1]), shard(1, lay), expect=(Shard,))
    case(aten.flip.default, f"seq-and-features-{lay}", args(x3, [2, 0, 1]), shard(1, lay), expect=(Shard,))
    case(aten.roll.default, f"seq-{lay}", args(x3, [1], [1]), shard(1, lay), expect=(Shard,))
    case(aten.roll.default, f"seq-back-{lay}", args(x3, [-5], [-2]), shard(1, lay), expect=(Shard,))
    case(aten.roll.default, f"seq-past-length-{lay}", args(x3, [S + 7, 1], [1, 2]), shard(1, lay), expect=(Shard,))
    case(aten.roll.default, f"seq-twice-{lay}", args(x3, [3, S - 3], [1, 1]), shard(1, lay), expect=(Shard,))
    case(aten.roll.default, f"features-{lay}", args(x3, [1], [2]), shard(1, lay), expect=(Shard,))
    case(aten.var.correction, f"over-seq-{lay}", args(x3, [1]), shard(1, lay))
    case(aten.cumsum.default, f"partial-{lay}", args(lambda g: randn(g, B, 3), 1), Partial())
case(
    aten.flip.default,
    "folded-[B*S,D]",
    args(lambda g: randn(g, B * S, D), [0]),
    shard(0, "zigzag", length=S),
    expect=(Shard,),
)
case(aten.flip.default, "features", args(x3, [2]), shard(1, "uneven"), expect=(Shard,))
case(aten.flip.default, "replicated-seq", args(x3, [1]), rs(1), expect=(Replicate,))
case(aten.flip.default, "partial", args(lambda g: randn(g, B, D), [1]), Partial(), expect=(Partial,))
case(
    aten.roll.default,
    "folded-[B*S,D]-gathered",
    args(lambda g: randn(g, B * S, D), [3], [0]),
    shard(0, length=S),
    expect=(Replicate,),
)
case(aten.roll.default, "flattened-gathered", args(x3, [5]), shard(1, "zigzag"), expect=(Replicate,))
case(aten.roll.default, "replicated-seq", args(x3, [2], [1]), rs(1), expect=(Replicate,))
case(aten.roll.default, "partial", args(lambda g: randn(g, B, D), [1], [1]), Partial(), expect=(Partial,))
case(aten.cumsum.default, "over-D", args(x3, 2), shard(1, "uneven"))
case(aten.amax.default, "partial", args(lambda g: randn(g, B, D), [1]), Partial())
case(
    aten.gather.default,
    "token-logp-sharded-labels-only",
    args(x3, 2, lambda g: ints(g, D, B, S, 1)),
    R,
    shard(1, "zigzag"),
    expect=(Shard,),
)
case(aten.gather.default, "index-shorter-on-seq", args(x3, 2, lambda g: ints(g, D, B, S - 2, 1)), shard(1), R)
case(
    aten.gather.default,
    "folded-[B*S,V]",
    args(lambda g: randn(g, B * S, D), 1, lambda g: ints(g, D, B * S, 1)),
    shard(0, "zigzag", length=S),
    R,
    expect=(Shard,),
)
case(aten.gather.default, "replicated", args(x3, 2, lambda g: ints(g, D, B, S, 1)), rs(1), R)


def _ix(k: int) -> Callable[[torch.Generator], torch.Tensor]:
    return lambda g: ints(g, D, B, S, k)  # k feature indices per token


def _src(k: int) -> Callable[[torch.Generator], torch.Tensor]:
    return lambda g: randn(g, B, S, k)


# Fresh tensors (only the operand's dtype and device read) and writes along dims other than the sequence:
# DeepSeek's MLA fills a new_empty with q's halves (slice_scatter); its router scatters over expert groups.
for lay in ALL_LAYOUTS:
    case(aten.new_zeros.default, f"seq-operand-{lay}", args(x3, [B, S, D]), shard(1, lay), expect=(Replicate,))
    case(aten.new_full.default, f"seq-operand-{lay}", args(x3, [S, 3], 1.5), shard(1, lay), expect=(Replicate,))
    case(
        aten.new_empty.default,
        f"seq-operand-{lay}",
        args(x3, [B, S, D]),
        shard(1, lay),
        expect=(Replicate,),
        check_values=False,
    )
    for name, placements in (("both", (shard(1, lay), shard(1, lay))), ("src", (R, shard(1, lay)))):
        case(
            aten.slice_scatter.default,
            f"head-dim-{name}-{lay}",
            args(x3, lambda g: randn(g, B, S, 2), 2, 1, 3),
            *placements,
            expect=(Shard,),
        )
    # op, name, (dim, index, src or value), placements of (x, index[, src])
    for op, name, rest, placements in (
        (aten.scatter.src, "features", (2, _ix(2), _src(2)), (shard(1, lay), rs(1), shard(1, lay))),
        (aten.scatter.value, "features", (-1, _ix(2), 1.5), (R, shard(1, lay))),
        (aten.scatter_add.default, "features", (2, _ix(3), _src(3)), (shard(1, lay), shard(1, lay), R)),
        (aten.scatter_reduce.two, "features-amax", (2, _ix(3), _src(3), "amax"), (shard(1, lay),) * 3),
    ):
        kw = {"include_self": False} if op is aten.scatter_reduce.two else {}
        case(op, f"{name}-{lay}", args(x3, *rest, **kw), *placements, expect=(Shard,))
for lay in ALL_LAYOUTS:
    case(aten.repeat.default, f"other-dims-{lay}", args(x3, [2, 1, 3]), shard(1, lay), expect=(Shard,))
    case(aten.repeat.default, f"new-leading-dim-{lay}", args(x3, [2, 1, 1, 2]), shard(1, lay), expect=(Shard,))
    case(aten.repeat.default, f"along-seq-{lay}", args(x3, [1, 2, 1]), shard(1, lay), expect=(Shard,))
case(
    aten.repeat.default,
    "along-folded-seq",
    args(lambda g: randn(g, B * S, D), [3, 2]),
    shard(0, "zigzag", length=S),
    expect=(Shard,),
)
case(aten.repeat.default, "replicated-seq", args(x3, [3, 1, 1]), rs(1), expect=(Replicate,))
case(aten.repeat.default, "partial", args(lambda g: randn(g, B, D), [2, 2]), Partial(), expect=(Partial,))
case(aten.new_ones.default, "partial-operand", args(lambda g: randn(g, B, D), [2, 3]), Partial(), expect=(Replicate,))
case(aten.slice_scatter.default, "along-seq", args(x3, lambda g: randn(g, B, 4, D), 1, 2, 6), shard(1, "zigzag"), R)
case(aten.slice_scatter.default, "replicated", args(x3, lambda g: randn(g, B, S, 2), 2, 0, 2), rs(1), rs(1))
case(aten.scatter.src, "along-seq", args(x3, 1, lambda g: ints(g, S, B, S, D), x3), shard(1, "uneven"), R, R)
case(
    aten.scatter.src,
    "index-shorter-on-seq",
    args(x3, 2, lambda g: ints(g, D, B, S - 2, 1), lambda g: randn(g, B, S - 2, 1)),
    shard(1, "even"),
    R,
    R,
)

# Attention that is no variant's site: queries' rows against a memory every rank holds whole (cross-attention).
# The leaf has no backward of its own (the SP rewrite replaces it), so values only; test_written_attention's
# cross-attention model checks the gradients end to end.
SDPA_LEAF = torch.ops.autosp.sdpa.default
NO_GRAD = {"requires_grad": (False, False, False, False)}


def q4(g: torch.Generator) -> torch.Tensor:
    return randn(g, B, 2, S, D)


def mem(g: torch.Generator) -> torch.Tensor:
    return randn(g, B, 2, 5, D)


for lay in ALL_LAYOUTS:
    case(
        SDPA_LEAF,
        f"cross-{lay}",
        args(q4, mem, mem),
        shard(2, lay),
        R,
        R,
        expect=(Shard,),
        requires_grad=(False, False, False),
    )
    case(
        SDPA_LEAF,
        f"cross-row-mask-{lay}",
        args(q4, mem, mem, lambda g: randn(g, B, 1, S, 5)),
        shard(2, lay),
        R,
        R,
        R,
        expect=(Shard,),
        **NO_GRAD,
    )
case(
    SDPA_LEAF,
    "cross-broadcast-mask",
    args(q4, mem, mem, lambda g: randn(g, 1, 1, 1, 5)),
    shard(2, "zigzag"),
    R,
    R,
    R,
    expect=(Shard,),
    **NO_GRAD,
)
case(
    SDPA_LEAF,
    "cross-causal-falls-back",
    args(q4, mem, mem, is_causal=True),
    shard(2),
    R,
    R,
    requires_grad=(False, False, False),
)
case(
    SDPA_LEAF,
    "self-kv-sharded-falls-back",
    args(q4, q4, q4),
    shard(2),
    shard(2),
    shard(2),
    requires_grad=(False, False, False),
)

# An MoE router's top-k over experts: token-wise; over the sequence it gathers.
for lay in ("even", "zigzag", "first_empty"):
    case(aten.topk.default, f"experts-{lay}", args(x3, 2, -1), shard(1, lay), expect=(Shard, Shard))
    case(aten.sort.default, f"experts-{lay}", args(x3, -1), shard(1, lay), expect=(Shard, Shard))
case(
    aten.topk.default,
    "folded-[B*S,E]",
    args(lambda g: randn(g, B * S, D), 3, 1),
    shard(0, "zigzag", length=S),
    expect=(Shard, Shard),
)
case(aten.topk.default, "over-seq-falls-back", args(x3, 3, 1), shard(1, "zigzag"))
case(aten.sort.default, "over-seq-falls-back", args(x3, 1), shard(1))


# table[idx] with one integer index: a lookup per index (cos[position_ids], experts[choice]).
for lay in SEQ_LAYOUTS:
    case(
        aten.index.Tensor,
        f"lookup-{lay}",
        args(lambda g: randn(g, V, D), [lambda g: ints(g, V, B, S)]),
        R,
        shard(1, lay),
        expect=(Shard,),
    )
case(
    aten.index.Tensor,
    "lookup-starts-sharding",
    args(lambda g: randn(g, V, D), [lambda g: ints(g, V, B, S)]),
    R,
    rs(1),
    layout="zigzag",
    expect=(Shard,),
)
case(
    aten.index.Tensor,
    "lookup-replicated",
    args(lambda g: randn(g, V, D), [lambda g: ints(g, V, B)]),
    R,
    R,
    expect=(Replicate,),
)
case(
    aten.index.Tensor,
    "two-indices-fall-back",
    args(lambda g: randn(g, V, V), [lambda g: ints(g, V, B, S), lambda g: ints(g, V, B, S)]),
    R,
    shard(1),
    shard(1),
)
case(aten.index.Tensor, "sharded-table-falls-back", args(x3, [lambda g: ints(g, B, 3)]), shard(1, "zigzag"), R)


# Reductions and scans along other axes than the sequence: token-wise; along it they gather.
def x4(g: torch.Generator) -> torch.Tensor:
    return randn(g, B, 3, S, D)


_INT_RESULTS = {"requires_grad": (False,)}  # argmax and friends: integer results, no gradient
ALONG = [
    (aten.amax.default, args(x3, [-1], True), args(x3, [1]), {}),
    (aten.amin.default, args(x3, [2]), args(x3, [0, 1]), {}),
    (aten.logsumexp.default, args(x3, [2]), args(x3, [1], True), {}),
    (aten.max.dim, args(x3, 2), args(x3, 1, True), {}),
    (aten.min.dim, args(x3, -1, True), args(x3, 1), {}),
    (aten.argmax.default, args(x3, 2), args(x3), _INT_RESULTS),
    (aten.argmin.default, args(x3, 0, True), args(x3, 1), _INT_RESULTS),
    (aten.median.dim, args(x3, 2), args(x3, 1), {}),
    (aten.mode.default, args(lambda g: randn(g, B, S, D).round()), args(x3, 1), {}),
    (aten.any.dim, args(lambda g: mask(g, B, S, D), 2), args(lambda g: mask(g, B, S, D), 1), _INT_RESULTS),
    (aten.any.dims, args(lambda g: mask(g, B, S, D), [0, 2]), args(lambda g: mask(g, B, S, D)), _INT_RESULTS),
    (aten.all.dim, args(lambda g: mask(g, B, S, D), 0), args(lambda g: mask(g, B, S, D), 1), _INT_RESULTS),
    (aten.prod.dim_int, args(x3, 2), args(x3, 1), {}),
    (aten.kthvalue.default, args(x3, 2), args(x3, 2, 1), {}),
    (aten.linalg_vector_norm.default, args(x3, 2, [-1], True), args(x3, 2, [1]), {}),
    (aten.var.correction, args(x3, [2], correction=1), args(x3, None, correction=0), {}),
    (aten.std.correction, args(x3, [2], correction=1, keepdim=True), args(x3, [1], correction=1), {}),
    (aten.var_mean.correction, args(x3, [0], correction=0), args(x3, [1, 2], correction=1), {}),
    (aten.cumprod.default, args(x3, 2), args(x3, 1), {}),
    (aten.cummax.default, args(x3, -1), args(x3, 1), {}),
    (aten.cummin.default, args(x3, 0), args(x3, 1), {}),
    (aten.logcumsumexp.default, args(x3, 2), args(x3, 1), {}),
]
for _op, _other, _seq, _opts in ALONG:
    for lay in SEQ_LAYOUTS:
        case(_op, f"along-other-{lay}", _other, shard(1, lay), expect=(Shard,) * len(_op._schema.returns), **_opts)
    case(_op, "along-seq-falls-back", _seq, shard(1, "zigzag"), **_opts)
case(aten.amax.default, "folded-[B*S,D]", args(lambda g: randn(g, B * S, D), [1]), shard(0, "zigzag", length=S))
case(aten.linalg_vector_norm.default, "heads-[B,H,S,D]", args(x4, 2, [-1]), shard(2, "zigzag"), expect=(Shard,))
case(aten.max.dim, "replicated-with-axis", args(x3, 2), rs(1), expect=(Replicate, Replicate))
case(aten.amax.default, "a-scalar", args(lambda g: randn(g), []), R, expect=(Replicate,))


def _case_seed(c: Case) -> int:
    return zlib.crc32(c.id.encode())


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("c", CASES, ids=[c.id for c in CASES])
def test_rule_matches_the_unsharded_op(c: Case, world: int) -> None:
    g = torch.Generator().manual_seed(_case_seed(c))
    call_args, call_kwargs = c.make(g)
    # Tracing under make_fx (as autosp.shard does) costs ~7 ms a rank: once per case, at P = 3, is enough
    # to catch a rule that reads tensor data; values and gradients are checked at every P.
    check_op(
        c.op,
        call_args,
        call_kwargs,
        placements=c.placements,
        world=world,
        expect=c.expect,
        seed=_case_seed(c),
        trace=world == 3,
        **c.options,
    )


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("lay", SEQ_LAYOUTS)
def test_copy_rule_has_a_gradient(world: int, lay: str) -> None:
    """In-place updates of activations (``x[:, 1:] += y``, ``h[:, -1] *= 2``) lower to ``aten.copy``.

    The sharded program is differentiated afterwards and ``aten.copy`` has no derivative, so the rule
    computes its value with ``copy_values``: same values as ``aten.copy``, gradients checked against it.
    """
    from autosp.sharding.rules.elementwise import copy_values

    g = torch.Generator().manual_seed(5)
    dst, src, row = x3(g), x3(g), randn(g, D)
    assert torch.equal(copy_values(dst, row), aten.copy(dst, row))
    rules = {**RULES, copy_values: RULES[aten.copy.default]}
    for inputs, placements in (
        ((dst, src), (shard(1, lay), shard(1, lay))),
        ((dst, src), (R, shard(1, lay))),
        ((dst, row), (shard(1, lay), R)),
        ((dst, src), (shard(1, lay), Partial())),
    ):
        check_op(copy_values, inputs, placements=placements, world=world, context={"rules": rules}, trace=world == 3)


def test_copy_rule_output_is_differentiable() -> None:
    """What the sharded program runs for ``aten.copy`` has a backward; ``aten.copy`` itself raises in it."""
    from autosp.sharding.context import SPContext, SPValue

    graph = torch.fx.Graph()
    node = graph.call_function(aten.copy.default, (graph.placeholder("dst"), graph.placeholder("src")))
    g = torch.Generator().manual_seed(6)
    dst, src = x3(g), x3(g).requires_grad_()
    node.meta["val"] = dst
    ctx = SPContext(rank=0, world=1, group_name="unused", seq_len=S, attention_rule=None)  # type: ignore[arg-type]
    out = RULES[aten.copy.default](ctx, node, (SPValue(dst, Replicate(), dst), SPValue(src, Replicate(), src)), {})
    out.local.sum().backward()
    assert torch.equal(out.local, src) and torch.equal(src.grad, torch.ones_like(src))


def _one_rank() -> Any:
    from autosp.sharding.context import SPContext

    return SPContext(rank=0, world=1, group_name="unused", seq_len=S, attention_rule=None)  # type: ignore[arg-type]


def test_a_node_without_meta_val_runs_whole() -> None:
    """Lowering's decompositions can leave nodes without ``meta["val"]`` (soft-target cross-entropy did)."""
    from autosp.sharding.context import SPValue
    from autosp.sharding.propagate import evaluate

    graph = torch.fx.Graph()
    node = graph.call_function(aten.mul.Tensor, (graph.placeholder("x"), graph.placeholder("y")))
    g = torch.Generator().manual_seed(7)
    x, y = x3(g), x3(g)
    out = evaluate(_one_rank(), node, (SPValue(x, Replicate(), x), SPValue(y, Replicate(), y)), {})
    assert isinstance(out.placement, Replicate) and torch.equal(out.local, x * y) and out.gval.shape == x.shape


def _write_then_read(read_after: bool) -> tuple[torch.fx.Node, torch.fx.Node, dict]:
    """``y = x.masked_fill_(m, 0)``, and ``x + 1`` afterwards if ``read_after``."""
    graph = torch.fx.Graph()
    x, m = graph.placeholder("x"), graph.placeholder("m")
    write = graph.call_function(aten.masked_fill_.Scalar, (x, m, 0.0))
    last = graph.call_function(aten.add.Tensor, (x if read_after else write, 1.0))
    graph.output(last)
    return x, write, {n: i for i, n in enumerate(graph.nodes)}


def test_an_in_place_write_read_later_reaches_its_readers_or_is_refused() -> None:
    """A rule writing into this rank's piece or a gathered copy would hide the write from later readers."""
    from autosp.errors import AutoSPError
    from autosp.sharding.context import SPValue
    from autosp.sharding.propagate import evaluate_in_place, written_and_read_later

    x, write, order = _write_then_read(read_after=False)
    assert written_and_read_later(write, order) == []  # read only through the op's result: any rule is exact
    x, write, order = _write_then_read(read_after=True)
    assert written_and_read_later(write, order) == [x]
    g = torch.Generator().manual_seed(8)
    whole, m = x3(g), mask(g, B, S, D)
    expected = whole.masked_fill(m, 0.0)
    env = {x: SPValue(whole, Replicate(), whole)}
    args = (env[x], SPValue(m, Replicate(), m), 0.0)
    out = evaluate_in_place(_one_rank(), write, args, {}, [x], env, order)
    assert torch.equal(out.local, expected) and torch.equal(env[x].local, expected)  # the reader sees the write
    piece = SPValue(whole, Shard(SeqAxis(1, S), (((0, S),),)), whole)
    env = {x: piece}
    with pytest.raises(AutoSPError, match="writes in place into x"):
        evaluate_in_place(_one_rank(), write, (piece, SPValue(m, Replicate(), m), 0.0), {}, [x], env, order)


def _write_into_view(sibling: bool) -> tuple:
    """``base = empty; view = base[:, 2:]; (sibling = base[:, :2];) view.copy_(src); read base (and sibling)``."""
    graph = torch.fx.Graph()
    base, src = graph.placeholder("base"), graph.placeholder("src")
    view = graph.call_function(aten.slice.Tensor, (base, 1, 2, S))
    other = graph.call_function(aten.slice.Tensor, (base, 1, 0, 2)) if sibling else None
    write = graph.call_function(aten.copy_.default, (view, src))
    last = graph.call_function(aten.add.Tensor, (base, 1.0))
    graph.output((last, graph.call_function(aten.mul.Tensor, (other, 2.0))) if sibling else last)
    return base, src, view, other, write, {n: i for i, n in enumerate(graph.nodes)}


def test_a_write_into_a_view_of_whole_values_reaches_the_base_or_is_refused() -> None:
    """Decompositions (F.pad with mode='circular') fill slices of a new tensor in place: exact when the
    view shares the whole base's storage on this rank; refused when it may not (a Shard piece, a copy)
    or when another view of the base, taken before the write, is read after it."""
    from autosp.errors import AutoSPError
    from autosp.sharding.context import SPValue
    from autosp.sharding.propagate import evaluate_in_place, written_and_read_later

    g = torch.Generator().manual_seed(9)
    src = x3(g)[:, 2:]
    whole = torch.zeros(B, S, D, dtype=src.dtype)
    for sibling in (False, True):
        base, s_node, view, other, write, order = _write_into_view(sibling)
        assert written_and_read_later(write, order) == [view]
        b = whole.clone()
        env = {base: SPValue(b, Replicate(), b), view: SPValue(b[:, 2:], Replicate(), b[:, 2:])}
        if other is not None:
            env[other] = SPValue(b[:, :2], Replicate(), b[:, :2])
        args = (env[view], SPValue(src, Replicate(), src))
        if sibling:
            with pytest.raises(AutoSPError, match="writes in place into slice"):
                evaluate_in_place(_one_rank(), write, args, {}, [view], env, order)
            continue
        evaluate_in_place(_one_rank(), write, args, {}, [view], env, order)
        assert torch.equal(env[base].local[:, 2:], src) and torch.equal(env[base].local[:, :2], whole[:, :2])
        # The view's local tensor a copy (as a rank's pieces put together are): the write would be lost.
        b = whole.clone()
        env = {base: SPValue(b, Replicate(), b), view: SPValue(b[:, 2:].clone(), Replicate(), b[:, 2:])}
        with pytest.raises(AutoSPError, match="writes in place into slice"):
            evaluate_in_place(_one_rank(), write, (env[view], args[1]), {}, [view], env, order)


def test_every_rule_has_a_case() -> None:
    covered = {c.op for c in CASES}
    missing = sorted(str(op) for op in RULES if op not in covered)
    assert not missing, f"sharding rules without a case in {__file__}: {missing}"


@torch.library.custom_op("autosp_test::log_sigmoid_cuda_like", mutates_args=())
def _log_sigmoid_cuda_like(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return F.logsigmoid(x), x.new_empty(0)


@_log_sigmoid_cuda_like.register_fake
def _(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), x.new_empty(0)


@pytest.mark.parametrize("world", WORLDS)
def test_log_sigmoid_buffer_empty_as_on_cuda_is_replicated(monkeypatch: pytest.MonkeyPatch, world: int) -> None:
    """On CUDA ``log_sigmoid_forward``'s buffer is empty: the same on every rank, not a piece of anything."""
    from autosp.sharding.rules.elementwise import log_sigmoid_rule

    op = torch.ops.autosp_test.log_sigmoid_cuda_like.default
    monkeypatch.setitem(RULES, op, log_sigmoid_rule)
    g = torch.Generator().manual_seed(0)
    check_op(
        op, (x3(g),), placements=[shard(1, "zigzag")], world=world, expect=(Shard, Replicate), requires_grad=[False]
    )


def test_a_wrong_rule_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The harness is not vacuous: a rule that treats tril as elementwise on a sharded axis fails it."""
    from autosp.sharding.rules.elementwise import elementwise
    from autosp.sharding.testing import RuleMismatch

    monkeypatch.setitem(RULES, aten.tril.default, elementwise)
    g = torch.Generator().manual_seed(0)
    with pytest.raises(RuleMismatch, match="values differ"):
        check_op(aten.tril.default, (randn(g, S, S),), placements=[shard(0)], world=2)


def test_a_wrong_gradient_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rule whose values are right but whose gradient is counted on every rank fails the gradient check."""
    from autosp.sharding.context import SPValue
    from autosp.sharding.redistribute import gather
    from autosp.sharding.testing import RuleMismatch

    def gather_then_sum(ctx, node, args, kwargs):
        v = args[0]
        whole = gather(ctx, v, for_output=True)  # a true-gradient backward, wrong for a value used redundantly
        return SPValue(whole.sum(), Replicate(), node.meta["val"])

    monkeypatch.setitem(RULES, aten.sum.default, gather_then_sum)
    g = torch.Generator().manual_seed(0)
    with pytest.raises(RuleMismatch, match="gradient of input 0"):
        check_op(aten.sum.default, (x3(g),), placements=[shard(1)], world=2)


# --- the simulator itself ---------------------------------------------------------------------------------


def test_simulated_ranks_exchange_data_and_gradients() -> None:
    from autosp.sharding import collectives as C
    from autosp.sharding.testing import simulate

    x = torch.arange(2 * 8 * 6, dtype=F64).reshape(2, 8, 6)

    def rank_fn(rank: int, group: str) -> tuple[bool, bool]:
        local = x[:, rank * 4 : (rank + 1) * 4].clone().requires_grad_()
        heads = C.all_to_all(local, 2, 1, group)  # sequence-sharded -> head-sharded
        heads.sum().backward()
        return torch.equal(heads, x[:, :, rank * 3 : (rank + 1) * 3]), bool(local.grad.eq(1).all())

    assert simulate(rank_fn, 2) == [(True, True), (True, True)]


def test_a_failing_rank_is_named() -> None:
    from autosp.sharding import collectives as C
    from autosp.sharding.testing import SimulationError, simulate

    def rank_fn(rank: int, group: str) -> None:
        if rank == 1:
            raise ValueError("boom")
        C.all_reduce(torch.ones(2), group, False)  # rank 0 waits here until rank 1's failure wakes it

    with pytest.raises(SimulationError, match="rank 1 of 2 raised ValueError: boom"):
        simulate(rank_fn, 2, timeout=60)


def test_ranks_that_disagree_on_collectives_are_reported() -> None:
    from autosp.sharding import collectives as C
    from autosp.sharding.testing import SimulationError, simulate

    def rank_fn(rank: int, group: str) -> None:
        if rank == 0:
            C.all_reduce(torch.ones(2), group, False)  # the other rank never joins

    with pytest.raises(SimulationError, match="did not finish"):
        simulate(rank_fn, 2, timeout=2)


def test_ranks_that_issue_different_collectives_are_reported() -> None:
    from autosp.sharding import collectives as C
    from autosp.sharding.testing import SimulationError, simulate

    def rank_fn(rank: int, group: str) -> None:
        if rank == 0:
            C.all_reduce(torch.ones(4), group, False)
        else:
            C.all_gather(torch.ones(2), 0, [2, 2], group, False)

    with pytest.raises(SimulationError, match="all_reduce.*\n.*all_gather"):
        simulate(rank_fn, 2, timeout=10)


def test_halo_layout_gives_every_rank_an_input_position_to_read_or_runs_whole() -> None:
    # A rank reading only padding would use the halo's all-gather through an empty slice, which a
    # compiler may drop (that rank then skips the collective the others wait in).
    from autosp.sharding.rules.halo import held_layout

    def left_pad(k: int):
        return lambda layout: tuple(tuple((lo - k, hi - k) for lo, hi in pieces) for pieces in layout)

    ranges = (((0, 4),), ((4, 8),))
    # A shift by 1: the input's pieces, the last one taking the new position.
    assert held_layout(ranges, 8, 9, left_pad(1))[0] == (((0, 4),), ((4, 9),))
    # 4 on each side: rank 0's piece [0, 4) would read padding only; cut evenly, both read the input.
    layout, reads = held_layout(ranges, 8, 16, left_pad(4))
    assert layout == (((0, 8),), ((8, 16),)) and reads == (((-4, 4),), ((4, 12),))
    # 8 on the left of 8 positions: half the output is padding whichever way it is cut.
    assert held_layout(ranges, 8, 16, left_pad(8)) is None
