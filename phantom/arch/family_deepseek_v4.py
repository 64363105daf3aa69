"""DeepSeek-V4 (Flash, Pro): transformers' DeepseekV4ForCausalLM.

Read into ModelConfig's hyper-connection fields (phantom.arch.hyper: hc_mult residual streams), its attention's
(phantom.arch.compressed: layer_types, one key-value head of head_dim, csa_rate and hca_rate from compress_rates,
the indexer's index_* fields, o_groups and o_lora_rank, sinks) and its mixture of experts' (sqrtsoftplus or
sigmoid scores with a correction bias, always renormalised and times routed_scaling_factor, one shared expert,
the experts of mlp_layer_types' hash_moe layers named by each token id, SwiGLU clamped at swiglu_limit). Two RoPE
bases: sliding layers turn by rope_theta unscaled (ModelConfig.local_rope_theta), compressed ones by
compress_rope_theta with the compress rope's scaling (YaRN with its attention factor 1, as transformers sets it).

Checkpoint names: the store's are DeepSeek's own; the table's Hugging Face names are transformers' modules' (what
its state_dict holds, experts as its 3-D tensors or one per expert). The Hub's files and save_pretrained's name
tensors as DeepSeek's inference code does (layers.N.attn.wq_a, ffn.experts.E.w1, hc_head_fn, with or without
"model."): deepseek_names reads them as transformers' conversion mapping does. Imports config and the shared tables.
"""
from __future__ import annotations

import re

from phantom.arch.config import ModelConfig, refuse
from phantom.arch.family_deepseek import read_mtp
from phantom.arch.family_moe import FUSED_EXPERTS, MoeKeys, refused_unless
from phantom.arch.familybase import COMMON_DEFAULTS, Family, _rope_scaling

L = "model.layers.{}."
ATTN = {f"{L}self_attn.{hf}": f"attention.{ours}" for hf, ours in (
    ("q_a_proj.weight", "wq_a.weight"), ("q_a_norm.weight", "q_a_norm.weight"), ("q_b_proj.weight", "wq_b.weight"),
    ("kv_proj.weight", "wkv.weight"), ("kv_norm.weight", "kv_norm.weight"), ("o_a_proj.weight", "wo_a.weight"),
    ("o_b_proj.weight", "wo_b.weight"), ("sinks", "sinks"))}
COMPRESSOR = (("kv_proj.weight", "wkv.weight"), ("gate_proj.weight", "wgate.weight"), ("position_bias", "ape"),
              ("kv_norm.weight", "norm.weight"))
ATTN |= {f"{L}self_attn.compressor.{hf}": f"attention.compressor.{ours}" for hf, ours in COMPRESSOR}
ATTN |= {f"{L}self_attn.compressor.indexer.{hf}": f"attention.indexer.compressor.{ours}" for hf, ours in COMPRESSOR}
ATTN |= {f"{L}self_attn.compressor.indexer.q_b_proj.weight": "attention.indexer.wq_b.weight",
         f"{L}self_attn.compressor.indexer.scorer.weights_proj.weight": "attention.indexer.weights_proj.weight"}
