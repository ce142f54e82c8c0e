"""The Hugging Face model matrix: tiny models built in code, each run compiled at sp=P against single-device eager.

One row is a model, a variant, gradient checkpointing on or off and a run mode (fp32 training, bf16 autocast
training, eval under ``torch.no_grad``). ``run_row`` is the pool task: on every rank it builds the model from a
fixed seed, runs a single-device eager step on a deep copy, then the ``autosp.compile``d step, and returns both.
``check_row`` compares them in the parent and says what happened: exact, refused (an ``AutoSPError`` that every
rank raised alike, recorded verbatim) or a bug (a wrong value, a hang, any other error).

No downloads: every config is written here with vocab 128, hidden 32, 2 layers, 4 heads (2 kv heads where the
architecture has GQA) and every dropout off, so that one compile takes seconds.
"""

from __future__ import annotations

import copy
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from cases import caches_off
from spmd_pool import PoolTimeout, RankError, SPMDPool

import autosp

Mode = Literal["train", "bf16", "eval"]
Kind = Literal["exact", "refused", "bug"]

VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, BATCH = 128, 32, 2, 4, 2, 2
SEQ = 16
WINDOW = 8  # Mistral's and Gemma-2's sliding window: smaller than SEQ, so the window really cuts
CLASSES = 3

# (rtol, atol) for the loss or outputs and for gradients. bf16 autocast: AutoSP's bf16 defaults (autosp.verify),
# with atol relative to the largest reference value, since bf16 rounding is relative to the values' scale.
TOLERANCES: dict[Mode, tuple[tuple[float, float], tuple[float, float]]] = {
    "train": ((1e-5, 1e-6), (1e-4, 1e-6)),
    "eval": ((1e-5, 1e-6), (1e-4, 1e-6)),
    "bf16": ((5e-2, 1e-2), (5e-2, 1e-2)),
}
# (rtol, atol relative to the largest logit) for the logits: autosp.verify's defaults for outputs.
LOGITS_TOLERANCES: dict[Mode, tuple[float, float]] = {"train": (1e-4, 1e-5), "eval": (1e-4, 1e-5), "bf16": (5e-2, 1e-2)}


def _sizes(**extra: Any) -> dict[str, Any]:
    return dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        max_position_embeddings=64,
        use_cache=False,
        tie_word_embeddings=False,
        **extra,
    )


def _llama(attn: str) -> Callable[[], Any]:
    def build() -> Any:
        import transformers as t

        return t.LlamaForCausalLM(t.LlamaConfig(**_sizes(num_key_value_heads=KV_HEADS), attn_implementation=attn))

    return build


def _mistral() -> Any:
    import transformers as t

    return t.MistralForCausalLM(
        t.MistralConfig(
            **_sizes(num_key_value_heads=KV_HEADS, head_dim=HIDDEN // HEADS, sliding_window=WINDOW),
            attn_implementation="sdpa",
        )
    )


def _qwen2() -> Any:
    import transformers as t

    return t.Qwen2ForCausalLM(t.Qwen2Config(**_sizes(num_key_value_heads=KV_HEADS), attn_implementation="sdpa"))


def _gemma2() -> Any:
    import transformers as t

    # As released: tanh soft-capping of attention scores and final logits, sliding and full layers alternating;
    # eager attention, which HF recommends for Gemma-2 because SDPA cannot soft-cap.
    cfg = t.Gemma2Config(
        **_sizes(
            num_key_value_heads=KV_HEADS,
            head_dim=HIDDEN // HEADS,
            query_pre_attn_scalar=HIDDEN // HEADS,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"],
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
            pad_token_id=0,
        ),
        attn_implementation="eager",
    )
    return t.Gemma2ForCausalLM(cfg)


def _phi3() -> Any:
    import transformers as t

    # Phi-3's default special tokens (32000) lie outside the tiny vocabulary.
    return t.Phi3ForCausalLM(
        t.Phi3Config(
            **_sizes(num_key_value_heads=KV_HEADS, pad_token_id=0, bos_token_id=1, eos_token_id=2),
            attn_implementation="sdpa",
        )
    )


def _gpt_neox() -> Any:
    import transformers as t

    # Rotary on a quarter of each head's dimensions (the released default): a partial-rotary model.
    cfg = t.GPTNeoXConfig(
        **_sizes(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}),
        attn_implementation="sdpa",
    )
    return t.GPTNeoXForCausalLM(cfg)


