"""DeepSeek-V3.2 (DeepseekV32ForCausalLM) and GLM-5 (GlmMoeDsaForCausalLM): DeepSeek-V3's latent attention and
DeepSeekMoE with DeepSeek Sparse Attention (phantom.arch.dsa), a lightning indexer choosing index_topk keys per
query.

DeepSeek-V3.2 has an indexer in every layer, its RoPE in halves. GLM-5 turns the indexer's RoPE in pairs, as its
attention's, and shares indexers across layers: indexer_types says which layers run their own ("full") and which
reuse the top-k of the last full layer before them ("shared": no indexer weights; phantom.arch.carry carries the
picks from block to block). The indexers' weights never train: transformers computes them under no_grad.

Each entry says how transformers' config class becomes a ModelConfig and how the checkpoint names its tensors;
phantom.arch.family collects them. Imports phantom.arch.config and the DeepSeek tables.
"""
from __future__ import annotations

from phantom.arch.config import ModelConfig, refuse
from phantom.arch.family_deepseek import DEEPSEEK_DEFAULTS, DEEPSEEK_EXPERTS, DEEPSEEK_MOE_KEYS, IRRELEVANT, \
    LAYER_NORM_KEYS, MLA_KEYS, V3_READERS, deepseek_fields, mla_fields
from phantom.arch.family_moe import refused_unless
from phantom.arch.familybase import Family

INDEXER_KEYS = {f"model.layers.{{}}.self_attn.indexer.{n}": f"attention.indexer.{n}" for n in (
    "wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight")}


def read_dsa(c: dict, path) -> dict:
    """The indexer's shapes and top-k; every layer's attention indexed (layer_types indexed_attention); the MLPs
    dense first, then sparse (mlp_layer_types where written, else first_k_dense_replace's layout)."""
    n, types = c["num_hidden_layers"], c.get("layer_types") or ["indexed_attention"] * c["num_hidden_layers"]
    if list(types) != ["indexed_attention"] * n:
        refuse(path, "layer_types", types, f"{n} x indexed_attention")
    first = c.get("first_k_dense_replace") or 0
    mlp = c.get("mlp_layer_types") or ["dense"] * first + ["sparse"] * (n - first)
    dense = tuple(i for i, t in enumerate(mlp) if t == "dense")
    if len(mlp) != n or set(mlp) - {"dense", "sparse"} or dense != tuple(range(len(dense))):
        refuse(path, "mlp_layer_types", mlp, f"{n} entries, dense ones first, then sparse")
    if not c.get("q_lora_rank"):
        refuse(path, "q_lora_rank", c.get("q_lora_rank"), "a rank (the indexer reads the q bottleneck)")
    return {"index_heads": c["index_n_heads"], "index_head_dim": c["index_head_dim"], "index_topk": c["index_topk"],
            "dense_layers": dense}


def indexer_types(c: dict) -> list:
    """GLM-5's indexer per layer as GlmMoeDsaConfig derives it: indexer_types as written, else index_topk_pattern
    ("FSS...": full, shared), else full where max(i - index_skip_topk_offset + 1, 0) % index_topk_freq is 0."""
    if c.get("indexer_types") is not None:
        return list(c["indexer_types"])
    if (pattern := c.get("index_topk_pattern")) is not None:
        return [{"F": "full", "S": "shared"}.get(ch, ch) for ch in pattern] if isinstance(pattern, str) else list(pattern)
    freq, offset = max(c.get("index_topk_freq") or 1, 1), c.get("index_skip_topk_offset", 2)
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(c["num_hidden_layers"])]


def read_shared_indexers(c: dict, path) -> dict:
    """Which GLM-5 layers reuse the last indexer layer's top-k (indexer_types "shared"); the first layer runs its
    own. The indexer's and attention's RoPE turn pairs, as GlmMoeDsaAttention always does (files that say so
    with rope_interleave, indexer_rope_interleave: true; false is not what transformers computes)."""
    types, n = indexer_types(c), c["num_hidden_layers"]
    if len(types) != n or set(types) - {"full", "shared"} or types[0] != "full":
        refuse(path, "indexer_types", types, f"{n} entries, each full or shared, the first full")
    for key in ("rope_interleave", "indexer_rope_interleave"):
        if c.get(key, True) is not True:
            refuse(path, key, c[key], "true (GlmMoeDsaAttention rotates pairs in attention and its indexer)")
    return {"index_shared": tuple(i for i, t in enumerate(types) if t == "shared")}


