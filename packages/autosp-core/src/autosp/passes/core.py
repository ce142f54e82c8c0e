"""The passes autosp-core provides: analysis, lowering, the SP rewrite, gradient sync, cleanup."""

from __future__ import annotations

import math
import warnings

import torch

from autosp.analysis.attention import AttentionSite, find_attention_sites, hint
from autosp.analysis.eager import (
    EagerRegion,
    find_eager_regions,
    may_mask_rows_finitely,
    region_site,
    rewrite_region,
)
from autosp.analysis.source import user_line
from autosp.canonical import canonical_order, lowered_code
from autosp.context import CompileContext
from autosp.discarded_outputs import reach
from autosp.embedding_renorm import bound_args
from autosp.errors import AutoSPError
from autosp.flex_mods import refuse_computed_captures, restore_mod_index
from autosp.guards import AttentionNotSharded
from autosp.lowering import FLEX, SDPA, insert_leaves, leaves_for_kernels, lower_to_aten, sdpa_args
from autosp.passes.choose_variant import choose_again
from autosp.passes.fold_attention_batch import FOLD_ATTENTION_BATCH
from autosp.passes.grad_sync import sync_grads
from autosp.passes.inline_regions import INLINE_REGIONS
from autosp.passes.manager import Pass, Stage
from autosp.passes.tile_loss import TILE_LOSS
from autosp.passes.tile_mlp import TILE_MLP
from autosp.passes.unrepeat import UNREPEAT_KV
from autosp.sharding import collectives as C
from autosp.sharding.context import SPContext
from autosp.sharding.dims import guess_seq_dim
from autosp.sharding.placement import even_ranges, piece_lengths
from autosp.sharding.propagate import shard_graph
from autosp.tensor_hooks import keep_tensor_hooks
from autosp.untracked_writes import refuse_untracked_writes
from autosp.user_function import keep_user_functions
from autosp.variants import refuses_length


def _specs(ctx: CompileContext) -> list:
    return [SDPA, FLEX, *ctx.registry.attention.values()]


def _drop_sites_not_rewritten(ctx: CompileContext) -> None:
    """Sites of ops the chosen variant does not rewrite run whole: the engine gathers their inputs."""
    for site in [s for s in ctx.sites if not s.spec.rewritten_by(ctx.options.variant)]:
        ctx.sites.remove(site)
        ctx.report.notes.append(
            f"{site.spec.name} {site.name}: variant {ctx.options.variant!r} does not rewrite it; computed whole on "
            f"every rank, q, k and v gathered (exact, no memory saving for it; variants that rewrite it: "
            f"{', '.join(site.spec.variants or ())})"
        )


def _drop_sites_not_splitting_evenly(ctx: CompileContext) -> None:
    """A self-attention over another length than the sequence (landmarks, pooled tokens) that the
    variant cannot take (it exchanges equal pieces, or some rank would get no token): it runs by the
    engine's rules (each rank's query rows, or whole), exact."""
    assert ctx.variant is not None  # only sequence-parallel graphs get here
    for site in list(ctx.sites):
        length = _concrete(site.seq_len)
        if isinstance(length, int) and length % ctx.world and (not ctx.variant.uneven or length < ctx.world):
            ctx.sites.remove(site)
            ctx.report.notes.append(
                f"attention {site.name}: its length {length} is not divisible by sp_size={ctx.world}, so no variant "
                "splits it; computed by query rows or whole on every rank (exact)"
            )


def leave_to_engine(ctx: CompileContext, site: AttentionSite, error: AutoSPError) -> None:
    """``error`` (the variant cannot take ``site``) raised for attention over the sequence; for attention
    over another length (a chunk of a sorted sequence, found written out), the site is dropped and the
    engine's rules compute it (each rank's query rows, or whole), exact, and the report says so.

    For variants that check their sites in ``prepare``, once the sequence is settled (hybrid's heads
    per ulysses group, whose degree is chosen after the written attention became SDPA sites).
    """
    length, whole = _concrete(site.seq_len), _concrete(ctx.seq_len)
    if not (isinstance(length, int) and isinstance(whole, int) and length != whole):
        raise error
    ctx.sites.remove(site)
    ctx.report.notes.append(
        f"attention {site.name} over length {length}, not the sequence's {whole}: the variant does not take "
        f"it ({str(error).split(';')[0]}); computed by query rows or whole on every rank (exact)"
    )


