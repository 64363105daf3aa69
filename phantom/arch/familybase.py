"""What every family entry is made of: the `Family` record, the tensor names and config.json fields most
families share, and the readers of RoPE and of the fields Llama's config class has. Each family group's
module (phantom.arch.family_deepseek, ...) builds its entries from these; phantom.arch.family collects them.
Also Meta's params.json read into a ModelConfig (from_meta_params).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Callable

from phantom.arch.config import ModelConfig, RopeScaling
from phantom.arch.config import refuse as _refuse
from phantom.arch.quantformat import read_as_shipped
from phantom.base import safejson

log = logging.getLogger(__name__)

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
ATTENTION_KEYS = {hf: name for hf, name in LLAMA_KEYS.items() if ".mlp." not in hf}
DENSE_MLP_KEYS = {hf: name for hf, name in LLAMA_KEYS.items() if ".mlp." in hf}  # dense layers among sparse ones
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
    "quantization_config": (lambda v: v is None or read_as_shipped(v),
                            "unquantized checkpoints (bf16, fp16, fp32), FP8 in blocks (quant_method 'fp8', fmt "
                            "'e4m3', activation_scheme 'dynamic', weight_block_size [rows, columns]), compressed-tensors' "
                            "pack-quantized symmetric INT4 in groups or gpt-oss's MXFP4"),
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
                       attention_factor=float(gain), truncate=rs.get("truncate", True),
                       mscale_all_dim=float(rs.get("mscale_all_dim") or 0.0))


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



def _read_attention_bias(c: dict, path) -> dict:
    bias = bool(c.get("attention_bias"))
    return {"qkv_bias": bias, "o_bias": bias}


def _read_mlp_bias(c: dict, path) -> dict:
    return {"mlp_bias": bool(c.get("mlp_bias"))}


def _read_mistral_window(c: dict, path) -> dict:
    """Mistral: every layer attends to the last sliding_window keys (None: plain causal)."""
    return {"sliding_window": c.get("sliding_window")}


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
    moe: "object | None" = None  # phantom.arch.family_moe.MoeKeys (that module builds on this one)
    hf_fields: "Callable[[ModelConfig], dict] | None" = None  # config.json fields of its own an export writes
    # a vision-language checkpoint's text model (Qwen3.5): (config.json -> the text model's fields, checkpoint
    # tensor names -> {text model's name: checkpoint's name}, the rest left out); None: the file is the text model
    text: "tuple[Callable[[dict, object], dict], Callable[[dict], dict]] | None" = None

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


def vl_text_config(c: dict, path, architecture: str, model_type: str, tie: bool) -> dict:
    """A vision-language config.json's text model (its text_config, with the outer quantization_config) read as
    `architecture`, the vision tower said left out; tie_word_embeddings is the outer config's (`tie` where left
    out), as the vision-language class ties. A config without text_config is returned as it is."""
    if not isinstance(c.get("text_config"), dict):
        return c
    log.info("%s: %s is a vision-language model: its text model is read, the vision tower is left out", path,
             (c.get("architectures") or ["?"])[0])
    outer = {k: c[k] for k in ("quantization_config",) if k in c}
    return {**c["text_config"], **outer, "architectures": [architecture], "model_type": model_type,
            "tie_word_embeddings": bool(c.get("tie_word_embeddings", tie))}


def from_meta_params(path: Path, vocab_size: int | None = None) -> ModelConfig:
    """ModelConfig from Meta's params.json (vocab_size -1 there means: take it from the tokenizer)."""
    p = safejson.load(path, what="params.json")
    vocab = p.get("vocab_size", -1)
    if vocab is None or vocab <= 0:
        if vocab_size is None:
            raise ValueError(f"{path}: vocab_size is {vocab}; pass the tokenizer's vocabulary size")
        vocab = vocab_size
    scaling = None
    if p.get("use_scaled_rope"):
        scaling = RopeScaling(factor=p.get("rope_scaling_factor", 8.0))
    return ModelConfig(dim=p["dim"], n_layers=p["n_layers"], n_heads=p["n_heads"], vocab_size=vocab,
                       n_kv_heads=p.get("n_kv_heads"), multiple_of=p.get("multiple_of", 256),
                       ffn_dim_multiplier=p.get("ffn_dim_multiplier"), norm_eps=p.get("norm_eps", 1e-5),
                       rope_theta=p.get("rope_theta", 10000.0), rope_scaling=scaling,
                       max_seq_len=p.get("max_seq_len", 4096))
