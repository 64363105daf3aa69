"""Qwen3-Next and Qwen3.5's mixtures of experts (text): Gated DeltaNet layers (phantom.arch.deltanet) among gated
full-attention ones (q_proj yields each head's query and its output gate; per-head q/k norms; RoPE over the
leading partial_rotary_factor of each head, in halves), (1 + w) RMSNorms, and experts with a sigmoid-gated
shared expert.

Qwen3.5's checkpoints are vision-language models: their config.json nests the text model in text_config and
their tensors under model.language_model; the text part is read, the vision tower (model.visual) and the
multi-token-prediction layers (mtp) are left out, said once. Imports phantom.arch.config and the shared tables.
"""
from __future__ import annotations

import logging

from phantom.arch.config import ModelConfig, refuse
from phantom.arch.family_moe import DENSE_READERS, FUSED_EXPERTS, MOE_IRRELEVANT, MOE_READERS, QWEN_EXPERTS, \
    QWEN_MOE_FIELDS, ROUTER_KEYS, SHARED_EXPERT_KEYS, MoeKeys, read_moe
from phantom.arch.familybase import ATTENTION_KEYS, COMMON_DEFAULTS, QK_NORM_KEYS, Family, _read_attention_bias

log = logging.getLogger(__name__)

LINEAR = "model.layers.{}.linear_attn"
LINEAR_KEYS = {f"{LINEAR}.{hf}": f"attention.{hf}" for hf in (
    "conv1d.weight", "dt_bias", "A_log", "norm.weight", "out_proj.weight")}
SPLIT_INPUTS = {f"{LINEAR}.in_proj_{p}.weight": f"attention.in_proj_{p}.weight" for p in ("qkv", "z", "b", "a")}
GROUPED_INPUTS = {f"{LINEAR}.in_proj_{p}.weight": f"attention.in_proj_{p}.weight" for p in ("qkvz", "ba")}
MOE_KEYS = {**ROUTER_KEYS, **SHARED_EXPERT_KEYS}
EXPERTS = MoeKeys(QWEN_EXPERTS, (*QWEN_MOE_FIELDS, "shared_expert_intermediate_size"), fused=FUSED_EXPERTS)
VLM_PREFIX = "model.language_model."  # where a Qwen3.5 vision-language checkpoint keeps the text model's tensors


def read_linear(c: dict, path) -> dict:
    """Gated DeltaNet's shapes, and which layers have it: layer_types as written, else every
    full_attention_interval-th layer full attention and the others linear (as the config classes fill them in)."""
    n, every = c["num_hidden_layers"], c.get("full_attention_interval", 4)
    types = c.get("layer_types") or ["linear_attention" if (i + 1) % every else "full_attention" for i in range(n)]
    if len(types) != n or set(types) - {"linear_attention", "full_attention"}:
        refuse(path, "layer_types", types, f"{n} entries, each linear_attention or full_attention")
    return {"layer_types": tuple(types), "linear_k_heads": c["linear_num_key_heads"],
            "linear_v_heads": c["linear_num_value_heads"], "linear_k_dim": c["linear_key_head_dim"],
            "linear_v_dim": c["linear_value_head_dim"], "linear_conv": c["linear_conv_kernel_dim"]}


def read_gated_attention(c: dict, path) -> dict:
    """Full attention gated per head (attn_output_gate, true in every published file), RoPE over the leading
    partial_rotary_factor of each head (0.25 where the file leaves it out, as the config classes set it)."""
    if not c.get("attn_output_gate", True):
        refuse(path, "attn_output_gate", c["attn_output_gate"], "true (transformers' classes always gate)")
    rope = c.get("rope_parameters") or {}
    factor = rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 0.25))
    head = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return {"rotary_dim": int(head * factor) if int(head * factor) != head else None, "attn_output_gate": True}


def read_mtp(c: dict, path) -> dict:
    if n := c.get("mtp_num_hidden_layers"):
        log.info("%s: %d multi-token-prediction layer(s) after the last block are left out, as transformers leaves "
                 "them out", path, n)
    return {}


def text_config(c: dict, path) -> dict:
    """A Qwen3.5 config.json's text model: text_config's fields where the file is a vision-language model's (the
    vision tower said left out, once); a text model has no dense MLP, so intermediate_size is its shared expert's
    (read by no layer)."""
    if isinstance(c.get("text_config"), dict):
        log.info("%s: %s is a vision-language model: its text model is read, the vision tower is left out", path,
                 (c.get("architectures") or ["?"])[0])
        c = {**c["text_config"], "architectures": ["Qwen3_5MoeForCausalLM"],
             "tie_word_embeddings": c["text_config"].get("tie_word_embeddings", c.get("tie_word_embeddings", False))}
    return {**c, "intermediate_size": c.get("shared_expert_intermediate_size", 512)}