def _concrete(n: int | torch.SymInt) -> int | torch.SymInt:
    """A plain int for sizes Dynamo specialised (a SymInt of a constant is tracked by no trace)."""
    if isinstance(n, torch.SymInt):
        value = n.node.maybe_as_int()
        return n if value is None else value
    return n


def find_attention(gm: torch.fx.GraphModule, ctx: CompileContext) -> None:
    if not ctx.sp:
        # Only for the report: one rank changes nothing, so odd attention shapes are fine.
        try:
            ctx.sites = find_attention_sites(gm, _specs(ctx))
            ctx.report.sites = list(ctx.sites)
        except AutoSPError as e:
            ctx.report.notes.append(f"attention analysis skipped: {e}")
        return
    _refuse_unsupported(gm)
    # Before the sites are read: attention inside a user's Function runs with it, whole.
    functions = keep_user_functions(gm, user_line)
    if functions:
        ctx.report.notes.append(
            f"{functions} custom torch.autograd.Function call(s) run whole on every rank with the user's backward "
            "(inputs gathered; exact, no memory saving for them)"
        )
    hooks = keep_tensor_hooks(gm, user_line)
    if hooks:
        ctx.report.notes.append(
            f"{hooks} gradient hook(s) (Tensor.register_hook) run whole on every rank on the true gradient "
            "(the hooked values gathered; exact, no memory saving for them)"
        )
    # Attention written out by hand is found after lowering (``autosp.lower``), where it is canonical.
    ctx.sites = find_attention_sites(gm, _specs(ctx))
    ctx.report.sites = list(ctx.sites)


def _input_size(ctx: CompileContext, n: int | torch.SymInt) -> int | torch.SymInt:
    """``n`` as the size of an input: a symbolic size read off the lowered graph belongs to its trace,
    and the SP rewrite traces anew from the inputs."""
    n = _concrete(n)
    if not isinstance(n, torch.SymInt):
        return n
    for x in ctx.fake_inputs:
        for d in x.shape if isinstance(x, torch.Tensor) else ():
            if isinstance(d, torch.SymInt) and d.node.expr == n.node.expr:
                return d
    return n


def _is_cross(site) -> bool:
    return _concrete(site.seq_len) != _concrete(site.kv_seq_len)


def _site_lengths(sites: list) -> list[int | torch.SymInt]:
    """The lengths that must agree: queries everywhere, keys of self-attention (a memory has its own)."""
    return [_concrete(s.seq_len) for s in sites] + [_concrete(s.kv_seq_len) for s in sites if not _is_cross(s)]


_FLEX_VMAP_ADVICE = (
    "It is FlexAttention's block mask, built inside the compiled function (create_block_mask, or "
    "flex_attention called without a block_mask): build the block mask outside the compiled function (once, "
    "and pass it in) or call F.scaled_dot_product_attention with the boolean mask your mask_mod describes "
    "(Ulysses and ring both take it, and ring skips the tiles it masks out), or compile with sp_size=1"
)
_VMAP_ADVICE = (
    "Write that code without vmap (batched torch ops, or a loop), or call it from a function decorated with "
    "@torch.compiler.disable: a graph break, which AutoSP keeps exact (the values crossing it are gathered "
    "whole), or compile with sp_size=1"
)


