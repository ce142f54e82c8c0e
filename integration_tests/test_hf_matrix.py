"""A few representative rows of the HF model matrix (the whole matrix: ``tools/scripts/hf_matrix.py``).

Each row is one tiny HF model built in code, compiled at sp=2 with ``aot_eager`` on a persistent pool, and
compared with single-device eager: loss and every parameter's gradient. The rows cover hand-written (eager)
attention under HF gradient checkpointing, a model-built sliding-window mask, soft-capping, an encoder with a
classification head and ring's zigzag layout.  The classification checks run first, without processes, so a
comparison that could never fail would be caught here. A few architectures beyond the matrix
(``hf_more.py``: generic tiny configs of models nobody here wrote for) run too.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from hf_matrix import Outcome, Row, check_row, classify
from hf_more import specaugment_step
from spmd_pool import RankError, SPMDPool

# Row -> None when it must be exact, else a phrase its refusal must contain (a clear message, recorded verbatim
# by tools/scripts/hf_matrix.py).
ROWS: dict[Row, str | None] = {
    Row("Llama (eager)", "ulysses", checkpointing=True): None,
    Row("Mistral (sliding window 8)", "ulysses"): None,
    Row("Gemma-2 (soft-capping, eager)", "ulysses"): None,
    Row("BERT classifier", "ulysses"): None,
    Row("GPT-2 (eager)", "ring"): None,
}


def _result(loss: float, grad: float, logit: float = 0.5, largest: float = 1.0) -> dict:
    return {
        "loss": torch.tensor(loss),
        "logits": torch.tensor([[logit, 1.0]]),
        "grads": {"w": torch.tensor([grad, largest])},
    }


def _rank(ref: dict, sp: dict) -> dict:
    return {"ref": ref, "sp": sp, "graphs": 1, "sites": 2, "fallbacks": [], "notes": [], "sharded": [16]}


def test_classify_flags_wrong_values_and_unclear_errors() -> None:
    row = Row("Llama (sdpa)", "ulysses")
    ref = _result(2.0, 0.5)
    assert classify(row, [_rank(ref, _result(2.0, 0.5))] * 2, 1.0).kind == "exact"
    # A gradient off by 1e-3 relative (a missing or doubled summand is far more) and a loss off by 1e-4.
    assert classify(row, [_rank(ref, _result(2.0, 0.5)), _rank(ref, _result(2.0, 0.5005))], 1.0).kind == "bug"
    assert classify(row, [_rank(ref, _result(2.0002, 0.5))] * 2, 1.0).kind == "bug"
    assert "logits" in classify(row, [_rank(ref, _result(2.0, 0.5, logit=0.501))] * 2, 1.0).detail
    # Beside a gradient of 1e4 in the same tensor, fp32 rounding moves a small element in its 1e-3s (DeiT's
    # [CLS] token, exact in float64): not a bug; that element off by 1e-2, or the large one by 1e-3 relative, is.
    big = _result(2.0, 13.0, largest=1.5e4)
    assert classify(row, [_rank(big, _result(2.0, 13.0034, largest=1.5e4))] * 2, 1.0).kind == "exact"
    assert classify(row, [_rank(big, _result(2.0, 13.02, largest=1.5e4))] * 2, 1.0).kind == "bug"
    assert classify(row, [_rank(big, _result(2.0, 13.0, largest=1.5015e4))] * 2, 1.0).kind == "bug"
    missing = {**ref, "grads": {}}
    assert "missing ['w']" in classify(row, [_rank(ref, missing)] * 2, 1.0).detail
    refusal = RankError("AutoSPError", ("AutoSPError", "Exception"), "cannot shard X; do Y", "tb")
    out = classify(row, [refusal, refusal], 1.0)
    assert (out.kind, out.detail) == ("refused", "AutoSPError: cannot shard X; do Y")
    # A refusal on one rank only, or an error that is not AutoSP's, is a bug: the ranks may be out of step.
    other = RankError("RuntimeError", ("RuntimeError", "Exception"), "gloo: connection reset", "tb")
    assert classify(row, [refusal, _rank(ref, ref)], 1.0).kind == "bug"
    assert classify(row, [other, other], 1.0).kind == "bug"


@pytest.fixture(scope="module")
def pool() -> Iterator[SPMDPool]:
    with SPMDPool(2, pg_timeout_s=240.0) as p:
        yield p


# Rows whose features first-tier tests also cover: a model-built sliding-window mask (cases.py's
# windowed Llama, ring's window cases) and soft-capping (test_written_attention.py's softcap case).
EXTENDED_ROWS = {Row("Mistral (sliding window 8)", "ulysses"), Row("Gemma-2 (soft-capping, eager)", "ulysses")}


@pytest.mark.parametrize(
    "row",
    [pytest.param(r, marks=pytest.mark.extended(covered_by="test_row")) if r in EXTENDED_ROWS else r for r in ROWS],
    ids=[r.label().replace(" | ", "-").replace(" ", "_") for r in ROWS],
)
def test_row(pool: SPMDPool, row: Row) -> None:
    out = check_row(pool, row, timeout_s=600.0)
    refusal = ROWS[row]
    if refusal is None:
        assert out.kind == "exact", f"{row.label()}: {out.cell()}"
    else:
        assert out.kind == "refused" and refusal in out.detail, f"{row.label()}: {out.cell()}"


# HF gradient checkpointing over transformers 5's hub-kernel layers, whose forward sets a Python variable
# around attention (Qwen3, Gemma-3, Granite, SmolLM3, OLMoE, ...): Dynamo refused the checkpoint op and
# ran those layers in eager, outside every graph, so no graph was sharded (exact, no sequence parallelism);
# Gemma-3, whose pieces then fell in a loop over a set, was refused (each rank compiled them in its order).
CHECKPOINTED_HUB_LAYERS = [
    Row("Qwen3", "ulysses", checkpointing=True),
    pytest.param(
        Row("Gemma-3 (sliding window 8)", "ring", checkpointing=True),
        marks=pytest.mark.extended(covered_by="test_checkpointed_hub_kernel_layers_stay_sequence_parallel"),
    ),
]


@pytest.mark.parametrize("row", CHECKPOINTED_HUB_LAYERS, ids=["qwen3-ulysses", "gemma3-ring"])
def test_checkpointed_hub_kernel_layers_stay_sequence_parallel(pool: SPMDPool, row: Row) -> None:
    out = check_row(pool, row, timeout_s=600.0)
    assert out.kind == "exact" and "1 of 1 graphs sharded, 2 attention sites" in out.detail, out.cell()


# Encoder-decoders (16 source tokens, 12 target tokens): the source sequence sharded (BART's six
# attentions through SDPA, T5's written out with its relative-position bias, kept as written), the
# target's self-attention whole on every rank, cross-attention with each rank's query rows against the
# memory whole.
T5 = "T5 (relative position buckets)"
ENCODER_DECODERS = {
    Row("BART", "ulysses"): "1 of 1 graphs sharded, 6 attention sites",
    Row(T5, "ring"): "1 of 1 graphs sharded, 4 attention sites, attention kept as written",
}


@pytest.mark.parametrize("row", list(ENCODER_DECODERS), ids=["bart-ulysses", "t5-ring"])
def test_encoder_decoders(pool: SPMDPool, row: Row) -> None:
    out = check_row(pool, row, timeout_s=600.0)
    assert out.kind == "exact" and ENCODER_DECODERS[row] in out.detail, out.cell()


# Vision-language models: an image's tokens placed in the text by the model. LLaVA's first call installs
# transformers' output-capturing hooks under a lock (a break) and binds its forward's signature by
# inspect, whose values view the resumed frames take as an input: Dynamo 2.13 crashed building its
# guards (autosp.dynamo_fixes). PaliGemma's prefix is seen both ways, its answer causally.
VISION_LANGUAGE = {
    Row("LLaVA (CLIP features from the second-to-last layer into Llama's text)", "ulysses"): (
        "4 of 5 graphs sharded, 4 attention sites"
    ),
    Row("PaliGemma (SigLIP prefix, prefix-LM mask from token_type_ids)", "ring"): (
        "2 of 2 graphs sharded, 3 attention sites"
    ),
}


@pytest.mark.parametrize("row", list(VISION_LANGUAGE), ids=["llava-ulysses", "paligemma-ring"])
def test_vision_language_models(pool: SPMDPool, row: Row) -> None:
    out = check_row(pool, row, timeout_s=600.0)
    assert out.kind == "exact" and VISION_LANGUAGE[row] in out.detail, out.cell()


# Architectures beyond the matrix (hf_more.py, generic configs) -> what the exact row's report must say.
MORE_ROWS: dict[Row, str] = {
    Row("Qwen3-MoE", "ulysses"): "1 of 1 graphs sharded, 2 attention sites",
    Row("Gemma-3 (sliding window 8)", "ring"): "1 of 1 graphs sharded, 2 attention sites",
    Row("Cohere (parallel block)", "ring"): "1 of 1 graphs sharded, 2 attention sites",
    Row("ModernBERT classifier", "ulysses"): "1 of 1 graphs sharded, 2 attention sites",
    Row("GPT-Neo (eager, local attention)", "ulysses"): "attention kept as written",
    # Attention written over [batch * heads, S, d]: found (so the graph is sharded), kept as written.
    Row("XGLM (eager)", "ulysses"): "1 of 1 graphs sharded, 0 attention sites, attention kept as written",
    # Scores from alibi.baddbmm(q, k^T): found (once missed: the graph ran whole); finfo.min keeps it as written.
    Row("BLOOM (ALiBi in baddbmm)", "ring"): "1 of 1 graphs sharded, 0 attention sites, attention kept as written",
    # Sinks in the softmax: found (once not: every layer's attention missed, the graph ran whole), kept as written.
    Row("GPT-OSS (attention sinks, MoE)", "ulysses"): (
        "1 of 1 graphs sharded, 0 attention sites, attention kept as written"
    ),
    Row("DeepSeek-V3 (MLA, MoE)", "ring"): "1 of 1 graphs sharded, 2 attention sites",
    Row("Llama-4 (text, MoE)", "ulysses"): "1 of 1 graphs sharded, 2 attention sites",
    # Its Mamba scan is torch.func.vmap under torch.compile (once refused): lowered, the scan run whole.
    Row("Jamba (Mamba scan + attention, MoE)", "ring"): "1 of 1 graphs sharded, 1 attention sites",
    # AltUp clamps its coefficients through .data in the forward (once refused: autosp.straight_through).
    Row("Gemma-3n (AltUp clamps parameters through .data)", "ulysses"): "1 of 1 graphs sharded, 2 attention sites",
    # Its router draws (exponential_, uniform_) in training: each rank draws the program's numbers.
    Row("PhiMoE (sparsemixer routing draws random numbers)", "ring"): "1 of 1 graphs sharded, 2 attention sites",
    # transformers' output capturing registers module hooks in its first call: Dynamo's nested graph
    # breaks crashed on them ("cannot create weak reference to 'dict' object": autosp.dynamo_fixes).
    Row("Wav2Vec2 audio classifier", "ulysses"): "3 of 6 graphs sharded",
    Row("Swin (shifted windows, patch merging)", "ulysses"): "1 of 1 graphs sharded, 2 attention sites",
    Row("SegFormer (spatial-reduction attention)", "ring"): "1 of 1 graphs sharded, 2 attention sites",
    Row("Qwen3-Next (gated delta rule + attention, MoE)", "ring"): "1 of 1 graphs sharded, 1 attention sites",
    Row("XLNet (relative attention, last-token summary)", "ulysses"): "1 of 1 graphs sharded, 2 attention sites",
    # Relative terms added to the flat [B*H, S, S] scores before their 4-D view: once not found, so
    # nothing was sharded; now found and kept as written.
    Row("DeBERTa-v2 (disentangled relative attention)", "ring"): (
        "2 of 2 graphs sharded, 0 attention sites, attention kept as written"
    ),
    # A vision tower's tokens scattered into the text at its image tokens, M-RoPE positions from them,
    # and graph breaks between: the text's attention sharded, the vision tower's whole.
    Row("Qwen2-VL (image tokens merged into the text, M-RoPE)", "ring"): "10 of 17 graphs sharded, 4 attention sites",
    # Gradients of 1e4 whose small elements fp32 rounds in their 1e-3s (exact in float64): once a false bug.
    Row("DeiT (distillation token)", "ring"): "1 of 1 graphs sharded, 2 attention sites",
    Row("SwitchTransformers (T5 with top-1 experts)", "ulysses"): "17 of 17 graphs sharded, 1 attention sites",
    Row("ProphetNet (n-gram streams)", "ring"): "1 of 2 graphs sharded, 14 attention sites",
    # Pixtral slices each image's patches by a tensor size in a list comprehension, a break: Dynamo 2.13
    # resumed it without the comprehension's iterator and crashed (autosp.dynamo_fixes).
    Row("Mistral-3 (Pixtral tower, 2-D rotary, merged patches)", "ring"): "13 of 17 graphs sharded, 3 attention sites",
    Row("Gemma-3 with images (pooled SigLIP tokens seen both ways)", "ulysses"): (
        "2 of 2 graphs sharded, 3 attention sites"
    ),
    # Two towers of 16 and 17 tokens in one graph, each sharded, pooled into a loss over the batch.
    Row("CLIP (text and image towers, contrastive loss over the batch)", "ring"): (
        "1 of 1 graphs sharded, 2 attention sites, uneven pieces"
    ),
    Row("Whisper (mel frames halved by a strided conv, a decoder cross-attending)", "ulysses"): (
        "1 of 1 graphs sharded, 6 attention sites"
    ),
}


# Nothing gathered: Cohere's rotary stacks interleaved pairs (once gathered q and k in every layer);
# BLOOM's GeLU is a custom autograd.Function, elementwise both ways (once ran whole on every rank);
# Llama-4's repeats along other dims than the sequence (once gathered their input whole).
TOKEN_WISE = {"Cohere (parallel block)", "BLOOM (ALiBi in baddbmm)", "Llama-4 (text, MoE)"}


@pytest.mark.parametrize(
    "row", list(MORE_ROWS), ids=[r.label().replace(" | ", "-").replace(" ", "_") for r in MORE_ROWS]
)
@pytest.mark.extended(covered_by="test_row")
def test_more_architectures(pool: SPMDPool, row: Row) -> None:
    out = check_row(pool, row, timeout_s=600.0)
    assert out.kind == "exact" and MORE_ROWS[row] in out.detail, f"{row.label()}: {out.cell()}"
    if row.model in TOKEN_WISE:
        assert not out.gathered, f"{row.label()}: {out.gathered}"
    if row.model.startswith("DeepSeek"):
        # Only the MoE's sort and index run whole; MLA's q and k, filled into a new_empty by halves
        # (slice_scatter), once were gathered whole in every layer.
        assert all(op.startswith(("sort", "index")) for op in out.gathered), f"{row.label()}: {out.gathered}"


@pytest.mark.extended(
    covered_by="packages/autosp-core/tests/test_guards.py::test_recompiles_within_the_first_call_name_the_function_not_the_lengths"
)
def test_a_block_loop_that_recompiles_is_refused_naming_the_function(pool: SPMDPool) -> None:
    # BigBird's block-sparse attention compiles a helper once per block index within one call: the
    # refusal names that function and what to do, not the sequence length (once: "mark it dynamic").
    out = check_row(pool, Row("BigBird (block sparse, random blocks)", "ring"), timeout_s=600.0)
    assert out.kind == "refused" and "inside the first call" in out.detail, out.cell()
    assert "_get_single_block_row_attention" in out.detail and "torch.compiler.disable" in out.detail, out.cell()
    assert "mark_dynamic" not in out.detail, out.cell()


@pytest.mark.extended(
    covered_by="integration_tests/test_guards.py::test_ranks_seeded_apart_are_refused_when_the_program_draws_random_numbers"
)
def test_specaugment_drawn_with_numpy_is_exact_or_refused(pool: SPMDPool) -> None:
    # Wav2Vec2's SpecAugment masks frames drawn with NumPy in eager code: no graph shows the draw, and
    # ranks seeded apart once each masked other frames of the one sequence, silently.
    for r in pool.run(specaugment_step, True, timeout_s=600):
        assert r["error"].startswith("RandomStateMismatch: the SP ranks hold different NumPy global random"), r
    for r in pool.run(specaugment_step, False, timeout_s=600):
        assert r["error"] is None and not r["problems"], r


@pytest.mark.extended(covered_by="integration_tests/test_fuzz.py::test_check_catches_a_missing_gradient_all_reduce")
def test_a_missing_gradient_all_reduce_is_caught(pool: SPMDPool) -> None:
    # Without the gradient all-reduce each rank holds only its tokens' share: the end-to-end check must see it.
    out = check_row(pool, Row("BERT classifier", "ulysses"), timeout_s=600.0, disable_passes=("autosp.sync_grads",))
    assert out.kind == "bug" and "differs from single-device eager: grad " in out.detail, out.cell()


# Vision encoders, whose sequence the model makes: patches plus the tokens it adds ([CLS], registers),
# lengths the ranks do not split evenly (17 over 2, 3 and 4 ranks, 21 over 2 and 4): once refused,
# now balanced pieces one token apart (autosp.sharding.padded, the ring op's ``sizes``; hybrid both).
VIT = "ViT classifier ([CLS] + 16 patches: 17 tokens)"
BEIT = "BEiT (relative position bias, [CLS] + 16 patches)"
DINO = "DINOv2 with registers ([CLS], 4 registers + 16 patches: 21 tokens)"
UNEVEN_ROWS = [
    (2, Row(VIT, "ulysses"), "aot_eager"),
    (2, Row(BEIT, "ring"), "aot_eager"),
    pytest.param(3, Row(VIT, "ring"), "aot_eager", marks=pytest.mark.extended(covered_by="test_uneven_lengths")),
    pytest.param(4, Row(DINO, "ulysses"), "inductor", marks=pytest.mark.extended(covered_by="test_uneven_lengths")),
    pytest.param(4, Row(BEIT, "ring"), "aot_eager", marks=pytest.mark.extended(covered_by="test_uneven_lengths")),
    pytest.param(4, Row(VIT, "hybrid"), "inductor", marks=pytest.mark.extended(covered_by="test_uneven_lengths")),
    # BEiT's stochastic depth (drop_path 0.1) draws in training: under Inductor with Inductor's own
    # generator, as torch.compile alone does (the [CLS] gradient 20% off eager's: once taken for a torch
    # bug); fallback_random draws eager's numbers.
    pytest.param(2, Row(BEIT, "ulysses"), "inductor", marks=pytest.mark.extended(covered_by="test_uneven_lengths")),
]


@pytest.mark.parametrize(("world", "row", "backend"), UNEVEN_ROWS, ids=lambda x: getattr(x, "model", str(x))[:8])
def test_uneven_lengths(pool: SPMDPool, world: int, row: Row, backend: str) -> None:
    out = _exact_on(pool, world, row, backend)
    assert out.detail == "1 of 1 graphs sharded, 2 attention sites, uneven pieces", out.cell()


def _exact_on(pool: SPMDPool, world: int, row: Row, backend: str) -> Outcome:
    """``row`` on ``world`` ranks (the module's pool at 2, its own otherwise), asserted exact; under
    Inductor with eager's random draws (``fallback_random``: dropout and stochastic depth in training)."""
    options = {"options": {"fallback_random": True}} if backend == "inductor" else {}
    if world == 2:
        out = check_row(pool, row, backend=backend, timeout_s=600.0, **options)
    else:
        with SPMDPool(world, pg_timeout_s=240.0) as own:
            out = check_row(own, row, backend=backend, timeout_s=600.0, **options)
    assert out.kind == "exact", f"P={world} {backend} {row.label()}: {out.cell()}"
    return out


# Padded batches (an attention mask: a left-padded row and a right-padded one, the padding's labels
# ignored) at lengths the ranks split unevenly, as fine-tuning data collators make them. Swept once
# over every text architecture here (Ulysses and ring at 15 tokens on 2 ranks, hybrid at 17 on 4;
# bf16 and eval too): all exact. These rows keep one of each kind.
PADDED_ROWS = [
    (2, Row("Llama (sdpa)", "ulysses", seq=15, padding=True), "aot_eager"),
    (2, Row("BERT classifier", "ring", seq=15, padding=True), "aot_eager"),
    pytest.param(
        4,
        Row("Mistral (sliding window 8)", "hybrid", seq=17, padding=True),
        "aot_eager",
        marks=pytest.mark.extended(covered_by="test_padded_batches_at_uneven_lengths"),
    ),
    pytest.param(
        2,
        Row("Qwen2", "ulysses", mode="bf16", seq=15, padding=True),
        "inductor",
        marks=pytest.mark.extended(covered_by="test_padded_batches_at_uneven_lengths"),
    ),
]


@pytest.mark.parametrize(("world", "row", "backend"), PADDED_ROWS, ids=lambda x: getattr(x, "model", str(x))[:8])
def test_padded_batches_at_uneven_lengths(pool: SPMDPool, world: int, row: Row, backend: str) -> None:
    out = _exact_on(pool, world, row, backend)
    assert "uneven pieces" in out.detail, out.cell()
