"""Hugging Face architectures beyond the matrix, each built the same generic way, for breadth.

The matrix (``hf_matrix.py``) writes each config by hand. These come from
``AutoConfig.for_model(model_type)`` with the matrix's tiny sizes set wherever the config has the
field (hidden 32, 2 layers, 4 heads, 2 kv heads, vocab 128), every float dropout set to 0 and the
attention implementation chosen: nobody here wrote for these models, so they stand in for what a
new user brings. ``hf_matrix.build`` finds them by name, so every matrix tool runs them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import hf_matrix as hm
import torch

IMAGE = 32  # pixels a side; the vision models cut it into 4 x 4 patches

# name -> (model_type, attention implementation, task)
ARCHITECTURES: dict[str, tuple[str, str, str]] = {
    "Falcon": ("falcon", "sdpa", "lm"),
    "OPT (eager)": ("opt", "eager", "lm"),
    "GPT-J (partial rotary)": ("gptj", "sdpa", "lm"),
    "Gemma": ("gemma", "sdpa", "lm"),
    "Gemma-3 (sliding window 8)": ("gemma3_text", "sdpa", "lm"),
    "Qwen3": ("qwen3", "sdpa", "lm"),
    "Qwen3-MoE": ("qwen3_moe", "sdpa", "lm"),
    "StableLM": ("stablelm", "sdpa", "lm"),
    "Starcoder2": ("starcoder2", "sdpa", "lm"),
    "OLMo-2": ("olmo2", "sdpa", "lm"),
    "OLMoE": ("olmoe", "sdpa", "lm"),
    "Cohere (parallel block)": ("cohere", "sdpa", "lm"),
    "Granite": ("granite", "sdpa", "lm"),
    "Persimmon": ("persimmon", "sdpa", "lm"),
    "Phi (eager)": ("phi", "eager", "lm"),
    "MPT (eager, ALiBi)": ("mpt", "eager", "lm"),
    "CodeGen (eager)": ("codegen", "eager", "lm"),
    "GPT-Neo (eager, local attention)": ("gpt_neo", "eager", "lm"),
    "GPTBigCode (MQA)": ("gpt_bigcode", "sdpa", "lm"),
    "XGLM (eager)": ("xglm", "eager", "lm"),
    "BLOOM (ALiBi in baddbmm)": ("bloom", "eager", "lm"),
    "Gemma-3n (AltUp clamps parameters through .data)": ("gemma3n_text", "sdpa", "lm"),
    "PhiMoE (sparsemixer routing draws random numbers)": ("phimoe", "sdpa", "lm"),
    "GPT-OSS (attention sinks, MoE)": ("gpt_oss", "eager", "lm"),
    "DeepSeek-V3 (MLA, MoE)": ("deepseek_v3", "sdpa", "lm"),
    "Llama-4 (text, MoE)": ("llama4_text", "sdpa", "lm"),
    "MiMo-V2-Flash (sinks, sliding window, MoE)": ("mimo_v2_flash", "eager", "lm"),
    "Jamba (Mamba scan + attention, MoE)": ("jamba", "sdpa", "lm"),
    "BioGPT": ("biogpt", "sdpa", "lm"),
    "SmolLM3": ("smollm3", "sdpa", "lm"),
    "GLM": ("glm", "sdpa", "lm"),
    "Nemotron": ("nemotron", "sdpa", "lm"),
    "ERNIE-4.5": ("ernie4_5", "sdpa", "lm"),
    "RoBERTa classifier (eager)": ("roberta", "eager", "classify"),
    "DistilBERT classifier": ("distilbert", "sdpa", "classify"),
    "ModernBERT classifier": ("modernbert", "sdpa", "classify"),
    "ELECTRA classifier": ("electra", "sdpa", "classify"),
    "ALBERT classifier": ("albert", "sdpa", "classify"),
    # Images of 4 x 4 patches: the encoder's sequence is made inside the model, with tokens it adds.
    "ViT classifier ([CLS] + 16 patches: 17 tokens)": ("vit", "sdpa", "vision"),
    "DINOv2 with registers ([CLS], 4 registers + 16 patches: 21 tokens)": ("dinov2_with_registers", "sdpa", "vision"),
    "BEiT (relative position bias, [CLS] + 16 patches)": ("beit", "sdpa", "vision"),
}

_SIZES: dict[str, Any] = dict(
    vocab_size=hm.VOCAB,
    hidden_size=hm.HIDDEN,
    num_hidden_layers=hm.LAYERS,
    num_attention_heads=hm.HEADS,
    intermediate_size=2 * hm.HIDDEN,
    max_position_embeddings=64,
    use_cache=False,
    tie_word_embeddings=False,
)
# Set only where the config has the field (names differ between architectures).
_WHERE_PRESENT: dict[str, Any] = dict(
    num_key_value_heads=hm.KV_HEADS,
    head_dim=hm.HIDDEN // hm.HEADS,
    n_positions=64,
    moe_intermediate_size=hm.HIDDEN,
    num_experts=4,
    num_experts_per_tok=2,
    embedding_size=hm.HIDDEN,
    num_labels=hm.CLASSES,
    pad_token_id=0,
    rotary_dim=4,
    global_attn_every_n_layers=1,
    image_size=IMAGE,
    patch_size=IMAGE // 4,
    num_channels=3,
)


def config(model_type: str, attention: str) -> Any:
    import transformers as t

    cfg = t.AutoConfig.for_model(model_type)
    for key, value in _SIZES.items():
        setattr(cfg, key, value)
    for key, value in _WHERE_PRESENT.items():
        if hasattr(cfg, key):
            try:
                setattr(cfg, key, value)
            except AttributeError:  # a property derived from the sizes above (Falcon's head_dim)
                pass
    for key, value in list(vars(cfg).items()):
        if ("dropout" in key or "pdrop" in key) and isinstance(value, float):
            setattr(cfg, key, 0.0)
    if getattr(cfg, "layer_types", "unset") is None:
        cfg.layer_types = ["full_attention"] * hm.LAYERS
    if model_type == "gemma3_text":
        # Both kinds of layer, as the real model mixes them: its rotary tables are computed in a loop
        # over set(layer_types), whose order differs per process (autosp.canonical).
        cfg.sliding_window = hm.WINDOW
        cfg.layer_types = ["sliding_attention", "full_attention"]
    if model_type == "deepseek_v3":  # MLA: low-rank q and kv, heads split into a rotary and a plain half
        head = hm.HIDDEN // hm.HEADS
        cfg.num_key_value_heads = hm.HEADS
        cfg.update(dict(q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=head // 2, qk_nope_head_dim=head // 2))
        cfg.update(dict(v_head_dim=head, qk_head_dim=head, head_dim=head // 2, moe_intermediate_size=16))
        cfg.update(dict(n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1))
    if model_type == "gemma3n_text":  # per-layer lists; AltUp and Laurel small; no kv sharing at 2 layers
        cfg.update(dict(intermediate_size=[2 * hm.HIDDEN] * hm.LAYERS, num_kv_shared_layers=0, laurel_rank=4))
        cfg.update(dict(activation_sparsity_pattern=[0.0] * hm.LAYERS, altup_num_inputs=2, head_dim=8))
        cfg.update(dict(hidden_size_per_layer_input=8, vocab_size_per_layer_input=hm.VOCAB, sliding_window=hm.WINDOW))
        cfg.layer_types = ["sliding_attention", "full_attention"]
    if model_type == "jamba":  # a Mamba layer (associative_scan under torch.compile: vmap), then attention
        cfg.update(dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1))
        cfg.update(dict(mamba_d_state=4, mamba_dt_rank=4))
    if model_type == "beit":  # a learned [H, S, S] bias over the patches and [CLS], in every layer
        cfg.use_relative_position_bias = True
    if model_type == "gpt_neo":  # one global and one local layer, the local window cutting the sequence
        cfg.attention_types = [[["global", "local"], 1]]
        cfg.attention_layers = ["global", "local"]
        cfg.window_size = hm.WINDOW
    cfg._attn_implementation = attention
    return cfg


def _builder(model_type: str, attention: str, task: str) -> Callable[[], Any]:
    def build() -> Any:
        import transformers as t

        auto = {
            "classify": t.AutoModelForSequenceClassification,
            "vision": t.AutoModelForImageClassification,
        }.get(task, t.AutoModelForCausalLM)
        return auto.from_config(config(model_type, attention))

    return build


BUILDERS: dict[str, Callable[[], Any]] = {name: _builder(*spec) for name, spec in ARCHITECTURES.items()}
CLASSIFIERS = {name for name, (_, _, task) in ARCHITECTURES.items() if task == "classify"}
VISION = {name for name, (_, _, task) in ARCHITECTURES.items() if task == "vision"}


def vision_batch(generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Images and one class label per image."""
    pixels = torch.randn(hm.BATCH, 3, IMAGE, IMAGE, generator=generator)
    return {"pixel_values": pixels, "labels": torch.randint(0, hm.CLASSES, (hm.BATCH,), generator=generator)}


# HF itself raises on gradient_checkpointing_enable() for these.
NO_CHECKPOINTING = frozenset({"ALBERT classifier"})


def more_rows(variants: tuple[str, ...] = ("ulysses", "ring"), checkpointing: bool = False) -> list[hm.Row]:
    """Every architecture above, fp32 training, under each variant (``checkpointing``: HF's
    ``gradient_checkpointing_enable()`` on each)."""
    names = [n for n in ARCHITECTURES if not (checkpointing and n in NO_CHECKPOINTING)]
    return [hm.Row(name, v, checkpointing) for name in names for v in variants]


__all__ = ["ARCHITECTURES", "BUILDERS", "CLASSIFIERS", "config", "more_rows"]