def _unsupported(node: torch.fx.Node, flex_in_graph: bool) -> tuple[str, str] | None:
    """What AutoSP cannot lower under SP and what to do instead, named for the user, or None.

    A ``torch.func.vmap`` is lowered in two steps (``autosp.lowering``), which FlexAttention's
    higher-order op does not survive: a vmap is refused where it builds Flex's block mask or shares
    its graph with a Flex call.
    """
    if getattr(node.target, "__name__", "") == "_vmap_increment_nesting":
        if "flex_attention" in (node.meta.get("stack_trace") or ""):
            return "torch.func.vmap", _FLEX_VMAP_ADVICE
        if flex_in_graph:
            return "torch.func.vmap in a graph that also calls flex_attention", _VMAP_ADVICE
        return None
    if node.target is torch.nn.functional.embedding:
        return _unsupported_embedding(bound_args(node))
    return None


def _unsupported_embedding(bound: dict) -> tuple[str, str] | None:
    if bound.get("max_norm") is not None:
        # One autosp.embedding_renorm did not write out (its table or ids not traced tensors): run as it
        # is, each rank would renormalise the rows its own tokens look up, and the ranks' tables would part.
        return (
            "nn.Embedding with max_norm (it renormalises rows of the table in place during the forward)",
            "Renormalise the rows outside the compiled call (under torch.no_grad(), e.g. after the optimizer "
            "step), or compile with sp_size=1",
        )
    if bound.get("sparse"):
        return (
            "nn.Embedding with sparse=True (a sparse gradient)",
            "Use sparse=False: the SP gradient all-reduce sums dense gradients; or compile with sp_size=1",
        )
    return None


def _refuse_unsupported(gm: torch.fx.GraphModule) -> None:
    """Refuse, before any lowering or collective, what the SP rewrite cannot trace."""
    graphs = [m for m in gm.modules() if isinstance(m, torch.fx.GraphModule)]
    flex = any(n.op == "call_function" and n.target in FLEX.targets for g in graphs for n in g.graph.nodes)
    for module in graphs:
        for node in module.graph.nodes:
            found = _unsupported(node, flex) if node.op == "call_function" else None
            if found is None:
                continue
            what, advice = found
            where = user_line(node)
            raise AutoSPError(
                f"{what} is not supported with sp_size > 1 yet" + (f" ({where})" if where else "") + f". {advice}"
            )


def _settle_sequence(ctx: CompileContext, lengths: list, written_out: list[EagerRegion]) -> None:
    """The sequence length this graph shards, from its attention or, lacking any, an earlier graph's.

    ``lengths``: those of the sites found in the Dynamo graph, read before lowering: lowering may
    specialise a dynamic length, and the rewrite must keep Dynamo's symbol.
    """
    lengths = list(lengths)
    for r in written_out:
        q_len, k_len = _concrete(r.shape4("q")[2]), _concrete(r.shape4("k")[2])
        lengths += [q_len] if q_len != k_len else [q_len, k_len]  # keys of another length: a memory
    lengths = [_input_size(ctx, n) for n in lengths]
    if not lengths:
        known = ctx.known_seq_len
        static = all(isinstance(d, int) for x in ctx.fake_inputs if isinstance(x, torch.Tensor) for d in x.shape)
        if known is None or not static:
            why = (
                "the last graph with attention before it ran whole, or there was none"
                if known is None
                else "its input sizes are symbolic"
            )
            ctx.report.notes.append(
                f"no attention in this graph and {why}: it runs whole on every rank (exact; no sequence "
                "parallelism or memory saving for it)"
            )
            return
        ctx.report.notes.append(
            f"no attention in this graph: sharding inputs of sequence length {known}, the length of the last "
            "compiled graph with attention (a graph break splits the model)"
        )
        lengths = [known]
    seq = lengths[0]
    # With a symbolic length these comparisons become guards: a length that breaks them recompiles.
    if any(n != seq for n in lengths):
        seq = _longest(ctx, lengths)
    if isinstance(seq, int) and seq == 0:
        raise AutoSPError("sequence length 0: there is nothing to split over the SP ranks; skip empty batches")
    if isinstance(seq, int) and seq < ctx.world:
        # Fewer tokens than ranks (a decoding step against a KV cache, a one-token probe): no split is
        # possible, and running whole costs nothing a split would save. Padding, the advice for a
        # length that is merely not divisible, would change what a decoding step computes.
        ctx.sites.clear()
        # `lower` noted cross-attention sites as queries sharded: not so in a graph that runs whole.
        ctx.report.notes = [n for n in ctx.report.notes if not n.startswith("cross-attention ")]
        ctx.report.notes.append(
            f"sequence length {seq} is shorter than sp_size={ctx.world} (a decoding step?): this graph runs "
            "whole on every rank (exact; nothing to split)"
        )
        return
    if seq % ctx.world:
        _take_uneven(ctx, seq)
    _drop_sites_not_rewritten(ctx)
    _drop_sites_not_splitting_evenly(ctx)
    for site in ctx.sites:
        ctx.variant.check(site, ctx.world)
    ctx.seq_len = seq
    ctx.report.seq_len = hint(seq)
    ctx.report.seq_symbol = str(seq) if isinstance(_concrete(seq), torch.SymInt) else None
    for name, x, param in zip(ctx.input_names, ctx.fake_inputs, ctx.is_param):
        if isinstance(x, torch.Tensor) and not param:
            dim = guess_seq_dim(x.shape, seq)
            where = f"sequence axis {dim}" if dim is not None else "no sequence axis"
            ctx.report.inputs.append(f"{name} {list(x.shape)}: {where}")


