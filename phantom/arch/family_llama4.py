"""Llama 4 (Scout, Maverick): the text model of Llama4ForConditionalGeneration and Llama4ForCausalLM.

Layers with RoPE (no_rope_layers 1) attend in chunks of attention_chunk_size positions and L2-norm q and k after
RoPE (use_qk_norm); the others (every no_rope_layer_interval-th) see every key before them without RoPE, their
queries scaled by 1 + attn_scale * log1p(floor((position + 1) / floor_scale)) (attn_temperature_tuning). RoPE
turns pairs (2i, 2i + 1), as transformers' Llama4 rotates the rows it ships: the store keeps them as they are.
Mixture-of-experts layers (moe_layers, or every interleave_moe_layer_step-th) route each token to the top-k of the
router's logits, weighted by their sigmoid applied to the experts' input, beside an ungated shared expert;
the other layers' MLP is intermediate_size_mlp wide. The experts are (experts, in, out) tensors, gate_up_proj
holding gate then up on its last dim.

ModelConfig's fields: layer_types (chunked_attention, full_attention), attn_chunk, qk_l2 (the chunked layers' norms),
nope_full (full_attention layers without RoPE), attn_scale and floor_scale (0: no temperature), router_score
topk_sigmoid, dense_layers, shared_expert_dim with shared_expert_gate false. Imports phantom.arch.config and the shared tables only.
"""
from __future__ import annotations

from phantom.arch.config import ModelConfig, refuse
from phantom.arch.family_moe import MoeKeys, expert_keys
from phantom.arch.familybase import ATTENTION_KEYS, BIAS_KEYS, COMMON_DEFAULTS, DENSE_MLP_KEYS, Family, \
    _read_attention_bias, vl_text_config


FF = "model.layers.{}.feed_forward"
KEYS = {**ATTENTION_KEYS, **{k: v for k, v in BIAS_KEYS.items() if "self_attn" in k},
        **{k.replace(".mlp.", ".feed_forward."): v for k, v in DENSE_MLP_KEYS.items()},
        f"{FF}.router.weight": "feed_forward.gate.weight",
        **expert_keys(f"{FF}.shared_expert", "gate_proj", "up_proj", "down_proj", "feed_forward.shared_expert")}
# Llama4TextExperts: (experts, in, 2 * width) gate then up, (experts, width, dim) down; read into each expert's parts
EXPERTS = MoeKeys({}, ("num_local_experts", "num_experts_per_tok"), fused={
    f"{FF}.experts.gate_up_proj": ("feed_forward.experts.<e>.w1.weight", "feed_forward.experts.<e>.w3.weight"),
    f"{FF}.experts.down_proj": ("feed_forward.experts.<e>.w2.weight",)}, turned="halves",
    peft_module="feed_forward.experts", peft_swapped=True)
TEXT = ("language_model.model.", "model."), ("language_model.lm_head.", "lm_head.")


def read_layers(c: dict, path) -> dict:
    """Which layers have RoPE (chunked_attention) and which are sparse, as Llama4TextConfig fills them in."""
    n, every = c["num_hidden_layers"], c.get("no_rope_layer_interval", 4)
    rope = c.get("no_rope_layers") or [int((i + 1) % every != 0) for i in range(n)]
    if len(rope) != n or set(rope) - {0, 1}:
        refuse(path, "no_rope_layers", rope, f"one 0 or 1 per layer ({n})")
    types = ["chunked_attention" if r else "full_attention" for r in rope]
    if c.get("layer_types") not in (None, types):
        refuse(path, "layer_types", c["layer_types"], f"chunked_attention where no_rope_layers is 1, else "
                                                      f"full_attention ({types})")
    step = c.get("interleave_moe_layer_step", 1)
    sparse = c.get("moe_layers")
    sparse = list(range(step - 1, n, step)) if sparse is None else sparse
    if any(type(i) is not int or not 0 <= i < n for i in sparse) or not sparse:
        refuse(path, "moe_layers", sparse, f"a non-empty list of layers in [0, {n})")
    chunk = c.get("attention_chunk_size")
    if type(chunk) is not int or chunk < 1:
        refuse(path, "attention_chunk_size", chunk, "a positive integer (transformers' Llama4 always chunks)")
    return {"layer_types": tuple(types), "dense_layers": tuple(i for i in range(n) if i not in sparse),
            "attn_chunk": chunk}


def read_attention(c: dict, path) -> dict:
    """q/k L2 norms on the RoPE layers (use_qk_norm), the RoPE-less layers' temperature (attn_temperature_tuning)."""
    tuned = bool(c.get("attn_temperature_tuning"))
    return {**_read_attention_bias(c, path), "qk_l2": bool(c.get("use_qk_norm")),
            "attn_scale": float(c["attn_scale"]) if tuned else 0.0,
            "floor_scale": float(c["floor_scale"]) if tuned else 0.0}


