"""The hyperparameter keys llama.cpp's convert_hf_to_gguf.py writes per family: each converter class's
set_gguf_parameters, read as it reads them from the config.json of phantom's HF export, in its order.

gguf_arch names which of these a family's Arch uses. May import gguf alone.
"""
from __future__ import annotations

import contextlib
import logging

import gguf

# scoring_func -> llama.cpp's llama_expert_gating_func_type (sqrtsoftplus: DeepSeek-V4's, which gguf's package lacks)
SCORING = {"softmax": 1, "sigmoid": 2, "sqrtsoftplus": 4}


def rope_parameters(c: dict) -> dict:
    """The converter's TextModel.rope_parameters: rope_parameters (or rope_scaling) with rope_theta mirrored in."""
    rope = dict(c.get("rope_parameters", c.get("rope_scaling")) or {})
    if "full_attention" not in rope and "sliding_attention" not in rope:
        if "rope_theta" not in rope and c.get("rope_theta") is not None:
            rope["rope_theta"] = c["rope_theta"]
        if "rope_type" not in rope and rope.get("type") is not None:
            rope["rope_type"] = rope["type"]
    return rope


def first(c: dict, keys: tuple[str, ...]):
    """The converter's find_hparam(keys, optional=True): the first key present (its value, None included)."""
    return next((c[k] for k in keys if k in c), None)


@contextlib.contextmanager
def rewriting():
    """Keys written a second time, as some converter classes do (the new value in the old one's place),
    without gguf's warning about it."""
    log = logging.getLogger("gguf.gguf_writer")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def text_hparams(w: gguf.GGUFWriter, c: dict, ftype: gguf.LlamaFileType, blocks: int | None = None) -> None:
    """TextModel.set_gguf_parameters: the keys every family's class starts from, in its order; blocks: the
    class's block count where it counts more than num_hidden_layers (prediction layers)."""
    w.add_block_count(blocks or c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    if (ff := first(c, ("intermediate_size", "n_inner", "hidden_dim"))) is not None:
        w.add_feed_forward_length(ff)
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    rope = rope_parameters(c)
    full = rope.get("full_attention", rope)
    kind, factor = full.get("rope_type"), full.get("factor")
    if kind == "linear" and factor is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(factor)
    elif kind == "yarn" and factor is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(factor)
        w.add_rope_scaling_orig_ctx_len(full["original_max_position_embeddings"])
        if full.get("extrapolation_factor") is not None:
            w.add_rope_scaling_yarn_ext_factor(full["extrapolation_factor"])
        if (attn := full.get("attention_factor", full.get("attn_factor"))) is not None:
            w.add_rope_scaling_yarn_attn_factor(attn)
        if full.get("beta_fast") is not None:
            w.add_rope_scaling_yarn_beta_fast(full["beta_fast"])
        if full.get("beta_slow") is not None:
            w.add_rope_scaling_yarn_beta_slow(full["beta_slow"])
    elif kind in ("su", "longrope"):
        w.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE)
    if "mrope_section" in rope:  # padded to 4 sections (time, height, width, extra)
        w.add_rope_dimension_sections((list(rope["mrope_section"]) + [0] * 4)[:4])
    if full.get("rope_theta") is not None:
        w.add_rope_freq_base(full["rope_theta"])
    if (local := rope.get("sliding_attention", {}).get("rope_theta")) is not None:
        w.add_rope_freq_base_swa(local)
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    if (experts := first(c, ("num_local_experts", "num_experts", "n_routed_experts"))) is not None:
        w.add_expert_count(experts)
    if (used := first(c, ("num_experts_per_tok", "num_experts_per_token", "top_k_experts"))) is not None:
        w.add_expert_used_count(used)
    if c.get("n_group") is not None:
        w.add_expert_group_count(c["n_group"])
    if c.get("topk_group") is not None:
        w.add_expert_group_used_count(c["topk_group"])
    score = first(c, ("score_function", "scoring_func", "score_func", "moe_router_activation",
                      "moe_router_activation_func"))
    if score is not None:
        w.add_uint32(gguf.Keys.LLM.EXPERT_GATING_FUNC.format(arch=w.arch), SCORING[score])
    if c.get("head_dim") is not None:
        w.add_key_length(c["head_dim"])
        w.add_value_length(c["head_dim"])
    w.add_file_type(ftype)