def _take_uneven(ctx: CompileContext, seq: int | torch.SymInt) -> None:
    """A length the ranks do not split evenly: balanced pieces one token apart, for a variant that
    takes them (``SPVariant.uneven``; a length marked dynamic, ``dynamic_uneven`` too); else the
    refusal says what to do."""
    assert ctx.variant is not None
    symbolic = not isinstance(seq, int)
    # A length marked dynamic that compiling has since fixed: Dynamo would refuse the fixed size.
    fixed = not symbolic and any(
        isinstance(d, torch.SymInt) and hint(d) == hint(seq)
        for x in ctx.fake_inputs
        if isinstance(x, torch.Tensor)
        for d in x.shape
    )
    if fixed:
        raise AutoSPError(
            _not_divisible(ctx, seq) + "; and compiling fixed the length marked dynamic (an input of that "
            "length left unmarked, or code that specialises it): compile without marking it, or mark every "
            "input of that length"
        )
    if refuses_length(ctx.variant, seq, ctx.world) is not None:
        variants = ctx.registry.variants.items()
        takers = sorted(name for name, v in variants if v.uneven and (v.dynamic_uneven or not symbolic))
        which = "takes lengths marked dynamic" if symbolic else "takes any length"
        other = f"; or use variant={takers[0]!r}, which {which}" if takers else ""
        unmark = "; or compile without marking the length dynamic" if symbolic else ""
        raise AutoSPError(_not_divisible(ctx, seq) + unmark + other)
    pieces = sorted({hint(n) for n in piece_lengths(even_ranges(seq, ctx.world))}, reverse=True)
    serves = (
        f" (marked dynamic: this graph serves every length of remainder {hint(seq) % ctx.world} modulo {ctx.world})"
        if symbolic
        else ""
    )
    ctx.report.notes.append(
        f"sequence length {hint(seq)} is not divisible by sp_size={ctx.world}{serves}: the ranks hold pieces of "
        f"{' and '.join(map(str, pieces))} tokens (exact; the longest piece sets the memory)"
    )


def _not_divisible(ctx: CompileContext, seq: int | torch.SymInt) -> str:
    # A symbolic length prints as its symbol (s70): say this call's length, which the user knows.
    n = hint(seq)
    inputs = [x for x, param in zip(ctx.fake_inputs, ctx.is_param) if isinstance(x, torch.Tensor) and not param]
    if any(guess_seq_dim(x.shape, seq) is not None for x in inputs):
        return (
            f"sequence length {n} is not divisible by sp_size={ctx.world}; pad the batch to a multiple "
            f"of {ctx.world} tokens (mask or ignore the padding in the loss)"
        )
    # No input has that length: the model makes the sequence (image patches plus a [CLS] token).
    return (
        f"the attention's sequence length {n} is made inside the model (no input has a dimension of {n}: "
        f"patches or frames plus tokens it adds, such as a [CLS] token) and is not divisible by "
        f"sp_size={ctx.world}. Choose sizes that make it a multiple of {ctx.world} (another patch count, extra "
        f"register tokens, or mean pooling instead of a [CLS] token), or an sp_size that divides {n}"
    )