BLOCK = {f"{L}input_layernorm.weight": "attention_norm.weight", f"{L}post_attention_layernorm.weight": "ffn_norm.weight",
         **{f"{L}{hc}_hc.{w}": f"hc_{hc}.{w}" for hc in ("attn", "ffn") for w in ("fn", "base", "scale")},
         f"{L}mlp.gate.weight": "feed_forward.gate.weight",
         f"{L}mlp.gate.e_score_correction_bias": "feed_forward.gate.e_score_correction_bias",
         f"{L}mlp.gate.tid2eid": "feed_forward.gate.tid2eid",
         **{f"{L}mlp.shared_experts.{hf}.weight": f"feed_forward.shared_expert.{w}.weight"
            for hf, w in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2"))}}
TOP = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight",
       "lm_head.weight": "output.weight", **{f"model.hc_head.hc_{w}": f"hc_head.{w}" for w in ("fn", "base", "scale")}}
KEYS = {**TOP, **ATTN, **BLOCK}
# one tensor per expert as DeepSeek names them (ffn -> mlp), or transformers' 3-D gate_up_proj (gate, then up) and down
EXPERTS = MoeKeys({f"{L}mlp.experts.<e>.{w}.weight": f"feed_forward.experts.<e>.{w}.weight" for w in ("w1", "w2", "w3")},
                  (), fused=FUSED_EXPERTS)  # their fields: v4_fields

# transformers' conversion mapping for deepseek_v4, in its order: DeepSeek's names -> its modules'
RENAMES = ((r"\.attn\.", ".self_attn."), (r"\.ffn\.", ".mlp."), (r"\.indexer\.compressor\.", ".compressor.indexer."),
           (r"\.attn_norm\.", ".input_layernorm."), (r"\.ffn_norm\.", ".post_attention_layernorm."),
           *((rf"\.hc_{hc}_{w}$", f".{hc}_hc.{w}") for hc in ("attn", "ffn") for w in ("fn", "base", "scale")),
           (r"\.attn_sink$", ".sinks"), (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
           (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."), (r"\.norm\.", ".kv_norm."),
           (r"\.ape$", ".position_bias"), (r"\.wq_a\.", ".q_a_proj."), (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."),
           (r"\.wkv\.", ".kv_proj."), (r"\.wgate\.", ".gate_proj."), (r"\.wo_a\.", ".o_a_proj."),
           (r"\.wo_b\.", ".o_b_proj."), (r"\.q_norm\.", ".q_a_norm."), (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
           (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."), (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
           (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."))
TOP_NAMES = {"embed.weight": "model.embed_tokens.weight", "embed_tokens.weight": "model.embed_tokens.weight",
             "head.weight": "lm_head.weight", "norm.weight": "model.norm.weight",
             **{f"hc_head_{w}": f"model.hc_head.hc_{w}" for w in ("fn", "base", "scale")},
             **{f"hc_head.hc_{w}": f"model.hc_head.hc_{w}" for w in ("fn", "base", "scale")}}


def module_name(key: str) -> str:
    """A checkpoint's tensor name as transformers' module holds it (its own names pass as they are)."""
    if key in KEYS or key == "lm_head.weight":
        return key
    bare = key.removeprefix("model.")
    if bare in TOP_NAMES:
        return TOP_NAMES[bare]
    if not (m := re.match(r"layers\.(\d+)(\..*)", bare)):
        return key
    rest = m.group(2)
    for pattern, to in RENAMES:
        rest = re.sub(pattern, to, rest)
    return f"model.layers.{m.group(1)}{rest}"


def deepseek_names(weight_map: dict[str, str]) -> dict[str, str]:
    """{transformers' module name: the checkpoint's name} of every tensor (the multi-token-prediction layers
    left out: mtp.*, as transformers leaves them)."""
    return {module_name(k): k for k in weight_map if not k.startswith(("mtp.", "model.mtp."))}


def v4_config(c: dict, path) -> dict:
    """config.json with intermediate_size read as moe_intermediate_size (DeepseekV4Config's attribute_map)."""
    return {**c, "intermediate_size": c.get("moe_intermediate_size", DEFAULTS["moe_intermediate_size"])}


def read_layers(c: dict, path) -> dict:
    """layer_types (or the older compress_ratios, 0 / 4 / 128 per layer), their rates (compress_rates, or the older
    compress_rate_csa / compress_rate_hca) and the hashed layers (mlp_layer_types, or the first num_hash_layers),
    filled in as DeepseekV4Config does."""
    n = c["num_hidden_layers"]
    kinds = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
    types = c.get("layer_types") or ([kinds.get(r, r) for r in c["compress_ratios"]] if c.get("compress_ratios")
                                     else ["heavily_compressed_attention"] * min(n, 2) + [
        "compressed_sparse_attention" if i % 2 else "heavily_compressed_attention" for i in range(max(n - 2, 0))])
    if len(types) < n or set(types) - set(kinds.values()):
        refuse(path, "layer_types", types, f"{n} of {', '.join(kinds.values())}")
    rates = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128, **(c.get("compress_rates") or {})}
    rates["compressed_sparse_attention"] = c.get("compress_rate_csa") or rates["compressed_sparse_attention"]
    rates["heavily_compressed_attention"] = c.get("compress_rate_hca") or rates["heavily_compressed_attention"]
    if any(type(r) is not int or r < 1 for r in rates.values()):
        refuse(path, "compress_rates", rates, "a positive number of tokens per compressed entry")
    first = c.get("num_hash_layers", 3)
    mlp = c.get("mlp_layer_types") or ["hash_moe"] * min(n, first) + ["moe"] * max(0, n - first)
    if len(mlp) < n or set(mlp) - {"hash_moe", "moe"}:
        refuse(path, "mlp_layer_types", mlp, f"{n} of hash_moe, moe")
    return {"layer_types": tuple(types[:n]), "csa_rate": rates["compressed_sparse_attention"],
            "hca_rate": rates["heavily_compressed_attention"], "sliding_window": c["sliding_window"],
            "hash_layers": tuple(i for i in range(n) if mlp[i] == "hash_moe")}


def read_rope(c: dict, path) -> dict:
    """Partial RoPE over the last head_dim * partial_rotary_factor dims (or qk_rope_head_dim), two bases: `main`
    (rope_theta, unscaled: sliding layers) and `compress` (compress_rope_theta, its scaling: compressed layers);
    rope_parameters nested by those names, or flat (the compress rope's scaling, as DeepseekV4Config nests it)."""
    head = c["head_dim"]
    factor = c.get("partial_rotary_factor") or (c["qk_rope_head_dim"] / head if c.get("qk_rope_head_dim") else 0.125)
    rp = c.get("rope_parameters") or c.get("rope_scaling") or {}
    nested = isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict)
    main = rp["main"] if nested else {"rope_type": "default", "rope_theta": c.get("rope_theta", 10000.0)}
    compress = rp["compress"] if nested else {**{k: v for k, v in rp.items() if k not in ("main", "compress")},
                                              "rope_theta": c.get("compress_rope_theta", 160000.0)}
    for name, part in (("main", main), ("compress", compress)):
        if part.get("partial_rotary_factor", factor) != factor:
            refuse(path, f"rope_parameters.{name}.partial_rotary_factor", part["partial_rotary_factor"],
                   f"partial_rotary_factor ({factor}): one RoPE width for both bases")
    if main.get("rope_type", main.get("type", "default")) != "default":
        refuse(path, "rope_parameters.main.rope_type", main.get("rope_type"), "default (the sliding layers' RoPE)")
    kind = compress.get("rope_type", compress.get("type", "default"))
    scaling = _rope_scaling({**compress, "rope_type": kind, **({"attention_factor": compress.get(
        "attention_factor", 1.0)} if kind == "yarn" else {})}, path, c["max_position_embeddings"], ("yarn",))
    return {"rotary_dim": int(head * factor), "rope_theta": compress.get("rope_theta", 160000.0),
            "rope_scaling": scaling, "local_rope_theta": main.get("rope_theta", 10000.0)}


def read_attention(c: dict, path) -> dict:
    """The q bottleneck, one key-value head, the grouped output, sinks, the indexer, the hyper-connections."""
    for key, allowed, supported in (("o_groups", c["num_attention_heads"] % max(c["o_groups"], 1) == 0,
                                     "a divisor of num_attention_heads"),
                                    ("q_lora_rank", (c["q_lora_rank"] or 0) > 0, "a rank (DeepseekV4 always has one)"),
                                    ("hc_mult", c["hc_mult"] >= 1, "at least one residual stream")):
        if not allowed:
            refuse(path, key, c[key], supported)
    return {"n_kv_heads": 1, "q_lora_rank": c["q_lora_rank"], "o_groups": c["o_groups"],
            "o_lora_rank": c["o_lora_rank"], "attn_sinks": True, "index_heads": c["index_n_heads"],
            "index_head_dim": c["index_head_dim"], "index_topk": c["index_topk"], "hc_mult": c["hc_mult"],
            "hc_iters": c["hc_sinkhorn_iters"], "hc_eps": float(c["hc_eps"])}


def read_moe(c: dict, path) -> dict:
    """n_routed_experts moe_intermediate_size wide and one shared expert as wide; scores by scoring_func, a
    correction bias for the choice (hashed layers: none), always renormalised, times routed_scaling_factor."""
    score = c.get("scoring_func", "sqrtsoftplus")
    if score not in ("sqrtsoftplus", "sigmoid"):
        refuse(path, "scoring_func", score, "sqrtsoftplus, sigmoid (transformers' activations have no softmax)")
    if c.get("n_shared_experts", 1) != 1:
        refuse(path, "n_shared_experts", c["n_shared_experts"], "1 (DeepseekV4SparseMoeBlock builds one)")
    if not c.get("norm_topk_prob", True):
        refuse(path, "norm_topk_prob", False, "true (DeepseekV4's routers always renormalise)")
    if c.get("swiglu_limit") is None or c["swiglu_limit"] <= 0:
        refuse(path, "swiglu_limit", c.get("swiglu_limit"), "a positive limit")
    return {"n_experts": c["n_routed_experts"], "experts_per_token": c["num_experts_per_tok"],
            "expert_dim": c["moe_intermediate_size"], "shared_expert_dim": c["moe_intermediate_size"],
            "shared_expert_gate": False, "router_score": score, "router_bias": True, "norm_topk_prob": True,
            "routed_scale": float(c["routed_scaling_factor"]), "swiglu_limit": float(c["swiglu_limit"]),
            "swiglu_clamped": True, "router_aux_coef": float(c.get("router_aux_loss_coef") or 0.0),
            "intermediate_size": c["moe_intermediate_size"]}


def v4_fields(cfg: ModelConfig) -> dict:
    """The fields of an export's config.json DeepseekV4Config reads beyond the common ones."""
    rope = {"rope_type": "default"} if cfg.rope_scaling is None else {
        "rope_type": "yarn", "factor": cfg.rope_scaling.factor, "beta_fast": cfg.rope_scaling.beta_fast,
        "beta_slow": cfg.rope_scaling.beta_slow, "attention_factor": cfg.rope_scaling.attention_factor,
        "original_max_position_embeddings": cfg.rope_scaling.original_max_seq_len}
    factor = cfg.rope_dim / cfg.head_dim
    return {"num_key_value_heads": 1, "q_lora_rank": cfg.q_lora_rank, "o_groups": cfg.o_groups,
            "o_lora_rank": cfg.o_lora_rank, "index_n_heads": cfg.index_heads, "index_head_dim": cfg.index_head_dim,
            "index_topk": cfg.index_topk, "hc_mult": cfg.hc_mult, "hc_sinkhorn_iters": cfg.hc_iters,
            "hc_eps": cfg.hc_eps, "layer_types": list(cfg.layer_types), "sliding_window": cfg.sliding_window,
            "compress_rates": {"compressed_sparse_attention": cfg.csa_rate or 4,
                               "heavily_compressed_attention": cfg.hca_rate or 128},
            "mlp_layer_types": ["hash_moe" if i in cfg.hash_layers else "moe" for i in range(cfg.n_layers)],
            "n_routed_experts": cfg.n_experts, "num_experts_per_tok": cfg.experts_per_token,
            "moe_intermediate_size": cfg.expert_dim, "n_shared_experts": 1, "scoring_func": cfg.router_score,
            "routed_scaling_factor": cfg.routed_scale, "swiglu_limit": cfg.swiglu_limit,
            "router_aux_loss_coef": cfg.router_aux_coef, "partial_rotary_factor": factor, "rope_theta":
            cfg.local_rope_theta, "compress_rope_theta": cfg.rope_theta, "num_nextn_predict_layers": 0,
            "rope_parameters": {"main": {"rope_type": "default", "rope_theta": cfg.local_rope_theta,
                                         "partial_rotary_factor": factor},
                                "compress": {**rope, "rope_theta": cfg.rope_theta, "partial_rotary_factor": factor}}}


LAYERS = ("layer_types", "compress_ratios", "compress_rates", "compress_rate_csa", "compress_rate_hca",
          "mlp_layer_types", "num_hash_layers", "sliding_window")
ROPE = ("rope_parameters", "rope_scaling", "rope_theta", "compress_rope_theta", "partial_rotary_factor",
        "qk_rope_head_dim")
ATTENTION = ("q_lora_rank", "o_groups", "o_lora_rank", "index_n_heads", "index_head_dim", "index_topk", "hc_mult",
             "hc_sinkhorn_iters", "hc_eps")
MOE = ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts", "scoring_func",
       "norm_topk_prob", "routed_scaling_factor", "swiglu_limit", "router_aux_loss_coef")
IRRELEVANT = {"output_router_logits": "whether transformers' forward returns the router logits (and adds their "
                                      "loss); phantom's full finetuning adds it with router_aux_loss_coef",
              "router_jitter_noise": "DeepseekV4's routers add no jitter (the field is not read)",
              "num_key_value_heads": "DeepseekV4's attention has one key-value head whatever this says",
              "expert_dtype": "the experts' format as shipped; quantization_config says it",
              "intermediate_size": "DeepseekV4Config maps it onto moe_intermediate_size"}
DEFAULTS = {**COMMON_DEFAULTS, "vocab_size": 129280, "max_position_embeddings": 1048576, "head_dim": 512,
            "num_key_value_heads": 1, "q_lora_rank": 1024, "num_experts_per_tok": 6, "n_routed_experts": 256,
            "n_shared_experts": 1, "moe_intermediate_size": 2048, "scoring_func": "sqrtsoftplus",
            "norm_topk_prob": True, "routed_scaling_factor": 1.5, "rope_theta": 10000.0,
            "compress_rope_theta": 160000.0, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
            "swiglu_limit": 10.0, "sliding_window": 128, "o_groups": 8, "o_lora_rank": 1024, "index_n_heads": 64,
            "index_head_dim": 128, "index_topk": 512, "router_aux_loss_coef": 0.001}

FAMILIES = {f.name: f for f in (
    Family("deepseek_v4", ("DeepseekV4ForCausalLM",), "deepseek_v4", KEYS,
           readers={**{f: read_layers for f in LAYERS}, **{f: read_rope for f in ROPE},
                    **{f: read_attention for f in ATTENTION}, **{f: read_moe for f in MOE},
                    "num_nextn_predict_layers": read_mtp,
                    "attention_bias": refused_unless("attention_bias", lambda v: not v, "false (DeepseekV4's attention "
                                                                                       "has no biases)"),
                    "mlp_bias": refused_unless("mlp_bias", lambda v: not v, "false (no biases on the experts)")},
           fixed={"rope_interleave": True},  # RoPE in pairs, as shipped: no row is permuted
           irrelevant=IRRELEVANT, moe=EXPERTS, hf_fields=v4_fields, defaults=DEFAULTS,
           text=(v4_config, deepseek_names)),
)}
