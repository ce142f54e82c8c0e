"""Hugging Face architectures beyond the matrix, each built the same generic way, for breadth.

The matrix (``hf_matrix.py``) writes each config by hand. These come from
``AutoConfig.for_model(model_type)`` with the matrix's tiny sizes set wherever the config has the
field (hidden 32, 2 layers, 4 heads, 2 kv heads, vocab 128), every float dropout set to 0 and the
attention implementation chosen: nobody here wrote for these models, so they stand in for what a
new user brings. ``hf_matrix.build`` finds them by name, so every matrix tool runs them.

Beyond decoder LMs and BERT-likes: encoders whose attention gathers relative positions or reshapes
the sequence (DeBERTa, Funnel, BigBird, Longformer, CANINE, XLNet), state-space and recurrent LMs and
their hybrids with attention (Mamba, RWKV, Jamba, Bamba, Qwen3-Next), speech classifiers fed raw
waveforms (Wav2Vec2, HuBERT, WavLM, SEW), vision models whose token grid is windowed or reduced
inside (Swin, SegFormer, PVT), encoder-decoders (T5, BART and their kin), and models written out by
hand with their own batches (``MULTIMODAL``): vision-language models whose image tokens the model
places in the text (Qwen2-VL, LLaVA, PaliGemma, Gemma-3, Mistral-3, Idefics3, InternVL), CLIP and
SigLIP (a text and an image tower against each other) and Whisper (speech to text). Where a
family's fields differ from the generic sizes they are written out (``_OVERRIDES``, ``_AUDIO``,
``_LAYER_KINDS``).
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
    # Encoders whose attention is not plain dot products: relative positions gathered by distance,
    # the sequence pooled or downsampled inside, landmarks, Fourier mixing, convolutions, blocks.
    "DeBERTa-v2 (disentangled relative attention)": ("deberta-v2", "eager", "classify"),
    "DeBERTa (disentangled relative attention)": ("deberta", "eager", "classify"),
    "MPNet (relative position bias)": ("mpnet", "eager", "classify"),
    "Funnel (the sequence pooled by 2 between blocks)": ("funnel", "eager", "classify"),
    "ConvBERT (span-based dynamic convolution)": ("convbert", "eager", "classify"),
    "SqueezeBERT (grouped conv1d)": ("squeezebert", "eager", "classify"),
    "Nystromformer (segment-mean landmarks)": ("nystromformer", "eager", "classify"),
    "FNet (Fourier token mixing)": ("fnet", "eager", "classify"),
    "RoFormer": ("roformer", "eager", "classify"),
    "ESM (rotary, protein)": ("esm", "eager", "classify"),
    "BigBird (block sparse, random blocks)": ("big_bird", "eager", "classify"),
    "Longformer (sliding chunks + global)": ("longformer", "eager", "classify"),
    "CANINE (characters downsampled by a strided conv)": ("canine", "eager", "classify"),
    "MobileBERT": ("mobilebert", "eager", "classify"),
    "MRA (multi-resolution blocks)": ("mra", "eager", "classify"),
    "XLNet (relative attention, last-token summary)": ("xlnet", "eager", "classify"),
    # Recurrent and state-space language models: scans, short convolutions, hybrids with attention.
    "Mamba": ("mamba", "eager", "lm"),
    "Mamba-2 (chunked SSD)": ("mamba2", "eager", "lm"),
    "FalconMamba": ("falcon_mamba", "eager", "lm"),
    "RecurrentGemma (RG-LRU + local attention)": ("recurrent_gemma", "sdpa", "lm"),
    "RWKV": ("rwkv", "eager", "lm"),
    "Bamba (Mamba-2 + attention)": ("bamba", "sdpa", "lm"),
    "LFM2 (short convolutions + attention)": ("lfm2", "sdpa", "lm"),
    "Qwen3-Next (gated delta rule + attention, MoE)": ("qwen3_next", "sdpa", "lm"),
    "FalconH1 (parallel Mamba-2 and attention)": ("falcon_h1", "sdpa", "lm"),
    "GraniteMoeHybrid": ("granitemoehybrid", "sdpa", "lm"),
    "MiniMax (lightning attention blocks + attention, MoE)": ("minimax", "sdpa", "lm"),
    "Exaone4": ("exaone4", "sdpa", "lm"),
    "Apertus (xIELU)": ("apertus", "sdpa", "lm"),
    "Doge (dynamic mask attention)": ("doge", "sdpa", "lm"),
    # Speech: 128 samples cut into 16 frames by strided convs, a grouped positional conv, mean-pooled
    # over the frames into a classifier; HF's layerdrop on, SpecAugment off (on in ``specaugment_step``).
    "Wav2Vec2 audio classifier": ("wav2vec2", "eager", "audio"),
    "HuBERT audio classifier": ("hubert", "sdpa", "audio"),
    "WavLM audio classifier (gated relative bias)": ("wavlm", "eager", "audio"),
    "SEW audio classifier (frames squeezed by 2)": ("sew", "eager", "audio"),
    "SEW-D audio classifier (DeBERTa attention)": ("sew-d", "eager", "audio"),
    # Images whose token grid is reshaped inside: shifted windows, merged patches, keys and values
    # from a strided conv over the grid, depthwise convs between attentions.
    "Swin (shifted windows, patch merging)": ("swin", "eager", "vision"),
    "Swin-v2 (cosine attention, log-spaced bias)": ("swinv2", "eager", "vision"),
    "SegFormer (spatial-reduction attention)": ("segformer", "eager", "vision"),
    "PVT (spatial-reduction attention)": ("pvt", "eager", "vision"),
    "PVT-v2 (overlapping patches, depthwise conv FFN)": ("pvt_v2", "eager", "vision"),
    "DeiT (distillation token)": ("deit", "eager", "vision"),
    # Encoder-decoders (16 source tokens, 12 target tokens): the encoder's sequence, the longer, is
    # sharded; the decoder's self-attention runs whole and its cross-attention keeps the memory whole.
    "T5 (relative position buckets)": ("t5", "eager", "seq2seq"),
    "mT5": ("mt5", "eager", "seq2seq"),
    "UMT5 (a bias per layer)": ("umt5", "eager", "seq2seq"),
    "LongT5 (transient-global local attention)": ("longt5", "eager", "seq2seq"),
    "SwitchTransformers (T5 with top-1 experts)": ("switch_transformers", "eager", "seq2seq"),
    "BART": ("bart", "sdpa", "seq2seq"),
    "mBART": ("mbart", "sdpa", "seq2seq"),
    "Marian": ("marian", "sdpa", "seq2seq"),
    "Pegasus (sinusoidal positions)": ("pegasus", "sdpa", "seq2seq"),
    "PegasusX (staggered blocks, global tokens)": ("pegasus_x", "eager", "seq2seq"),
    "PLBart": ("plbart", "sdpa", "seq2seq"),
    "Blenderbot": ("blenderbot", "sdpa", "seq2seq"),
    "M2M100": ("m2m_100", "sdpa", "seq2seq"),
    "NLLB-MoE": ("nllb-moe", "eager", "seq2seq"),
    "LED (Longformer encoder)": ("led", "eager", "seq2seq"),
    "BigBirdPegasus": ("bigbird_pegasus", "eager", "seq2seq"),
    "ProphetNet (n-gram streams)": ("prophetnet", "eager", "seq2seq"),
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


# Per-stage lists for the hierarchical vision models: two stages over a 32-pixel image (8 x 8 tokens,
# then 4 x 4), one block each.
_STAGES: dict[str, Any] = dict(
    depths=[1, 1],
    num_encoder_blocks=2,
    hidden_sizes=[16, 32],
    num_attention_heads=[1, 2],
    mlp_ratios=[2, 2],
    strides=[4, 2],
)
# Written out where the generic sizes above do not fit the architecture.
_OVERRIDES: dict[str, dict[str, Any]] = {
    "funnel": dict(block_sizes=[1, 1], d_model=hm.HIDDEN, n_head=hm.HEADS, d_head=8, d_inner=64, num_decoder_layers=1),
    "xlnet": dict(d_model=hm.HIDDEN, n_layer=hm.LAYERS, n_head=hm.HEADS, d_head=8, d_inner=64, mem_len=None),
    "deberta-v2": dict(
        pooler_hidden_size=hm.HIDDEN,
        relative_attention=True,
        position_buckets=8,
        pos_att_type=["p2c", "c2p"],
        max_relative_positions=16,
    ),
    "deberta": dict(
        pooler_hidden_size=hm.HIDDEN, relative_attention=True, pos_att_type=["p2c", "c2p"], max_relative_positions=16
    ),
    "canine": dict(downsampling_rate=2, num_hash_buckets=64, local_transformer_stride=8, upsampling_kernel_size=2),
    "big_bird": dict(block_size=2, num_random_blocks=1),
    "longformer": dict(attention_window=[4, 4]),
    "mobilebert": dict(embedding_size=16, intra_bottleneck_size=16, true_hidden_size=16, num_feedforward_networks=2),
    "recurrent_gemma": dict(lru_width=hm.HIDDEN, head_dim=8, attention_window_size=hm.WINDOW, vocab_size=hm.VOCAB),
    "mamba2": dict(num_heads=4, head_dim=16, state_size=8, n_groups=1, chunk_size=4, expand=2),
    "bamba": dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_chunk_size=4, attn_layer_indices=[1]),
    "falcon_h1": dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_ssm=64, mamba_d_state=8, mamba_chunk_size=4),
    "granitemoehybrid": dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_chunk_size=4),
    "qwen3_next": dict(
        linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4
    ),
    "minimax": dict(block_size=4),
    "rwkv": dict(attention_hidden_size=hm.HIDDEN, intermediate_size=2 * hm.HIDDEN, context_length=64),
    "xlstm": dict(embedding_dim=hm.HIDDEN, num_blocks=hm.LAYERS, num_heads=hm.HEADS, mode="train"),
    "swin": dict(patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 4], window_size=4, num_layers=2),
    "swinv2": dict(patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 4], window_size=4, num_layers=2),
    "segformer": dict(_STAGES, sr_ratios=[2, 1], patch_sizes=[7, 3], decoder_hidden_size=hm.HIDDEN),
    "pvt": dict(_STAGES, sequence_reduction_ratios=[2, 1], patch_sizes=[4, 2]),
    "pvt_v2": dict(_STAGES, sr_ratios=[2, 1], patch_sizes=[7, 3]),
    "deit": dict(architectures=["DeiTForImageClassification"]),  # not the teacher's head, which has no loss
}
_AUDIO: dict[str, Any] = dict(
    conv_dim=[16, 16],
    conv_kernel=[4, 2],
    conv_stride=[4, 2],
    num_feat_extract_layers=2,
    num_conv_pos_embeddings=4,
    num_conv_pos_embedding_groups=4,
    classifier_proj_size=16,
    mask_time_prob=0.0,
    position_buckets=8,
    max_position_embeddings=16,
)
AUDIO_SAMPLES = 128  # cut by the strides (4, 2) into 16 frames
# Encoder-decoders' own names for the sizes, set where the config has them.
_SEQ2SEQ: dict[str, Any] = dict(
    d_ff=2 * hm.HIDDEN,
    d_kv=hm.HIDDEN // hm.HEADS,
    num_decoder_layers=hm.LAYERS,
    encoder_layers=hm.LAYERS,
    decoder_layers=hm.LAYERS,
    decoder_attention_heads=hm.HEADS,
    encoder_ffn_dim=2 * hm.HIDDEN,
    decoder_ffn_dim=2 * hm.HIDDEN,
    decoder_vocab_size=hm.VOCAB,
    relative_attention_num_buckets=8,
    expert_capacity=64,
    ngram=2,
    attention_window=4,
    block_size=4,
    num_random_blocks=1,
)
TARGET = 12  # target tokens of the encoder-decoders, after 16 source tokens
# Hybrids' layer kinds, one per layer: one of each kind (the defaults list dozens of layers).
_LAYER_KINDS: dict[str, list[str]] = {
    "qwen3_next": ["linear_attention", "full_attention"],
    "minimax": ["linear_attention", "full_attention"],
    "lfm2": ["conv", "full_attention"],
    "granitemoehybrid": ["linear_attention", "full_attention"],
}


def config(model_type: str, attention: str) -> Any:
    import transformers as t

    cfg = t.AutoConfig.for_model(model_type)
    for key, value in _SIZES.items():
        if key in _OVERRIDES.get(model_type, {}):
            continue
        try:
            setattr(cfg, key, value)
        except NotImplementedError:  # XLNet has no position limit and raises on setting one
            pass
    for key, value in _WHERE_PRESENT.items():
        if hasattr(cfg, key) and key not in _OVERRIDES.get(model_type, {}):
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
    if model_type in ("wav2vec2", "hubert", "wavlm", "sew", "sew-d"):
        cfg.update({k: v for k, v in _AUDIO.items() if hasattr(cfg, k)})
    if cfg.is_encoder_decoder:
        cfg.update({k: v for k, v in _SEQ2SEQ.items() if hasattr(cfg, k)})
        cfg.update(dict(pad_token_id=0, decoder_start_token_id=1))  # T5's config lacks the second
    cfg.update(_OVERRIDES.get(model_type, {}))
    if model_type in _LAYER_KINDS:
        cfg.layer_types = _LAYER_KINDS[model_type]
    cfg._attn_implementation = attention
    return cfg


def _builder(model_type: str, attention: str, task: str) -> Callable[[], Any]:
    def build() -> Any:
        import transformers as t

        auto = {
            "classify": t.AutoModelForSequenceClassification,
            "vision": t.AutoModelForImageClassification,
            "audio": t.AutoModelForAudioClassification,
            "seq2seq": t.AutoModelForSeq2SeqLM,
        }.get(task, t.AutoModelForCausalLM)
        return auto.from_config(config(model_type, attention))

    return build


def _qwen2_vl() -> Any:
    """Qwen2-VL: a vision tower's 4 merged tokens per image scattered into the text at its image
    tokens, and multimodal rotary positions (M-RoPE: time, height, width) computed from them."""
    import transformers as t

    text = dict(_SIZES, num_key_value_heads=hm.KV_HEADS, vocab_size=QWEN2_VL_VOCAB, max_position_embeddings=128)
    text["rope_scaling"] = {"type": "mrope", "mrope_section": [1, 1, 2]}
    vision = dict(depth=1, embed_dim=16, hidden_size=hm.HIDDEN, num_heads=2, patch_size=4, spatial_merge_size=2)
    vision.update(temporal_patch_size=2, in_chans=3, mlp_ratio=2)
    cfg = t.Qwen2VLConfig(text_config=text, vision_config=vision, **dict(zip(_QWEN2_VL_TOKENS, range(150, 154))))
    cfg._attn_implementation = "sdpa"
    return t.Qwen2VLForConditionalGeneration(cfg)


QWEN2_VL = "Qwen2-VL (image tokens merged into the text, M-RoPE)"
QWEN2_VL_VOCAB = 160
_QWEN2_VL_TOKENS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


def qwen2_vl_batch(generator: torch.Generator) -> dict[str, torch.Tensor]:
    """One 16 x 16 image per row (4 x 4 patches of 4, merged 2 x 2 into 4 tokens) between its start
    and end tokens, in 16 tokens of text; the image's tokens are not trained on."""
    ids = torch.randint(1, 140, (hm.BATCH, hm.SEQ), generator=generator)
    ids[:, 1], ids[:, 2:6], ids[:, 6] = 152, 150, 153
    pixels = torch.randn(hm.BATCH * 16, 3 * 2 * 4 * 4, generator=generator)
    labels = ids.masked_fill(ids >= 150, -100)
    grid = torch.tensor([[1, 4, 4]] * hm.BATCH)
    return {
        "input_ids": ids,
        "pixel_values": pixels,
        "image_grid_thw": grid,
        "labels": labels,
        "mm_token_type_ids": (ids == 150).long(),
    }


