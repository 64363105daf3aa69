"""Families are data: one frozen `Family` per Hugging Face architecture phantom reads, Llama's, Mistral's and the
dense Qwens' here, each other group's in a module of its own (family_gemma, family_phi, family_moe,
family_deepseek, family_dsa, family_gptoss, family_qwen35, family_llama4, family_deepseek_v4): adding a family is
one file and a row below.

An entry says how the family's config.json becomes a ModelConfig (every field of its transformers
config class is modelled, refused when set, or irrelevant with the reason) and how its checkpoint's
tensors are named (a weight_map, as gpt-fast's converter keeps one). The block maths read only
ModelConfig's fields; the converter, exporter and LoRA writer read these tables.
"""
from __future__ import annotations

import json
from pathlib import Path

from phantom.arch import family_deepseek, family_deepseek_v4, family_dsa, family_gemma, family_gptoss, family_llama4, \
    family_moe, family_phi, family_qwen35
from phantom.arch.config import ACTIVATIONS, ConfigError, ModelConfig  # noqa: F401
from phantom.arch.config import refuse as _refuse
from phantom.arch.familybase import (  # noqa: F401 - the shared tables are part of this module's API
    BIAS_KEYS,
    COMMON_DEFAULTS,
    IRRELEVANT,
    LLAMA_KEYS,
    MODELLED_COMMON,
    QK_NORM_KEYS,
    REFUSED_WHEN_SET,
    Family,
    _read_attention_bias,
    _read_mlp_bias,
    _read_mistral_window,
    _read_rope,
    from_meta_params,
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
for group in (family_gemma, family_phi, family_moe, family_deepseek, family_dsa, family_gptoss, family_qwen35,
              family_llama4, family_deepseek_v4):  # one a group
    FAMILIES.update(group.FAMILIES)
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
    if fam.text is not None:  # a vision-language model's config: its text model's fields
        c = fam.text[0](c, path)
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