def _longest(ctx: CompileContext, lengths: list) -> int:
    """Self-attention over several lengths (an encoder and a decoder, a sequence pooled to half its
    length): the longest is sharded; attention over another length is no site, so it runs whole on
    every rank, its inputs gathered (exact, no saving for it), and the report says so."""
    if not all(isinstance(n, int) for n in lengths):
        raise AutoSPError(
            f"attention sites disagree on the sequence length ({sorted({hint(n) for n in lengths})}) and a "
            "length is dynamic: AutoSP shards one sequence per graph and cannot tell which one is the longest "
            "for every call; compile without marking lengths dynamic, or split the model into separate "
            "compiled calls"
        )
    seq = max(lengths)
    for site in [s for s in ctx.sites if _concrete(s.seq_len) != seq]:
        ctx.sites.remove(site)
        ctx.report.notes.append(
            f"attention {site.name} over length {hint(site.seq_len)}: this graph shards its longest sequence, "
            f"{seq}; attention over another length is computed whole on every rank, its inputs gathered "
            "(exact, no memory saving for it)"
        )
    return seq


def _take_written_out(aten_gm: torch.fx.GraphModule, ctx: CompileContext) -> tuple[bool, list[EagerRegion]]:
    """Turn hand-written attention into SDPA calls where that computes the same; return what stays written."""
    changed, kept = False, []
    inputs = aten_gm.graph.find_nodes(op="placeholder")
    # Parameters and buffers by their values at compile time (a mask buffer, ALiBi's slopes).
    state = {
        n: x
        for n, x, is_param in zip(inputs, ctx.example_inputs, ctx.is_param)
        if is_param and isinstance(x, torch.Tensor) and getattr(n.meta.get("val"), "shape", None) == x.shape
    }
    if len(inputs) != len(ctx.example_inputs):
        state = {}  # not the backend's inputs one for one: no value is known
    for region in find_eager_regions(aten_gm):
        if region.why_not is None and may_mask_rows_finitely(aten_gm, region, state):
            region.why_not = (
                "its mask may leave a query row with every key masked by a finite value (finfo.min with padding): "
                "written out, such a row attends uniformly; SDPA's fused kernels would give it n times the "
                "gradient. Mask with -inf or a boolean mask to have it computed as SDPA"
            )
        if region.why_not is None:
            try:
                ctx.variant.check(region_site(region), ctx.world)
            except AutoSPError as e:
                region.why_not = f"variant {ctx.options.variant!r} cannot take it as attention ({e})"
        if region.why_not is not None:
            ctx.report.notes.append(
                f"attention written out at {region.line} kept as written, {region.why_not}: each rank computes "
                "its rows of the scores against k and v gathered whole (exact; no variant rewrite)"
            )
            kept.append(region)
            continue
        rewrite_region(aten_gm, region, SDPA.leaf)
        ctx.report.notes.append(f"attention written out at {region.line} computed as one SDPA call")
        changed = True
    return changed, kept


