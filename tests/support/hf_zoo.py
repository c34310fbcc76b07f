"""A zoo of tiny random configs, one per Hugging Face causal-LM family of transformers 5.

The sequence-parallel guard decides, family by family, whether a causal LM trains exactly under
sequence parallelism or is refused; a sweep needs every family built small. ``FAMILIES`` maps
each ``model_type`` of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` that can be built tiny to a
:class:`Family` (config overrides on top of :data:`BASE`, the dtype its eager forward and backward
run in, what it exercises, and the layer kinds it must contain); ``EXCLUDED`` says why the others
are left out. ``tiny_config(model_type)`` builds the config (deterministically: nothing random).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import CONFIG_MAPPING, PretrainedConfig

from tests.support.helpers import HF_TINY

F64 = torch.float64
F32 = torch.float32

# Shared small base; a key is passed only to configs that know it (a field or an attribute_map
# alias), so families spelling a size differently get it through their overrides.
BASE: dict[str, Any] = dict(
    HF_TINY,  # the sizes of the HF tests' tiny models
    head_dim=8,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    decoder_start_token_id=2,
    cls_token_id=3,
    sep_token_id=4,
    # (image/audio placeholder token ids stay outside the vocabulary: random ids never hit them)
    # windows and caps small enough to bite in a 64-token sequence
    sliding_window=8,
    final_logit_softcapping=2.0,
    attn_logit_softcapping=0.02,
    # MoE: 4 experts, top-2, one dense layer first where the family has a dense prefix
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    moe_num_experts=4,
    num_experts_per_tok=2,
    moe_topk=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    shared_intermediate_size=32,
    n_shared_experts=1,
    num_shared_experts=1,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,
    # multi-token-prediction heads are not part of the causal-LM forward
    num_nextn_predict_layers=0,
    num_mtp_layers=0,
    # MLA at DeepSeek-V3's proportions: q/k heads 8 + 4 RoPE = 12 wide (128 + 64 = 192 there),
    # values 8 (128 there)
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_rope_head_dim=4,
    qk_nope_head_dim=8,
    v_head_dim=8,
    # sparse-attention indexers: few heads, top-k below the sequence length so they select
    index_n_heads=4,
    index_head_dim=8,
    index_topk=16,
    # encoder-decoder families' decoders (their causal LM is the decoder alone)
    decoder_layers=2,
    decoder_attention_heads=4,
    decoder_ffn_dim=64,
    encoder_layers=2,
    encoder_attention_heads=4,
    encoder_ffn_dim=64,
    ffn_dim=64,
    n_inner=64,
)
# every config field whose name contains one of these is set to 0 (no randomness in train mode)
ZEROED = ("dropout", "pdrop", "layerdrop", "jitter")

SW = ["sliding_attention", "full_attention"]
MAMBA2 = dict(mamba_n_heads=8, mamba_n_groups=4, mamba_d_state=16, mamba_chunk_size=16)
# gated delta nets: 4 key and 4 value heads of 8 channels, a causal conv of 4
GDN = dict(linear_num_key_heads=4, linear_num_value_heads=4, linear_conv_kernel_dim=4)
GDN |= dict(linear_key_head_dim=8, linear_value_head_dim=8)
GRANITE = dict(
    embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.25, logits_scaling=4.0
)
SCALING = {"logits_scaling": GRANITE["logits_scaling"]}  # checked where GRANITE is set
# the inkling families' sliding-window heads and relative positions
SWA = dict(swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=8)
INKLING = dict(SWA, d_rel=4, rel_extent=16, log_scaling_n_floor=4)
INKLING2 = dict(
    INKLING,
    layer_types=["hybrid_sliding", "hybrid"],
    unpadded_vocab_size=96,
    n_layers_per_attn_res_block=1,
)  # inkling2_text; inkling2_loop_text adds its LOOP
LOOP = dict(loop_layer_index_start=1, loop_layer_index_end=2, loop_num_passes=2, loop_gate_rank=4)
# qwen4_exp_text's QSA indexer, n-gram per-layer embeddings (PLE) and hyper-connections
QSA = dict(indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=16)
NGRAM = dict(heads_per_ngram=2, ngram_vocab_size_base=97, make_ngram_vocab_size_divisible_by=8)
PLE = dict(ple_layer_ids=[1], ple_embed_dim=8, split_ngram_parts=1, **NGRAM)
QWEN4 = dict(hc_lowrank=8, indexer_compress_ratio=4, **QSA, **PLE)
# jamba: attention and MoE every second layer, from the second on
PERIODS = dict(
    attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1
)
MLA = dict(num_key_value_heads=4)  # MLA expands one latent to every head: no GQA
GEMMA = dict(query_pre_attn_scalar=16)  # gemma2, gemma3_text, vaultgemma
LLAMA_LIKE = "llama-like"
DECODER = dict(is_decoder=True)  # BERT-style encoders run causally (and build a causal LM) only so


@dataclass(frozen=True)
class Family:
    """One causal-LM family of the zoo."""

    model_type: str
    overrides: dict[str, Any] = field(default_factory=dict)
    note: str = ""
    dtype: torch.dtype = F64
    # the per-layer kinds the tiny config must list (its layer_types / layers_block_type), in order
    layer_types: tuple[str, ...] = ()
    # class-name fragments the built model must contain, one per mixer kind
    modules: tuple[str, ...] = ()
    # parameter-name fragments the built model must have (attention sinks, ...)
    params: tuple[str, ...] = ()
    # parameter-name fragments that get no (or an all-zero) gradient from the LM loss: parts a
    # text-only forward never uses, selectors trained by other losses (see note)
    no_grad: tuple[str, ...] = ()
    # config attributes (dotted paths) and the values the note relies on
    checks: dict[str, Any] = field(default_factory=dict)
    # whether the causal LM's forward takes position_ids
    position_ids: bool = True
    # sub-configs (text_config, vision_config, ...): :data:`BASE` for their class plus these
    sub_configs: dict[str, dict[str, Any]] = field(default_factory=dict)


def _decoder(model_type: str, note: str, overrides: dict[str, Any] | None = None) -> Family:
    """An encoder-decoder family's decoder run alone: its forward takes no position_ids and
    its cross-attention gets no input."""
    no_input = ("encoder_attn",)
    return Family(model_type, overrides or {}, note, no_grad=no_input, position_ids=False)


def _sliding(model_type: str, overrides: dict[str, Any], note: str, **kw: Any) -> Family:
    """A family of sliding then full attention layers (:data:`SW`), set and checked."""
    overrides = {"layer_types": SW, **overrides}
    return Family(model_type, overrides, note, layer_types=tuple(SW), **kw)


def _mixed(
    model_type: str, kinds: tuple[str, ...], modules: tuple[str, ...], note: str, **overrides: Any
) -> Family:
    """A family of one layer of each of ``kinds`` (set and checked), with a mixer of each of
    ``modules``."""
    overrides = {"layer_types": list(kinds), "num_hidden_layers": len(kinds), **overrides}
    return Family(model_type, overrides, note, layer_types=kinds, modules=modules)


def _indexed(model_type: str, overrides: dict[str, Any], note: str, **kw: Any) -> Family:
    """A family with a sparse-attention indexer: it selects the keys and gets no gradient
    from the LM loss."""
    return Family(model_type, overrides, note, no_grad=("indexer",), **kw)


_FAMILIES: list[Family] = [
    _sliding(
        "afmoe",
        dict(num_dense_layers=1),
        "sliding + full attention; dense layer then MoE (4 experts, top-2, 1 shared; "
        "the expert bias stays float32)",
    ),
    Family("apertus", {}, "llama-like, xIELU activation, q/k norms"),
    Family("apertus1p5_text", {}, "Apertus 1.5 text model: xIELU activation, q/k norms"),
    Family("arcee", {}, "llama-like, ReLU^2 MLP"),
    Family("aria_text", dict(moe_num_shared_experts=1), "MoE in every layer, shared expert"),
    Family(
        "axk1",
        dict(MLA, mlp_layer_types=["dense", "sparse"]),
        "MLA (deepseek-v3-like), dense then MoE",
    ),
    _indexed(
        "axk2",
        dict(MLA, mlp_layer_types=["dense", "sparse"]),
        "MLA + sparse-attention indexer (top-16 keys per query; it reads the 4D mask "
        "and gets no LM gradient); dense then MoE",
    ),
    Family(
        "bailing_hybrid",
        dict(MLA, layer_group_size=2),
        "KDA-style linear attention (short conv + gated delta rule) then MLA softmax "
        "attention; dense then MoE",
        layer_types=("linear_attention", "full_attention"),
        modules=("BailingHybridDeltaAttention", "BailingHybridAttention"),
    ),
    Family(
        "bamba",
        dict(attn_layer_indices=[1], **MAMBA2),
        "Mamba2 (8 heads, 4 groups, chunk 16) then attention",
        layer_types=("linear_attention", "full_attention"),
        modules=("BambaMixer", "BambaAttention"),
    ),
    _decoder(
        "bart",
        "BART decoder alone: learned positions from a local arange (no position_ids "
        "argument); its cross-attention gets no input",
    ),
    _sliding(
        "beam",
        dict(mlp_layer_types=["dense", "sparse"]),
        "sliding (RoPE) + full (NoPE, scalable-softmax query scale (1 + pos/2048)^0.1 "
        "from position_ids) layers, dense then MoE, final softcap 2 (logits in "
        "float32)",
    ),
    Family("bert", DECODER, "BERT encoder run causally (is_decoder), absolute positions"),
    Family("bert-generation", DECODER, "BERT-generation decoder, absolute positions"),
    Family(
        "big_bird",
        dict(is_decoder=True, attention_type="original_full"),
        "BigBird with full attention (block-sparse needs long rows) run causally",
        no_grad=("pooler",),
    ),
    _decoder(
        "bigbird_pegasus",
        "BigBird-Pegasus decoder alone; cross-attention gets no input",
        dict(attention_type="original_full"),
    ),
    Family("biogpt", {}, "BioGPT, learned positions, embedding scale"),
    Family("bitnet", {}, "BitNet (ternary weights quantized in forward)"),
    _decoder("blenderbot", "Blenderbot decoder alone; cross-attention gets no input"),
    _decoder("blenderbot-small", "Blenderbot-small decoder alone; cross-attention gets no input"),
    Family(
        "blt",
        dict(
            encoder_hash_byte_group_size=[3, 4],
            encoder_hash_byte_group_vocab=64,
            local_attention_window_len=8,
        ),
        "byte latent transformer: frozen entropy patcher, local encoder (window 8) "
        "with cross-attention into patches, global transformer over patches (positions "
        "from a local arange), local decoder; logits in float32",
        sub_configs={
            "patcher_config": {},
            "encoder_config": dict(hidden_size_global=32, num_hidden_layers=1),
            "decoder_config": dict(hidden_size_global=32, num_hidden_layers=1),
            "global_config": {},
        },
    ),
    Family(
        "bloom",
        {},
        "ALiBi built in the model (no position ids; attention outside the interface)",
        position_ids=False,
    ),
    Family("codegen", dict(rotary_dim=4), "partial rotary (4 of 8), parallel attention + MLP"),
    Family(
        "cohere",
        dict(logit_scale=0.25),
        "logit_scale 0.25 after lm_head",
        checks={"logit_scale": 0.25},
    ),
    _sliding(
        "cohere2",
        dict(logit_scale=0.25),
        "logit_scale 0.25, sliding (RoPE) + full (NoPE) layers",
        checks={"logit_scale": 0.25},
    ),
    _sliding(
        "cohere2_moe",
        dict(logit_scale=0.25, mlp_layer_types=["dense", "sparse"]),
        "logit_scale 0.25, sliding + full, dense then MoE",
        checks={"logit_scale": 0.25},
    ),
    _sliding(
        "cohere_compass_text",
        dict(
            logit_scale=0.25,
            rope_parameters={
                "sliding_attention": {
                    "rope_type": "default",
                    "rope_theta": 10000.0,
                    "mrope_section": [2, 1, 1],
                },
                "full_attention": None,
            },
        ),
        "M-RoPE (3 position axes) on sliding layers, NoPE full layers, logit_scale 0.25",
        checks={"logit_scale": 0.25},
    ),
    Family(
        "cpmant",
        dict(
            dim_head=8,
            dim_ff=64,
            prompt_types=3,
            prompt_length=2,
            segment_types=3,
            position_bias_num_buckets=32,
            position_bias_max_distance=128,
        ),
        "CPM-Ant: prompt tokens prepended, segments from input_ids != 0, relative "
        "position buckets from a local arange; attention outside the interface",
        position_ids=False,
    ),
    Family("camembert", DECODER, "CamemBERT run causally, positions from the padding mask"),
    Family("ctrl", dict(dff=64), "CTRL, sinusoidal absolute positions"),
    _sliding("cwm", {}, "sliding + full"),
    Family("data2vec-text", DECODER, "Data2Vec text encoder run causally, absolute positions"),
    Family(
        "dbrx",
        dict(
            attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
            ffn_config={"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2},
        ),
        "fused qkv, MoE (attn_config needs rope_theta: the attention reads it there)",
    ),
    Family("deepseek_v2", dict(MLA, topk_method="greedy"), "MLA, dense then MoE"),
    Family("deepseek_v3", MLA, "MLA (interleaved RoPE), dense then MoE with group routing"),
    _indexed(
        "deepseek_v32",
        MLA,
        "MLA + DSA lightning indexer (top-16 keys per query; it reads the 4D mask and "
        "gets no LM gradient); dense then MoE",
    ),
    _indexed(
        "deepseek_v4",
        dict(
            num_hidden_layers=3,
            num_key_value_heads=1,
            layer_types=[
                "sliding_attention",
                "compressed_sparse_attention",
                "heavily_compressed_attention",
            ],
            mlp_layer_types=["hash_moe", "moe", "moe"],
            compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
            hc_mult=2,
            o_groups=2,
            o_lora_rank=16,
            partial_rotary_factor=0.5,
        ),
        "sliding, compressed-sparse (blocks of 4 + indexer) and heavily-compressed "
        "(blocks of 16) attention with sinks: the compressors pool the sequence "
        "outside the attention interface; hash MoE (experts from token ids) then MoE; "
        "hyper-connections (2 streams)",
        layer_types=(
            "sliding_attention",
            "compressed_sparse_attention",
            "heavily_compressed_attention",
        ),
        params=("self_attn.sinks",),
    ),
    Family("diffllama", {}, "differential attention (two softmaxes per head)"),
    Family(
        "doge",
        dict(keep_window_size=16),
        "dynamic mask attention: each query keeps its top-16 keys, chosen outside the "
        "attention interface from the values",
    ),
    Family(
        "dory",
        dict(
            num_hidden_layers=3,
            n_input_layers=1,
            n_output_layers=1,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        ),
        "input, looped recurrent (2 passes) and output layers; sliding + full; logits in float32",
    ),
    Family("dots1", dict(max_window_layers=1), "MoE after a dense layer, sliding from layer 1"),
    _indexed(
        "dots3_note_text",
        dict(MLA, shared_experts_intermediate_size=32, mlp_layer_types=["dense", "sparse"]),
        "MLA + sparse-attention indexer (top-16; reads the 4D mask, no LM gradient); "
        "dense then MoE",
    ),
    Family("electra", dict(is_decoder=True, embedding_size=16), "ELECTRA run causally"),
    Family(
        "emu3",
        {},
        "Emu3's text decoder (llama-like) built from the multimodal config",
        sub_configs={"text_config": {}, "vq_config": dict(embed_dim=8, codebook_size=16)},
    ),
    Family("ernie", DECODER, "ERNIE encoder run causally"),
    Family("ernie4_5", {}, "llama-like, interleaved RoPE"),
    Family(
        "ernie4_5_moe",
        dict(moe_layer_start_index=1, moe_num_shared_experts=1),
        "dense then MoE with shared expert",
    ),
    Family("exaone", {}, LLAMA_LIKE),
    _sliding("exaone4", {}, "sliding + full, post-norm"),
    _sliding("exaone_moe", {}, "sliding + full, dense then MoE"),
    Family("falcon", dict(new_decoder_architecture=True, num_kv_heads=2), "Falcon with RoPE, GQA"),
    Family(
        "falcon_h1",
        dict(mamba_d_ssm=64, mamba_d_head=8, lm_head_multiplier=0.5, **MAMBA2),
        "parallel Mamba2 (8 heads, 4 groups) + attention in every layer; muP multipliers, "
        "lm_head_multiplier 0.5",
        modules=("FalconH1Mixer", "FalconH1Attention"),
        checks={"lm_head_multiplier": 0.5},
        layer_types=("hybrid", "hybrid"),
    ),
    Family(
        "falcon_mamba",
        {},
        "Mamba1 with RMS-normed B/C/dt; logits in float32",
        modules=("FalconMambaMixer",),
        position_ids=False,
    ),
    Family("flex_olmo", {}, "MoE in every layer"),
    _sliding(
        "flint",
        dict(mlp_only_layers=[0]),
        "attention sinks (s_aux, kept in float32), sliding + full, dense then MoE",
        params=("self_attn.sinks",),
    ),
    Family("gemma", {}, "embedding scale sqrt(hidden)"),
    _sliding(
        "gemma2",
        GEMMA,
        "sliding + full, attention softcap 0.02 and final softcap 2 (both bite)",
        checks={"final_logit_softcapping": 2.0, "attn_logit_softcapping": 0.02},
    ),
    _sliding(
        "gemma3_text",
        GEMMA,
        "sliding (local RoPE) + full, q/k norms, final softcap 2",
        checks={"final_logit_softcapping": 2.0},
    ),
    Family(
        "gemma3n_text",
        dict(
            num_hidden_layers=4,
            layer_types=SW * 2,
            num_kv_shared_layers=2,
            vocab_size_per_layer_input=96,
            hidden_size_per_layer_input=8,
            laurel_rank=4,
            altup_num_inputs=2,
            intermediate_size=[64, 64, 64, 64],
            activation_sparsity_pattern=[0.95, 0.0, 0.0, 0.0],
        ),
        "AltUp, LAuReL, per-layer inputs, KV shared by the last 2 layers, sliding + full, "
        "activation sparsity from per-token statistics",
        layer_types=tuple(SW * 2),
    ),
    _sliding(
        "gemma4_text",
        dict(
            vocab_size_per_layer_input=96,
            hidden_size_per_layer_input=8,
            global_head_dim=16,
            enable_moe_block=True,
            top_k_experts=2,
        ),
        "sliding (head_dim 8) + full (head_dim 16, proportional partial RoPE), per-layer "
        "inputs, dense MLP + MoE block in every layer",
    ),
    _sliding(
        "gemma4_unified_text",
        dict(global_head_dim=16),
        "sliding (head_dim 8) + full (head_dim 16, proportional partial RoPE)",
    ),
    Family(
        "git",
        dict(num_image_with_embedding=None),
        "GIT text decoder without images (its image encoder gets no input)",
        no_grad=("image_encoder", "visual_projection"),
        sub_configs={"vision_config": dict(image_size=16, patch_size=8)},
    ),
    Family("glm", {}, "partial interleaved RoPE"),
    Family("glm4", {}, "post-attention and post-MLP norms"),
    Family("glm4_moe", {}, "dense then MoE, group routing"),
    Family("glm4_moe_lite", dict(MLA, mlp_layer_types=["dense", "sparse"]), "MLA, dense then MoE"),
    _indexed(
        "glm_moe_dsa",
        dict(MLA, indexer_types=["full", "shared"]),
        "MLA + DSA indexer (top-16; the second layer reuses the first's selection; "
        "reads the 4D mask, no LM gradient); dense then MoE",
    ),
    Family("gpt-sw3", {}, "GPT-2 architecture, learned absolute positions"),
    Family("gpt2", {}, "learned absolute positions"),
    Family("gpt_bigcode", {}, "multi-query attention, learned absolute positions"),
    Family(
        "gpt_neo",
        dict(attention_types=[[["global", "local"], 1]], window_size=8, intermediate_size=64),
        "global + local (window 8) attention, learned absolute positions, no scaling",
    ),
    Family("gpt_neox", {}, "partial rotary (25%), parallel residual"),
    Family("gpt_neox_japanese", {}, "GPT-NeoX Japanese"),
    _sliding(
        "gpt_oss",
        {},
        "attention sinks (s_aux), sliding + full, MoE with clamped SwiGLU (float64 "
        "works with the eager experts)",
        params=("self_attn.sinks",),
    ),
    Family("gptj", dict(rotary_dim=4), "partial interleaved rotary, parallel attention + MLP"),
    Family(
        "granite", GRANITE, "muP multipliers, logits divided by logits_scaling 4", checks=SCALING
    ),
    _sliding("granite_swa", GRANITE, "granite multipliers, sliding + full", checks=SCALING),
    Family("granitemoe", GRANITE, "granite multipliers, MoE", checks=SCALING),
    _sliding("granitemoe_swa", GRANITE, "granite multipliers, MoE, sliding + full", checks=SCALING),
    Family(
        "granitemoehybrid",
        dict(layer_types=["mamba", "attention"], **MAMBA2, **GRANITE),
        "Mamba2 (8 heads, 4 groups) then attention (NoPE), MoE + shared MLP, granite multipliers",
        layer_types=("linear_attention", "full_attention"),
        modules=("GraniteMoeHybridMambaLayer", "GraniteMoeHybridAttention"),
        checks=SCALING,
    ),
    Family("granitemoeshared", GRANITE, "granite multipliers, MoE + shared MLP", checks=SCALING),
    Family("helium", {}, LLAMA_LIKE),
    Family(
        "hrm_text",
        dict(num_hidden_layers=1, H_cycles=2, L_cycles=1),
        "hierarchical recurrent model: one stack reused over H/L cycles (4 attention "
        "calls for 2 layers); prefix-LM mask only with token_type_ids (none here: "
        "causal)",
    ),
    Family("hunyuan_v1_dense", {}, "q/k norms"),
    Family("hunyuan_v1_moe", {}, "MoE with shared MLP"),
    Family("hy_v3", dict(mlp_layer_types=["dense", "sparse"]), "dense then MoE"),
    _indexed(
        "hy_v4",
        dict(hc_mult=2, indexer_types=["full", "shared"]),
        "MLA + indexer (top-16, reads the 4D mask, no LM gradient), hyper-connections "
        "(2 streams), learnable sinks, dense then MoE; logits in float32",
        params=("self_attn.sinks",),
    ),
    Family(
        "hyperclovax",
        GRANITE,
        "granite-like muP multipliers, but logits are multiplied by logits_scaling (4); post norms",
        checks=SCALING,
    ),
    Family(
        "inkling2_loop_text",
        dict(INKLING2, **LOOP),
        "as inkling2_text, with the second layer looped twice (loop gates, message residuals)",
        layer_types=("hybrid_sliding", "hybrid"),
        no_grad=("message_input",),
    ),
    Family(
        "inkling2_text",
        INKLING2,
        "short convolutions on k/v, relative position bias and log position scaling "
        "(from a local arange, not position_ids), sliding + full, final softcap 2 "
        "(logits in float32)",
        layer_types=("hybrid_sliding", "hybrid"),
    ),
    Family(
        "inkling_text",
        dict(INKLING, local_layer_ids=[0], mlp_layer_types=["dense", "sparse"]),
        "short convolutions, relative-position logits from a local arange "
        "(position_ids unused), local + global layers, hidden states divided by the "
        "muP width multiplier before lm_head; dense then MoE",
    ),
    Family("internlm3", {}, LLAMA_LIKE),
    Family("iquestcoder", {}, LLAMA_LIKE),
    Family("jais2", {}, "LayerNorm, ReLU^2 MLP"),
    Family(
        "jamba",
        dict(PERIODS, use_mamba_kernels=False),
        "Mamba1 (dense MLP) then attention without RoPE (MoE)",
        layer_types=("linear_attention", "full_attention"),
        modules=("JambaMambaMixer", "JambaAttention"),
    ),
    Family(
        "jetmoe", dict(num_key_value_heads=2, kv_channels=8), "mixture of attention heads + MoE"
    ),
    Family(
        "kimi_linear",
        dict(
            MLA,
            layer_types=["linear_attention", "full_attention"],
            linear_num_heads=4,
            linear_head_dim=8,
            q_lora_rank=None,
            mlp_layer_types=["dense", "sparse"],
        ),
        "KDA linear attention (short conv + delta rule) then MLA without RoPE; dense then MoE",
        layer_types=("linear_attention", "full_attention"),
        modules=("KimiLinearDeltaAttention", "KimiLinearAttention"),
    ),
    _sliding("kolibri1", {}, "sliding + full, MoE"),
    _sliding(
        "laguna",
        dict(num_attention_heads_per_layer=[4, 8]),
        "sliding + full (per-type partial RoPE), per-layer head counts, gated attention, "
        "dense then MoE",
    ),
    _mixed(
        "lara_mini",
        ("linear_attention", "sliding_attention", "full_attention"),
        ("LaraMiniGatedDeltaNet", "LaraMiniAttention"),
        "gated delta net, sliding and full attention; MoE",
        **GDN,
    ),
    _mixed(
        "lfm2",
        ("conv", "full_attention"),
        ("Lfm2ShortConv", "Lfm2Attention"),
        "gated short convolution then attention",
        block_auto_adjust_ff_dim=False,
    ),
    _mixed(
        "lfm2_moe",
        ("conv", "full_attention"),
        ("Lfm2MoeShortConv", "Lfm2MoeAttention"),
        "gated short convolution then attention; dense then MoE",
        num_dense_layers=1,
    ),
    _mixed(
        "lfm3",
        ("conv", "sliding_attention", "full_attention"),
        ("Lfm3ShortConv", "Lfm3Attention"),
        "short convolution, sliding and full attention; sandwich norms, attention gate",
    ),
    Family("llama", {}, "the reference decoder"),
    Family(
        "llama4_text",
        dict(
            attention_chunk_size=16,
            no_rope_layers=[1, 0],
            floor_scale=4,
            moe_layers=[1],
            intermediate_size_mlp=64,
        ),
        "chunked attention (chunk 16, RoPE) then NoPE full attention with temperature "
        "tuning (floor_scale 4: temperature != 1 from position 3 on, computed from a "
        "local arange); dense then MoE",
        layer_types=("chunked_attention", "full_attention"),
        checks={"attention_chunk_size": 16, "floor_scale": 4, "attn_temperature_tuning": True},
    ),
    Family(
        "longcat_flash",
        dict(MLA, num_layers=1, head_dim=4, zero_expert_num=2),
        "two MLA attentions and MLPs per layer, shortcut MoE with zero experts",
    ),
    Family(
        "mamba",
        {},
        "Mamba1 selective scan and causal conv; logits in float32",
        modules=("MambaMixer",),
        position_ids=False,
    ),
    Family(
        "mamba2",
        dict(num_heads=8, n_groups=4, state_size=16, chunk_size=16),
        "Mamba2 SSD (8 heads, 4 groups, chunk 16) and causal conv; logits in float32",
        modules=("Mamba2Mixer",),
        position_ids=False,
    ),
    _decoder("marian", "Marian decoder alone, sinusoidal positions; cross-attention gets no input"),
    _decoder("mbart", "mBART decoder alone; cross-attention gets no input"),
    Family("megatron-bert", DECODER, "Megatron-BERT run causally"),
    _sliding(
        "mellum",
        dict(mlp_layer_types=["dense", "sparse"]),
        "sliding + full (per-type RoPE), dense then MoE",
    ),
    _sliding(
        "mimo_v2_flash",
        dict(head_dim=8, v_head_dim=8),
        "sliding (attention sinks) + full attention, partial RoPE, value scale; dense then MoE",
        params=("self_attn.sinks",),
    ),
    Family(
        "minicpm3",
        dict(MLA, dim_model_base=16, scale_emb=2.0),
        "MLA; muP: embeddings times scale_emb, residuals times "
        "scale_depth/sqrt(layers), hidden states divided by hidden/dim_model_base (2) "
        "before lm_head",
    ),
    _mixed(
        "minimax",
        ("linear_attention", "full_attention"),
        ("MiniMaxLightningAttention", "MiniMaxAttention"),
        "lightning (linear) attention in blocks of 16, outside the attention "
        "interface, then softmax attention; MoE",
        block_size=16,
    ),
    Family("minimax_m2", {}, "q/k norms over all heads, MoE"),
    Family(
        "minimax_m3_vl_text",
        dict(
            dense_intermediate_size=64,
            rotary_dim=4,
            index_block_size=8,
            index_topk_blocks=2,
            mlp_layer_types=["dense", "sparse"],
        ),
        "block-sparse attention with indexer (blocks of 8, top-2 blocks), dense then MoE",
    ),
    Family(
        "mllama",
        {},
        "Mllama text decoder: a self-attention layer, then a cross-attention layer "
        "that is skipped without image states; logits in float32",
        no_grad=("layers.1.",),
        sub_configs={"text_config": dict(cross_attention_layers=[1])},
    ),
    _sliding("ministral", {}, "sliding + full"),
    Family("ministral3", {}, "sliding window on every layer"),
    Family("mistral", {}, "sliding window on every layer"),
    Family("mixtral", {}, "MoE, sliding window"),
    Family("modernbert-decoder", dict(local_attention=8), "local (window 8) + global attention"),
    Family("moshi", dict(num_codebooks=2), "Moshi text decoder"),
    Family("mpt", dict(expansion_ratio=2), "ALiBi, no positional embedding", position_ids=False),
    _decoder("mvp", "MVP decoder alone; cross-attention gets no input"),
    Family("nanochat", {}, "ReLU^2 MLP, q/k norms, final softcap 2"),
    Family("nemotron", {}, "LayerNorm1P, ReLU^2, partial rotary"),
    Family(
        "nemotron_h",
        dict(
            layers_block_type=["linear_attention", "moe", "full_attention", "mlp"],
            mamba_num_heads=8,
            mamba_head_dim=8,
            n_groups=4,
            ssm_state_size=16,
            chunk_size=16,
            moe_shared_expert_intermediate_size=32,
        ),
        "Mamba2 (8 heads, 4 groups, chunk 16), MoE, attention without RoPE, MLP: one "
        "layer each; logits in float32",
        layer_types=("linear_attention", "moe", "full_attention", "mlp"),
        modules=("NemotronHMamba2Mixer", "NemotronHAttention"),
    ),
    Family("olmo", {}, "non-parametric LayerNorm"),
    Family("olmo2", {}, "q/k norms after projection"),
    _sliding("olmo3", {}, "sliding + full"),
    _mixed(
        "olmo_hybrid",
        ("linear_attention", "full_attention"),
        ("OlmoHybridGatedDeltaNet", "OlmoHybridAttention"),
        "gated delta net then attention",
        **GDN,
    ),
    Family("olmoe", {}, "MoE, q/k norms"),
    Family("openai-gpt", {}, "GPT-1, learned absolute positions"),
    Family("opt", {}, "learned positions offset by 2"),
    _decoder(
        "pegasus", "Pegasus decoder alone, sinusoidal positions; cross-attention gets no input"
    ),
    Family("persimmon", {}, "partial rotary, q/k LayerNorm"),
    Family("phi", {}, "partial rotary, parallel attention + MLP"),
    Family("phi3", {}, "fused qkv"),
    Family(
        "phi4_multimodal",
        {},
        "Phi-4 multimodal text decoder (image and audio embedders get no input)",
        no_grad=("embed_tokens_extend",),
        sub_configs={
            "vision_config": dict(image_size=16, crop_size=16, patch_size=8),
            "audio_config": dict(
                num_blocks=1,
                ext_pw_out_channel=32,
                depthwise_separable_out_channel=32,
                nemo_conv_channels=8,
            ),
        },
    ),
    Family(
        "phimoe",
        {},
        "MoE with sparsemixer routing; its router_jitter_noise is the sparsemixer eps: "
        "at 0 (no randomness) the train-mode Gumbel sampling degenerates to the argmax "
        "and the router gets exactly zero gradient",
        no_grad=("router",),
    ),
    _decoder("plbart", "PLBart decoder alone; cross-attention gets no input"),
    Family(
        "prophetnet",
        dict(
            num_encoder_layers=2,
            num_decoder_layers=2,
            num_encoder_attention_heads=4,
            num_decoder_attention_heads=4,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            ngram=2,
        ),
        "ProphetNet decoder alone: main + 2 n-gram predicting streams, relative "
        "position buckets from a local arange; cross-attention gets no input",
        no_grad=("cross_attn",),
        position_ids=False,
    ),
    Family(
        "qwen2",
        dict(use_sliding_window=True, max_window_layers=1),
        "sliding window from layer 1 (max_window_layers)",
    ),
    Family("qwen2_moe", dict(mlp_only_layers=[0]), "dense then MoE with gated shared expert"),
    Family(
        "qwen3",
        dict(use_sliding_window=True, max_window_layers=1),
        "q/k norms, sliding window from layer 1",
    ),
    _mixed(
        "qwen3_5_text",
        ("linear_attention", "full_attention"),
        ("Qwen3_5GatedDeltaNet", "Qwen3_5Attention"),
        "gated delta net then gated attention (partial M-RoPE)",
        **GDN,
    ),
    _mixed(
        "qwen3_5_moe_text",
        ("linear_attention", "full_attention"),
        ("Qwen3_5MoeGatedDeltaNet", "Qwen3_5MoeAttention"),
        "gated delta net then gated attention; MoE with shared expert",
        **GDN,
    ),
    Family("qwen3_moe", dict(mlp_only_layers=[0]), "dense then MoE"),
    _mixed(
        "qwen3_next",
        ("linear_attention", "full_attention"),
        ("Qwen3NextGatedDeltaNet", "Qwen3NextAttention"),
        "gated delta net then gated attention (partial RoPE); dense then MoE",
        mlp_only_layers=[0],
        **GDN,
    ),
    _indexed(
        "qwen4_exp_text",
        dict(layer_types=["linear_attention", "full_attention"], **QWEN4, **GDN),
        "gated delta net (with n-gram per-layer embeddings and a dilated conv) then QSA-indexed "
        "attention (top-16 tokens from blocks of 4); hyper-connections; MoE",
        layer_types=("linear_attention", "indexed_attention"),
        modules=("Qwen4ExpTextGatedDeltaNet", "Qwen4ExpTextAttention"),
    ),
    Family(
        "recurrent_gemma",
        dict(block_types=["recurrent", "attention"], logits_soft_cap=2.0, lru_width=32),
        "RG-LRU recurrence (state reset where position_ids == 0) with causal conv, "
        "then local attention (window 8); final softcap 2",
        layer_types=("linear_attention", "sliding_attention"),
        modules=("RecurrentGemmaRglru", "RecurrentGemmaAttention"),
        checks={"logits_soft_cap": 2.0},
    ),
    Family(
        "reformer",
        dict(
            is_decoder=True,
            attn_layers=["local", "lsh"],
            attention_head_size=8,
            feed_forward_size=64,
            axial_pos_shape=[8, 8],
            axial_pos_embds_dim=[16, 16],
            local_attn_chunk_length=16,
            lsh_attn_chunk_length=16,
            num_buckets=4,
            hash_seed=0,
        ),
        "local (chunks of 16) and LSH (4 buckets) attention, axial positions (the "
        "sequence must be 64 long); lm_head.bias is not used by the forward",
        position_ids=True,
        no_grad=("lm_head.bias",),
    ),
    Family(
        "rembert",
        dict(is_decoder=True, input_embedding_size=16, output_embedding_size=16),
        "RemBERT run causally, decoupled embeddings",
    ),
    Family("roberta", DECODER, "RoBERTa run causally, positions from the padding mask"),
    Family("roberta-prelayernorm", DECODER, "RoBERTa pre-LayerNorm run causally"),
    Family(
        "roc_bert",
        dict(
            is_decoder=True,
            pronunciation_embed_dim=8,
            pronunciation_vocab_size=16,
            shape_embed_dim=8,
            shape_vocab_size=16,
        ),
        "RoCBERT run causally (pronunciation/shape embeddings unused without their ids)",
        no_grad=("pronunciation_embed", "shape_embed"),
    ),
    Family(
        "roformer",
        DECODER,
        "RoFormer run causally, rotary (sinusoidal) positions",
        position_ids=False,
    ),
    Family(
        "rwkv",
        dict(attention_hidden_size=32),
        "RWKV-4 time mixing (WKV recurrence) and token shift",
        modules=("RwkvSelfAttention",),
        position_ids=False,
    ),
    Family("sarvam_mla", MLA, "MLA, dense then MoE"),
    Family("sarvam_moe", {}, "q/k norms, dense then MoE"),
    Family("seed_oss", {}, "llama-like with attention biases"),
    Family("smollm3", dict(no_rope_layers=[1, 0]), "RoPE then NoPE layer"),
    Family("solar_open", {}, "MoE"),
    Family("stablelm", {}, "partial rotary, LayerNorm"),
    Family("starcoder2", {}, "sliding window, biases"),
    _decoder("trocr", "TrOCR decoder, learned positions; cross-attention gets no input"),
    _sliding(
        "vaultgemma",
        GEMMA,
        "sliding + full, attention softcap and final softcap 2",
        checks={"final_logit_softcapping": 2.0},
    ),
    _decoder(
        "whisper",
        "Whisper decoder alone, learned positions; cross-attention gets no input",
        dict(max_target_positions=512),
    ),
    Family(
        "xglm",
        {},
        "sinusoidal positions (offset 2), embedding scale; attention outside the "
        "interface (float32: it builds torch.full((), finfo(dtype).min) in the default "
        "float32 dtype, which overflows for float64)",
        dtype=F32,
    ),
    Family("xlm", dict(causal=True, emb_dim=32, n_langs=1), "XLM run causally, learned positions"),
    Family("xlm-roberta", DECODER, "XLM-R run causally"),
    Family("xlm-roberta-xl", DECODER, "XLM-R XL run causally"),
    Family(
        "xlnet",
        dict(d_head=8, d_inner=64, attn_type="uni", mem_len=0),
        "XLNet with unidirectional attention, relative positions from arange (float32: its "
        "relative position encoding is built in float32 and einsum refuses to mix it with float64)",
        dtype=F32,
        position_ids=False,
        no_grad=("mask_emb", "r_s_bias", "seg_embed"),
    ),
    Family(
        "xlstm",
        dict(
            num_heads=4,
            chunk_size=16,
            mode="train",
            ffn_round_up_to_multiple_of=16,
            output_logit_soft_cap=2.0,
            autocast_kernel_dtype="float32",
        ),
        "mLSTM (chunkwise, chunk 16) blocks; final softcap 2; logits in float32",
        modules=("xLSTMLayer",),
        position_ids=False,
        checks={"output_logit_soft_cap": 2.0},
    ),
    Family(
        "xmod",
        dict(is_decoder=True, default_language="en_XX"),
        "X-MOD run causally, language adapters",
    ),
    Family("youtu", MLA, "MLA, dense"),
    Family(
        "zamba",
        dict(
            num_hidden_layers=3,
            layers_block_type=["mamba", "hybrid", "hybrid"],
            n_mamba_heads=4,
            attention_head_dim=16,
        ),
        "Mamba1, then two hybrid layers sharing one attention block (no RoPE) on "
        "[hidden, embeddings]",
        layer_types=("linear_attention", "hybrid", "hybrid"),
        modules=("ZambaMambaMixer", "ZambaAttention"),
    ),
    Family(
        "zamba2",
        dict(
            layers_block_type=["mamba", "hybrid"],
            n_mamba_heads=8,
            mamba_ngroups=4,
            mamba_d_state=16,
            chunk_size=16,
            adapter_rank=4,
            use_shared_attention_adapter=True,
            use_mem_rope=True,
            num_key_value_heads=4,  # the LoRA adapters add to full-width keys
        ),
        "Mamba2 (8 heads, 4 groups, chunk 16) then a shared attention block with LoRA "
        "adapters (use_mem_rope on; off by default, then NoPE)",
        layer_types=("linear_attention", "hybrid"),
        modules=("Zamba2MambaMixer", "Zamba2Attention"),
    ),
    Family(
        "zaya",
        dict(num_experts_per_tok=1, router_hidden_size=16),
        "CCA attention (convolutions over time on q/k), top-1 MoE with MLP router",
    ),
]

FAMILIES: dict[str, Family] = {f.model_type: f for f in _FAMILIES}

_SAME = "multimodal wrapper: AutoModelForCausalLM builds the text model swept as "
_DRAFT = (
    "speculative-decoding draft head: its forward ignores input_ids and needs the target "
    "model's inputs_embeds and shared_kv_states"
)
EXCLUDED: dict[str, str] = {
    # wrappers whose causal LM is the text model of another model type (swept under that type)
    "dots3_note": _SAME + "dots3_note_text",
    "llama4": _SAME + "llama4_text",
    "qwen3_5": _SAME + "qwen3_5_text",
    "qwen3_5_moe": _SAME + "qwen3_5_moe_text",
    "qwen4_exp": _SAME + "qwen4_exp_text",
    "gemma3": "vision-language wrapper (SigLIP + Gemma3ForConditionalGeneration); its text "
    "model is swept as gemma3_text",
    "gemma4": "vision/audio wrapper (Gemma4ForConditionalGeneration); its text model is swept "
    "as gemma4_text",
    "gemma4_unified": "vision/audio wrapper; its text model is swept as gemma4_unified_text",
    "gemma3n": "vision/audio wrapper whose vision tower needs timm (not installed); its text "
    "model is swept as gemma3n_text",
    "fuyu": "vision wrapper: a patch projection in front of Persimmon (swept as persimmon)",
    "got_ocr2": "OCR wrapper: a SAM-style vision encoder in front of Qwen2 (swept as qwen2)",
    "moss_transcribe_diarize": "speech wrapper: an audio encoder in front of Qwen3 (swept as "
    "qwen3)",
    # not trainable from token ids alone
    "gemma4_assistant": _DRAFT,
    "gemma4_unified_assistant": _DRAFT,
    "musicgen": "audio-code decoder: MusicgenForCausalLM takes a MusicgenDecoderConfig that "
    "AutoModelForCausalLM does not route (from_config(MusicgenConfig) fails) and reads "
    "num_codebooks delayed code streams, not text",
    "musicgen_melody": "audio-code decoder: MusicgenMelodyForCausalLM takes a "
    "MusicgenMelodyDecoderConfig that AutoModelForCausalLM does not route and reads "
    "num_codebooks delayed code streams, not text",
}


def _base_kwargs(cls: type) -> dict[str, Any]:
    """:data:`BASE` restricted to what config class ``cls`` knows, dropouts zeroed."""
    fields = dataclasses.fields(cls) if dataclasses.is_dataclass(cls) else ()
    names = {f.name for f in fields}
    aliases = getattr(cls, "attribute_map", {})
    kwargs = {k: v for k, v in BASE.items() if k in names}
    for key, value in BASE.items():  # an alias (gpt2's n_embd for hidden_size) under its field name
        if key not in names and aliases.get(key) in names and aliases[key] not in kwargs:
            kwargs[aliases[key]] = value
    for f in fields:
        if any(s in f.name for s in ZEROED) and "bool" not in str(f.type):
            kwargs[f.name] = 0.0
    return kwargs


def config_kwargs(model_type: str) -> dict[str, Any]:
    """The keyword arguments :func:`tiny_config` passes to the family's config class."""
    cls = CONFIG_MAPPING[model_type]
    # eager experts: the default grouped_mm kernel takes no float64
    kwargs: dict[str, Any] = {"experts_implementation": "eager", **_base_kwargs(cls)}
    fam = FAMILIES.get(model_type)
    if fam is not None:
        kwargs.update(fam.overrides)
        for name, extra in fam.sub_configs.items():
            kwargs[name] = {**_base_kwargs(cls.sub_configs[name]), **extra}
    return kwargs


