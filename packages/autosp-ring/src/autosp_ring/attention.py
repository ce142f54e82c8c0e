"""The ring rule at one attention site: q stays put, k/v travel (``variant="ring"``).

q, k and v are laid out as contiguous even sequence chunks (rank r: positions
``[r*S/P, (r+1)*S/P)``; zigzag pieces when the length allows; pieces one token apart when P
does not divide S), the ring op runs, and its output keeps q's layout.
Heads are never split, so any head count works on any number of ranks; GQA k/v
travel with their Hkv heads and are expanded per block on arrival.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from autosp.analysis.attention import AttentionSite, hints
from autosp.errors import AutoSPError, ConfigError
from autosp.lowering import FLEX, SDPA, sdpa_args
from autosp.sharding.context import SPContext, SPValue
from autosp.sharding.placement import Layout, Replicate, SeqAxis, Shard, piece_lengths, zigzag_ranges
from autosp.sharding.redistribute import to_replicate, to_shard
from autosp_ring.blocks import acc_dtype, default_scale
from autosp_ring.flex import ring_flex_rule

# Plugin attention specs with this name are causal sliding-window attention called as
# ``op(q, k, v, window)`` (see plugins/autosp-window); ring handles them natively.
SLIDING_WINDOW = "sliding_window"

SUPPORTED = (
    "ring attention supports F.scaled_dot_product_attention (is_causal, and an attn_mask that broadcasts "
    "as SDPA's to [B or 1, H or 1, S or 1, S or 1]: [S, S] and [H, S, S] too, boolean or additive), FlexAttention, "
    f"and plugin ops registered as {SLIDING_WINDOW!r} attention (causal sliding window, e.g. autosp-window's "
    "autosp_window.sliding_window_attention)"
)


def check(site: AttentionSite, world: int) -> None:
    """Compile-time refusal of what the ring op cannot compute exactly (runs before any collective)."""
    if site.spec is FLEX:
        return  # the rule cuts the block mask, or runs the call whole when it cannot (autosp_ring.flex)
    if site.spec.name not in (SDPA.name, SLIDING_WINDOW):
        raise AutoSPError(f"attention {site.name} is a {site.spec.name!r} op; {SUPPORTED}; or use variant='ulysses'")
    if site.mask_shape is not None and not _tileable(site):
        raise AutoSPError(
            f"attention {site.name} gets an attn_mask of shape {hints(site.mask_shape)}, which ring attention "
            f"cannot cut into (query block, key block) tiles; {SUPPORTED}. Or use variant='ulysses'"
        )
    if sorted(site.spec.layout) != sorted("BHSD"):
        raise AutoSPError(f"attention {site.name}: layout {site.spec.layout!r} is not a permutation of BHSD")


def _tileable(site: AttentionSite) -> bool:
    """A mask ring can tile: its last two axes are the whole (query, key) sequence, the rest broadcast."""
    assert site.mask_shape is not None  # only sites with a mask are asked
    shape = tuple(site.mask_shape)
    if len(shape) > 4:
        return False
    shape = (1,) * (4 - len(shape)) + shape  # SDPA broadcasts a mask from the right: [H, S, S] is [1, H, S, S]
    b, h, s, sk = shape
    return s in (1, site.seq_len) and sk in (1, site.kv_seq_len) and b in (1, site.batch) and h in (1, site.heads)


@dataclass
class Call:
    """One attention call in ring terms: q/k/v values and what the op needs."""

    q: SPValue
    k: SPValue
    v: SPValue
    causal: bool
    scale: float
    window: int
    mask: Any = None  # the model's mask (SPValue or tensor), tiled per block


def _plain(x: Any) -> Any:
    return x.local if isinstance(x, SPValue) else x


def parse(node: torch.fx.Node, site: AttentionSite, args: tuple, kwargs: dict) -> Call:
    spec = site.spec
    if spec.leaf is not None and node.target == spec.leaf:
        a = sdpa_args(args, kwargs)
        if a["dropout_p"]:
            raise AutoSPError(f"attention {site.name}: dropout_p={a['dropout_p']} is not supported by ring attention")
        scale = a["scale"] if a["scale"] is not None else default_scale(site.head_dim)
        return Call(a["query"], a["key"], a["value"], bool(a["is_causal"]), float(scale), 0, a["attn_mask"])
    q, k, v = (args[i] for i in spec.qkv)
    window = _plain(args[3]) if len(args) > 3 else _plain(kwargs["window"])
    if not isinstance(window, int) or window < 1:
        raise AutoSPError(f"attention {site.name}: window={window!r}; ring needs a constant int >= 1")
    return Call(q, k, v, True, default_scale(site.head_dim), window)


def to_bhsd(site: AttentionSite, x: torch.Tensor) -> torch.Tensor:
    order = [site.spec.layout.index(c) for c in "BHSD"]
    return x.permute(order).contiguous()


def from_bhsd(site: AttentionSite, x: torch.Tensor) -> torch.Tensor:
    order = ["BHSD".index(c) for c in site.spec.layout]
    return x.permute(order)


# Query rows balance in chunks no smaller than this by default: each chunk is a kernel call per key
# run, and smaller calls run less efficiently. Measured on the CPU flash kernel (ring op, fp32, P=2,
# causal documents of 3/4 and 1/4 of the row; tools/scripts/ring_balance.py --measure): chunks of
# 128 made S=4096 1.07x slower, 512 made it 0.97x and S=8192 0.81x.
BALANCE_CHUNK = 512


def balance_chunk(options: dict[str, Any]) -> int:
    """``variant_options["balance_chunk"]``: the smallest chunk (tokens) of query rows that a model-built
    mask may rebalance (``autosp_ring.balance``); 0 keeps the program's layout."""
    value = options.get("balance_chunk", BALANCE_CHUNK)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"variant_options['balance_chunk']={value!r}: give an int >= 0 (0 turns balancing off)")
    return value