def lower(gm: torch.fx.GraphModule, ctx: CompileContext) -> torch.fx.GraphModule:
    # Compiled during the call: its grad mode is the call's.
    refuse_untracked_writes(gm, torch.is_grad_enabled(), user_line)
    refuse_computed_captures(gm, FLEX.targets, torch.is_grad_enabled(), user_line)
    dynamo_lengths = _site_lengths(ctx.sites)
    insert_leaves(gm, _specs(ctx))
    aten_gm = lower_to_aten(gm, ctx.fake_inputs, ctx.fake_mode)
    # Tracing leaves dead nodes (FlexAttention's example scalars, `new_zeros` of q): the SP rewrite
    # would gather their sharded inputs for nothing. Random ops count as live, so the RNG stream keeps.
    if aten_gm.graph.eliminate_dead_code():
        aten_gm.recompile()
    ctx.reach = reach(aten_gm)  # the single-device program's, before any rewrite
    if not ctx.sp:  # lowered for a test or a tool: one rank has nothing to settle
        ctx.sites = find_attention_sites(aten_gm, _specs(ctx))
        return aten_gm
    kernels = leaves_for_kernels(aten_gm)
    if kernels:
        ctx.report.notes.append(
            f"{kernels} SDPA kernel call(s) from code Dynamo kept whole (nn.MultiheadAttention) taken as attention"
        )
    changed, written_out = _take_written_out(aten_gm, ctx)
    changed = changed or bool(kernels)
    if changed:
        # Once more, so that the new nodes carry meta values like every other.
        aten_gm = lower_to_aten(aten_gm, ctx.fake_inputs, ctx.fake_mode)
        if aten_gm.graph.eliminate_dead_code():
            aten_gm.recompile()
    # Every rank the same graph, whatever order its trace took (see autosp.canonical); the ranks
    # compare this form. Left as traced (not compared as canonical) only if it cannot be made.
    if canonical_order(aten_gm):
        ctx.report.lowered = lowered_code(aten_gm)
    # Sites again, now keyed by the lowered graph's node names.
    ctx.sites = find_attention_sites(aten_gm, _specs(ctx))
    ctx.report.sites = list(ctx.sites)
    for site in [s for s in ctx.sites if _is_cross(s)]:
        # Keys of another length than the queries: a memory, whole on every rank; each rank's query rows
        # attend to it locally (the ``query_rows_attention`` rule), so no variant rewrites it.
        ctx.sites.remove(site)
        ctx.report.notes.append(
            f"cross-attention {site.name}: queries of length {hint(site.seq_len)} sharded, keys and values of "
            f"length {hint(site.kv_seq_len)} whole on every rank; each rank attends for its own rows"
        )
    _leave_dropout_whole(aten_gm, ctx)
    choose_again(ctx)
    # Sites inside higher-order ops (checkpointed layers) and rewritten ones appear only after lowering.
    _settle_sequence(ctx, dynamo_lengths or _site_lengths(ctx.sites), written_out)
    return aten_gm


def _leave_dropout_whole(aten_gm: torch.fx.GraphModule, ctx: CompileContext) -> None:
    """Attention that draws dropout inside its kernel is no site: it runs whole on every rank.

    No variant can draw the single-device program's masks: the kernel draws one mask over all
    heads and positions, and a rank running a subset (its heads, its query rows, a ring block)
    would draw another (the same one for each rank's heads, with the ranks seeded alike). Run
    whole, from the same generator state, it draws exactly the program's; the rest of the graph
    stays sequence-parallel.
    """
    nodes = {n.name: n for n in aten_gm.graph.nodes}
    for site in list(ctx.sites):
        node = nodes.get(site.name)
        if site.spec.name != SDPA.name or node is None:
            continue
        p = sdpa_args(node.args, node.kwargs)["dropout_p"]
        if not p:
            continue
        ctx.sites.remove(site)
        where = user_line(node)
        message = (
            f"attention {site.name}{f' ({where})' if where else ''} draws dropout (dropout_p={p}): computed whole "
            "on every rank, q, k and v gathered, so that its masks are the single-device program's (exact; no "
            "memory saving for it). For sequence parallelism set the attention dropout to 0 (Hugging Face: "
            "attention_dropout / attn_pdrop / attention_probs_dropout_prob = 0.0)"
        )
        ctx.report.notes.append(message)
        warnings.warn(message, AttentionNotSharded, stacklevel=2)


