"""DeepSeek-V3 (and R1, V3.1, Kimi-K2, which ship its architecture; Kimi-K2.5/K2.6's text model), DeepSeek-V2 and
GLM-4.5: DeepSeekMoE
routing (sigmoid or softmax scores, a correction bias for the choice, groups of experts, a scale, ungated
shared experts, dense first layers) and, for the DeepSeeks, multi-head latent attention (phantom.arch.mla).

Each entry says how transformers' config class becomes a ModelConfig and how the checkpoint names its
tensors; phantom.arch.family collects them. Imports phantom.arch.config and the shared tables only.

Kimi-K2.5/K2.6 (Kimi_K25ForConditionalGeneration) is DeepSeek-V3's text model (its text_config) beside a vision
tower: the text model is read as DeepSeek-V3, the vision tower and its projector are left out (said once).
"""
from __future__ import annotations

import logging
import re

from phantom.arch.config import ModelConfig, refuse
from phantom.arch.family_moe import FUSED_EXPERTS, QWEN_EXPERTS, MoeKeys, expert_keys, refused_unless
from phantom.arch.familybase import ATTENTION_KEYS, BIAS_KEYS, COMMON_DEFAULTS, DENSE_MLP_KEYS, LLAMA_KEYS, \
    QK_NORM_KEYS, Family, vl_text_config

log = logging.getLogger(__name__)

MLA_KEYS = {f"model.layers.{{}}.self_attn.{hf}.weight": f"attention.{ours}.weight" for hf, ours in (
    ("q_a_proj", "wq_a"), ("q_a_layernorm", "q_a_norm"), ("q_b_proj", "wq_b"), ("q_proj", "wq"),
    ("kv_a_proj_with_mqa", "wkv_a"), ("kv_a_layernorm", "kv_a_norm"), ("kv_b_proj", "wkv_b"), ("o_proj", "wo"))}
LAYER_NORM_KEYS = {hf: name for hf, name in LLAMA_KEYS.items() if "layernorm" in hf or "{}" not in hf}
DEEPSEEK_MOE_KEYS = {"model.layers.{}.mlp.gate.weight": "feed_forward.gate.weight",
                     "model.layers.{}.mlp.gate.e_score_correction_bias": "feed_forward.gate.e_score_correction_bias",
                     **expert_keys("model.layers.{}.mlp.shared_experts", "gate_proj", "up_proj", "down_proj",
                                   "feed_forward.shared_expert"),
                     **DENSE_MLP_KEYS}
DEEPSEEK_EXPERTS = MoeKeys(QWEN_EXPERTS, (), fused=FUSED_EXPERTS)


def read_mla(c: dict, path) -> dict:
    """Latent attention's shapes: a q/k head is qk_nope_head_dim + qk_rope_head_dim wide, RoPE turns its
    last qk_rope_head_dim dims, in pairs (rope_interleave, DeepSeek-V2 always) or halves."""
    nope, rope = c["qk_nope_head_dim"], c["qk_rope_head_dim"]
    return {"q_lora_rank": c.get("q_lora_rank") or 0, "kv_lora_rank": c["kv_lora_rank"], "qk_nope_head_dim": nope,
            "v_head_dim": c["v_head_dim"], "explicit_head_dim": nope + rope, "rotary_dim": rope, "n_kv_heads": None,
            "rope_interleave": bool(c.get("rope_interleave", True))}


