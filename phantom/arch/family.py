"""Families are data: one frozen `Family` per Hugging Face architecture phantom reads.

An entry says how the family's config.json becomes a ModelConfig (every field of its transformers
config class is modelled, refused when set, or irrelevant with the reason) and how its checkpoint's
tensors are named (a weight_map, as gpt-fast's converter keeps one). The block maths read only
ModelConfig's fields; the converter, exporter and LoRA writer read these tables.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from phantom.arch.config import ACTIVATIONS, ConfigError, ModelConfig, RopeScaling  # noqa: F401
from phantom.arch.config import refuse as _refuse
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
from phantom.base import safejson

# ---------------------------------------------------------------------------------------------
# Tensor names: Hugging Face name -> store name ({} is the layer index)

LLAMA_KEYS = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
    "model.layers.{}.self_attn.q_proj.weight": "attention.wq.weight",
    "model.layers.{}.self_attn.k_proj.weight": "attention.wk.weight",
    "model.layers.{}.self_attn.v_proj.weight": "attention.wv.weight",
    "model.layers.{}.self_attn.o_proj.weight": "attention.wo.weight",
    "model.layers.{}.mlp.gate_proj.weight": "feed_forward.w1.weight",
    "model.layers.{}.mlp.down_proj.weight": "feed_forward.w2.weight",
    "model.layers.{}.mlp.up_proj.weight": "feed_forward.w3.weight",
    "model.layers.{}.input_layernorm.weight": "attention_norm.weight",
    "model.layers.{}.post_attention_layernorm.weight": "ffn_norm.weight",
}
BIAS_KEYS = {hf.replace(".weight", ".bias"): name.replace(".weight", ".bias")
             for hf, name in LLAMA_KEYS.items() if "_proj" in hf}
QK_NORM_KEYS = {"model.layers.{}.self_attn.q_norm.weight": "attention.q_norm.weight",
                "model.layers.{}.self_attn.k_norm.weight": "attention.k_norm.weight"}

# ---------------------------------------------------------------------------------------------
# config.json fields

IRRELEVANT = {  # fields of every transformers config that do not change the maths, and why
    "_name_or_path": "where transformers loaded the config from",
    "bos_token_id": "a token id for generation; the tokenizer's files carry it",
    "eos_token_id": "a token id for generation; the tokenizer's files carry it",
    "pad_token_id": "a token id for padding; phantom packs rows and masks targets instead",
    "chunk_size_feed_forward": "transformers' memory knob: the MLP run in chunks computes the same values",
    "dtype": "the checkpoint's dtype; phantom reads it from the tensors",
    "torch_dtype": "the checkpoint's dtype (older name); phantom reads it from the tensors",
    "id2label": "labels of a classification head; a causal LM has none",
    "label2id": "labels of a classification head; a causal LM has none",
    "problem_type": "the loss of a classification head; a causal LM has none",
    "initializer_range": "the init of new weights; phantom loads trained ones",
    "output_attentions": "what transformers' forward returns, not what it computes",
    "output_hidden_states": "what transformers' forward returns, not what it computes",
    "return_dict": "what transformers' forward returns, not what it computes",
    "use_cache": "whether transformers' generation keeps a KV cache; the same values",
    "transformers_version": "the version of transformers that wrote the file",
    "pretraining_tp": "a record of Meta's tensor parallelism; transformers' Llama ignores it too",
    "max_window_layers": "read with use_sliding_window (Qwen's rule for which layers slide)",
}
REFUSED_WHEN_SET = {  # field -> (allowed value check, what phantom supports)
    "attention_dropout": (lambda v: not v, "0 (no dropout on attention probabilities)"),
    "is_encoder_decoder": (lambda v: not v, "decoder-only models"),
    "use_bidirectional_attention": (lambda v: not v, "causal attention"),
    "quantization_config": (lambda v: v is None, "unquantized checkpoints (bf16, fp16, fp32)"),
    "num_experts": (lambda v: not v, "dense models (no mixture of experts)"),
    "num_local_experts": (lambda v: not v, "dense models (no mixture of experts)"),
    "n_routed_experts": (lambda v: not v, "dense models (no mixture of experts)"),
    "partial_rotary_factor": (lambda v: v in (None, 1, 1.0), "1.0 (RoPE over the whole head)"),
    "resid_pdrop": (lambda v: not v, "0 (no dropout on the residual stream)"),
    "embd_pdrop": (lambda v: not v, "0 (no dropout on the embeddings)"),
}
MODELLED_COMMON = ("architectures", "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
                   "num_key_value_heads", "vocab_size", "intermediate_size", "rms_norm_eps",
                   "max_position_embeddings", "rope_parameters", "rope_theta", "rope_scaling",
                   "tie_word_embeddings", "hidden_act", "head_dim")


SCALED_ROPES = ("llama3", "linear", "yarn")  # what transformers' Llama, Mistral, Qwen and Gemma classes read


def _rope_scaling(rs: dict, path, max_pos: int, kinds: tuple[str, ...] = SCALED_ROPES) -> RopeScaling | None:
    """A rope_scaling (or rope_parameters) dict as phantom's RopeScaling; refused unless its type is one of
    kinds. original_max_position_embeddings defaults to max_pos, as transformers fills it in."""
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind != "default" and kind not in kinds:
        _refuse(path, "rope_scaling.rope_type", kind, "'default', " + ", ".join(repr(t) for t in kinds))
    rs = {"original_max_position_embeddings": max_pos, **rs}
    if kind == "default":
        return None
    if kind == "linear":
        return RopeScaling(rope_type="linear", factor=rs["factor"])
    if kind == "yarn":
        return _yarn(rs, path)
    if kind == "longrope":
        return _longrope(rs, path, max_pos)
    if kind == "llama3":
        return RopeScaling(factor=rs["factor"], low_freq_factor=rs["low_freq_factor"],
                           high_freq_factor=rs["high_freq_factor"],
                           original_max_seq_len=rs["original_max_position_embeddings"])
    raise AssertionError(f"{kind}: in ROPE_TYPES but not read")


def _yarn(rs: dict, path) -> RopeScaling:
    """YaRN's fields as transformers reads them (its attention factor from factor unless given)."""
    factor = rs["factor"]
    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
    gain = rs.get("attention_factor")
    if gain is None:
        m, m_all = rs.get("mscale"), rs.get("mscale_all_dim")
        gain = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    return RopeScaling(rope_type="yarn", factor=factor, original_max_seq_len=rs["original_max_position_embeddings"],
                       beta_fast=rs.get("beta_fast") or 32.0, beta_slow=rs.get("beta_slow") or 1.0,
                       attention_factor=float(gain), truncate=rs.get("truncate", True))


