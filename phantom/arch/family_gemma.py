"""Gemma-2 and Gemma-3 (text): scaled embeddings, (1 + w) norms, post-norms, GELU-tanh, soft-capping, sliding
and global layers (Gemma-3: two RoPE bases). Its entries in the family table (phantom.arch.family collects them).
"""
from __future__ import annotations

from phantom.arch.config import ACTIVATIONS
from phantom.arch.config import refuse as _refuse
from phantom.arch.familybase import BIAS_KEYS, LLAMA_KEYS, QK_NORM_KEYS, Family, _read_attention_bias, _rope_scaling

def _read_gemma3_rope(c: dict, path) -> dict:
    """Gemma-3: global layers at rope_theta (1e6), scaled; sliding layers at rope_local_base_freq (1e4), unscaled."""
    rope = c.get("rope_parameters") or {}
    full, local = rope.get("full_attention") or {}, rope.get("sliding_attention") or {}
    scaling = c.get("rope_scaling") or full
    if local.get("rope_type", "default") != "default":
        _refuse(path, "rope_parameters.sliding_attention.rope_type", local["rope_type"], "'default'")
    return {"rope_theta": c.get("rope_theta", full.get("rope_theta", 1e6)),
            "rope_scaling": _rope_scaling(scaling, path, c["max_position_embeddings"]),
            "local_rope_theta": c.get("rope_local_base_freq", local.get("rope_theta", 1e4))}


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

FAMILIES = {f.name: f for f in (
    Family("gemma2", ("Gemma2ForCausalLM",), "gemma2", GEMMA_KEYS, readers=GEMMA_READERS, fixed=GEMMA_FIXED,
           defaults={**GEMMA_DEFAULTS, "max_position_embeddings": 8192, "attn_logit_softcapping": 50.0,
                     "final_logit_softcapping": 30.0}),
    Family("gemma3", ("Gemma3ForCausalLM",), "gemma3_text", {**GEMMA_KEYS, **QK_NORM_KEYS},
           readers={**GEMMA_READERS, "rope_parameters": _read_gemma3_rope}, fixed={**GEMMA_FIXED, "qk_norm": True},
           defaults={**GEMMA_DEFAULTS, "max_position_embeddings": 131072},
           irrelevant={"_sliding_window_pattern": "Gemma-3's older way to say layer_types, which are read"}),
)}