def _gpt2() -> Any:
    import transformers as t

    cfg = t.GPT2Config(
        vocab_size=VOCAB,
        n_embd=HIDDEN,
        n_layer=LAYERS,
        n_head=HEADS,
        n_positions=64,
        use_cache=False,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=1,
        eos_token_id=2,
        attn_implementation="eager",
    )
    return t.GPT2LMHeadModel(cfg)


def _mixtral() -> Any:
    import transformers as t

    cfg = t.MixtralConfig(
        **_sizes(num_key_value_heads=KV_HEADS, head_dim=HIDDEN // HEADS, num_local_experts=4, num_experts_per_tok=2),
        attn_implementation="sdpa",
    )
    return t.MixtralForCausalLM(cfg)


def _bert() -> Any:
    import transformers as t

    cfg = t.BertConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        intermediate_size=2 * HIDDEN,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=CLASSES,
        pad_token_id=0,
        use_cache=False,
        attn_implementation="sdpa",
    )
    return t.BertForSequenceClassification(cfg)


BUILDERS: dict[str, Callable[[], Any]] = {
    "Llama (sdpa)": _llama("sdpa"),
    "Llama (eager)": _llama("eager"),
    "Mistral (sliding window 8)": _mistral,
    "Qwen2": _qwen2,
    "Gemma-2 (soft-capping, eager)": _gemma2,
    "Phi-3": _phi3,
    "GPT-NeoX (partial rotary)": _gpt_neox,
    "GPT-2 (eager)": _gpt2,
    "Mixtral (MoE)": _mixtral,
    "BERT classifier": _bert,
}
CLASSIFIERS = {"BERT classifier"}


@dataclass(frozen=True)
class Row:
    model: str
    variant: str
    checkpointing: bool = False
    mode: Mode = "train"
    seq: int = SEQ
    padding: bool = False  # an attention mask: left padding in the first row, right padding in the second

    def label(self) -> str:
        extra = (f" | {self.seq} tokens" if self.seq != SEQ else "") + (" | padded" if self.padding else "")
        return f"{self.model} | {self.variant} | checkpointing {'on' if self.checkpointing else 'off'} | {self.mode}{extra}"


def _more() -> Any:
    import hf_more  # architectures beyond the matrix, built generically (it reads this module's sizes)

    return hf_more


def build(row: Row) -> Any:
    torch.manual_seed(0)
    builder = BUILDERS.get(row.model) or _more().BUILDERS[row.model]
    model = builder()
    if row.checkpointing:
        with warnings.catch_warnings():  # transformers 5 calls it deprecated; it is still what users call
            warnings.simplefilter("ignore", FutureWarning)
            model.gradient_checkpointing_enable()
    return model.train(row.mode != "eval")