def dsa_fields(cfg: ModelConfig) -> dict:
    return {**mla_fields(cfg), **deepseek_fields(cfg), "index_n_heads": cfg.index_heads,
            "index_head_dim": cfg.index_head_dim, "index_topk": cfg.index_topk}


def v32_fields(cfg: ModelConfig) -> dict:
    """DeepSeek-V3.2's fields, scoring_func and topk_method as its Hub file says them (as DeepSeek-V3's): transformers'
    class has them fixed, but llama.cpp's converter writes the router's gating from them, without which llama.cpp's
    deepseek32 does not load the file."""
    return {**dsa_fields(cfg), "scoring_func": "sigmoid", "topk_method": "noaux_tc"}


def glm5_fields(cfg: ModelConfig) -> dict:
    """GLM-5's fields: the sparse attention's, indexer_types per layer, no prediction layer (left out, as by
    transformers)."""
    return {**dsa_fields(cfg), "num_nextn_predict_layers": 0,
            "indexer_types": ["shared" if i in cfg.index_shared else "full" for i in range(cfg.n_layers)]}


DSA_READERS = {**{k: v for k, v in V3_READERS.items() if k != "rope_interleave"},
               **{f: read_dsa for f in ("index_topk", "index_n_heads", "index_head_dim", "layer_types",
                                        "mlp_layer_types")},
               "mlp_bias": refused_unless("mlp_bias", lambda v: not v, "false (DeepSeek Sparse Attention's models have "
                                                                       "no MLP biases)")}
GLM5_READERS = {**DSA_READERS, **{f: read_shared_indexers for f in (
    "indexer_types", "index_topk_pattern", "index_topk_freq", "index_skip_topk_offset", "rope_interleave",
    "indexer_rope_interleave")}}
GLM5_IRRELEVANT = {**IRRELEVANT,
                   "index_share_for_mtp_iteration": "how the multi-token-prediction layer (left out) shares an indexer",
                   "moe_router_dtype": "the router's dtype; transformers' router computes in fp32, as phantom's does"}
DSA_DEFAULTS = {**DEEPSEEK_DEFAULTS, "moe_intermediate_size": 2048, "n_shared_experts": 1, "n_routed_experts": 256,
                "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "first_k_dense_replace": 3,
                "norm_topk_prob": True, "index_topk": 2048, "index_head_dim": 128}

FAMILIES = {f.name: f for f in (
    Family("deepseek_v32", ("DeepseekV32ForCausalLM",), "deepseek_v32",
           {**LAYER_NORM_KEYS, **MLA_KEYS, **DEEPSEEK_MOE_KEYS, **INDEXER_KEYS}, readers=DSA_READERS,
           fixed={"rope_interleave": True},  # DeepseekV32Attention always rotates pairs (its indexer halves)
           irrelevant=IRRELEVANT, moe=DEEPSEEK_EXPERTS, hf_fields=v32_fields,
           defaults={**DSA_DEFAULTS, "max_position_embeddings": 163840, "q_lora_rank": 1536, "v_head_dim": 128,
                     "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4, "index_n_heads": 64}),
    Family("glm_moe_dsa", ("GlmMoeDsaForCausalLM",), "glm_moe_dsa",
           {**LAYER_NORM_KEYS, **MLA_KEYS, **DEEPSEEK_MOE_KEYS, **INDEXER_KEYS}, readers=GLM5_READERS,
           fixed={"rope_interleave": True, "index_pairs": True},  # GlmMoeDsaAttention and its indexer rotate pairs
           irrelevant=GLM5_IRRELEVANT, moe=DEEPSEEK_EXPERTS, hf_fields=glm5_fields,
           defaults={**DSA_DEFAULTS, "rms_norm_eps": 1e-5, "max_position_embeddings": 202752, "q_lora_rank": 2048,
                     "v_head_dim": 256, "qk_nope_head_dim": 192, "n_group": 1, "topk_group": 1, "index_n_heads": 32}),
)}