def read_experts(c: dict, path) -> dict:
    """Experts intermediate_size wide, the dense layers intermediate_size_mlp, a shared expert as wide as an expert."""
    if c.get("router_jitter_noise"):
        refuse(path, "router_jitter_noise", c["router_jitter_noise"], "0 (no jitter)")
    if c.get("num_local_experts", 0) < 1:
        refuse(path, "num_local_experts", c.get("num_local_experts"), "an integer >= 1")
    return {"n_experts": c["num_local_experts"], "experts_per_token": c["num_experts_per_tok"],
            "expert_dim": c["intermediate_size"], "shared_expert_dim": c["intermediate_size"],
            "intermediate_size": c["intermediate_size_mlp"]}


def text_config(c: dict, path) -> dict:
    """A Llama4ForConditionalGeneration config.json's text model (text_config), the vision tower said left out."""
    return vl_text_config(c, path, "Llama4ForCausalLM", "llama4_text", tie=False)


def text_weights(weight_map: dict[str, str]) -> dict[str, str]:
    """language_model.model.X as model.X, language_model.lm_head as lm_head; the vision tower's and projector's left
    out. A Llama4ForCausalLM file's names as they are."""
    if not any(k.startswith("language_model.") for k in weight_map):
        return {k: k for k in weight_map}
    return {ours + k[len(theirs):]: k for k in weight_map for theirs, ours in TEXT if k.startswith(theirs)}


def moe_step(cfg: ModelConfig) -> int | None:
    """interleave_moe_layer_step, where the sparse layers are every step-th (the published models'; llama.cpp's
    converter reads the step alone), or None."""
    sparse = [i for i in range(cfg.n_layers) if cfg.sparse(i)]
    step = sparse[0] + 1 if sparse else 0
    return step if sparse == list(range(step - 1, cfg.n_layers, step)) else None


def llama4_fields(cfg: ModelConfig) -> dict:
    """The fields of an export's config.json Llama4TextConfig reads beyond the common ones."""
    types = [cfg.layer_types[i % len(cfg.layer_types)] for i in range(cfg.n_layers)]
    step = moe_step(cfg)
    return {"no_rope_layers": [int(t == "chunked_attention") for t in types], "layer_types": types,
            "moe_layers": [i for i in range(cfg.n_layers) if cfg.sparse(i)],
            **({"interleave_moe_layer_step": step} if step else {}),
            "intermediate_size": cfg.expert_dim,
            "intermediate_size_mlp": cfg.intermediate_size, "attention_chunk_size": cfg.attn_chunk,
            "use_qk_norm": cfg.qk_l2, "attn_temperature_tuning": bool(cfg.attn_scale),
            "attn_scale": cfg.attn_scale or 0.1, "floor_scale": int(cfg.floor_scale or 8192),
            "attention_bias": cfg.qkv_bias, "num_local_experts": cfg.n_experts,
            "num_experts_per_tok": cfg.experts_per_token}


LAYERS = ("no_rope_layers", "no_rope_layer_interval", "layer_types", "moe_layers", "interleave_moe_layer_step",
          "attention_chunk_size")
IRRELEVANT = {"output_router_logits": "what transformers' forward returns; Llama4ForCausalLM adds no router loss",
              "router_aux_loss_coef": "Llama4ForCausalLM's loss has no router term (full finetuning adds none)",
              "for_llm_compressor": "a flag of Meta's quantization tooling, not of the maths"}
FAMILIES = {f.name: f for f in (
    Family("llama4", ("Llama4ForCausalLM", "Llama4ForConditionalGeneration"), "llama4_text", KEYS,
           readers={**{f: read_layers for f in LAYERS},
                    **{f: read_attention for f in ("use_qk_norm", "attn_temperature_tuning", "attn_scale",
                                                   "floor_scale", "attention_bias")},
                    **{f: read_experts for f in ("num_local_experts", "num_experts_per_tok", "intermediate_size_mlp",
                                                 "router_jitter_noise")}},
           fixed={"nope_full": True, "rope_interleave": True, "router_score": "topk_sigmoid",
                  "shared_expert_gate": False},
           irrelevant=IRRELEVANT, moe=EXPERTS, hf_fields=llama4_fields, text=(text_config, text_weights),
           defaults={**COMMON_DEFAULTS, "rms_norm_eps": 1e-5, "max_position_embeddings": 4096 * 32, "head_dim": 128,
                     "num_local_experts": 16, "num_experts_per_tok": 1, "interleave_moe_layer_step": 1,
                     "intermediate_size_mlp": 16384, "use_qk_norm": True, "no_rope_layer_interval": 4,
                     "attention_chunk_size": 8192, "attn_temperature_tuning": True, "floor_scale": 8192,
                     "attn_scale": 0.1, "router_jitter_noise": 0.0}),
)}
