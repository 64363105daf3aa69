"""gpt-oss (openai/gpt-oss-20b and -120b): attention sinks, sliding-window layers between full ones, biases on
q, k, v, o, a biased router whose softmax runs over the chosen top-k, and experts with biases and the clamped
SwiGLU, stored as transformers' GptOssExperts holds them: 3-D (experts, in, out) tensors, gate and up
alternating on gate_up_proj's last dim.

The entry says how GptOssConfig becomes a ModelConfig (attn_sinks, router_logit_bias, expert_bias, swiglu_*,
interleaved_experts) and how the checkpoint names its tensors; phantom.arch.family collects it. The experts
here come from a 16-bit checkpoint (transformers' save_pretrained, or a bf16 copy of the Hub's) or as the Hub
ships them, in MXFP4 (an mxfp4 store: phantom.convert.checkpoints). Imports phantom.arch.config and the shared tables only.
"""
from __future__ import annotations

from phantom.arch.config import ModelConfig, refuse
from phantom.arch.family_moe import MOE_IRRELEVANT, MoeKeys, read_moe
from phantom.arch.familybase import ATTENTION_KEYS, BIAS_KEYS, COMMON_DEFAULTS, Family, _read_attention_bias

EXPERTS = "model.layers.{}.mlp.experts"
GPT_OSS_KEYS = {**ATTENTION_KEYS, **{k: v for k, v in BIAS_KEYS.items() if "self_attn" in k},
                "model.layers.{}.self_attn.sinks": "attention.sinks",
                "model.layers.{}.mlp.router.weight": "feed_forward.gate.weight",
                "model.layers.{}.mlp.router.bias": "feed_forward.gate.bias"}
# transformers' GptOssExperts (and the Hub's bf16 copies): (experts, in, out) weights, gate and up alternating
# on gate_up_proj's last dim (its bias's too); phantom.files.fusedrows reads each expert's parts out of them
GPT_OSS_EXPERTS = MoeKeys({}, ("num_local_experts", "num_experts_per_tok", "router_aux_loss_coef"), fused={
    f"{EXPERTS}.gate_up_proj": ("feed_forward.experts.<e>.w1.weight", "feed_forward.experts.<e>.w3.weight"),
    f"{EXPERTS}.gate_up_proj_bias": ("feed_forward.experts.<e>.w1.bias", "feed_forward.experts.<e>.w3.bias"),
    f"{EXPERTS}.down_proj": ("feed_forward.experts.<e>.w2.weight",),
    f"{EXPERTS}.down_proj_bias": ("feed_forward.experts.<e>.w2.bias",)})


def read_window(c: dict, path) -> dict:
    """layer_types as written, else GptOssConfig's: the even layers (the first included) slide over the last
    sliding_window keys, the odd ones see every key before them."""
    n = c["num_hidden_layers"]
    types = c.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    if len(types) != n:
        refuse(path, "layer_types", types, f"one type per layer ({n})")
    return {"sliding_window": c.get("sliding_window"), "layer_types": tuple(types)}


def read_swiglu(c: dict, path) -> dict:
    """The experts' clamped SwiGLU: gate clamped above and up on both sides at swiglu_limit, the sigmoid's gain
    swiglu_alpha (GptOssExperts has no unclamped form: a null limit is refused)."""
    limit, alpha = c.get("swiglu_limit"), c.get("swiglu_alpha")
    if type(limit) not in (int, float) or limit <= 0:
        refuse(path, "swiglu_limit", limit, "a positive number (GptOssExperts always clamps)")
    if type(alpha) not in (int, float):
        refuse(path, "swiglu_alpha", alpha, "a number")
    return {"swiglu_limit": float(limit), "swiglu_alpha": float(alpha)}


def read_experts(c: dict, path) -> dict:
    """The experts are intermediate_size wide, each token's num_experts_per_tok weighted by a softmax over
    their logits alone (GptOssTopKRouter); the router's aux loss weight as the other mixtures'."""
    return {**read_moe(c, path), "router_score": "topk_softmax", "norm_topk_prob": False}


def gpt_oss_fields(cfg: ModelConfig) -> dict:
    """The fields of an export's config.json GptOssConfig reads beyond the common ones."""
    types = [cfg.layer_types[i % len(cfg.layer_types)] for i in range(cfg.n_layers)] if cfg.layer_types else \
        ["full_attention"] * cfg.n_layers
    return {"attention_bias": cfg.qkv_bias, "sliding_window": cfg.sliding_window, "layer_types": types,
            "swiglu_limit": cfg.swiglu_limit, "swiglu_alpha": cfg.swiglu_alpha,
            "intermediate_size": cfg.expert_dim}


IRRELEVANT = {**MOE_IRRELEVANT,
              "experts_per_token": "OpenAI's own code's name for num_experts_per_tok, which transformers reads",
              "initial_context_length": "OpenAI's own code's name for the yarn original context; transformers reads "
                                        "rope_scaling's original_max_position_embeddings"}
FAMILIES = {f.name: f for f in (
    Family("gpt_oss", ("GptOssForCausalLM",), "gpt_oss", GPT_OSS_KEYS,
           readers={"attention_bias": _read_attention_bias, "sliding_window": read_window, "layer_types": read_window,
                    "swiglu_limit": read_swiglu, "swiglu_alpha": read_swiglu,
                    **{f: read_experts for f in ("num_local_experts", "num_experts", "num_experts_per_tok",
                                                 "router_aux_loss_coef")}},
           fixed={"attn_sinks": True, "router_logit_bias": True, "expert_bias": True, "interleaved_experts": True},
           irrelevant=IRRELEVANT, moe=GPT_OSS_EXPERTS, hf_fields=gpt_oss_fields,
           defaults={**COMMON_DEFAULTS, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "head_dim": 64,
                     "sliding_window": 128, "num_experts_per_tok": 4, "swiglu_alpha": 1.702, "swiglu_limit": 7.0,
                     "router_aux_loss_coef": 0.001, "attention_bias": True,
                     "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                         "truncate": False, "original_max_position_embeddings": 4096,
                                         "rope_theta": 150000.0}}),
)}