VLM_VOCAB = 160
IMAGE_TOKEN = 150
VLM_IMAGE = 8  # pixels a side, in patches of 4: 2 x 2 patches, 4 image tokens in the text (twice it: 4 x 4)


def _vision_tower(kind: str, layers: int) -> Any:
    import transformers as t

    sizes = dict(hidden_size=hm.HIDDEN, intermediate_size=2 * hm.HIDDEN, num_hidden_layers=layers)
    sizes.update(num_attention_heads=hm.HEADS, image_size=VLM_IMAGE, patch_size=VLM_IMAGE // 2)
    return t.CLIPVisionConfig(**sizes) if kind == "clip" else t.SiglipVisionConfig(**sizes)


def _text(config_class: str) -> Any:
    import transformers as t

    sizes = dict(_SIZES, num_key_value_heads=hm.KV_HEADS, head_dim=hm.HIDDEN // hm.HEADS, vocab_size=VLM_VOCAB)
    return getattr(t, config_class)(**sizes)


def _llava() -> Any:
    """LLaVA: a CLIP tower's patch features (its last layer's input: vision_feature_layer=-2, read from
    the hidden states transformers captures by hooks it registers on the first call) projected into a
    Llama's text at its image tokens."""
    import transformers as t

    cfg = t.LlavaConfig(
        vision_config=_vision_tower("clip", 2), text_config=_text("LlamaConfig"), image_token_index=IMAGE_TOKEN
    )
    cfg.image_seq_length = 4
    cfg._attn_implementation = "sdpa"
    return t.LlavaForConditionalGeneration(cfg)


def _paligemma() -> Any:
    """PaliGemma: a SigLIP tower's tokens as a prefix that attends both ways with the prompt (a prefix-LM
    mask from ``token_type_ids``), the answer causally."""
    import transformers as t

    cfg = t.PaliGemmaConfig(
        vision_config=_vision_tower("siglip", 1),
        text_config=_text("GemmaConfig"),
        image_token_index=IMAGE_TOKEN,
        vocab_size=VLM_VOCAB,
        projection_dim=hm.HIDDEN,
        hidden_size=hm.HIDDEN,
    )
    cfg.text_config.num_image_tokens = cfg.vision_config.num_image_tokens = 4
    cfg._attn_implementation = "sdpa"
    return t.PaliGemmaForConditionalGeneration(cfg)


def _gemma3() -> Any:
    """Gemma-3 with images: a SigLIP tower's 16 patches average-pooled into 4 tokens, which attend to each
    other both ways inside the causal text (``token_type_ids``)."""
    import transformers as t

    vision = _vision_tower("siglip", 1)
    vision.image_size = 2 * VLM_IMAGE  # 4 x 4 patches, pooled 2 x 2
    text = _text("Gemma3TextConfig")
    text.layer_types = ["sliding_attention", "full_attention"]
    text.sliding_window = hm.WINDOW
    cfg = t.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=IMAGE_TOKEN)
    cfg.boi_token_index, cfg.eoi_token_index = IMAGE_TOKEN + 1, IMAGE_TOKEN + 2
    cfg._attn_implementation = "sdpa"
    return t.Gemma3ForConditionalGeneration(cfg)


def _mistral3() -> Any:
    """Mistral-3: a Pixtral tower (2-D rotary positions over the patch grid) whose 4 x 4 patches are
    merged 2 x 2 into 4 tokens, in a Mistral's text."""
    import transformers as t

    vision = t.PixtralVisionConfig(
        hidden_size=hm.HIDDEN,
        intermediate_size=2 * hm.HIDDEN,
        num_hidden_layers=1,
        num_attention_heads=hm.HEADS,
        head_dim=hm.HIDDEN // hm.HEADS,
        image_size=2 * VLM_IMAGE,
        patch_size=VLM_IMAGE // 2,
    )
    cfg = t.Mistral3Config(
        vision_config=vision, text_config=_text("MistralConfig"), image_token_index=IMAGE_TOKEN, spatial_merge_size=2
    )
    cfg.vision_feature_layer = -1
    cfg._attn_implementation = "sdpa"
    return t.Mistral3ForConditionalGeneration(cfg)


def _idefics3() -> Any:
    """Idefics3 (SmolVLM's base): a SigLIP-like tower's 4 x 4 patches pixel-shuffled by 2 into 4 tokens."""
    import transformers as t

    vision = t.Idefics3VisionConfig(
        hidden_size=hm.HIDDEN,
        intermediate_size=2 * hm.HIDDEN,
        num_hidden_layers=1,
        num_attention_heads=hm.HEADS,
        image_size=2 * VLM_IMAGE,
        patch_size=VLM_IMAGE // 2,
    )
    cfg = t.Idefics3Config(
        vision_config=vision, text_config=_text("LlamaConfig"), image_token_id=IMAGE_TOKEN, scale_factor=2
    )
    cfg._attn_implementation = "sdpa"
    return t.Idefics3ForConditionalGeneration(cfg)


def _internvl() -> Any:
    """InternVL: an InternViT tower (layer scale, [CLS] dropped) pixel-shuffled by 2 into 4 tokens, in a
    Qwen2's text."""
    import transformers as t

    vision = t.InternVLVisionConfig(
        hidden_size=hm.HIDDEN,
        intermediate_size=2 * hm.HIDDEN,
        num_hidden_layers=1,
        num_attention_heads=hm.HEADS,
        image_size=[2 * VLM_IMAGE] * 2,
        patch_size=[VLM_IMAGE // 2] * 2,
    )
    cfg = t.InternVLConfig(
        vision_config=vision,
        text_config=_text("Qwen2Config"),
        image_token_id=IMAGE_TOKEN,
        image_seq_length=4,
        vision_feature_layer=-1,
    )
    cfg._attn_implementation = "sdpa"
    return t.InternVLForConditionalGeneration(cfg)


def idefics3_batch(generator: torch.Generator) -> dict[str, torch.Tensor]:
    batch = llava_batch(generator)
    batch["pixel_values"] = torch.randn(hm.BATCH, 1, 3, 2 * VLM_IMAGE, 2 * VLM_IMAGE, generator=generator)
    return batch


def internvl_batch(generator: torch.Generator) -> dict[str, torch.Tensor]:
    batch = llava_batch(generator)
    batch["pixel_values"] = torch.randn(hm.BATCH, 3, 2 * VLM_IMAGE, 2 * VLM_IMAGE, generator=generator)
    return batch


def _contrastive(kind: str) -> Callable[[], Any]:
    """CLIP or SigLIP: a text tower and a vision tower, each pooled, against each other by a contrastive
    loss over the batch (softmax for CLIP, pairwise sigmoid for SigLIP)."""

    def build() -> Any:
        import transformers as t

        text = dict(
            vocab_size=hm.VOCAB,
            hidden_size=hm.HIDDEN,
            intermediate_size=2 * hm.HIDDEN,
            num_hidden_layers=1,
            num_attention_heads=hm.HEADS,
            max_position_embeddings=64,
        )
        vision = _vision_tower(kind, 1)
        vision.image_size = 2 * VLM_IMAGE
        if kind == "clip":
            cfg = t.CLIPConfig(text_config=t.CLIPTextConfig(**text), vision_config=vision, projection_dim=hm.HIDDEN)
            cfg._attn_implementation = "sdpa"
            return t.CLIPModel(cfg)
        cfg = t.SiglipConfig(text_config=t.SiglipTextConfig(**text), vision_config=vision)
        cfg._attn_implementation = "sdpa"
        return t.SiglipModel(cfg)

    return build


def contrastive_batch(generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Captions of 16 tokens (the last one CLIP's end-of-text, pooled) and 16 x 16 images."""
    ids = torch.randint(1, hm.VOCAB - 1, (hm.BATCH, hm.SEQ), generator=generator)
    ids[:, -1] = hm.VOCAB - 1
    pixels = torch.randn(hm.BATCH, 3, 2 * VLM_IMAGE, 2 * VLM_IMAGE, generator=generator)
    return {"input_ids": ids, "pixel_values": pixels, "return_loss": True}


def _whisper() -> Any:
    """Whisper: 32 frames of 8 mel bins, halved by a strided conv into 16 encoder tokens; a decoder
    cross-attends to them."""
    import transformers as t

    cfg = t.WhisperConfig(vocab_size=hm.VOCAB, num_mel_bins=8, d_model=hm.HIDDEN, encoder_attention_heads=hm.HEADS)
    cfg.update({k: v for k, v in _SEQ2SEQ.items() if hasattr(cfg, k)})
    cfg.update(dict(max_source_positions=hm.SEQ, max_target_positions=32, use_cache=False))
    cfg.update(dict(pad_token_id=0, decoder_start_token_id=1))
    cfg._attn_implementation = "sdpa"
    return t.WhisperForConditionalGeneration(cfg)


def whisper_batch(generator: torch.Generator) -> dict[str, torch.Tensor]:
    labels = torch.randint(3, hm.VOCAB, (hm.BATCH, TARGET), generator=generator)
    labels[1, :2] = -100
    return {"input_features": torch.randn(hm.BATCH, 8, 2 * hm.SEQ, generator=generator), "labels": labels}


def gemma3_batch(generator: torch.Generator) -> dict[str, torch.Tensor]:
    batch = llava_batch(generator)
    batch["pixel_values"] = torch.randn(hm.BATCH, 3, 2 * VLM_IMAGE, 2 * VLM_IMAGE, generator=generator)
    batch["token_type_ids"] = (batch["input_ids"] == IMAGE_TOKEN).long()
    return batch


def mistral3_batch(generator: torch.Generator) -> dict[str, torch.Tensor]:
    batch = gemma3_batch(generator)
    del batch["token_type_ids"]
    batch["image_sizes"] = torch.tensor([[2 * VLM_IMAGE, 2 * VLM_IMAGE]] * hm.BATCH)
    return batch


def llava_batch(generator: torch.Generator) -> dict[str, torch.Tensor]:
    """An 8 x 8 image per row, its 4 tokens after a first text token, in 16 tokens; the image's tokens
    are not trained on."""
    ids = torch.randint(1, IMAGE_TOKEN - 10, (hm.BATCH, hm.SEQ), generator=generator)
    ids[:, 1:5] = IMAGE_TOKEN
    pixels = torch.randn(hm.BATCH, 3, VLM_IMAGE, VLM_IMAGE, generator=generator)
    return {"input_ids": ids, "pixel_values": pixels, "labels": ids.masked_fill(ids == IMAGE_TOKEN, -100)}


def paligemma_batch(generator: torch.Generator) -> dict[str, torch.Tensor]:
    """The image's 4 tokens first, a prompt of 6 tokens (both seen both ways, not trained on), then an
    answer of 6 that is trained on, as PaliGemma's processor lays them out."""
    ids = torch.randint(1, IMAGE_TOKEN - 10, (hm.BATCH, hm.SEQ), generator=generator)
    ids[:, :4] = IMAGE_TOKEN
    token_type_ids = torch.zeros_like(ids)
    token_type_ids[:, 10:] = 1  # the answer (suffix)
    labels = ids.masked_fill(token_type_ids == 0, -100)
    pixels = torch.randn(hm.BATCH, 3, VLM_IMAGE, VLM_IMAGE, generator=generator)
    return {"input_ids": ids, "pixel_values": pixels, "token_type_ids": token_type_ids, "labels": labels}


LLAVA = "LLaVA (CLIP features from the second-to-last layer into Llama's text)"
PALIGEMMA = "PaliGemma (SigLIP prefix, prefix-LM mask from token_type_ids)"
# Written out with their own batches: vision-language models (an image's tokens placed in the text by
# the model), two-tower contrastive models, speech to text.
MULTIMODAL: dict[str, tuple[Callable[[], Any], Callable[[torch.Generator], dict[str, torch.Tensor]]]] = {
    QWEN2_VL: (_qwen2_vl, qwen2_vl_batch),
    LLAVA: (_llava, llava_batch),
    PALIGEMMA: (_paligemma, paligemma_batch),
    "Gemma-3 with images (pooled SigLIP tokens seen both ways)": (_gemma3, gemma3_batch),
    "Mistral-3 (Pixtral tower, 2-D rotary, merged patches)": (_mistral3, mistral3_batch),
    "Idefics3 (pixel-shuffled SigLIP tokens)": (_idefics3, idefics3_batch),
    "InternVL (InternViT, pixel-shuffled, Qwen2 text)": (_internvl, internvl_batch),
    "CLIP (text and image towers, contrastive loss over the batch)": (_contrastive("clip"), contrastive_batch),
    "SigLIP (text and image towers, sigmoid loss over pairs)": (_contrastive("siglip"), contrastive_batch),
    "Whisper (mel frames halved by a strided conv, a decoder cross-attending)": (_whisper, whisper_batch),
}

BUILDERS: dict[str, Callable[[], Any]] = {name: _builder(*spec) for name, spec in ARCHITECTURES.items()}
BUILDERS.update({name: build for name, (build, _) in MULTIMODAL.items()})
CLASSIFIERS = {name for name, (_, _, task) in ARCHITECTURES.items() if task == "classify"}
VISION = {name for name, (_, _, task) in ARCHITECTURES.items() if task == "vision"}
AUDIO = {name for name, (_, _, task) in ARCHITECTURES.items() if task == "audio"}
SEQ2SEQ = {name for name, (_, _, task) in ARCHITECTURES.items() if task == "seq2seq"}


def vision_batch(generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Images and one class label per image."""
    pixels = torch.randn(hm.BATCH, 3, IMAGE, IMAGE, generator=generator)
    return {"pixel_values": pixels, "labels": torch.randint(0, hm.CLASSES, (hm.BATCH,), generator=generator)}


def audio_batch(generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Raw waveforms and one class label per clip."""
    samples = torch.randn(hm.BATCH, AUDIO_SAMPLES, generator=generator)
    return {"input_values": samples, "labels": torch.randint(0, hm.CLASSES, (hm.BATCH,), generator=generator)}


def seq2seq_batch(generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Source tokens, and target tokens (the decoder's inputs are them shifted right, inside the
    model) with a prompt of two that is not trained on."""
    ids = torch.randint(3, hm.VOCAB, (hm.BATCH, hm.SEQ), generator=generator)
    labels = torch.randint(3, hm.VOCAB, (hm.BATCH, TARGET), generator=generator)
    labels[1, :2] = -100
    return {"input_ids": ids, "labels": labels}


def specaugment_step(rank: int, world: int, seed_apart: bool) -> dict[str, Any]:
    """Pool task: Wav2Vec2 training with SpecAugment on, whose time masks ``_compute_mask_indices``
    draws with NumPy in eager (``np.random.choice`` breaks the graph; Dynamo told to keep NumPy's
    stream, so that single-device eager draws the same), against single-device eager.

    ``seed_apart``: NumPy seeded ``seed + rank`` after the reference ran: each rank would mask other
    frames of one sequence. Returns the error's type and text, or the differences from eager."""
    import copy

    import numpy as np
    import transformers as t

    from autosp import compile as sp_compile

    torch._dynamo.reset()
    cfg = config("wav2vec2", "eager")
    cfg.update(dict(mask_time_prob=0.5, mask_time_length=2))
    torch.manual_seed(0)
    model = t.AutoModelForAudioClassification.from_config(cfg).train()
    batch = audio_batch(torch.Generator().manual_seed(1))
    np.random.seed(7)
    torch.manual_seed(0)
    ref = hm._step(copy.deepcopy(model), batch, "train")
    compiled = sp_compile(model, variant="ulysses", backend="aot_eager")
    np.random.seed(7 + (rank if seed_apart else 0))
    torch.manual_seed(0)
    saved = torch._dynamo.config.use_numpy_random_stream
    torch._dynamo.config.use_numpy_random_stream = True
    try:
        got = hm._step(compiled, batch, "train")
    except Exception as e:  # noqa: BLE001 - the test asserts on it
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        torch._dynamo.config.use_numpy_random_stream = saved
    return {"error": None, "problems": hm._differences(got, ref, "train")}


# HF itself raises on gradient_checkpointing_enable() for these.
NO_CHECKPOINTING = frozenset({"ALBERT classifier"})


def more_rows(variants: tuple[str, ...] = ("ulysses", "ring"), checkpointing: bool = False) -> list[hm.Row]:
    """Every architecture above, fp32 training, under each variant (``checkpointing``: HF's
    ``gradient_checkpointing_enable()`` on each)."""
    names = [n for n in [*ARCHITECTURES, *MULTIMODAL] if not (checkpointing and n in NO_CHECKPOINTING)]
    return [hm.Row(name, v, checkpointing) for name in names for v in variants]


__all__ = [
    "ARCHITECTURES",
    "AUDIO",
    "BUILDERS",
    "CLASSIFIERS",
    "MULTIMODAL",
    "QWEN2_VL",
    "SEQ2SEQ",
    "VISION",
    "config",
    "more_rows",
]