def tiny_config(model_type: str) -> PretrainedConfig:
    """The tiny config of ``model_type`` (a fresh object on each call)."""
    return CONFIG_MAPPING[model_type](**config_kwargs(model_type))


def config_layer_types(cfg: PretrainedConfig) -> list[str]:
    """The per-layer kinds a config lists, whatever the family calls them."""
    for name in ("layer_types", "layers_block_type", "block_types"):
        value = getattr(cfg, name, None)
        if value:
            return list(value)
    return []


@torch.no_grad()
def wake_zero_params_(model: torch.nn.Module, std: float = 0.02, seed: int = 0) -> list[str]:
    """Give every all-zero parameter small deterministic noise, in place; returns their names.

    Many families zero-initialise gates, temperatures, biases or output scales, which leaves
    whole paths dead at init (zaya's q/k temperature 0 makes attention uniform; xLSTM's zero
    up-gate silences the FFN): an exactness check would then not exercise them.
    """
    gen = torch.Generator().manual_seed(seed)
    woken = []
    for name, param in model.named_parameters():
        if param.is_floating_point() and not param.any():
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float64) * std
            param.copy_(noise.to(param.dtype))
            woken.append(name)
    return woken


def with_router_loss(cfg: PretrainedConfig, coef: float = 0.5) -> PretrainedConfig:
    """``cfg`` with its MoE load-balancing loss on: ``output_router_logits`` and the
    coefficient (``router_aux_loss_coef``, JetMoE's ``aux_loss_coef``, DBRX's
    ``ffn_config.moe_loss_weight``) set on the text config, where the causal LM reads them."""
    text = cfg.get_text_config()
    text.output_router_logits = True
    for name in ("router_aux_loss_coef", "aux_loss_coef"):
        if hasattr(text, name):
            setattr(text, name, coef)
    ffn = getattr(text, "ffn_config", None)  # DBRX: ffn_config.moe_loss_weight
    if hasattr(ffn, "moe_loss_weight"):
        ffn.moe_loss_weight = coef
    return cfg


def has_router_loss(model_type: str) -> bool:
    """The family's config has ``output_router_logits`` (its forward can add an MoE
    load-balancing loss)."""
    return hasattr(tiny_config(model_type).get_text_config(), "output_router_logits")
