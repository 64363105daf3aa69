"""Families are data: one frozen `Family` per Hugging Face architecture phantom reads.

An entry says how the family's config.json becomes a ModelConfig (every field of its transformers
config class is modelled, refused when set, or irrelevant with the reason) and how its checkpoint's
tensors are named (a weight_map, as gpt-fast's converter keeps one). The block maths read only
ModelConfig's fields; the converter, exporter and LoRA writer read these tables.
"""
from __future__ import annotations

import json
from pathlib import Path

from phantom.arch.config import ACTIVATIONS, ConfigError, ModelConfig  # noqa: F401
from phantom.arch.config import refuse as _refuse
from phantom.arch import family_deepseek
from phantom.arch.family_moe import (
    DENSE_READERS,
    MOE_IRRELEVANT,
    MOE_READERS,
    QWEN_EXPERTS,
    QWEN_MOE,
    QWEN_MOE_FIELDS,
    ROUTER_KEYS,
    SHARED_EXPERT_KEYS,
    MoeKeys,
    expert_keys,
    read_moe,
    read_qwen2_moe_window,
    read_qwen3_moe_window,
    refused_unless,
)
from phantom.arch.familybase import (  # noqa: F401 - the shared tables are part of this module's API
    ATTENTION_KEYS,
    BIAS_KEYS,
    COMMON_DEFAULTS,
    DENSE_MLP_KEYS,
    IRRELEVANT,
    MODELLED_COMMON,
    Family,
    LLAMA_KEYS,
    QK_NORM_KEYS,
    REFUSED_WHEN_SET,
    _read_attention_bias,
    _read_gemma3_rope,
    _read_mistral_window,
    _read_mlp_bias,
    _read_rope,
    _rope_scaling,
)
from phantom.base import safejson


def _read_qwen_window(c: dict, path) -> dict:
    """Qwen: the window applies only with use_sliding_window, to layers from max_window_layers on
    (or as layer_types says), as transformers' Qwen2Config/Qwen3Config decide."""
    window = c.get("sliding_window") if c.get("use_sliding_window") else None
    if window is None:
        return {"sliding_window": None, "layer_types": None}
    n = c["num_hidden_layers"]
    types = c.get("layer_types") or ["sliding_attention" if i >= c.get("max_window_layers", 28) else "full_attention"
                                     for i in range(n)]
    return {"sliding_window": window, "layer_types": tuple(types)}


def _read_phi3_rope(c: dict, path) -> dict:
    """Phi-3: RoPE "default" or "longrope" (transformers' Phi3Config reads "su" and "yarn" as longrope),
    a scaled one counting from the top-level original_max_position_embeddings, which Phi3Config puts
    before the one inside rope_scaling."""
    rope = dict(c.get("rope_scaling") or c.get("rope_parameters") or {})
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "longrope", "su", "yarn"):
        _refuse(path, "rope_scaling.rope_type", kind, "'default', 'longrope' (Phi3Config reads 'su' and 'yarn' as "
                                                      "'longrope')")
    if kind != "default":
        rope["rope_type"] = "longrope"
        rope["original_max_position_embeddings"] = c["original_max_position_embeddings"]
    return {"rope_theta": c.get("rope_theta", rope.get("rope_theta", 10000.0)),
            "rope_scaling": _rope_scaling(rope, path, c["max_position_embeddings"], ("longrope",))}


def _read_phi3_rotary(c: dict, path) -> dict:
    """Phi-4-mini: RoPE turns int(head_dim * partial_rotary_factor) leading dims of each head (the one in
    rope_parameters first, as transformers' standardize_rope_params keeps it)."""
    factor = (c.get("rope_parameters") or {}).get("partial_rotary_factor") or c.get("partial_rotary_factor") or 1.0
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    rotary = int(head_dim * factor)
    return {"rotary_dim": rotary if rotary != head_dim else None}


def _read_gemma_activation(c: dict, path) -> dict:
    act = c.get("hidden_activation")
    if act not in ACTIVATIONS:
        _refuse(path, "hidden_activation", act, ", ".join(ACTIVATIONS))
    return {"activation": act}


def _read_gemma_attention(c: dict, path) -> dict:
    return {"query_pre_attn_scalar": c.get("query_pre_attn_scalar"), "attn_softcap": c.get("attn_logit_softcapping"),
            "final_softcap": c.get("final_logit_softcapping")}