def read_deepseek_moe(c: dict, path) -> dict:
    """DeepSeekMoE: n_routed_experts of width moe_intermediate_size, n_shared_experts always on (one MLP that
    wide times their number), the first first_k_dense_replace layers dense; the choice limited to topk_group of
    n_group groups; the weights times routed_scaling_factor."""
    n, groups = c["num_hidden_layers"], c.get("n_group") or 1
    freq, first = c.get("moe_layer_freq", 1), c.get("first_k_dense_replace") or 0
    if freq != 1:
        refuse(path, "moe_layer_freq", freq, "1 (transformers' DeepSeek and GLM-4.5 classes make every layer from "
                                             "first_k_dense_replace on sparse)")
    if not 0 <= first <= n:
        refuse(path, "first_k_dense_replace", first, f"0 to num_hidden_layers ({n})")
    return {"n_experts": c["n_routed_experts"], "experts_per_token": c["num_experts_per_tok"],
            "expert_dim": c["moe_intermediate_size"], "shared_expert_dim": c["moe_intermediate_size"] *
            (c.get("n_shared_experts") or 0), "shared_expert_gate": False, "dense_layers": tuple(range(first)),
            "routed_scale": float(c.get("routed_scaling_factor") or 1.0), "router_groups": groups,
            "router_topk_groups": c.get("topk_group") or 1, "router_fp32": True}


def read_v3_router(c: dict, path) -> dict:
    """DeepSeek-V3 and GLM-4.5: sigmoid scores, the correction bias, groups ranked by their two best scores
    (DeepSeek's noaux_tc; its scoring_func and topk_method, in the Hub's files, must say so)."""
    if c.get("scoring_func", "sigmoid") != "sigmoid":
        refuse(path, "scoring_func", c["scoring_func"], "sigmoid (as transformers' DeepseekV3TopkRouter scores)")
    if c.get("topk_method", "noaux_tc") != "noaux_tc":
        refuse(path, "topk_method", c["topk_method"], "noaux_tc (as transformers' DeepseekV3TopkRouter chooses)")
    return {"router_score": "sigmoid", "router_bias": True, "router_group_score": "top2",
            "norm_topk_prob": bool(c.get("norm_topk_prob"))}


def read_v2_router(c: dict, path) -> dict:
    """DeepSeek-V2: softmax scores; greedy top-k, or within the best groups by their best score
    (group_limited_greedy). DeepseekV2TopkRouter never renormalises (norm_topk_prob is not read)."""
    method = c.get("topk_method") or "greedy"
    if method not in ("greedy", "group_limited_greedy"):
        refuse(path, "topk_method", method, "greedy, group_limited_greedy")
    if c.get("scoring_func", "softmax") != "softmax":
        refuse(path, "scoring_func", c["scoring_func"], "softmax (as transformers' DeepseekV2TopkRouter scores)")
    grouped = method == "group_limited_greedy"
    return {"router_score": "softmax", "router_group_score": "max", "norm_topk_prob": False,
            "router_groups": (c.get("n_group") or 1) if grouped else 1,
            "router_topk_groups": (c.get("topk_group") or 1) if grouped else 1}


def read_mtp(c: dict, path) -> dict:
    """The multi-token-prediction layers DeepSeek-V3's and GLM-4.5's files carry after the last block: transformers
    ignores them, and so does phantom (said once, here)."""
    if n := c.get("num_nextn_predict_layers") or c.get("num_mtp_layers"):
        log.info("%s: %d multi-token-prediction layer(s) after the last block are left out, as transformers leaves "
                 "them out", path, n)
    return {}


def read_glm_attention(c: dict, path) -> dict:
    """GLM-4.5: biases on q, k, v (none on o), per-head q/k norms (use_qk_norm), RoPE over the leading
    partial_rotary_factor of each head (0.5 where the file leaves it out, as Glm4MoeConfig sets it)."""
    rope = c.get("rope_parameters") or {}
    factor = rope.get("partial_rotary_factor") or c.get("partial_rotary_factor") or 0.5
    head = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return {"qkv_bias": bool(c.get("attention_bias")), "qk_norm": bool(c.get("use_qk_norm")),
            "rotary_dim": int(head * factor) if int(head * factor) != head else None}


def kimi_text_config(c: dict, path) -> dict:
    """A Kimi-K2.5 config.json's text model (text_config: DeepSeek-V3's fields), the vision tower said left out;
    tied where the outer config leaves it out, as Kimi_K25ForConditionalGeneration ties. A DeepSeek-V3 file is its
    own text model."""
    return vl_text_config(c, path, "DeepseekV3ForCausalLM", "deepseek_v3", tie=True)


KIMI_TEXT = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
             ("model.language_model.", "model."))  # the Hub's names, save_pretrained's, the modules'