def shard(gm: torch.fx.GraphModule, ctx: CompileContext) -> torch.fx.GraphModule:
    if ctx.variant.prepare is not None:
        ctx.variant_state = ctx.variant.prepare(ctx)
    sp = SPContext(
        rank=ctx.rank,
        world=ctx.world,
        group_name=ctx.group_name,
        seq_len=ctx.seq_len,
        attention_rule=ctx.variant.attention_rule,
        sites={s.name: s for s in ctx.sites},
        variant_options=dict(ctx.options.variant_options),
        layout_fn=ctx.variant.layout,
        rules=ctx.registry.sharding_rules,
        variant_state=ctx.variant_state,
        sharded_outputs=ctx.options.outputs == "sharded",
    )
    try:
        out = shard_graph(gm, sp, ctx.fake_inputs, ctx.is_param, ctx.fake_mode)
    except RuntimeError as e:
        symbolic = any(
            isinstance(d, torch.SymInt) for x in ctx.fake_inputs if isinstance(x, torch.Tensor) for d in x.shape
        )
        if not symbolic or "is not tracked with proxy" not in str(e):
            raise
        raise AutoSPError(
            f"AutoSP could not trace this model with a dynamic sequence length ({sp.seq_len}); compile without "
            "marking the length dynamic (each new length then compiles once)"
        ) from e
    for node in out.graph.nodes:
        if node.op == "call_function" and node.target in C.COLLECTIVE_OPS:
            ctx.report.collectives[node.target._opname] += 1
    ctx.report.collectives["shard_start"] += sp.counts["shard_start"]
    ctx.report.fallbacks.extend(sp.fallbacks)
    ctx.report.notes.extend(sp.notes)
    restore_mod_index(out, FLEX.targets)
    ctx.report.outputs = list(sp.outputs)
    ctx.output_shards = list(sp.output_shards)
    _warn_large_outputs(out, ctx)
    return out


LARGE_OUTPUT_BYTES = 256 * 2**20


def _warn_large_outputs(gm: torch.fx.GraphModule, ctx: CompileContext) -> None:
    """Say when outputs gathered whole are large: at long context an LM's logits dwarf the rest."""
    outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    gathered = 0
    for node, shard in zip(torch.utils._pytree.tree_leaves(outputs), ctx.output_shards):
        val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
        if shard is None and isinstance(val, torch.Tensor) and ctx.seq_len is not None:
            sizes = [hint(d) for d in val.shape]
            if hint(ctx.seq_len) in sizes:
                gathered += math.prod(sizes) * val.element_size()
    if gathered >= LARGE_OUTPUT_BYTES:
        ctx.report.notes.append(
            f"outputs gathered whole on every rank: {gathered / 2**20:.0f} MiB per rank (an LM's logits?); return "
            "only the loss, or compile with outputs='sharded' to get them as DTensors gathered on demand"
        )


def eliminate_dead_code(gm: torch.fx.GraphModule, ctx: CompileContext) -> None:
    if gm.graph.eliminate_dead_code():
        gm.recompile()


def _sp(ctx: CompileContext) -> bool:
    return ctx.sp


PASSES = (
    INLINE_REGIONS,
    FOLD_ATTENTION_BATCH,
    Pass("autosp.find_attention", Stage.GRAPH, find_attention, doc="find attention sites and their axes"),
    Pass(
        "autosp.lower",
        Stage.GRAPH,
        lower,
        requires=("autosp.find_attention",),
        applies=_sp,
        doc="lower to functional aten, attention kept whole",
    ),
    UNREPEAT_KV,
    TILE_LOSS,
    TILE_MLP,
    Pass(
        "autosp.shard",
        Stage.GRAPH,
        shard,
        requires=("autosp.lower",),
        applies=_sp,
        doc="propagate placements; insert collectives and slices",
    ),
    Pass("autosp.sync_grads", Stage.JOINT, sync_grads, applies=_sp, doc="all-reduce input gradients in buckets"),
    Pass("autosp.dce_forward", Stage.FORWARD, eliminate_dead_code, doc="drop dead nodes"),
    Pass("autosp.dce_backward", Stage.BACKWARD, eliminate_dead_code, doc="drop dead recompute"),
)

__all__ = ["PASSES", "eliminate_dead_code", "find_attention", "leave_to_engine", "lower", "shard"]