def _read_gemma_window(c: dict, path) -> dict:
    """Gemma: layer_types as written, else Gemma-2's alternation (sliding first) or Gemma-3's one global
    layer in sliding_window_pattern (6), as transformers' config classes fill them in."""
    period = c.get("sliding_window_pattern", 6 if c.get("model_type") == "gemma3_text" else 2)
    types = c.get("layer_types") or ["sliding_attention" if (i + 1) % period else "full_attention"
                                     for i in range(c["num_hidden_layers"])]
    return {"sliding_window": c.get("sliding_window"), "layer_types": tuple(types)}


QWEN_WINDOW = {"sliding_window": _read_qwen_window, "use_sliding_window": _read_qwen_window,
               "layer_types": _read_qwen_window}

FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("llama", ("LlamaForCausalLM",), "llama", {**LLAMA_KEYS, **BIAS_KEYS},
           readers={"attention_bias": _read_attention_bias, "mlp_bias": _read_mlp_bias},
           defaults={**COMMON_DEFAULTS, "max_position_embeddings": 2048}),
    Family("mistral", ("MistralForCausalLM",), "mistral", LLAMA_KEYS,
           readers={"sliding_window": _read_mistral_window},
           defaults={**COMMON_DEFAULTS, "max_position_embeddings": 4096 * 32, "sliding_window": 4096}),
    Family("qwen2", ("Qwen2ForCausalLM",), "qwen2", {**LLAMA_KEYS, **BIAS_KEYS}, readers=QWEN_WINDOW,
           fixed={"qkv_bias": True},
           defaults={**COMMON_DEFAULTS, "max_position_embeddings": 32768, "max_window_layers": 28}),
    Family("qwen3", ("Qwen3ForCausalLM",), "qwen3", {**LLAMA_KEYS, **BIAS_KEYS, **QK_NORM_KEYS},
           readers={"attention_bias": _read_attention_bias, **QWEN_WINDOW}, fixed={"qk_norm": True},
           defaults={**COMMON_DEFAULTS, "max_position_embeddings": 32768, "max_window_layers": 28,
                     "head_dim": 128}),
)}
GEMMA_KEYS = {**{hf: name for hf, name in LLAMA_KEYS.items() if "layernorm" not in hf}, **BIAS_KEYS,
              "model.layers.{}.input_layernorm.weight": "attention_norm.weight",
              "model.layers.{}.post_attention_layernorm.weight": "attention_post_norm.weight",
              "model.layers.{}.pre_feedforward_layernorm.weight": "ffn_norm.weight",
              "model.layers.{}.post_feedforward_layernorm.weight": "ffn_post_norm.weight"}
GEMMA_READERS = {"attention_bias": _read_attention_bias, "hidden_activation": _read_gemma_activation,
                 "query_pre_attn_scalar": _read_gemma_attention, "attn_logit_softcapping": _read_gemma_attention,
                 "final_logit_softcapping": _read_gemma_attention, "sliding_window": _read_gemma_window,
                 "layer_types": _read_gemma_window}
GEMMA_FIXED = {"norm_offset": 1.0, "embed_scale": True, "post_norms": True}
GEMMA_DEFAULTS = {"rms_norm_eps": 1e-6, "tie_word_embeddings": True, "head_dim": 256, "hidden_activation":
                  "gelu_pytorch_tanh", "query_pre_attn_scalar": 256, "sliding_window": 4096}

FAMILIES.update({f.name: f for f in (
    Family("gemma2", ("Gemma2ForCausalLM",), "gemma2", GEMMA_KEYS, readers=GEMMA_READERS, fixed=GEMMA_FIXED,
           defaults={**GEMMA_DEFAULTS, "max_position_embeddings": 8192, "attn_logit_softcapping": 50.0,
                     "final_logit_softcapping": 30.0}),
    Family("gemma3", ("Gemma3ForCausalLM",), "gemma3_text", {**GEMMA_KEYS, **QK_NORM_KEYS},
           readers={**GEMMA_READERS, "rope_parameters": _read_gemma3_rope}, fixed={**GEMMA_FIXED, "qk_norm": True},
           defaults={**GEMMA_DEFAULTS, "max_position_embeddings": 131072},
           irrelevant={"_sliding_window_pattern": "Gemma-3's older way to say layer_types, which are read"}),
)})
PHI3_FUSED = {"model.layers.{}.self_attn.qkv_proj.weight": ("attention.wq.weight", "attention.wk.weight",
                                                            "attention.wv.weight"),
              "model.layers.{}.mlp.gate_up_proj.weight": ("feed_forward.w1.weight", "feed_forward.w3.weight")}