def text_weights(weight_map: dict[str, str]) -> dict[str, str]:
    """A checkpoint's tensor names -> the text model's (a vision-language checkpoint's model.language_model.X as
    model.X), the vision tower's and the prediction layers' left out."""
    if not any(k.startswith(VLM_PREFIX) for k in weight_map):
        return {k: k for k in weight_map}
    out = {k.replace(VLM_PREFIX, "model.", 1): k for k in weight_map if k.startswith(VLM_PREFIX)}
    return out | {k: k for k in weight_map if k.startswith("lm_head.")}


def full_attention_interval(cfg: ModelConfig) -> int | None:
    """p where every p-th layer (and only those) is full attention, as the config classes and llama.cpp lay
    layers out from full_attention_interval; None where the layers follow no such period."""
    full = [i + 1 for i in range(cfg.n_layers) if not cfg.linear(i)]
    period = full[0] if full else cfg.n_layers + 1
    return period if full == list(range(period, cfg.n_layers + 1, period)) else None


def linear_fields(cfg: ModelConfig) -> dict:
    """The fields an export's config.json writes for these families (what read_linear and read_gated_attention
    read); full_attention_interval beside layer_types where they agree (llama.cpp's converter reads it alone)."""
    period = full_attention_interval(cfg)
    return {"layer_types": ["linear_attention" if cfg.linear(i) else "full_attention" for i in range(cfg.n_layers)],
            **({"full_attention_interval": period} if period else {}),
            "linear_num_key_heads": cfg.linear_k_heads, "linear_num_value_heads": cfg.linear_v_heads,
            "linear_key_head_dim": cfg.linear_k_dim, "linear_value_head_dim": cfg.linear_v_dim,
            "linear_conv_kernel_dim": cfg.linear_conv, "partial_rotary_factor": cfg.rope_dim / cfg.head_dim,
            "attention_bias": cfg.qkv_bias}


def qwen35_fields(cfg: ModelConfig) -> dict:
    return {k: v for k, v in linear_fields(cfg).items()} | {"intermediate_size": None}


LINEAR_READERS = {f: read_linear for f in ("layer_types", "full_attention_interval", "linear_num_key_heads",
                                           "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                                           "linear_conv_kernel_dim")}
COMMON_READERS = {**LINEAR_READERS, "attention_bias": _read_attention_bias, **MOE_READERS,
                  "moe_intermediate_size": read_moe, "shared_expert_intermediate_size": read_moe,
                  **{f: read_gated_attention for f in ("attn_output_gate", "partial_rotary_factor")},
                  "mtp_num_hidden_layers": read_mtp}
FIXED = {"qk_norm": True, "norm_offset": 1.0, "rope_interleave": False}  # (1 + w) norms; HF's RoPE halves, unpermuted
IRRELEVANT = {**MOE_IRRELEVANT, "mtp_use_dedicated_embeddings": "how the left-out prediction layers embed tokens"}
DEFAULTS = {**COMMON_DEFAULTS, "max_position_embeddings": 32768, "head_dim": 256, "linear_conv_kernel_dim": 4,
            "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_key_heads": 16,
            "linear_num_value_heads": 32, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
            "router_aux_loss_coef": 0.001, "attention_bias": False}

FAMILIES = {f.name: f for f in (
    Family("qwen3_next", ("Qwen3NextForCausalLM",), "qwen3_next",
           {**ATTENTION_KEYS, **QK_NORM_KEYS, **LINEAR_KEYS, **GROUPED_INPUTS, **MOE_KEYS},
           readers={**COMMON_READERS, **DENSE_READERS}, fixed={**FIXED, "linear_grouped": True},
           irrelevant=IRRELEVANT, moe=EXPERTS, hf_fields=linear_fields,
           defaults={**DEFAULTS, "intermediate_size": 5632, "num_experts": 512, "num_experts_per_tok": 10,
                     "norm_topk_prob": True, "decoder_sparse_step": 1}),
    Family("qwen3_5_moe", ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"), "qwen3_5_moe_text",
           {**ATTENTION_KEYS, **QK_NORM_KEYS, **LINEAR_KEYS, **SPLIT_INPUTS, **MOE_KEYS},
           readers=COMMON_READERS, fixed={**FIXED, "norm_topk_prob": True},  # its router always renormalises
           irrelevant={**IRRELEVANT, "norm_topk_prob": "Qwen3_5MoeTopKRouter always renormalises"},
           moe=EXPERTS, hf_fields=qwen35_fields, text=(text_config, text_weights),
           defaults={**DEFAULTS, "num_experts": 256, "num_experts_per_tok": 8}),
)}