def batch(row: Row) -> dict[str, torch.Tensor]:
    """Token ids and labels; causal LMs get labels with ignored (-100) tokens, shifted inside the model."""
    g = torch.Generator().manual_seed(1)
    if row.model not in BUILDERS and row.model in _more().VISION:
        return _more().vision_batch(g)
    if row.model not in BUILDERS and row.model in _more().AUDIO:
        return _more().audio_batch(g)
    if row.model in _more().MULTIMODAL:
        return _more().MULTIMODAL[row.model][1](g)
    if row.model not in BUILDERS and row.model in _more().SEQ2SEQ:
        return _more().seq2seq_batch(g)
    seq = row.seq
    ids = torch.randint(3, VOCAB, (BATCH, seq), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :4], mask[1, seq - 3 :] = 0, 0  # a left-padded row and a right-padded one
    padding = {"attention_mask": mask} if row.padding else {}
    if row.model in CLASSIFIERS or (row.model not in BUILDERS and row.model in _more().CLASSIFIERS):
        return {"input_ids": ids, "labels": torch.randint(0, CLASSES, (BATCH,), generator=g), **padding}
    labels = ids.clone()
    labels[0, 3] = labels[0, seq // 2 + 1] = -100  # one ignored token on each half of the sequence
    labels[1, : seq // 4] = -100  # a prompt whose tokens are not trained on
    if row.padding:
        labels = labels.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "labels": labels, **padding}


def _step(model: Any, inputs: dict[str, torch.Tensor], mode: Mode) -> dict[str, Any]:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "bf16"):
        if mode == "eval":
            with torch.no_grad():
                out = model(**inputs)
        else:
            out = model(**inputs)
    # The logits are a sequence-shaped output (a classifier's are [B, classes]): whole on every rank, by contract.
    # CLIP and SigLIP score images against captions: logits_per_image.
    logits = out.logits if "logits" in out else out.logits_per_image
    result = {"loss": out.loss.detach().float(), "logits": logits.detach().float(), "grads": {}}
    if mode != "eval":
        out.loss.backward()
        params = model._orig_mod if hasattr(model, "_orig_mod") else model
        result["grads"] = {n: p.grad.clone() for n, p in params.named_parameters() if p.grad is not None}
    return result