FAMILIES["phi3"] = Family(
    "phi3", ("Phi3ForCausalLM",), "phi3",
    {hf: name for hf, name in LLAMA_KEYS.items() if name not in {n for ns in PHI3_FUSED.values() for n in ns}},
    readers={"sliding_window": _read_mistral_window, "rope_scaling": _read_phi3_rope,
             "rope_parameters": _read_phi3_rope, "original_max_position_embeddings": _read_phi3_rope,
             "partial_rotary_factor": _read_phi3_rotary},
    defaults={**COMMON_DEFAULTS, "rms_norm_eps": 1e-5, "max_position_embeddings": 4096,
              "original_max_position_embeddings": 4096}, fused=PHI3_FUSED)

FAMILIES.update({f.name: f for f in (
    Family("qwen3_moe", ("Qwen3MoeForCausalLM",), "qwen3_moe", {**ATTENTION_KEYS, **BIAS_KEYS, **QK_NORM_KEYS,
                                                                 **ROUTER_KEYS, **DENSE_MLP_KEYS},
           readers={"attention_bias": _read_attention_bias, "moe_intermediate_size": read_moe, **MOE_READERS,
                    **DENSE_READERS, "sliding_window": read_qwen3_moe_window, "use_sliding_window": read_qwen3_moe_window},
           fixed={"qk_norm": True}, irrelevant=MOE_IRRELEVANT, moe=MoeKeys(QWEN_EXPERTS, QWEN_MOE_FIELDS),
           defaults={**COMMON_DEFAULTS, **QWEN_MOE, "moe_intermediate_size": 768}),
    Family("qwen2_moe", ("Qwen2MoeForCausalLM",), "qwen2_moe",
           {**ATTENTION_KEYS, **{k: v for k, v in BIAS_KEYS.items() if "o_proj" not in k and "self_attn" in k},
            **ROUTER_KEYS, **SHARED_EXPERT_KEYS, **DENSE_MLP_KEYS},
           readers={"qkv_bias": lambda c, path: {"qkv_bias": bool(c["qkv_bias"])}, **MOE_READERS, **DENSE_READERS,
                    "moe_intermediate_size": read_moe, "shared_expert_intermediate_size": read_moe,
                    "sliding_window": read_qwen2_moe_window, "use_sliding_window": read_qwen2_moe_window,
                    "layer_types": read_qwen2_moe_window},
           irrelevant=MOE_IRRELEVANT, moe=MoeKeys(QWEN_EXPERTS, (*QWEN_MOE_FIELDS, "shared_expert_intermediate_size")),
           defaults={**COMMON_DEFAULTS, **QWEN_MOE, "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
                     "shared_expert_intermediate_size": 5632, "qkv_bias": True,
                     "max_window_layers": 28}),
    Family("mixtral", ("MixtralForCausalLM",), "mixtral",
           {**ATTENTION_KEYS, "model.layers.{}.block_sparse_moe.gate.weight": "feed_forward.gate.weight"},
           readers={**MOE_READERS, "sliding_window": _read_mistral_window,
                    "router_jitter_noise": refused_unless("router_jitter_noise", lambda v: not v, "0 (no jitter)")},
           fixed={"norm_topk_prob": True}, irrelevant=MOE_IRRELEVANT,
           moe=MoeKeys(expert_keys("model.layers.{}.block_sparse_moe.experts.<e>", "w1", "w3", "w2"),
                       ("num_local_experts", "num_experts_per_tok", "router_aux_loss_coef"),
                       {"model.layers.{}.block_sparse_moe.gate.weight": "model.layers.{}.mlp.gate.weight"}),
           defaults={**COMMON_DEFAULTS, "rms_norm_eps": 1e-5, "max_position_embeddings": 4096 * 32,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
                     "num_experts_per_tok": 2, "router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0}),
    Family("olmoe", ("OlmoeForCausalLM",), "olmoe", {**ATTENTION_KEYS, **BIAS_KEYS, **QK_NORM_KEYS, **ROUTER_KEYS},
           readers={"attention_bias": _read_attention_bias, **MOE_READERS,
                    "clip_qkv": refused_unless("clip_qkv", lambda v: v is None, "null (q, k, v unclipped)")},
           fixed={"qk_norm": True, "qk_norm_over": "projection"}, irrelevant=MOE_IRRELEVANT,
           moe=MoeKeys(QWEN_EXPERTS, ("num_experts", "num_experts_per_tok", "norm_topk_prob", "router_aux_loss_coef")),
           defaults={**COMMON_DEFAULTS, "rms_norm_eps": 1e-5, "max_position_embeddings": 4096,
                     "num_experts_per_tok": 8, "norm_topk_prob": False, "router_aux_loss_coef": 0.01}),
)})
FAMILIES.update(family_deepseek.FAMILIES)
BIAS_FIELDS = ("attention_bias", "mlp_bias")  # a family without the field has no such biases


def family_of(c: dict, path) -> Family:
    archs = c.get("architectures") or []
    for fam in FAMILIES.values():
        if set(archs) & set(fam.architectures) or (not archs and c.get("model_type") == fam.model_type):
            return fam
    supported = ", ".join(f.hf_class for f in FAMILIES.values())
    named = archs[0] if archs else c.get("model_type", "?")
    raise ConfigError(f"{path}: architecture {named} is not supported (architectures={json.dumps(archs)}; "
                      f"supported: {supported})")


def check_fields(c: dict, fam: Family, path) -> None:
    """Refuse what this family's maths in phantom would silently compute otherwise."""
    for key, (allowed, supported) in REFUSED_WHEN_SET.items():
        if key in c and key not in fam.readers and not allowed(c[key]):
            _refuse(path, key, c[key], supported)
    allowed, supported = REFUSED_WHEN_SET["partial_rotary_factor"]  # transformers >= 5 keeps it in rope_parameters
    if "partial_rotary_factor" not in fam.readers and not allowed(f := (c.get("rope_parameters") or {}).get(
            "partial_rotary_factor")):
        _refuse(path, "rope_parameters.partial_rotary_factor", f, supported)
    for key in BIAS_FIELDS:
        if c.get(key) and key not in fam.readers:
            _refuse(path, key, c[key], f"false: {fam.hf_class} has no such biases")
    if (act := c.get("hidden_act", "silu")) not in ACTIVATIONS:
        _refuse(path, "hidden_act", act, ", ".join(ACTIVATIONS))


def config_from_hf(c: dict, path="config.json") -> ModelConfig:
    """ModelConfig from a parsed Hugging Face config.json of a supported family.

    Raises:
        ConfigError: an architecture or a field phantom does not model (one line naming it).
        KeyError, TypeError: a config.json that lacks a field every family has.
    """
    fam = family_of(c, path)
    c = {**fam.defaults, **c}
    check_fields(c, fam, path)
    kw = dict(dim=c["hidden_size"], n_layers=c["num_hidden_layers"], n_heads=c["num_attention_heads"],
              vocab_size=c["vocab_size"], n_kv_heads=c.get("num_key_value_heads"),
              intermediate_size=c["intermediate_size"], norm_eps=c["rms_norm_eps"],
              max_seq_len=c["max_position_embeddings"], family=fam.name,
              activation=c.get("hidden_act", "silu"), tie_embeddings=bool(c["tie_word_embeddings"]))
    head_dim = c.get("head_dim")
    if head_dim and head_dim * c["num_attention_heads"] != c["hidden_size"]:
        kw["explicit_head_dim"] = head_dim
    for read in dict.fromkeys(fam.readers.values()):  # each reader once, in the table's order
        kw.update(read(c, path))
    if "rope_theta" not in kw:  # one RoPE for every layer, unless the family reads its own
        kw["rope_theta"], kw["rope_scaling"] = _read_rope(c, path)
    kw.update(fam.fixed)
    try:
        return ModelConfig(**kw)
    except ValueError as e:
        raise ConfigError(f"{path}: {e}") from None


def from_hf_config(path: Path) -> ModelConfig:
    """ModelConfig from a Hugging Face config.json file (see config_from_hf)."""
    return config_from_hf(safejson.load(path, what="config.json"), path)


def family(cfg: ModelConfig) -> Family:
    return FAMILIES[cfg.family]