def kimi_text_weights(weight_map: dict[str, str]) -> dict[str, str]:
    """A checkpoint's tensor names -> the text model's: Kimi-K2.5's language_model.model.X (the Hub's; transformers'
    save_pretrained writes its layers as blocks.N) or model.language_model.X as model.X, language_model.lm_head as
    lm_head; the vision tower's and projector's left out. Other files' names as they are."""
    if not any(k.startswith(("language_model.", "model.language_model.")) for k in weight_map):
        return {k: k for k in weight_map}
    out = {}
    for k in weight_map:
        for theirs, ours in KIMI_TEXT:
            if k.startswith(theirs):
                name = ours + k[len(theirs):]
                out[re.sub(r"^model\.blocks\.(\d+)\.", r"model.layers.\1.", name)] = k
    return out | {k: k for k in weight_map if k.startswith("lm_head.")}


def deepseek_fields(cfg: ModelConfig) -> dict:
    """The DeepSeekMoE fields of an export's config.json, as the config classes name them."""
    first = len(cfg.dense_layers)
    if cfg.dense_layers != tuple(range(first)):
        raise ValueError(f"dense layers {list(cfg.dense_layers)} are not the first ones (first_k_dense_replace)")
    return {"n_routed_experts": cfg.n_experts, "num_experts_per_tok": cfg.experts_per_token,
            "moe_intermediate_size": cfg.expert_dim, "n_shared_experts": cfg.shared_expert_dim // cfg.expert_dim,
            "routed_scaling_factor": cfg.routed_scale, "n_group": cfg.router_groups,
            "topk_group": cfg.router_topk_groups, "norm_topk_prob": cfg.norm_topk_prob,
            "first_k_dense_replace": first}


def mla_fields(cfg: ModelConfig) -> dict:
    """Latent attention's fields; head_dim is the rotated part's, as the config classes set it (RoPE's width)."""
    return {"head_dim": cfg.rope_dim, "q_lora_rank": cfg.q_lora_rank or None, "kv_lora_rank": cfg.kv_lora_rank,
            "qk_nope_head_dim": cfg.qk_nope_head_dim, "qk_rope_head_dim": cfg.rope_dim, "v_head_dim": cfg.v_head_dim}


def v3_fields(cfg: ModelConfig) -> dict:
    """scoring_func and topk_method as the Hub's files say them: transformers' class has them fixed, but
    llama.cpp's converter reads the router's scoring from them (without, llama.cpp routes with softmax)."""
    return {**mla_fields(cfg), **deepseek_fields(cfg), "rope_interleave": cfg.rope_interleave,
            "scoring_func": "sigmoid", "topk_method": "noaux_tc"}


def v2_fields(cfg: ModelConfig) -> dict:
    grouped = cfg.router_groups > 1
    return {**mla_fields(cfg), **deepseek_fields(cfg), "topk_method": "group_limited_greedy" if grouped else "greedy",
            "n_group": cfg.router_groups if grouped else None, "topk_group": cfg.router_topk_groups if grouped else None}


def glm_fields(cfg: ModelConfig) -> dict:
    """GLM-4.5's fields; no prediction layers (they are left out: Glm4MoeConfig's default counts one, and
    llama.cpp would look for its tensors)."""
    return {**deepseek_fields(cfg), "attention_bias": cfg.qkv_bias, "use_qk_norm": cfg.qk_norm,
            "partial_rotary_factor": cfg.rope_dim / cfg.head_dim, "num_nextn_predict_layers": 0}


MOE_COMMON = {f: read_deepseek_moe for f in ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
                                              "n_shared_experts", "routed_scaling_factor", "n_group", "topk_group",
                                              "first_k_dense_replace", "moe_layer_freq")} | {
    "num_nextn_predict_layers": read_mtp, "num_mtp_layers": read_mtp}
MLA_READERS = {**{f: read_mla for f in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                         "v_head_dim", "head_dim", "qk_head_dim")},
               "attention_bias": refused_unless("attention_bias", lambda v: not v, "false (every published DeepSeek "
                                                                                  "has no attention biases)")}
