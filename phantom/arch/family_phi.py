"""Phi-3 and Phi-4 (`Phi3ForCausalLM`): q, k, v and gate, up fused in the checkpoint, longrope, RoPE over part of
each head (Phi-4-mini). Its entry in the family table (phantom.arch.family collects it).
"""
from __future__ import annotations

from phantom.arch.config import refuse as _refuse
from phantom.arch.familybase import COMMON_DEFAULTS, LLAMA_KEYS, Family, _read_mistral_window, _rope_scaling

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


PHI3_FUSED = {"model.layers.{}.self_attn.qkv_proj.weight": ("attention.wq.weight", "attention.wk.weight",
                                                            "attention.wv.weight"),
              "model.layers.{}.mlp.gate_up_proj.weight": ("feed_forward.w1.weight", "feed_forward.w3.weight")}
FAMILIES = {"phi3": Family(
    "phi3", ("Phi3ForCausalLM",), "phi3",
    {hf: name for hf, name in LLAMA_KEYS.items() if name not in {n for ns in PHI3_FUSED.values() for n in ns}},
    readers={"sliding_window": _read_mistral_window, "rope_scaling": _read_phi3_rope,
             "rope_parameters": _read_phi3_rope, "original_max_position_embeddings": _read_phi3_rope,
             "partial_rotary_factor": _read_phi3_rotary},
    defaults={**COMMON_DEFAULTS, "rms_norm_eps": 1e-5, "max_position_embeddings": 4096,
              "original_max_position_embeddings": 4096}, fused=PHI3_FUSED)}