def ring_layout(length: Any, world: int, options: dict[str, Any]) -> Layout | None:
    """Zigzag (rank r: chunks r and 2P-1-r) balances causal work; contiguous when it cannot split evenly."""
    if not options.get("zigzag", True) or not isinstance(length, int) or length % (2 * world):
        return None
    return zigzag_ranges(length, world)


def seq_chunks(ctx: SPContext, site: AttentionSite, call: Call) -> tuple[torch.Tensor, ...]:
    """q, k, v as this rank's pieces of the sequence (the variant's layout), in BHSD."""
    sdim, length = site.axis("S"), site.seq_len
    target = Shard(SeqAxis(sdim, length), ctx.layout(length))
    out = []
    for x in (call.q, call.k, call.v):
        if not isinstance(x, SPValue):
            x = SPValue(x, Replicate(), x)
        if x.ndim != len(site.spec.layout):
            raise AutoSPError(f"attention {site.name}: q/k/v of rank {x.ndim}, layout {site.spec.layout!r}")
        local = to_shard(ctx, x, sdim, target)
        if isinstance(x.placement, Shard) and not x.placement.same_layout(target):
            ctx.note("relayout")
        out.append(to_bhsd(site, local))
    return tuple(out)


def whole_mask(ctx: SPContext, site: AttentionSite, call: Call) -> torch.Tensor | None:
    """The model's mask whole on every rank, as [B or 1, H or 1, S, S]: each ring block slices its tile.

    A mask the model builds may arrive sharded on its query rows; gathering it costs what the
    single-device program held, and lets every block read any (query, key) tile.
    """
    mask = call.mask
    if mask is None:
        return None
    if isinstance(mask, SPValue):
        mask = to_replicate(ctx, mask).local
    mask = mask.view((1,) * (4 - mask.dim()) + tuple(mask.shape))  # as SDPA broadcasts it (_tileable)
    # A mask broadcast over queries or keys ([B, 1, 1, S] padding) is spelled out: tiles slice both axes.
    mask = mask.expand(mask.shape[0], mask.shape[1], site.seq_len, site.kv_seq_len)
    if mask.dtype != torch.bool:
        mask = mask.to(acc_dtype(mask.dtype))
    return mask.contiguous()


def ring_attention_rule(ctx: SPContext, node: torch.fx.Node, site: AttentionSite, args: tuple, kwargs: dict) -> Any:
    if site.spec is FLEX:
        return ring_flex_rule(ctx, node, site, args, kwargs)
    call = parse(node, site, args, kwargs)
    q, k, v = seq_chunks(ctx, site, call)
    mask = whole_mask(ctx, site, call)
    ctx.note("ring_attention")
    sdim, length = site.axis("S"), site.seq_len
    layout = ctx.layout(length)
    zigzag = layout != ctx.even_ranges(length)
    balance = balance_chunk(ctx.variant_options)
    # A length the ranks do not split evenly: contiguous pieces one token apart (ring_layout gives no zigzag).
    sizes = None if zigzag or length % ctx.world == 0 else [int(n) for n in piece_lengths(layout)]
    out, _ = torch.ops.autosp_ring.ring_attention(
        q, k, v, call.causal, call.scale, call.window, zigzag, ctx.group_name, mask, balance, sizes
    )
    return SPValue(from_bhsd(site, out), Shard(SeqAxis(sdim, length), layout), node.meta["val"])


__all__ = [
    "BALANCE_CHUNK",
    "SLIDING_WINDOW",
    "SUPPORTED",
    "Call",
    "balance_chunk",
    "check",
    "parse",
    "ring_attention_rule",
    "ring_layout",
    "seq_chunks",
    "whole_mask",
]