def run_row(
    rank: int, world: int, row: Row, backend: str = "aot_eager", options: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Pool task: the single-device eager step and the AutoSP step of ``row``, with what the reports say.

    ``options`` go to ``autosp.compile`` as well (the tests break the engine on purpose through them).
    """
    torch._dynamo.reset()
    model = build(row)
    inputs = batch(row)
    # The same generator state for both runs: a model that draws (PhiMoE's router jitter) draws alike.
    torch.manual_seed(0)
    ref = _step(copy.deepcopy(model), inputs, row.mode)
    start = time.perf_counter()
    compiled = autosp.compile(model, variant=row.variant, backend=backend, **(options or {}))
    torch.manual_seed(0)
    with caches_off():
        got = _step(compiled, inputs, row.mode)
    reports = compiled.autosp_reports
    return {
        "ref": ref,
        "sp": got,
        "seconds": time.perf_counter() - start,
        "graphs": len(reports),
        "sites": sum(len(r.sites) for r in reports),
        "fallbacks": [f for r in reports for f in r.fallbacks],
        "notes": [n for r in reports for n in r.notes],
        "sharded": [r.seq_len for r in reports],
    }


@dataclass(frozen=True)
class Outcome:
    kind: Kind
    detail: str  # the refusal verbatim, the bug's error, or what the reports said for an exact row
    seconds: float
    gathered: tuple[str, ...] = ()  # ops without a sharding rule, run on gathered inputs (exact, slower)

    def cell(self) -> str:
        text = self.detail.replace("|", "\\|").replace("\n", " ")
        return {"exact": f"exact ({text})", "refused": f"refused: {text}", "bug": f"BUG: {text}"}[self.kind]


def _differences(got: dict[str, Any], ref: dict[str, Any], mode: Mode) -> list[str]:
    (lr, la), (gr, ga) = TOLERANCES[mode]
    problems = []
    tr, ta = LOGITS_TOLERANCES[mode]
    pairs = [
        ("loss", got["loss"], ref["loss"], lr, la),
        ("logits", got["logits"], ref["logits"], tr, ta * ref["logits"].abs().max().item()),
    ]
    if got["grads"].keys() != ref["grads"].keys():
        missing = sorted(ref["grads"].keys() - got["grads"].keys())
        extra = sorted(got["grads"].keys() - ref["grads"].keys())
        problems.append(f"parameters with a gradient differ: missing {missing[:4]}, extra {extra[:4]}")
    scale = max((g.abs().max().item() for g in ref["grads"].values()), default=0.0)
    for name in sorted(ref["grads"].keys() & got["grads"].keys()):
        # atol relative to the largest gradient anywhere, as autosp.verify does, for bf16. For fp32, relative to
        # this parameter's largest when that is above 1: rounding is relative to the summands' size, and an
        # element summed from terms of 1e4 (DeiT's [CLS] token) differs in its 1e-4s whatever the order.
        own = ref["grads"][name].abs().max().item() if ref["grads"][name].numel() else 0.0
        atol = ga * (scale if mode == "bf16" else max(1.0, own))
        pairs.append((f"grad {name}", got["grads"][name], ref["grads"][name], gr, atol))
    for what, a, b, rtol, atol in pairs:
        if a.shape != b.shape:
            problems.append(f"{what}: shape {list(a.shape)} vs single-device {list(b.shape)}")
            continue
        err = (a.float() - b.float()).abs()
        bad = ~(err <= atol + rtol * b.float().abs())
        if bad.any():
            problems.append(
                f"{what}: max abs error {err.max().item():.3g} at {bad.sum().item()} of {bad.numel()} "
                f"elements (rtol {rtol:g}, atol {atol:g})"
            )
    return problems


def classify(row: Row, per_rank: list[Any], seconds: float) -> Outcome:
    """What ``run_row``'s per-rank results say: exact, a clear refusal, or a bug."""
    errors = [v for v in per_rank if isinstance(v, RankError)]
    if errors:
        first = errors[0]
        same = len(errors) == len(per_rank) and len({(e.type_name, e.message) for e in errors}) == 1
        if same and first.is_a("AutoSPError"):
            return Outcome("refused", f"{first.type_name}: {first.message}", seconds)
        kinds = sorted(
            {f"rank {r}: {v.type_name}: {v.message[:400]}" for r, v in enumerate(per_rank) if isinstance(v, RankError)}
        )
        return Outcome("bug", f"{'; '.join(kinds)}\n{first.traceback[-2500:]}", seconds)
    for rank, res in enumerate(per_rank):
        problems = _differences(res["sp"], res["ref"], row.mode)
        if problems:
            return Outcome(
                "bug",
                f"rank {rank} differs from single-device eager: {'; '.join(problems[:5])}"
                + (f" (+{len(problems) - 5} more)" if len(problems) > 5 else ""),
                seconds,
            )
    first = per_rank[0]
    gathers = f", {len(first['fallbacks'])} ops gathered" if first["fallbacks"] else ""
    kept = ", attention kept as written" if any("kept as written" in n for n in first["notes"]) else ""
    kept += ", uneven pieces" if any("is not divisible by sp_size" in n for n in first["notes"]) else ""
    # A graph that shards nothing runs whole on every rank: exact, but not sequence-parallel; say so.
    sharded = sum(s is not None for s in first["sharded"])
    return Outcome(
        "exact",
        f"{sharded} of {first['graphs']} graphs sharded, {first['sites']} attention sites{kept}{gathers}",
        seconds,
        tuple(first["fallbacks"]),
    )


def check_row(
    pool: SPMDPool, row: Row, *, backend: str = "aot_eager", timeout_s: float = 300.0, **options: Any
) -> Outcome:
    """Run ``row`` on every rank of ``pool`` and classify it; ``options`` go to ``autosp.compile``."""
    start = time.perf_counter()
    try:
        per_rank = pool.run(run_row, row, backend, options, timeout_s=timeout_s)
    except PoolTimeout as e:
        return Outcome("bug", f"hang or crash: {e}", time.perf_counter() - start)
    return classify(row, per_rank, time.perf_counter() - start)


def matrix_rows(variants: tuple[str, ...] = ("ulysses", "ring")) -> list[Row]:
    """Every model with checkpointing off and on under each variant, then Llama's bf16 and eval runs."""
    rows = [Row(m, v, ckpt) for m in BUILDERS for v in variants for ckpt in (False, True)]
    rows += [Row("Llama (sdpa)", v, False, mode) for mode in ("bf16", "eval") for v in variants]
    return rows


__all__ = ["BUILDERS", "Outcome", "Row", "batch", "build", "check_row", "classify", "matrix_rows", "run_row"]
