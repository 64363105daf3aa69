"""The mixture-of-experts parts of phantom.arch.family's tables (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, MiniMax-M2).

MoeKeys says how a family's experts are named in both checkpoint layouts (one tensor per expert and
projection, or transformers 5's fused 3-D tensors); the readers turn the router's and experts' config.json
fields into ModelConfig's. Imports only phantom.arch.config; phantom.arch.family holds the entries.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from phantom.arch.config import ModelConfig, refuse
from phantom.arch.familybase import ATTENTION_KEYS, BIAS_KEYS, COMMON_DEFAULTS, DENSE_MLP_KEYS, QK_NORM_KEYS, Family, \
    _read_attention_bias, _read_mistral_window


@dataclass(frozen=True)
class MoeKeys:
    """experts: one expert's Hugging Face names (<e> its index) -> store names, in the per-expert layout;
    fields: the config.json fields of the experts an export writes (MOE_FIELDS: the ModelConfig field
    each is); fused: the 3-D layout's tensors -> one expert's parts, stacked by rows; fused_renames:
    names that layout changes (Mixtral's block_sparse_moe is mlp there, as transformers 5 renames it)."""

    experts: dict[str, str]
    fields: tuple[str, ...]
    fused_renames: dict[str, str] = field(default_factory=dict)
    fused: dict[str, tuple[str, ...]] = field(default_factory=lambda: FUSED_EXPERTS)
    turned: str = ""  # "halves": the fused tensors are (experts, in, out), gate then up on out (Llama 4)
    peft_module: str = "mlp.experts"  # where peft finds the fused tensors inside a layer (target_parameters)
    peft_swapped: bool = False  # peft takes their (experts, in, out) for (experts, out, in) (phantom.arch.expertlora)


def expert_keys(prefix: str, gate: str, up: str, down: str, to: str = "feed_forward.experts.<e>") -> dict:
    return {f"{prefix}.{gate}.weight": f"{to}.w1.weight", f"{prefix}.{up}.weight": f"{to}.w3.weight",
            f"{prefix}.{down}.weight": f"{to}.w2.weight"}


FUSED_EXPERTS = {"model.layers.{}.mlp.experts.gate_up_proj": ("feed_forward.experts.<e>.w1.weight",
                                                              "feed_forward.experts.<e>.w3.weight"),
                 "model.layers.{}.mlp.experts.down_proj": ("feed_forward.experts.<e>.w2.weight",)}
MOE_FIELDS = {"num_experts": "n_experts", "num_local_experts": "n_experts", "num_experts_per_tok": "experts_per_token",
              "moe_intermediate_size": "expert_dim", "norm_topk_prob": "norm_topk_prob",
              "shared_expert_intermediate_size": "shared_expert_dim", "router_aux_loss_coef": "router_aux_coef"}
MOE_IRRELEVANT = {"output_router_logits": "whether transformers' forward returns the router logits (and adds "
                                          "their loss); phantom's full finetuning adds it with router_aux_loss_coef"}


def read_moe(c: dict, path) -> dict:
    """The experts and their router. The number of experts has no default: transformers writes it as
    num_experts or num_local_experts (either is read; a config class maps one onto the other)."""
    counts = {c[f] for f in ("num_experts", "num_local_experts") if c.get(f) is not None}  # either name is read
    if len(counts) != 1:
        refuse(path, "num_experts", sorted(counts), "one number of experts (num_experts or num_local_experts)")
    out = {attr: c[f] for f, attr in MOE_FIELDS.items() if c.get(f) is not None}
    return {"expert_dim": c["intermediate_size"], **out, "norm_topk_prob": bool(out.get("norm_topk_prob"))}


def read_dense_layers(c: dict, path) -> dict:
    """Qwen-MoE's dense layers among sparse ones: those in mlp_only_layers, and where decoder_sparse_step
    is k, every layer but each k-th (layers k-1, 2k-1, ... are sparse), as Qwen2MoeDecoderLayer and
    Qwen3MoeDecoderLayer choose; their MLP is intermediate_size wide (ModelConfig.dense_layers)."""
    only, step, n = c.get("mlp_only_layers") or [], c.get("decoder_sparse_step", 1), c["num_hidden_layers"]
    if not isinstance(only, list) or any(type(i) is not int or not 0 <= i < n for i in only):
        refuse(path, "mlp_only_layers", only, f"a list of layers in [0, {n})")
    if type(step) is not int or step < 1:
        refuse(path, "decoder_sparse_step", step, "an integer >= 1")
    return {"dense_layers": tuple(i for i in range(n) if i in only or (i + 1) % step)}


def refused_unless(key: str, allowed: Callable, supported: str):
    def read(c: dict, path) -> dict:
        if not allowed(c.get(key)):
            refuse(path, key, c.get(key), supported)
        return {}
    return read


def read_qwen3_moe_window(c: dict, path) -> dict:
    """Qwen3-MoE: with use_sliding_window, every layer slides (Qwen3MoeConfig has no layer_types)."""
    return {"sliding_window": c.get("sliding_window") if c.get("use_sliding_window") else None}


def read_qwen2_moe_window(c: dict, path) -> dict:
    """Qwen2-MoE: with use_sliding_window, layer_types as written, else every other layer (the first
    included) below max_window_layers slides, as Qwen2MoeConfig fills them in."""
    if not c.get("use_sliding_window"):
        return {"sliding_window": None, "layer_types": None}
    types = c.get("layer_types") or ["sliding_attention" if (i + 1) % 2 and i < c["max_window_layers"]
                                     else "full_attention" for i in range(c["num_hidden_layers"])]
    return {"sliding_window": c.get("sliding_window"), "layer_types": tuple(types)}


MOE_READERS = {f: read_moe for f in ("num_experts", "num_local_experts", "num_experts_per_tok", "norm_topk_prob",
                                      "router_aux_loss_coef")}
DENSE_READERS = {"decoder_sparse_step": read_dense_layers, "mlp_only_layers": read_dense_layers}  # Qwen-MoE
ROUTER_KEYS = {"model.layers.{}.mlp.gate.weight": "feed_forward.gate.weight"}
QWEN_EXPERTS = expert_keys("model.layers.{}.mlp.experts.<e>", "gate_proj", "up_proj", "down_proj")
QWEN_MOE = dict(max_position_embeddings=32768, norm_topk_prob=False, router_aux_loss_coef=0.001, decoder_sparse_step=1,
                num_experts_per_tok=8, use_sliding_window=False)
QWEN_MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                   "router_aux_loss_coef")
SHARED_EXPERT_KEYS = {**expert_keys("model.layers.{}.mlp.shared_expert", "gate_proj", "up_proj", "down_proj",
                                     "feed_forward.shared_expert"),
                      "model.layers.{}.mlp.shared_expert_gate.weight": "feed_forward.shared_expert_gate.weight"}