def _longrope(rs: dict, path, max_pos: int) -> RopeScaling:
    """LongRoPE's fields as transformers reads them: its attention factor from max_pos over the original
    context (sqrt(1 + ln f / ln original)) unless given."""
    original = rs["original_max_position_embeddings"]
    factor = rs.get("factor") or max_pos / original
    gain = rs.get("attention_factor")
    if gain is None:
        gain = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeScaling(rope_type="longrope", factor=factor, original_max_seq_len=original, attention_factor=float(gain),
                       short_factor=rs["short_factor"], long_factor=rs["long_factor"])


def _read_rope(c: dict, path) -> tuple[float, RopeScaling | None]:
    """One RoPE for every layer: rope_theta + rope_scaling (older files) or rope_parameters (transformers >= 5)."""
    rope = c.get("rope_parameters") or {}
    return (c.get("rope_theta", rope.get("rope_theta", 10000.0)),
            _rope_scaling(c.get("rope_scaling") or rope, path, c["max_position_embeddings"]))


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


def _read_attention_bias(c: dict, path) -> dict:
    bias = bool(c.get("attention_bias"))
    return {"qkv_bias": bias, "o_bias": bias}


def _read_mlp_bias(c: dict, path) -> dict:
    return {"mlp_bias": bool(c.get("mlp_bias"))}


