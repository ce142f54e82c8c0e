"""Programs outside the other suites, as others write them: exact against single-device eager, or refused.

The held-out probes of the sharding engine (probe_models.py): complex and interleaved rotary,
T5's relative-position bias, ALiBi and OPT positions from the padding mask, a strided conv
front, RWKV's negative pad, statistics over batch and sequence (BatchNorm) or over the sequence
(LayerNorm on the sequence axis), per-sequence normalised token losses, selections by computed
indices (argmax, top-k, a Gram matrix over the sequence, ``torch.where(cond)``), the first token
broadcast along the sequence, an embedding whose gradient is scaled by token frequency, a complex
output, attention dropout inside SDPA or written out, a circular pad, in-place updates of
activations (once a crash in the backward: ``aten.copy`` has no derivative), several outputs,
batch 1 and batch == sequence length, soft-target cross-entropy (once a crash: a node that
lowering left without ``meta["val"]``) and label smoothing (an in-place ``masked_fill_`` from
its decomposition), values made under ``no_grad`` (a buffer's running mean, a self-distillation
target: once silently given a gradient), self-attention over several lengths (an encoder and a
decoder, a funnel, learned latent queries: the longest is sharded), block-local attention through SDPA
on 5-D q/k/v (once refused: the analysis read SDPA as 4-D only), token mixers beyond attention
(FFT, a causal conv, a GRU, a loop over positions, CTC) and, under Inductor, collectives it once
ordered differently per rank or dropped on one rank (deadlocks), or merged on one rank (CSE: a
silently wrong loss); and what scripts do around the model (probe_tasks.py): random draws in the
forward, the caller's tensors written in place or differentiated, Python reading values across graph
breaks, Hugging Face task heads; and the sequence axis used as something other than positions
(probe_sequence.py): parameters sized by it, two sequence axes, a CRF, returns-to-go, attention
pooling, order statistics; tokens routed, sampled, merged and recurred over (probe_routing.py): ToMe,
Gumbel and multinomial draws, an STFT front, an LSTM, k nearest points, mixture-of-depths, log-space
gates. Loss, every other
output, every parameter's gradient, every buffer and the caller's tensors (and their gradients) are compared on every rank (probe_workers.differences). One pool of 2 gloo ranks for the file.
The probes left out here to save time (Hugging Face models, unfold, index_add, ...) are in probe_models.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from harness import run_spmd
from probe_models import HOOKS, ROUTES
from probe_routing import PROGRAMS as ROUTING
from probe_sequence import PROGRAMS
from probe_tasks import TASKS
from probe_workers import run_inference, run_probes
from spmd_pool import RankError, SPMDPool

COMMON = [
    ("in-place", 16, 2),
    ("t5-bias", 16, 2),
    ("layernorm-seq", 16, 2),
    ("multi-output", 16, 1),
    # The third round of held-out probes: a one-position piece broadcast along the sequence, a
    # complex output, dropout drawn inside SDPA (all three once silently wrong).
    ("first-token-broadcast", 16, 2),
    ("complex-output", 16, 2),
    ("attention-dropout", 16, 2),
    # The fifth round: pad rows every key of which a finite value masks (ring's merge, and written
    # attention taken as SDPA, once silently wrong on them).
    ("leftpad-finfo", 16, 2),
    ("leftpad-finfo-written", 16, 2),
    # Writes autograd does not record (once a silently wrong gradient, then refused): exact.
    ("act-clamp-no-grad", 16, 2),
    ("act-setitem-no-grad", 16, 2),
    ("param-data-clamp", 16, 2),
    # A per-head [H, S, S] mask, broadcast over the batch as SDPA does (ring and hybrid once refused it).
    ("head-bias-3d", 16, 2),
]
PROBES = {
    "ulysses": [
        *COMMON,
        ("complex-rope", 16, 2),
        ("alibi", 16, 2),
        ("opt-positions", 16, 2),
        ("rwkv-shift", 16, 2),
        ("batchnorm", 16, 2),
        ("per-seq-loss", 16, 3),
        ("select-argmax", 16, 2),
        ("select-gram", 16, 2),
        ("class-conditioned", 8, 8),
        ("loss-soft", 16, 2),
        ("loss-smoothing", 16, 2),
        ("ema-buffer", 16, 2),
        ("no-grad-target", 16, 2),
        ("encoder-decoder", 16, 2),
        ("latent-queries", 16, 2),
        ("chunk-local", 16, 2),
        ("embedding-freq-scaled", 16, 2),
        ("written-dropout", 16, 2),
        ("circular-pad", 16, 2),
        ("selected-positions", 16, 2),
        ("eos-pool", 16, 2),
        # nn.MultiheadAttention returning its weights: bmm over [B*H, S, d] views (once run whole).
        ("torch-mha-weights", 16, 2),
        ("loss-soft-classes-first", 16, 2),
    ],
    "ring": [
        *COMMON,
        ("instancenorm", 16, 2),
        ("select-topk", 16, 3),
        ("funnel", 16, 2),
        ("chunk-local-mask", 16, 2),
        # Fifth round: an attention over 3 landmarks (not splitting over 2 ranks), wider value heads.
        ("landmarks", 18, 2),
        ("wide-value-heads", 16, 2),
        # Reductions along features (max, argmax, vector norm, var/std, cummax, logsumexp): token-wise.
        ("feature-reductions", 16, 2),
    ],
}
# Under Inductor: collectives whose order Inductor would choose by rank-dependent sizes (two
# independent exchanges), one a rank would drop (its piece of the queries is empty), and ones
# whose ordering edge a rank would drop (its piece of their result is empty).
INDUCTOR = [("reverse-attention", 16, 2), ("last-queries", 16, 2), ("mix-position-loop", 16, 2), ("rotated", 16, 2)]
# SDPA on 5-D q/k/v, folded to 4-D before the analysis, under Inductor too (both variants).
INDUCTOR += [("chunk-local-mask", 16, 2)]
# Rows every key of which finfo.min masks: ring's count-weighted merge, and the written form kept as written.
INDUCTOR += [("leftpad-finfo", 16, 2), ("leftpad-finfo-written", 16, 2)]
INDUCTOR += [("feature-reductions", 16, 2)]
# Token mixing beyond attention, with SAC on (the min-cut partitioner, which once merged equal
# collectives on one rank by CSE: the position loop's all-reduces then paired wrongly across ranks).
MIXERS = [
    (f"mix-{k}", 16, 2) for k in ("fnet", "causal-conv", "gru", "position-loop", "flip-roll", "cummax", "ctc", "median")
]


@pytest.fixture(scope="module")
def pool() -> Iterator[SPMDPool]:
    with SPMDPool(2, pg_timeout_s=240.0) as p:
        yield p


def _exact(per_rank: list, probes: list[tuple[str, int, int]], what: str) -> list[tuple[str, dict]]:
    """Asserts every probe ran and matched single-device eager on every rank; returns them by rank."""
    out = []
    for rank, results in enumerate(per_rank):
        assert not isinstance(results, RankError), results.traceback
        for probe in probes:
            r, where = results[probe], f"{probe} {what} rank {rank}"
            assert "error" not in r, f"{where}: {r['error']}"
            assert not r["problems"], f"{where}: {r['problems']}"
            out.append((where, r))
    return out


@pytest.mark.parametrize(
    ("variant", "half"),
    [
        ("ulysses", 0),  # every other probe in CI; the rest, and ring's, in test-all
        pytest.param("ulysses", 1, marks=pytest.mark.extended(covered_by="test_probes_match_single_device")),
        pytest.param("ring", 0, marks=pytest.mark.extended(covered_by="test_probes_match_single_device")),
        pytest.param("ring", 1, marks=pytest.mark.extended(covered_by="test_probes_match_single_device")),
    ],
)
def test_probes_match_single_device(pool: SPMDPool, variant: str, half: int) -> None:
    probes = PROBES[variant][half::2]
    per_rank = pool.run(run_probes, probes, variant, timeout_s=600)
    for where, r in _exact(per_rank, probes, variant):
        # Sequence-parallel, not the whole program run on every rank.
        assert r["sharded"] and all(r["sharded"]), f"{where}: {r['sharded']}"
        # Only SDPA's own dropout makes an attention call run whole, and the user is told which and why.
        whole = r["whole_attention"]
        if where.startswith("('attention-dropout'"):
            assert len(whole) == 1 and "dropout_p=0.2" in whole[0] and "attention_dropout" in whole[0], whole
        else:
            assert not whole, f"{where}: {whole}"


@pytest.mark.parametrize("variant", ["ulysses", "ring"])
@pytest.mark.extended(covered_by="test_probes_match_single_device")
def test_probes_match_single_device_inductor(pool: SPMDPool, variant: str) -> None:
    _exact(pool.run(run_probes, INDUCTOR, variant, "inductor", timeout_s=600), INDUCTOR, f"{variant} inductor")


@pytest.mark.parametrize(
    "backend",
    [
        "aot_eager",
        pytest.param("inductor", marks=pytest.mark.extended(covered_by="test_buffers_updated_in_place_under_sac")),
    ],
)
def test_buffers_updated_in_place_under_sac(pool: SPMDPool, backend: str) -> None:
    # What reads a buffer the step updates in place must be saved, not recomputed: recomputed
    # in the backward it would read the updated buffer (once a crash under aot_eager, and
    # silently wrong gradients under Inductor).
    probes = [("ema-buffer", 16, 2), ("batchnorm", 16, 2)]
    _exact(pool.run(run_probes, probes, "ulysses", backend, {"sac": True}, timeout_s=600), probes, f"sac {backend}")


def test_token_mixers_under_sac(pool: SPMDPool) -> None:
    options = {"sac": True, "fullgraph": False}  # nn.GRU is a graph break
    _exact(pool.run(run_probes, MIXERS, "ulysses", "aot_eager", options, timeout_s=600), MIXERS, "sac")


# GPT-OSS's attention sinks (a logit per head joined to the keys, dropped after the softmax): once not
# found as attention, so a model whose every layer has sinks ran whole on every rank, with no sequence
# parallelism. Found now and kept as written: each rank computes its rows, k and v gathered.
SINKS = [("attention-sinks", 16, 2)]


@pytest.mark.parametrize(
    "variant",
    [
        "ulysses",
        pytest.param(
            "ring", marks=pytest.mark.extended(covered_by="test_attention_sinks_are_found_and_kept_as_written")
        ),
    ],
)
def test_attention_sinks_are_found_and_kept_as_written(pool: SPMDPool, variant: str) -> None:
    for where, r in _exact(pool.run(run_probes, SINKS, variant, timeout_s=600), SINKS, variant):
        assert r["sharded"] == [16] and not r["fallbacks"], f"{where}: {r['sharded']} {r['fallbacks']}"


# Strided slices along the sequence (x[:, ::2], x[:, 1::3]): each rank keeps the kept positions it
# holds, nothing crossing (once gathered whole). Ring's zigzag pieces make the uneven case. Writes
# and copies along other dims (new_empty filled by halves, repeat, scatter): once gathered whole.
STRIDED = [("strided-tokens", 24, 2), ("token-writes", 24, 2)]


@pytest.mark.parametrize(
    "variant",
    [
        "ring",
        pytest.param("ulysses", marks=pytest.mark.extended(covered_by="test_strided_slices_stay_sharded")),
    ],
)
def test_strided_slices_stay_sharded(pool: SPMDPool, variant: str) -> None:
    for where, r in _exact(pool.run(run_probes, STRIDED, variant, timeout_s=600), STRIDED, variant):
        assert r["sharded"] == [24] and not r["fallbacks"], f"{where}: {r['sharded']} {r['fallbacks']}"


# Writes autograd does not record (autosp.straight_through), a per-head 3-D mask under ring and hybrid.
TENTH_ROUND = [
    ("act-clamp-no-grad", 16, 2),
    ("act-setitem-no-grad", 16, 2),
    ("param-data-clamp", 16, 2),
    ("head-bias-3d", 16, 2),
]


@pytest.mark.parametrize(("variant", "backend"), [("ring", "inductor"), ("hybrid", "aot_eager")])
@pytest.mark.extended(covered_by="test_probes_match_single_device")
def test_tenth_round_probes_on_four_ranks(variant: str, backend: str) -> None:
    probes = TENTH_ROUND
    for where, r in _exact(run_spmd(run_probes, 4, probes, variant, backend), probes, f"{variant} {backend} P=4"):
        # Sequence-parallel (x[ids == 3] = 0, a boolean index_put, has no rule: it runs on gathered values).
        assert r["sharded"] == [16], f"{where}: {r['sharded']}"


@pytest.mark.extended(covered_by="test_strided_slices_stay_sharded")
def test_new_token_wise_rules_and_sinks_under_inductor_on_four_ranks() -> None:
    probes = [*STRIDED, *SINKS]
    for where, r in _exact(run_spmd(run_probes, 4, probes, "ring", "inductor"), probes, "ring inductor P=4"):
        assert r["sharded"] and not r["fallbacks"], f"{where}: {r['sharded']} {r['fallbacks']}"


# Ops reading nearby positions (sharding.rules.halo): RWKV's token shift (a negative pad) and a causal
# depthwise convolution (left pad, conv1d, crop) once gathered their input whole; now each rank
# computes its own positions, a few neighbouring ones crossing in one small all-gather.
# mix-valid-conv: under Ulysses at P=2 the conv's output (8 positions) was all rank 0's; rank 1 then
# read no weight (no gradient for the all-reduce) and no halo. Every rank now holds output positions
# that read the input (the output cut evenly where the input's pieces would not give that).
HALO = [("rwkv-shift", 16, 2), ("mix-causal-conv", 16, 2), ("mix-valid-conv", 16, 2)]


def _halo_exact(per_rank: list, probes: list, what: str) -> None:
    for where, r in _exact(per_rank, probes, what):
        assert r["sharded"] and not r["fallbacks"], f"{where}: {r['sharded']} {r['fallbacks']}"


@pytest.mark.parametrize("variant", ["ulysses", "ring"])
def test_token_shift_and_causal_convolution_gather_nothing(pool: SPMDPool, variant: str) -> None:
    _halo_exact(pool.run(run_probes, HALO, variant, timeout_s=600), HALO, variant)


@pytest.mark.parametrize(("variant", "world"), [("ring", 3), ("hybrid", 4)])
@pytest.mark.extended(covered_by="test_token_shift_and_causal_convolution_gather_nothing")
def test_token_shift_and_causal_convolution_under_inductor(variant: str, world: int) -> None:
    probes = [(name, 8 * world, batch) for name, _, batch in HALO]
    _halo_exact(run_spmd(run_probes, world, probes, variant, "inductor"), probes, f"{variant} inductor P={world}")


# Code Dynamo runs in eager, outside every graph: nn.TransformerEncoder's causal-mask check (an
# .item() inside torch's own module) once sent its whole layer stack there, silently whole on every
# rank; a layer the user disabled still runs there, and the user is told.
EAGER = [("torch-mha-encoder", 16, 2), ("eager-layer", 16, 2)]


def test_code_dynamo_runs_in_eager(pool: SPMDPool) -> None:
    per_rank = pool.run(run_probes, EAGER, "ulysses", "aot_eager", {"fullgraph": False}, timeout_s=600)
    for where, r in _exact(per_rank, EAGER, "ulysses"):
        if where.startswith(str(EAGER[0])):
            # The break resumes inside the encoder: its layers are compiled into the sharded graph.
            assert r["sharded"] == [None, 16] and not r["ran_in_eager"], f"{where}: {r}"
        else:
            assert r["sharded"] == [16, 16], f"{where}: {r['sharded']}"
            (message,) = r["ran_in_eager"]
            assert "4 parameter(s) of the model (eager." in message and "qkv.weight" in message, message
            assert "attention (ScaledDotProduct" in message, message
    # In eval under no_grad torch's modules take their inference fast path, attention fused into one
    # kernel no rule splits (the whole program then ran on every rank): off during AutoSP's calls.
    probes = [EAGER[0], ("torch-mha-no-weights", 16, 2)]
    for rank, results in enumerate(pool.run(run_inference, probes, "ulysses", timeout_s=600)):
        assert not isinstance(results, RankError), results.traceback
        encoder, mha = (results[p] for p in probes)
        assert not encoder["problems"] and not mha["problems"], f"rank {rank}: {results}"
        assert encoder["sharded"] == [None, 16] and mha["sharded"] == [16], f"rank {rank}: {results}"


@pytest.mark.extended(covered_by="test_code_dynamo_runs_in_eager")
def test_torch_encoder_on_four_ranks_under_inductor() -> None:
    # The encoder's layers, compiled after the break inside it, over 4 ranks (one head each) under Inductor.
    probes = [EAGER[0]]
    per_rank = run_spmd(run_probes, 4, probes, "ulysses", "inductor", {"fullgraph": False})
    for where, r in _exact(per_rank, probes, "ulysses inductor P=4"):
        assert r["sharded"] == [None, 16] and not r["ran_in_eager"], f"{where}: {r}"


# A buffer moved to the activations' dtype in every forward: returned as the very buffer (once a
# copy made to scale a gradient no input has; HF CTRL then failed after the break in __setattr__
# with "'Tensor' object has no attribute 'persistent'"). `step` compares which buffers are still
# the same objects and which outputs are the model's own tensors with eager's.
BUFFERS = [("buffer-moved", 16, 2), ("buffer-returned", 16, 2)]
# And one handed over a graph break into eager code that writes it in place: a folded [B * S, D] tensor
# gathered whole was returned as a view of the gathered buffer, which the write refused (HF DBRX).
BUFFERS += [("expert-loop", 16, 2)]


@pytest.mark.parametrize("variant", ["ulysses", "ring"])
def test_buffers_moved_in_forward_and_outputs_written_after_a_break(pool: SPMDPool, variant: str) -> None:
    per_rank = pool.run(run_probes, BUFFERS, variant, "aot_eager", {"fullgraph": False}, timeout_s=600)
    for where, r in _exact(per_rank, BUFFERS, variant):
        assert 16 in r["sharded"], f"{where}: {r}"
        assert "expert-loop" in where or not r["fallbacks"], f"{where}: {r['fallbacks']}"


@pytest.mark.extended(covered_by="test_buffers_moved_in_forward_and_outputs_written_after_a_break")
def test_buffers_moved_in_forward_on_four_ranks_under_inductor() -> None:
    per_rank = run_spmd(run_probes, 4, BUFFERS, "hybrid", "inductor", {"fullgraph": False})
    for where, r in _exact(per_rank, BUFFERS, "hybrid inductor P=4"):
        assert 16 in r["sharded"], f"{where}: {r}"


# torch.func.vmap in the graph (once refused: functorch's functionalize cannot trace it; HF Mamba,
# FalconMamba and Jamba run their scan through associative_scan's vmap under torch.compile).
VMAP = [("vmap-tokens", 16, 2), ("vmap-batch", 16, 2), ("vmap-associative-scan", 16, 2)]


def test_vmap_and_associative_scan_in_the_program(pool: SPMDPool) -> None:
    per_rank = pool.run(run_probes, VMAP, "ulysses", "aot_eager", timeout_s=600)
    for where, r in _exact(per_rank, VMAP, "ulysses"):
        assert r["sharded"] == [16], f"{where}: {r}"
        if "associative" not in where:  # vmap over positions or the batch: nothing gathered
            assert not r["fallbacks"], f"{where}: {r['fallbacks']}"


@pytest.mark.extended(covered_by="test_vmap_and_associative_scan_in_the_program")
def test_vmap_and_associative_scan_on_four_ranks_under_inductor() -> None:
    per_rank = run_spmd(run_probes, 4, VMAP, "ring", "inductor")
    for where, r in _exact(per_rank, VMAP, "ring inductor P=4"):
        assert r["sharded"] == [16], f"{where}: {r}"


# Work traced in another order on each rank (a loop over a set: Python's string hashes differ per
# process; HF Gemma-3 and Gemma-4 compute their rotary tables so). Once refused as other programs; the
# ranks now compile one canonical graph (autosp.canonical). Compared as canonical but compiled as
# traced, the branches' collectives and gradient buckets paired the wrong ones: every output and
# gradient wrong. Dropout drawn in another order is another program, still refused.
SET_ORDER = [("set-order", 16, 2)]


def test_work_traced_in_another_order_per_rank_is_one_program(pool: SPMDPool) -> None:
    per_rank = pool.run(run_probes, [*SET_ORDER, ("set-order-dropout", 16, 2)], "ulysses", timeout_s=600)
    for where, r in _exact(per_rank, SET_ORDER, "ulysses"):
        assert r["sharded"] == [16] and not r["fallbacks"], f"{where}: {r}"
    for results in per_rank:
        error = results["set-order-dropout", 16, 2]["error"]
        assert error.startswith("refused: ProgramMismatch: the SP ranks compiled different programs"), error


@pytest.mark.extended(covered_by="test_work_traced_in_another_order_per_rank_is_one_program")
@pytest.mark.parametrize("variant", ["ring", "hybrid"])
def test_work_traced_in_another_order_on_four_ranks_under_inductor(variant: str) -> None:
    per_rank = run_spmd(run_probes, 4, SET_ORDER, variant, "inductor")
    for where, r in _exact(per_rank, SET_ORDER, f"{variant} inductor P=4"):
        assert r["sharded"] == [16] and not r["fallbacks"], f"{where}: {r}"


# Blocks through one torch.compiler.nested_compile_region (invoke_subgraph), and torch.func's vjp,
# jvp and grad inside the model: AutoSP's lowering failed on both (functionalization cannot trace the
# op, nor functorch's levels inside its own); a region is inlined, transforms traced out first.
TRACED_OUT = [("nested-regions", 16, 2), ("functorch-inside", 16, 2)]


def test_nested_regions_and_functorch_transforms_are_sequence_parallel(pool: SPMDPool) -> None:
    per_rank = pool.run(run_probes, TRACED_OUT, "ulysses", timeout_s=600)
    for where, r in _exact(per_rank, TRACED_OUT, "ulysses"):
        assert r["sharded"] == [16] and not r["fallbacks"], f"{where}: {r}"


@pytest.mark.extended(covered_by="test_nested_regions_and_functorch_transforms_are_sequence_parallel")
@pytest.mark.parametrize(("variant", "world"), [("hybrid", 4), ("ring", 3)])
def test_nested_regions_and_functorch_transforms_under_inductor(variant: str, world: int) -> None:
    probes = [(name, 24 if world == 3 else seq, batch) for name, seq, batch in TRACED_OUT]
    per_rank = run_spmd(run_probes, world, probes, variant, "inductor")
    for where, r in _exact(per_rank, probes, f"{variant} inductor P={world}"):
        assert r["sharded"] == [probes[0][1]] and not r["fallbacks"], f"{where}: {r}"


# Tokens routed, sorted, resampled or counted over the whole sequence (the seventh round).
ROUTED = [f"route-{k}" for k in ROUTES]


BUCKETS = ["route-bucket-sort", "route-bucket-sdpa"]
_EXTENDED = pytest.mark.extended(covered_by="test_routed_sequences")


@pytest.mark.parametrize(
    ("variant", "world", "seq", "names", "backend"),
    [
        # Attention over chunks of a sorted sequence, 3 chunks where SDPA expects heads: hybrid once
        # refused it (3 heads do not split over its ulysses groups of 2); it is no sequence attention.
        ("hybrid", 4, 12, BUCKETS, "aot_eager"),
        pytest.param("hybrid", 4, 12, BUCKETS, "inductor", marks=_EXTENDED),
        pytest.param("hybrid", 4, 12, ROUTED, "aot_eager", marks=_EXTENDED),
        pytest.param("ulysses", 2, 16, ROUTED, "aot_eager", marks=_EXTENDED),
        pytest.param("ring", 3, 24, ROUTED, "aot_eager", marks=_EXTENDED),
    ],
)
def test_routed_sequences(variant: str, world: int, seq: int, names: list[str], backend: str) -> None:
    probes = [(n, seq, 2) for n in names]
    per_rank = run_spmd(run_probes, world, probes, variant, backend)
    for where, r in _exact(per_rank, probes, f"{variant} {backend} P={world}"):
        assert r["sharded"] and all(r["sharded"]), f"{where}: {r['sharded']}"


# Custom autograd.Functions: a gradient reversal; a clamped gradient (a backward not linear in the
# gradient) feeding attention, a SwiGLU with its own backward, parameters among its inputs and a
# non-differentiable result; the same layer under torch.utils.checkpoint; dropout drawn inside a Function;
# and one behind a graph break.
FUNCTIONS = [
    ("custom-functions", 16, 2),
    ("custom-functions-checkpointed", 16, 2),
    ("custom-functions-dropout", 16, 2),
]
FUNCTION_DISABLED = ("custom-function-disabled", 16, 2)


def _functions_exact(per_rank: list, probes: list, what: str) -> None:
    for where, r in _exact(per_rank, probes, what):
        assert r["sharded"] and all(r["sharded"]), f"{where}: {r['sharded']}"  # the rest stays sequence-parallel
        if not where.startswith(str(FUNCTION_DISABLED)):
            assert any("custom torch.autograd.Function runs whole" in f for f in r["fallbacks"]), where


def test_custom_autograd_functions_run_whole_with_the_users_backward(pool: SPMDPool) -> None:
    # Once a crash (functionalization's "NYI"), then refused: each Function now runs whole on every rank
    # with the user's backward, handed the true gradient of its results (autosp.user_function). The
    # dropout one runs under ring below.
    probes = [*FUNCTIONS[:2], FUNCTION_DISABLED]
    per_rank = pool.run(run_probes, probes, "ulysses", "aot_eager", {"fullgraph": False}, timeout_s=600)
    _functions_exact(per_rank, probes, "ulysses")
    for results in per_rank:
        assert results[FUNCTION_DISABLED]["sharded"] == [16, 16]  # both graphs around the break are SP
    # SAC must not recompute a Function in the backward: the dropout's mask would be drawn anew.
    probes = [("custom-functions-dropout", 16, 2)]
    per_rank = pool.run(run_probes, probes, "ring", "aot_eager", {"sac": True}, timeout_s=600)
    _functions_exact(per_rank, probes, "ring sac")


# Elementwise forward and backward (autosp.token_wise_body): BLOOM's GeLU, a straight-through round, a
# gate over two inputs, a clamped gradient, a clamping hook, a gradient reversal. Each once ran whole on
# every rank, its inputs gathered; now each rank runs it on its positions, and nothing is gathered.
TOKEN_WISE = [("token-wise-functions", 16, 2), ("custom-function", 16, 2)]


def _token_wise_exact(per_rank: list, what: str) -> None:
    for where, r in _exact(per_rank, TOKEN_WISE, what):
        assert r["sharded"] and all(r["sharded"]) and not r["fallbacks"], f"{where}: {r['sharded']} {r['fallbacks']}"


@pytest.mark.parametrize("variant", ["ulysses", "ring"])
def test_token_wise_functions_and_hooks_run_on_each_ranks_positions(pool: SPMDPool, variant: str) -> None:
    _token_wise_exact(pool.run(run_probes, TOKEN_WISE, variant, timeout_s=600), variant)


@pytest.mark.parametrize(("variant", "world"), [("hybrid", 4), ("ring", 3)])
@pytest.mark.extended(covered_by="test_token_wise_functions_and_hooks_run_on_each_ranks_positions")
def test_token_wise_functions_under_inductor(variant: str, world: int) -> None:
    probes = [(name, 8 * world, batch) for name, _, batch in TOKEN_WISE]
    per_rank = run_spmd(run_probes, world, probes, variant, "inductor")
    for where, r in _exact(per_rank, probes, f"{variant} inductor P={world}"):
        assert not r["fallbacks"], f"{where}: {r['fallbacks']}"


@pytest.mark.extended(covered_by="test_custom_autograd_functions_run_whole_with_the_users_backward")
def test_every_custom_autograd_function_probe_on_two_ranks(pool: SPMDPool) -> None:
    per_rank = pool.run(run_probes, FUNCTIONS, "ulysses", "aot_eager", {"fullgraph": False}, timeout_s=600)
    _functions_exact(per_rank, FUNCTIONS, "ulysses")


@pytest.mark.parametrize(("variant", "backend"), [("ulysses", "inductor"), ("hybrid", "aot_eager")])
@pytest.mark.extended(covered_by="test_custom_autograd_functions_run_whole_with_the_users_backward")
def test_custom_autograd_functions_on_four_ranks(variant: str, backend: str) -> None:
    per_rank = run_spmd(run_probes, 4, FUNCTIONS, variant, backend, {"sac": True})
    _functions_exact(per_rank, FUNCTIONS, f"{variant} {backend} P=4")


SDPA_3D = [("sdpa-3d", 16, 2), ("sdpa-3d-bias", 16, 2)]


def _three_dims_exact(per_rank: list, what: str) -> None:
    for where, r in _exact(per_rank, SDPA_3D, what):
        assert r["sharded"] == [16] and not r["whole_attention"], f"{where}: {r['sharded']} {r['whole_attention']}"


@pytest.mark.parametrize("variant", ["ulysses", "ring"])
def test_sdpa_on_three_dims(pool: SPMDPool, variant: str) -> None:
    # [batch * heads, S, d] q/k/v (once refused): lifted to 4-D, batch * heads split as Ulysses' heads.
    _three_dims_exact(pool.run(run_probes, SDPA_3D, variant, timeout_s=600), variant)


@pytest.mark.parametrize("variant", ["ulysses", "hybrid"])
@pytest.mark.extended(covered_by="test_sdpa_on_three_dims")
def test_sdpa_on_three_dims_on_four_ranks_under_inductor(variant: str) -> None:
    _three_dims_exact(run_spmd(run_probes, 4, SDPA_3D, variant, "inductor"), f"{variant} inductor P=4")


# Gradient hooks registered inside the compiled code (probe_models.GradientHooks): each runs whole on
# every rank, on the true gradient, in registration order (autosp.tensor_hooks).
HOOK_PROBES = [(f"hook-{k}", 16, 2) for k in HOOKS]


def _hooks_exact(per_rank: list, probes: list, what: str) -> None:
    for where, r in _exact(per_rank, probes, what):
        if "hook-module" in where:
            # torch's hook setup breaks the graph around each hooked module: its hooks run in eager on
            # the gradient that crosses the break, whole. The attention's forward is compiled as a
            # frame of its own, sequence-parallel; the hooked nn.Linear head runs in eager, said so.
            assert r["sharded"][-1], f"{where}: {r['sharded']}"
            (eager,) = r["ran_in_eager"]
            assert "(head.bias, head.weight)" in eager and "attn." not in eager, f"{where}: {eager}"
            continue
        assert r["sharded"] and all(r["sharded"]), f"{where}: {r['sharded']}"
        assert any("gradient hook (Tensor.register_hook) runs whole" in f for f in r["fallbacks"]), where


def test_gradient_hooks_see_the_true_gradient(pool: SPMDPool) -> None:
    # Not fullgraph: a module's backward hooks break the graph (Dynamo refuses them under fullgraph).
    per_rank = pool.run(run_probes, HOOK_PROBES, "ulysses", "aot_eager", {"fullgraph": False}, timeout_s=600)
    _hooks_exact(per_rank, HOOK_PROBES, "ulysses")


@pytest.mark.parametrize(
    ("variant", "world", "seq", "backend"), [("ring", 3, 24, "aot_eager"), ("hybrid", 4, 16, "inductor")]
)
@pytest.mark.extended(covered_by="test_gradient_hooks_see_the_true_gradient")
def test_gradient_hooks_under_other_variants(variant: str, world: int, seq: int, backend: str) -> None:
    probes = [(name, seq, batch) for name, _, batch in HOOK_PROBES]
    per_rank = run_spmd(run_probes, world, probes, variant, backend, {"fullgraph": False})
    _hooks_exact(per_rank, probes, f"{variant} {backend} P={world}")


def test_reductions_along_features_and_lookups_stay_sharded(pool: SPMDPool) -> None:
    # Max, argmax, vector norm, var/std, cummax and logsumexp over features, and table[idx] lookups,
    # are token-wise: exact, and nothing gathered (F.normalize's vector norm once gathered q and k
    # whole, and experts[choice] its index); so are rotary embeddings through complex numbers
    # (view_as_complex once gathered q and k in every layer).
    probes = [("feature-reductions", 16, 2), ("complex-rope", 16, 2)]
    for where, r in _exact(pool.run(run_probes, probes, "ulysses"), probes, "ulysses"):
        assert not r["fallbacks"], f"{where}: {r['fallbacks']}"


@pytest.mark.extended(covered_by="test_reductions_along_features_and_lookups_stay_sharded")
def test_reductions_along_features_and_lookups_on_four_ranks_under_inductor() -> None:
    # The same rules (stack, nll_loss2d, view_as_complex, ...) on 4 ranks, hybrid's two groups, Inductor.
    probes = [("feature-reductions", 32, 2), ("complex-rope", 32, 2)]
    for where, r in _exact(run_spmd(run_probes, 4, probes, "hybrid", "inductor"), probes, "hybrid inductor P=4"):
        assert not r["fallbacks"], f"{where}: {r['fallbacks']}"


UNEVEN = {
    # Lengths no world size here divides (13, 17, 19, 23 over 2, 3 or 4 ranks; once refused): pieces one
    # token apart, attention sharded (no site run whole), exact. A token shift across the pieces'
    # border, T5's and ALiBi's biases from global positions, OPT's positions from the padding mask,
    # rows every key of which finfo.min masks; value heads wider than q/k (a rank without padding once
    # placed its exchanges apart from the padded rank's: CollectiveMismatch).
    "ulysses": [
        ("rwkv-shift", 17, 2),
        ("t5-bias", 13, 2),
        ("opt-positions", 19, 1),
        ("leftpad-finfo", 23, 2),
        ("wide-value-heads", 13, 2),
    ],
    "ring": [("alibi", 13, 2), ("head-bias-3d", 17, 2), ("leftpad-finfo", 19, 2), ("complex-rope", 23, 2)],
    # At P=4 (ulysses_degree 2): spans of 6 and 7 tokens around the ring (13), equal spans of unequal
    # pieces (18: 4+5 and 4+5), each group's pieces alike but the spans not (19: 4+5 and 5+5).
    "hybrid": [("t5-bias", 13, 2), ("leftpad-finfo", 18, 2), ("wide-value-heads", 19, 2), ("rwkv-shift", 17, 2)],
}


_UNEVEN_MORE = pytest.mark.extended(covered_by="test_lengths_the_ranks_do_not_split_evenly_are_exact")


@pytest.mark.parametrize(
    ("variant", "world", "backend", "options"),
    [
        ("ulysses", 2, "aot_eager", {}),
        ("ring", 2, "aot_eager", {}),
        # Inductor with SAC (the partitioner recomputes around the padded exchanges), head groups pipelined.
        pytest.param(
            "ulysses", 2, "inductor", {"sac": True, "variant_options": {"ulysses_chunks": 2}}, marks=_UNEVEN_MORE
        ),
        pytest.param("ring", 3, "inductor", {"sac": True}, marks=_UNEVEN_MORE),
        pytest.param("ulysses", 4, "aot_eager", {}, marks=_UNEVEN_MORE),
        pytest.param("ring", 4, "aot_eager", {}, marks=_UNEVEN_MORE),
        ("hybrid", 4, "aot_eager", {}),
        pytest.param(
            "hybrid", 4, "inductor", {"sac": True, "variant_options": {"balance_chunk": 1}}, marks=_UNEVEN_MORE
        ),
    ],
)
def test_lengths_the_ranks_do_not_split_evenly_are_exact(
    pool: SPMDPool, variant: str, world: int, backend: str, options: dict
) -> None:
    probes = UNEVEN[variant]
    if world == 2:
        per_rank = pool.run(run_probes, probes, variant, backend, options, timeout_s=600)
    else:
        with SPMDPool(world, pg_timeout_s=240.0) as own:
            per_rank = own.run(run_probes, probes, variant, backend, options, timeout_s=600)
    _exact(per_rank, probes, f"{variant} P={world} {backend}")
    for results in per_rank:
        for probe in probes:
            r = results[probe]
            assert r["sharded"] == [probe[1]] and not r["whole_attention"], (probe, r)
            assert not any("attention" in f for f in r["fallbacks"]), (probe, r["fallbacks"])


def test_a_write_autograd_does_not_record_that_one_read_cannot_state_is_refused(pool: SPMDPool) -> None:
    # A view that requires grad, taken before an untracked write and read after it (autosp.straight_through).
    probe = ("act-view-read-after-no-grad", 16, 2)
    for results in pool.run(run_probes, [probe], "ulysses", timeout_s=300):
        assert not isinstance(results, RankError), results.traceback
        error = results[probe].get("error", "")
        assert error.startswith("refused: AutoSPError") and "autograd does not record" in error, error
        assert "probe_models.py" in error, error  # the line


# nn.Embedding(max_norm=...) renormalises, in place, the rows its lookup reads (once refused under SP):
# every rank renormalises the rows of every token, so its table after the call is eager's (compared).
MAX_NORM = [(f"embedding-max-norm-{kind}", 15, 2) for kind in ("plain", "tied", "twice", "bag")]


@pytest.mark.parametrize("variant", ["ulysses", "ring"])
def test_max_norm_lookups_renormalise_the_rows_of_every_token_on_every_rank(pool: SPMDPool, variant: str) -> None:
    for where, r in _exact(pool.run(run_probes, MAX_NORM, variant, timeout_s=600), MAX_NORM, variant):
        assert r["sharded"] == [15] and not r["fallbacks"], (where, r)


@pytest.mark.parametrize(("variant", "world", "seq"), [("hybrid", 4, 18), ("ulysses", 3, 16)])
@pytest.mark.extended(covered_by="test_max_norm_lookups_renormalise_the_rows_of_every_token_on_every_rank")
def test_max_norm_lookups_under_inductor_on_more_ranks(variant: str, world: int, seq: int) -> None:
    probes = [(name, seq, 2) for name, _, _ in MAX_NORM]
    _exact(run_spmd(run_probes, world, probes, variant, "inductor"), probes, f"{variant} inductor P={world}")


@pytest.mark.parametrize(
    ("variant", "probes"),
    [
        ("ring", [("leftpad-finfo", 16, 2), ("leftpad-finfo-written", 16, 2), ("landmarks", 24, 2)]),
        ("ulysses", [("leftpad-finfo", 16, 2), ("leftpad-finfo-written", 16, 2)]),
    ],
)
@pytest.mark.extended(covered_by="test_probes_match_single_device")
def test_fifth_round_probes_on_four_ranks(variant: str, probes: list[tuple[str, int, int]]) -> None:
    """Fully masked rows merged over four ring blocks (zigzag pieces), 3 landmarks over 4 ranks."""
    _exact(run_spmd(run_probes, 4, probes, variant), probes, f"{variant} P=4")


# The eleventh round (probe_tasks.py), at a length the ranks split unevenly: random draws in the
# forward (MAE's shuffle, masking done in the model, noise), the caller's tensors written in place or
# differentiated, statistics and pooling over the sequence, a sequence-first layer, weights shared,
# frozen and tied, Python reading values (.item(), .tolist(), boolean indexing, graph breaks), and
# Hugging Face's question-answering, token-classification and multiple-choice heads.
ELEVENTH_ROUND = [(name, 15, 2) for name in TASKS]
# Inductor draws random numbers with its own generator, as torch.compile does on one device; with
# fallback_random it draws eager's, so the SP program is compared with eager's draws exactly.
DRAWS = [("mae-masking", 15, 2), ("mlm-inside", 15, 2), ("noise-injection", 15, 2)]
EAGER_DRAWS = {"fullgraph": False, "sac": True, "options": {"fallback_random": True}}


def _eleventh_exact(per_rank: list, probes: list, what: str) -> None:
    for where, r in _exact(per_rank, probes, what):
        assert r["sharded"] and all(r["sharded"]), f"{where}: {r['sharded']}"


def test_eleventh_round(pool: SPMDPool) -> None:
    per_rank = pool.run(run_probes, ELEVENTH_ROUND, "ulysses", "aot_eager", {"fullgraph": False}, timeout_s=600)
    _eleventh_exact(per_rank, ELEVENTH_ROUND, "ulysses")


def test_draws_in_the_forward_under_inductor(pool: SPMDPool) -> None:
    _eleventh_exact(pool.run(run_probes, DRAWS, "ulysses", "inductor", EAGER_DRAWS, timeout_s=600), DRAWS, "inductor")


@pytest.mark.parametrize(
    ("variant", "world", "seq", "backend"),
    [("ring", 3, 17, "aot_eager"), ("hybrid", 4, 16, "aot_eager"), ("ulysses", 4, 18, "inductor")],
)
@pytest.mark.extended(covered_by="test_eleventh_round")
def test_eleventh_round_on_more_ranks(variant: str, world: int, seq: int, backend: str) -> None:
    names = list(TASKS)
    if backend == "inductor":  # one of each kind, to keep the compile time down
        drawn = {name for name, _, _ in DRAWS}
        names = [n for n in names if n in drawn or n.startswith(("input-", "item", "graph", "tolist", "boolean"))]
        names += ["masked-pool", "seq-stats", "hf-qa-llama"]
    probes = [(name, seq, 2) for name in names]
    options = EAGER_DRAWS if backend == "inductor" else {"fullgraph": False}
    per_rank = run_spmd(run_probes, world, probes, variant, backend, options)
    _eleventh_exact(per_rank, probes, f"{variant} {backend} P={world}")


# The twelfth round (probe_sequence.py), at a length the ranks split unevenly: the sequence contracted
# with parameters sized by it (MLP-Mixer, gMLP's gate as a Conv1d over positions, Linformer), two
# sequence axes (a pair representation, InfoNCE over positions), a CRF's neighbouring labels and its
# recursion, returns-to-go by a flipped cumsum, softmax over the sequence, order statistics, the
# sequence tiled and pooled into segments by amax, unbind over positions.
TWELFTH_ROUND = [(name, 15, 2) for name in PROGRAMS]


def test_twelfth_round(pool: SPMDPool) -> None:
    _eleventh_exact(pool.run(run_probes, TWELFTH_ROUND, "ulysses", timeout_s=600), TWELFTH_ROUND, "ulysses")


@pytest.mark.parametrize(
    ("variant", "world", "seq", "backend", "options"),
    [
        ("ring", 3, 17, "aot_eager", {}),
        ("hybrid", 4, 18, "aot_eager", {}),
        ("ulysses", 4, 18, "inductor", {"sac": True}),
    ],
)
@pytest.mark.extended(covered_by="test_twelfth_round")
def test_twelfth_round_on_more_ranks(variant: str, world: int, seq: int, backend: str, options: dict) -> None:
    probes = [(name, seq, 2) for name in PROGRAMS]
    _eleventh_exact(
        run_spmd(run_probes, world, probes, variant, backend, options), probes, f"{variant} {backend} P={world}"
    )


# The thirteenth round (probe_routing.py): tokens routed, sampled, merged and recurred over. ToMe's
# bipartite merging, a Gumbel-softmax router and REINFORCE by ``multinomial`` (draws over the
# sequence), an STFT frontend (complex frames), a bidirectional LSTM (Dynamo breaks the graph around
# it: run in eager, whole, named), point-cloud neighbourhoods by ``cdist`` and ``topk``, buckets from
# ``bucketize``, pairs merged by a reshape after ``F.pad``, ``unfold``ed windows, mixture-of-depths,
# a ``roll``ed negative, ``logcumsumexp`` gates, stick-breaking by ``cumprod``, a frozen teacher.
THIRTEENTH_ROUND = [(name, 15, 2) for name in ROUTING]
ROUND_OPTIONS = {"fullgraph": False}  # the LSTM breaks the graph


def test_thirteenth_round(pool: SPMDPool) -> None:
    per_rank = pool.run(run_probes, THIRTEENTH_ROUND, "ulysses", "aot_eager", ROUND_OPTIONS, timeout_s=600)
    _eleventh_exact(per_rank, THIRTEENTH_ROUND, "ulysses")
    lstm = per_rank[0]["lstm-head", 15, 2]
    assert any("rnn.weight_ih_l0" in w for w in lstm["ran_in_eager"]), lstm
    # Gates through F.logsigmoid (log_sigmoid_forward) and logcumsumexp keep their tokens (once
    # gathered whole); only the [S, S] decay's key axis is gathered, as a pair matrix needs.
    gates = per_rank[0]["gated-linear-attention", 15, 2]["fallbacks"]
    assert gates == ["sub: operand sharded on a broadcast dim"], gates


@pytest.mark.parametrize(
    ("variant", "world", "seq", "backend", "options"),
    [
        ("ring", 3, 17, "aot_eager", ROUND_OPTIONS),
        ("hybrid", 4, 18, "aot_eager", ROUND_OPTIONS),
        ("ulysses", 4, 18, "inductor", EAGER_DRAWS),
    ],
)
@pytest.mark.extended(covered_by="test_thirteenth_round")
def test_thirteenth_round_on_more_ranks(variant: str, world: int, seq: int, backend: str, options: dict) -> None:
    probes = [(name, seq, 2) for name in ROUTING]
    _eleventh_exact(
        run_spmd(run_probes, world, probes, variant, backend, options), probes, f"{variant} {backend} P={world}"
    )