V3_READERS = {**MOE_COMMON, **MLA_READERS, "rope_interleave": read_mla,
              **{f: read_v3_router for f in ("norm_topk_prob", "scoring_func", "topk_method")}}
IRRELEVANT = {"output_router_logits": "whether transformers' forward returns the router logits; these classes add "
                                      "no router loss",
              "aux_loss_alpha": "the weight of a balancing loss in DeepSeek's own training code, which transformers' "
                                "class does not compute",
              "seq_aux": "whether DeepSeek's own training code's balancing loss is per sequence; not computed",
              "ep_size": "how DeepSeek's own code spread the experts over devices",
              "auto_map": "code in the model's repository, which phantom does not run: the fields say the architecture",
              "num_key_value_heads": "latent attention has one latent for every head"}
DEEPSEEK_DEFAULTS = {**COMMON_DEFAULTS, "max_position_embeddings": 4096, "num_experts_per_tok": 8}

FAMILIES = {f.name: f for f in (
    Family("deepseek_v3", ("DeepseekV3ForCausalLM", "Kimi_K25ForConditionalGeneration",
                           "KimiK25ForConditionalGeneration"), "deepseek_v3",
           {**LAYER_NORM_KEYS, **MLA_KEYS, **DEEPSEEK_MOE_KEYS},
           readers=V3_READERS, irrelevant=IRRELEVANT, moe=DEEPSEEK_EXPERTS, hf_fields=v3_fields,
           defaults={**DEEPSEEK_DEFAULTS, "moe_intermediate_size": 2048, "n_shared_experts": 1,
                     "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
                     "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8,
                     "topk_group": 4, "first_k_dense_replace": 3, "norm_topk_prob": True, "rope_interleave": True},
           text=(kimi_text_config, kimi_text_weights)),
    Family("deepseek_v2", ("DeepseekV2ForCausalLM",), "deepseek_v2", {**LAYER_NORM_KEYS, **MLA_KEYS,
                                                                       **DEEPSEEK_MOE_KEYS},
           readers={**MOE_COMMON, **MLA_READERS, **{f: read_v2_router for f in ("topk_method", "scoring_func")},
                    "mlp_bias": refused_unless("mlp_bias", lambda v: not v, "false (no published DeepSeek-V2 has "
                                                                            "MLP biases)")},
           irrelevant={**IRRELEVANT, "norm_topk_prob": "DeepseekV2TopkRouter never renormalises"},
           moe=DEEPSEEK_EXPERTS, hf_fields=v2_fields,
           defaults={**COMMON_DEFAULTS, "max_position_embeddings": 2048, "moe_intermediate_size": 1407,
                     "n_shared_experts": 2, "n_routed_experts": 64, "routed_scaling_factor": 1.0, "kv_lora_rank": 512,
                     "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
                     "first_k_dense_replace": 0, "topk_method": "greedy"}),
    Family("glm4_moe", ("Glm4MoeForCausalLM",), "glm4_moe",
           {**{k: v for k, v in ATTENTION_KEYS.items()}, **{k: v for k, v in BIAS_KEYS.items() if "o_proj" not in k
                                                           and "self_attn" in k}, **QK_NORM_KEYS, **DEEPSEEK_MOE_KEYS},
           readers={**MOE_COMMON, **{f: read_v3_router for f in ("norm_topk_prob", "scoring_func", "topk_method")},
                    **{f: read_glm_attention for f in ("attention_bias", "use_qk_norm", "partial_rotary_factor")}},
           irrelevant={k: v for k, v in IRRELEVANT.items() if k != "num_key_value_heads"}, moe=DEEPSEEK_EXPERTS,
           hf_fields=glm_fields,
           defaults={**COMMON_DEFAULTS, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
                     "moe_intermediate_size": 1408, "num_experts_per_tok": 8, "n_shared_experts": 1,
                     "n_routed_experts": 128, "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1,
                     "first_k_dense_replace": 1, "norm_topk_prob": True, "use_qk_norm": False}),
)}