def _read_mistral_window(c: dict, path) -> dict:
    """Mistral: every layer attends to the last sliding_window keys (None: plain causal)."""
    return {"sliding_window": c.get("sliding_window")}


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


@dataclass(frozen=True)
class Family:
    """One architecture: how its config.json and tensor names map onto phantom's.

    readers: config field -> function (config, path) -> ModelConfig fields, for the fields beyond
    MODELLED_COMMON this family has; fixed: ModelConfig fields the family always sets; defaults:
    the values transformers' config class gives fields a config.json leaves out; irrelevant:
    family-specific fields that do not change the maths, with why; fused: a checkpoint tensor that
    holds several of phantom's, stacked by rows in this order (Phi-3's qkv_proj: q, k, v). The
    store keeps them apart (and back to back, so a block still runs them as one matmul); a LoRA on
    the fused module is one A shared by its parts (phantom.model.lora). moe: a mixture of experts' names
    and config fields (MoeKeys); None for a dense family.
    """

    name: str
    architectures: tuple[str, ...]
    model_type: str
    keys: dict[str, str]
    readers: dict[str, Callable[[dict, object], dict]] = field(default_factory=dict)
    fixed: dict = field(default_factory=dict)
    defaults: dict = field(default_factory=dict)
    irrelevant: dict[str, str] = field(default_factory=dict)
    fused: dict[str, tuple[str, ...]] = field(default_factory=dict)
    moe: "MoeKeys | None" = None

    @property
    def hf_class(self) -> str:
        return self.architectures[0]

    def modelled(self) -> set[str]:
        return set(MODELLED_COMMON) | set(self.readers)

    def hf_names(self) -> dict[tuple[bool, str], str]:
        """(in a block?, store name) -> Hugging Face name (of the fused tensor holding it, where fused)."""
        return {**{("{}" in hf, name): hf for hf, name in self.keys.items()},
                **{(True, name): hf for hf, names in self.fused.items() for name in names}}

    def layout(self, cfg: ModelConfig, fused_experts: bool = False) -> tuple[dict, dict]:
        """cfg's checkpoint names: ((in a block?, store name) -> Hugging Face name, fused Hugging Face name ->
        the store names it stacks by rows). A mixture of experts is one tensor per expert and projection
        (as the Hub's files and transformers' save_pretrained hold them), or with fused_experts the 3-D
        tensors of transformers' modules ((experts, 2 * width, dim) gate and up; (experts, dim, width) down),
        read as their experts' rows stacked, expert after expert."""
        keys, fused = dict(self.keys), dict(self.fused)
        if self.moe is not None:
            m, each = self.moe, range(cfg.n_experts)
            if fused_experts:
                keys = {m.fused_renames.get(hf, hf): name for hf, name in keys.items()}
                fused |= {hf: tuple(p.replace("<e>", str(e)) for e in each for p in parts)
                          for hf, parts in m.fused.items()}
            else:
                keys |= {hf.replace("<e>", str(e)): name.replace("<e>", str(e)) for e in each
                         for hf, name in m.experts.items()}
        return ({**{("{}" in hf, name): hf for hf, name in keys.items()},
                 **{(True, name): hf for hf, names in fused.items() for name in names}}, fused)


COMMON_DEFAULTS = {"rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": False}
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

ATTENTION_KEYS = {hf: name for hf, name in LLAMA_KEYS.items() if ".mlp." not in hf}
DENSE_MLP_KEYS = {hf: name for hf, name in LLAMA_KEYS.items() if ".mlp." in hf}  # Qwen-MoE's dense layers (dense_layers)
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