def llama_hparams(w: gguf.GGUFWriter, c: dict, ftype) -> None:
    """LlamaModel: the vocabulary size and RoPE's width after the base keys."""
    text_hparams(w, c, ftype)
    w.add_vocab_size(c["vocab_size"])
    w.add_rope_dimension_count(c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"])


def qwen_moe_hparams(w: gguf.GGUFWriter, c: dict, ftype, blocks: int | None = None) -> None:
    """Qwen2MoeModel (Qwen3MoeModel's base): the experts' widths."""
    text_hparams(w, c, ftype, blocks)
    if c.get("moe_intermediate_size") is not None:
        w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    if c.get("shared_expert_intermediate_size") is not None:
        w.add_expert_shared_feed_forward_length(c["shared_expert_intermediate_size"])


def olmoe_hparams(w: gguf.GGUFWriter, c: dict, ftype) -> None:
    """OlmoeModel: the base keys, its norms' epsilon set to 1e-5 (check_supported refuses another)."""
    text_hparams(w, c, ftype)
    with rewriting():
        w.add_layer_norm_rms_eps(1e-5)


def gemma2_hparams(w: gguf.GGUFWriter, c: dict, ftype) -> None:
    """Gemma2Model's own keys (no RoPE base: llama.cpp's default 10000, which check_supported requires)."""
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_block_count(c["num_hidden_layers"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_key_length(c["head_dim"])
    w.add_value_length(c["head_dim"])
    w.add_file_type(ftype)
    w.add_attn_logit_softcapping(c["attn_logit_softcapping"])
    w.add_final_logit_softcapping(c["final_logit_softcapping"])
    w.add_sliding_window(c["sliding_window"])


def gemma3_hparams(w: gguf.GGUFWriter, c: dict, ftype) -> None:
    """Gemma3Model: the base keys, some written again (in place), then soft-capping and the window."""
    text_hparams(w, c, ftype)
    with rewriting():
        w.add_context_length(c.get("max_position_embeddings", 131072))
        w.add_head_count(c.get("num_attention_heads", 8))
        w.add_layer_norm_rms_eps(c.get("rms_norm_eps", 1e-6))
        w.add_key_length(c.get("head_dim", 256))
        w.add_value_length(c.get("head_dim", 256))
        rope = rope_parameters(c)
        w.add_rope_freq_base(rope.get("full_attention", rope).get("rope_theta", 1_000_000.0))
        if c.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(c["final_logit_softcapping"])
        if c.get("sliding_window_pattern") != 1:
            w.add_sliding_window(c["sliding_window"])
        w.add_head_count_kv(c.get("num_key_value_heads", 4))


def deepseek2_hparams(w: gguf.GGUFWriter, c: dict, ftype, blocks: int | None = None) -> None:
    """DeepseekV2Model (DeepSeek-V2 and V3): the base keys with one kv head (latent attention as MQA), then
    the latent ranks and head sizes (key/value lengths written again, in place), the experts and RoPE's width;
    blocks: as text_hparams'."""
    c = {**c, "num_key_value_heads": 1, "rms_norm_eps": c.get("rms_norm_eps", 1e-6)}
    text_hparams(w, c, ftype, blocks)
    experts = c.get("n_routed_experts")
    first_dense = c.get("first_k_dense_replace")
    w.add_leading_dense_block_count(first_dense if first_dense is not None else
                                    0 if experts is not None else c["num_hidden_layers"])
    rank = c.get("kv_lora_rank", 512)
    w.add_vocab_size(c["vocab_size"])
    if c.get("q_lora_rank") is not None:
        w.add_q_lora_rank(c["q_lora_rank"])
    w.add_kv_lora_rank(rank)
    with rewriting():
        w.add_key_length(rank + c["qk_rope_head_dim"])
        w.add_value_length(rank)
    w.add_key_length_mla(c["qk_nope_head_dim"] + c["qk_rope_head_dim"])
    w.add_value_length_mla(c["v_head_dim"])
    w.add_expert_feed_forward_length(first(c, ("moe_intermediate_size", "intermediate_size")))
    if experts is not None:
        with rewriting():
            w.add_expert_count(experts)
    w.add_expert_shared_count(c.get("n_shared_experts", 0))
    if c.get("routed_scaling_factor") is not None:
        w.add_expert_weights_scale(c["routed_scaling_factor"])
    if c.get("norm_topk_prob"):
        w.add_expert_weights_norm(c["norm_topk_prob"])
    w.add_rope_dimension_count(c["qk_rope_head_dim"])
    if (mscale := rope_parameters(c).get("mscale_all_dim")) is not None:
        w.add_rope_scaling_yarn_log_mul(0.1 * mscale)


def dsa_hparams(w: gguf.GGUFWriter, c: dict, ftype, glm: bool = False) -> None:
    """DeepseekV32Model (DeepSeek Sparse Attention): DeepseekV2Model's keys, its blocks counting the prediction
    layers, then their count and the lightning indexer's heads, width and top-k; glm: GlmMoeDsaModel's, which
    writes RoPE's width again (times partial_rotary_factor, in place) before them and which layers run an indexer
    of their own (indexer_types) after."""
    deepseek2_hparams(w, c, ftype, c["num_hidden_layers"] + c.get("num_nextn_predict_layers", 0))
    if glm:
        with rewriting():
            rope = rope_parameters(c).get("partial_rotary_factor", 1.0)
            w.add_rope_dimension_count(int(c["qk_rope_head_dim"] * rope))
    if c.get("num_nextn_predict_layers") is not None:
        w.add_nextn_predict_layers(c["num_nextn_predict_layers"])
    w.add_uint32(f"{w.arch}.attention.indexer.head_count", c["index_n_heads"])
    w.add_uint32(f"{w.arch}.attention.indexer.key_length", c["index_head_dim"])
    w.add_uint32(f"{w.arch}.attention.indexer.top_k", c["index_topk"])
    if glm and c.get("indexer_types") is not None:
        w.add_array(f"{w.arch}.attention.indexer.types", [t == "full" for t in c["indexer_types"]])


def glm_dsa_hparams(w: gguf.GGUFWriter, c: dict, ftype) -> None:
    """GlmMoeDsaModel (GLM-5): dsa_hparams' GLM form."""
    dsa_hparams(w, c, ftype, glm=True)


def phi3_rope_dims(c: dict) -> int:
    return int(c.get("partial_rotary_factor", 1.0) * c["hidden_size"]) // c["num_attention_heads"]


def phi3_hparams(w: gguf.GGUFWriter, c: dict, ftype) -> None:
    """Phi3MiniModel's own keys (sliding window 0 where there is none)."""
    w.add_context_length(c["max_position_embeddings"])
    w.add_rope_scaling_orig_ctx_len(c["original_max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_block_count(c["num_hidden_layers"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_rope_dimension_count(phi3_rope_dims(c))
    rope = rope_parameters(c)
    w.add_rope_freq_base(rope.get("full_attention", rope)["rope_theta"])
    w.add_file_type(ftype)
    w.add_sliding_window(c.get("sliding_window") or 0)


def rope_dims(c: dict, default_factor: float) -> int:
    """RoPE's width as Glm4MoeModel and Qwen3NextModel write it: the head's, times partial_rotary_factor."""
    head = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return int(head * c.get("partial_rotary_factor", default_factor))


def glm4moe_hparams(w: gguf.GGUFWriter, c: dict, ftype) -> None:
    """Glm4MoeModel: the base keys, RoPE's width, then DeepSeekMoE's (routed experts alone counted, sigmoid
    scores always) and the multi-token-prediction layers' count."""
    text_hparams(w, c, ftype, c["num_hidden_layers"] + c.get("num_nextn_predict_layers", 0))
    w.add_rope_dimension_count(rope_dims(c, 0.5))
    if c.get("n_routed_experts") is not None:
        with rewriting():  # the base keys wrote it already (n_routed_experts), in place
            w.add_expert_count(c["n_routed_experts"])
    if c.get("moe_intermediate_size") is not None:
        w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    if c.get("n_shared_experts") is not None:
        w.add_expert_shared_count(c["n_shared_experts"])
    if c.get("first_k_dense_replace") is not None:
        w.add_leading_dense_block_count(c["first_k_dense_replace"])
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    if c.get("routed_scaling_factor") is not None:
        w.add_expert_weights_scale(c["routed_scaling_factor"])
    if c.get("norm_topk_prob") is not None:
        w.add_expert_weights_norm(c["norm_topk_prob"])
    if c.get("num_nextn_predict_layers") is not None:
        w.add_nextn_predict_layers(c["num_nextn_predict_layers"])


def llama4_hparams(w: gguf.GGUFWriter, c: dict, ftype) -> None:
    """Llama4Model: LlamaModel's keys with the dense layers' width as the feed-forward length (intermediate_size_mlp),
    then the sparse layers' period and the experts' width (intermediate_size); no window where no layer chunks."""
    llama_hparams(w, {**c, "intermediate_size": c["intermediate_size_mlp"]}, ftype)
    w.add_interleave_moe_layer_step(c.get("interleave_moe_layer_step", 1))  # Llama4TextConfig's default
    w.add_expert_feed_forward_length(c["intermediate_size"])
    if "layer_types" in c and all(t == "full_attention" for t in c["layer_types"]):
        w.add_sliding_window(0)


def minimax_m2_hparams(w: gguf.GGUFWriter, c: dict, ftype) -> None:
    """MiniMaxM2Model: the base keys, the experts' width (intermediate_size), RoPE's width (rotary_dim)."""
    text_hparams(w, c, ftype)
    w.add_expert_feed_forward_length(c["intermediate_size"])
    w.add_rope_dimension_count(c["rotary_dim"])


def gpt_oss_hparams(w: gguf.GGUFWriter, c: dict, ftype) -> None:
    """GptOssModel: the base keys, the window, the experts' width (intermediate_size)."""
    text_hparams(w, c, ftype)
    w.add_sliding_window(c["sliding_window"])
    w.add_expert_feed_forward_length(c["intermediate_size"])


def qwen3next_hparams(w: gguf.GGUFWriter, c: dict, ftype) -> None:
    """Qwen3NextModel as converted with --no-mtp (phantom's export has no multi-token-prediction layers, as
    transformers has none): Qwen2MoeModel's keys, Gated DeltaNet's shapes as ssm.*, which layers are recurrent
    (layer_types), the full-attention period, RoPE's width."""
    qwen_moe_hparams(w, c, ftype)
    w.add_ssm_conv_kernel(c["linear_conv_kernel_dim"])
    w.add_ssm_state_size(c["linear_key_head_dim"])
    w.add_ssm_group_count(c["linear_num_key_heads"])
    w.add_ssm_time_step_rank(c["linear_num_value_heads"])
    w.add_ssm_inner_size(c["linear_value_head_dim"] * c["linear_num_value_heads"])
    if (layer_types := c.get("layer_types")) is not None:
        w.add_array(f"{w.arch}.attention.recurrent_layers", [t == "linear_attention" for t in layer_types])
    w.add_full_attention_interval(c.get("full_attention_interval", 4))
    w.add_rope_dimension_count(rope_dims(c, 0.25))


QWEN35_MROPE_SECTION = [11, 11, 10, 0]  # _Qwen35MRopeMixin's default, written where the config has none


def qwen35moe_hparams(w: gguf.GGUFWriter, c: dict, ftype) -> None:
    """Qwen3_5MoeTextModel as converted with --no-mtp: Qwen3NextModel's keys, its default M-RoPE sections where the
    config has none."""
    qwen3next_hparams(w, c, ftype)
    if "mrope_section" not in rope_parameters(c):
        w.add_rope_dimension_sections(QWEN35_MROPE_SECTION)