def read_minimax_m2(c: dict, path) -> dict:
    """MiniMax-M2: RMSNorms over the whole q and k projections, RoPE over the leading partial_rotary_factor of each
    head (rotary_dim / head_dim in the Hub's files, as MiniMaxM2Config converts it), sigmoid scores with
    e_score_correction_bias moving the choice alone and the k weights renormalised (MiniMaxM2TopKRouter); no jitter."""
    if c.get("router_jitter_noise"):
        refuse(path, "router_jitter_noise", c["router_jitter_noise"], "0 (no jitter)")
    head = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    factor = (c.get("rope_parameters") or {}).get("partial_rotary_factor") or c.get("partial_rotary_factor") or \
        (c["rotary_dim"] / head if c.get("rotary_dim") else 1.0)
    return {"rotary_dim": int(head * factor) if int(head * factor) != head else None}


def minimax_m2_fields(cfg: ModelConfig) -> dict:
    """The Hub's fields beside partial_rotary_factor: RoPE's width as rotary_dim, the router's scores as scoring_func
    (MiniMaxM2Config reads the one, keeps the other; llama.cpp's converter needs both)."""
    return {"rotary_dim": cfg.rotary_dim or cfg.head_dim, "scoring_func": "sigmoid"}


MINIMAX_M2_ROUTER = {"model.layers.{}.block_sparse_moe.gate.weight": "feed_forward.gate.weight",
                     "model.layers.{}.block_sparse_moe.e_score_correction_bias":
                         "feed_forward.gate.e_score_correction_bias"}
MIXTRAL_EXPERTS = expert_keys("model.layers.{}.block_sparse_moe.experts.<e>", "w1", "w3", "w2")

FAMILIES = {f.name: f for f in (
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
           moe=MoeKeys(MIXTRAL_EXPERTS, ("num_local_experts", "num_experts_per_tok", "router_aux_loss_coef"),
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
    Family("minimax_m2", ("MiniMaxM2ForCausalLM",), "minimax_m2", {**ATTENTION_KEYS, **QK_NORM_KEYS,
                                                                  **MINIMAX_M2_ROUTER},
           readers={**MOE_READERS, **{f: read_minimax_m2 for f in ("router_jitter_noise", "rotary_dim",
                                                                   "partial_rotary_factor")}},
           fixed={"qk_norm": True, "qk_norm_over": "projection", "norm_topk_prob": True, "router_score": "sigmoid",
                  "router_bias": True},
           irrelevant=MOE_IRRELEVANT,
           moe=MoeKeys(MIXTRAL_EXPERTS, ("num_local_experts", "num_experts_per_tok", "router_aux_loss_coef"),
                       {k: k.replace("block_sparse_moe", "mlp") for k in MINIMAX_M2_ROUTER}),
           defaults={**COMMON_DEFAULTS, "max_position_embeddings": 196608, "head_dim": 128,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 5e6}, "num_local_experts": 256,
                     "num_experts_per_tok": 8, "router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0},
           hf_fields=minimax_m2_fields),
)}
