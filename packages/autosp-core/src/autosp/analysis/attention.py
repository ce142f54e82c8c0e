"""Finding attention sites and their axes, with no user tags.

An attention variant is declared by an ``AttentionSpec``: the callables that
stand for it in the Dynamo graph, where q, k and v are among their arguments,
and the axis order of q/k/v (``"BHSD"`` for SDPA).  From the meta values of
those arguments we read batch, heads, kv heads, sequence and head-dim sizes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from autosp.errors import AutoSPError


@dataclass(frozen=True)
class AttentionSpec:
    """How an attention op looks in the graph.

    Attributes:
        name: variant name used in reports and by SP variants.
        targets: callables that mark the op in the Dynamo (Torch-IR) graph.
        layout: axis letters of q, k and v: B batch, H heads, S sequence, D head dim.
        qkv: positions of q, k and v among the call's arguments.
        mask: keyword or position of an additive/boolean mask, if the op takes one.
        causal: keyword of the causal flag, if any.
        leaf: op that stands for the call while the graph is lowered to aten, so that
            it stays one node; ``None`` when the target already is a custom op.
        signature: argument names of ``leaf``, to map keyword arguments onto it.
        variants: names of the SP variants that rewrite this op; ``None``: every variant. Under
            any other variant the call is no site: the engine runs it whole, inputs gathered.
        pads_heads: the op computes each query head from that head's q, k, v (and mask) alone and
            reads no head index, so a variant may add zero heads to split the heads over its ranks
            and cut their results (SDPA; FlexAttention, whose mods get a clamped head index). ``False``
            (the default for a plugin's op): the ranks must split the heads as they are.
    """

    name: str
    targets: tuple[Callable[..., Any], ...]
    layout: str = "BHSD"
    qkv: tuple[int, int, int] = (0, 1, 2)
    mask: str | int | None = None
    causal: str | None = None
    leaf: Any = None
    signature: tuple[str, ...] = ()
    variants: tuple[str, ...] | None = None
    pads_heads: bool = False

    def rewritten_by(self, variant: str) -> bool:
        return self.variants is None or variant in self.variants


@dataclass
class AttentionSite:
    """One attention call with the sizes inferred from its inputs."""

    name: str
    spec: AttentionSpec
    batch: Any
    heads: Any
    kv_heads: Any
    seq_len: Any
    kv_seq_len: Any
    head_dim: Any
    is_causal: bool
    mask_shape: tuple | None
    dtype: torch.dtype
    repeated_kv: bool = False
    notes: list[str] = field(default_factory=list)

    def axis(self, letter: str) -> int:
        return self.spec.layout.index(letter)

    def describe(self) -> str:
        gqa = f", GQA {hint(self.heads)}:{hint(self.kv_heads)}" if self.heads != self.kv_heads else ""
        mask = f", mask {hints(self.mask_shape)}" if self.mask_shape is not None else ""
        return (
            f"{self.name} [{self.spec.name}] B={hint(self.batch)} H={hint(self.heads)} S={hint(self.seq_len)} "
            f"D={hint(self.head_dim)}"
            f"{gqa}{', causal' if self.is_causal else ''}{mask}"
        )


def hint(n: Any) -> Any:
    """A size as this call's number, for messages: a symbolic length prints as its value, not ``s70``.

    Reads the size hint without adding a guard, so a message never specialises the graph.
    """
    if isinstance(n, torch.SymInt):
        from autosp.torch_compat import optimization_hint

        return optimization_hint(n, fallback=-1)
    return n


def hints(shape: Any) -> list[Any]:
    return [hint(n) for n in shape]


def _meta(node: Any) -> Any:
    if not isinstance(node, torch.fx.Node):
        return node
    return node.meta.get("val", node.meta.get("example_value"))


def _arg(node: torch.fx.Node, key: str | int | None, signature: Sequence[str]) -> Any:
    if key is None:
        return None
    if isinstance(key, int):
        return node.args[key] if key < len(node.args) else None
    if key in node.kwargs:
        return node.kwargs[key]
    if key in signature and signature.index(key) < len(node.args):
        return node.args[signature.index(key)]
    return None


SDPA_SIGNATURE = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def site_from_node(node: torch.fx.Node, spec: AttentionSpec) -> AttentionSite:
    q, k, v = (_meta(node.args[i]) for i in spec.qkv)
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        raise AutoSPError(f"attention call {node.name} has no tensor meta for q/k/v; cannot infer its axes")
    lay = spec.layout
    if q.dim() != len(lay) or k.dim() != len(lay):
        raise AutoSPError(
            f"attention call {node.name}: q has {q.dim()} dims but layout {lay!r} of {spec.name} expects {len(lay)}"
            + (
                " (SDPA on more dims is folded to 4 when its batch dims are of static size and alike in q, k and "
                "v; fold them yourself, q.flatten(0, q.dim() - 4) and the same for k and v, or mark no length dynamic)"
                if spec.name == "sdpa" and q.dim() > len(lay)
                else (
                    " (q, k and v without a heads dim, [batch, S, d] or [batch * heads, S, d]: give them one, "
                    "q.view(batch, heads, S, d) or q.unsqueeze(1), and the same for k and v, so the variant can "
                    "split heads or sequence)"
                    if spec.name == "sdpa" and q.dim() < len(lay)
                    else ""
                )
            )
        )
    signature = spec.signature or SDPA_SIGNATURE
    mask = _meta(_arg(node, spec.mask, signature))
    causal = _arg(node, spec.causal, signature)
    return AttentionSite(
        name=node.name,
        spec=spec,
        batch=q.shape[lay.index("B")],
        heads=q.shape[lay.index("H")],
        kv_heads=k.shape[lay.index("H")],
        seq_len=q.shape[lay.index("S")],
        kv_seq_len=k.shape[lay.index("S")],
        head_dim=q.shape[lay.index("D")],
        is_causal=bool(causal) if causal is not None else False,
        mask_shape=tuple(mask.shape) if isinstance(mask, torch.Tensor) else None,
        dtype=q.dtype,
    )


def find_attention_sites(gm: torch.fx.GraphModule, specs: Sequence[AttentionSpec]) -> list[AttentionSite]:
    """Every call in ``gm`` that matches one of ``specs``, in graph order."""
    by_target: dict[Any, AttentionSpec] = {}
    for spec in specs:
        for target in spec.targets:
            by_target[target] = spec
        if spec.leaf is not None:
            by_target[spec.leaf] = spec
    sites = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in by_target:
            sites.append(site_from_node(node, by_target[node.target]))
    return sites


__all__ = [
    "SDPA_SIGNATURE",
    "AttentionSite",
    "AttentionSpec",
    "find_attention_sites",
    "hint",
    "hints",
    "site_from_node",
]
