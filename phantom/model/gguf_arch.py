"""What llama.cpp's convert_hf_to_gguf.py does per family: its converter class's architecture, the keys its
set_gguf_parameters writes (read, as it reads them, from the config.json of phantom's HF export), how it
renames and reshapes tensors, and what a family's GGUF cannot say (refused, one line).

gguf_export plans and writes the file from these. May import gguf and phantom.arch.
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
from dataclasses import dataclass
from typing import Callable

import gguf
import torch

from phantom.arch.config import ModelConfig

T = gguf.GGMLQuantizationType


SCORING = {"sigmoid": gguf.ExpertGatingFuncType.SIGMOID, "softmax": gguf.ExpertGatingFuncType.SOFTMAX}


def rope_parameters(c: dict) -> dict:
    """The converter's TextModel.rope_parameters: rope_parameters (or rope_scaling) with rope_theta mirrored in."""
    rope = dict(c.get("rope_parameters", c.get("rope_scaling")) or {})
    if "full_attention" not in rope and "sliding_attention" not in rope:
        if "rope_theta" not in rope and c.get("rope_theta") is not None:
            rope["rope_theta"] = c["rope_theta"]
        if "rope_type" not in rope and rope.get("type") is not None:
            rope["rope_type"] = rope["type"]
    return rope


def first(c: dict, keys: tuple[str, ...]):
    """The converter's find_hparam(keys, optional=True): the first key present (its value, None included)."""
    return next((c[k] for k in keys if k in c), None)


@contextlib.contextmanager
def rewriting():
    """Keys written a second time, as some converter classes do (the new value in the old one's place),
    without gguf's warning about it."""
    log = logging.getLogger("gguf.gguf_writer")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def text_hparams(w: gguf.GGUFWriter, c: dict, ftype: gguf.LlamaFileType) -> None:
    """TextModel.set_gguf_parameters: the keys every family's class starts from, in its order."""
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    if (ff := first(c, ("intermediate_size", "n_inner", "hidden_dim"))) is not None:
        w.add_feed_forward_length(ff)
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    rope = rope_parameters(c)
    full = rope.get("full_attention", rope)
    kind, factor = full.get("rope_type"), full.get("factor")
    if kind == "linear" and factor is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(factor)
    elif kind == "yarn" and factor is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(factor)
        w.add_rope_scaling_orig_ctx_len(full["original_max_position_embeddings"])
        if (attn := full.get("attention_factor", full.get("attn_factor"))) is not None:
            w.add_rope_scaling_yarn_attn_factor(attn)
        if full.get("beta_fast") is not None:
            w.add_rope_scaling_yarn_beta_fast(full["beta_fast"])
        if full.get("beta_slow") is not None:
            w.add_rope_scaling_yarn_beta_slow(full["beta_slow"])
    elif kind in ("su", "longrope"):
        w.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE)
    if full.get("rope_theta") is not None:
        w.add_rope_freq_base(full["rope_theta"])
    if (local := rope.get("sliding_attention", {}).get("rope_theta")) is not None:
        w.add_rope_freq_base_swa(local)
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    if (experts := first(c, ("num_local_experts", "num_experts"))) is not None:
        w.add_expert_count(experts)
    if (used := first(c, ("num_experts_per_tok", "num_experts_per_token", "top_k_experts"))) is not None:
        w.add_expert_used_count(used)
    if c.get("n_group") is not None:
        w.add_expert_group_count(c["n_group"])
    if c.get("topk_group") is not None:
        w.add_expert_group_used_count(c["topk_group"])
    score = first(c, ("score_function", "scoring_func", "score_func", "moe_router_activation",
                      "moe_router_activation_func"))
    if score is not None:
        w.add_expert_gating_func(SCORING[score])
    if c.get("head_dim") is not None:
        w.add_key_length(c["head_dim"])
        w.add_value_length(c["head_dim"])
    w.add_file_type(ftype)


def llama_hparams(w: gguf.GGUFWriter, c: dict, ftype) -> None:
    """LlamaModel: the vocabulary size and RoPE's width after the base keys."""
    text_hparams(w, c, ftype)
    w.add_vocab_size(c["vocab_size"])
    w.add_rope_dimension_count(c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"])


def qwen_moe_hparams(w: gguf.GGUFWriter, c: dict, ftype) -> None:
    """Qwen2MoeModel (Qwen3MoeModel's base): the experts' widths."""
    text_hparams(w, c, ftype)
    if c.get("moe_intermediate_size") is not None:
        w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    if c.get("shared_expert_intermediate_size") is not None:
        w.add_expert_shared_feed_forward_length(c["shared_expert_intermediate_size"])


def olmoe_hparams(w: gguf.GGUFWriter, c: dict, ftype) -> None:
    """OlmoeModel: the base keys, its norms' epsilon set to 1e-5 (check_supported refuses another)."""
    text_hparams(w, c, ftype)
    with rewriting():
        w.add_layer_norm_rms_eps(1e-5)


def gemma2_hparams(w: gguf.GGUFWriter, c: dict, ftype) -> None:
    """Gemma2Model's own keys (no RoPE base: llama.cpp's default 10000, which check_supported requires)."""
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_block_count(c["num_hidden_layers"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_key_length(c["head_dim"])
    w.add_value_length(c["head_dim"])
    w.add_file_type(ftype)
    w.add_attn_logit_softcapping(c["attn_logit_softcapping"])
    w.add_final_logit_softcapping(c["final_logit_softcapping"])
    w.add_sliding_window(c["sliding_window"])


def gemma3_hparams(w: gguf.GGUFWriter, c: dict, ftype) -> None:
    """Gemma3Model: the base keys, some written again (in place), then soft-capping and the window."""
    text_hparams(w, c, ftype)
    with rewriting():
        w.add_context_length(c.get("max_position_embeddings", 131072))
        w.add_head_count(c.get("num_attention_heads", 8))
        w.add_layer_norm_rms_eps(c.get("rms_norm_eps", 1e-6))
        w.add_key_length(c.get("head_dim", 256))
        w.add_value_length(c.get("head_dim", 256))
        rope = rope_parameters(c)
        w.add_rope_freq_base(rope.get("full_attention", rope).get("rope_theta", 1_000_000.0))
        if c.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(c["final_logit_softcapping"])
        if c.get("sliding_window_pattern") != 1:
            w.add_sliding_window(c["sliding_window"])
        w.add_head_count_kv(c.get("num_key_value_heads", 4))


def deepseek2_hparams(w: gguf.GGUFWriter, c: dict, ftype) -> None:
    """DeepseekV2Model (DeepSeek-V2 and V3): the base keys with one kv head (latent attention as MQA), then
    the latent ranks and head sizes (key/value lengths written again, in place), the experts and RoPE's width."""
    c = {**c, "num_key_value_heads": 1, "rms_norm_eps": c.get("rms_norm_eps", 1e-6)}
    text_hparams(w, c, ftype)
    experts = c.get("n_routed_experts")
    first_dense = c.get("first_k_dense_replace")
    w.add_leading_dense_block_count(first_dense if first_dense is not None else
                                    0 if experts is not None else c["num_hidden_layers"])
    rank = c.get("kv_lora_rank", 512)
    w.add_vocab_size(c["vocab_size"])
    if c.get("q_lora_rank") is not None:
        w.add_q_lora_rank(c["q_lora_rank"])
    w.add_kv_lora_rank(rank)
    with rewriting():
        w.add_key_length(rank + c["qk_rope_head_dim"])
        w.add_value_length(rank)
    w.add_key_length_mla(c["qk_nope_head_dim"] + c["qk_rope_head_dim"])
    w.add_value_length_mla(c["v_head_dim"])
    w.add_expert_feed_forward_length(first(c, ("moe_intermediate_size", "intermediate_size")))
    if experts is not None:
        with rewriting():
            w.add_expert_count(experts)
    w.add_expert_shared_count(c.get("n_shared_experts", 0))
    if c.get("routed_scaling_factor") is not None:
        w.add_expert_weights_scale(c["routed_scaling_factor"])
    if c.get("norm_topk_prob"):
        w.add_expert_weights_norm(c["norm_topk_prob"])
    w.add_rope_dimension_count(c["qk_rope_head_dim"])
    if (mscale := rope_parameters(c).get("mscale_all_dim")) is not None:
        w.add_rope_scaling_yarn_log_mul(0.1 * mscale)


def phi3_rope_dims(c: dict) -> int:
    return int(c.get("partial_rotary_factor", 1.0) * c["hidden_size"]) // c["num_attention_heads"]


def phi3_hparams(w: gguf.GGUFWriter, c: dict, ftype) -> None:
    """Phi3MiniModel's own keys (sliding window 0 where there is none)."""
    w.add_context_length(c["max_position_embeddings"])
    w.add_rope_scaling_orig_ctx_len(c["original_max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_block_count(c["num_hidden_layers"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_rope_dimension_count(phi3_rope_dims(c))
    rope = rope_parameters(c)
    w.add_rope_freq_base(rope.get("full_attention", rope)["rope_theta"])
    w.add_file_type(ftype)
    w.add_sliding_window(c.get("sliding_window") or 0)


@dataclass(frozen=True)
class Arch:
    """How llama.cpp's converter class for a family writes it.

    permute_qk: LlamaModel's undo_permute: llama.cpp's `llama` rotates adjacent pairs, so q/k rows go back
    into Meta's interleaved order (the store's own); the other archs rotate Hugging Face's halves.
    vocab: the class's set_vocab: "llama" (tokenizer.model, else a Llama-style tokenizer.json, else BPE),
    "sentencepiece" (tokenizer.model first, then BPE), "bpe" (byte-level BPE alone), "phi3" (Phi3MiniModel's
    own reading of tokenizer.model). space_prefix: add_space_prefix false after the vocabulary (Gemma).
    experts: (the HF name of a layer's experts, their projections in the order the converter stacks them).
    norm_shift: 1 added to every *norm.weight (Gemma's (1 + w) norms, as llama.cpp multiplies by w).
    drop_head: lm_head not written (Gemma2Model: tied embeddings). split_kv_b: latent attention's kv_b_proj
    written as k_b_proj (heads, kv rank, nope dims) and v_b_proj (heads, v dims, kv rank). renormalizes: whether llama.cpp's graph
    renormalizes the chosen experts' weights (build_moe_ffn's norm_w in its src/models/*.cpp), a mixture's
    norm_topk_prob must be that."""

    arch: gguf.MODEL_ARCH
    hparams: Callable = text_hparams
    permute_qk: bool = False
    vocab: str = "sentencepiece"
    space_prefix: bool = False
    experts: tuple[str, tuple[str, ...]] = ("model.layers.{}.mlp.experts", ("down_proj", "gate_proj", "up_proj"))
    norm_shift: bool = False
    drop_head: bool = False
    renormalizes: bool | None = None
    split_kv_b: bool = False  # DeepseekV2Model: kv_b_proj as k_b (per head, transposed) and v_b


MIXTRAL_EXPERTS = ("model.layers.{}.block_sparse_moe.experts", ("w1", "w2", "w3"))
ARCHES = {"llama": Arch(gguf.MODEL_ARCH.LLAMA, llama_hparams, permute_qk=True, vocab="llama"),
          "mistral": Arch(gguf.MODEL_ARCH.LLAMA, llama_hparams, permute_qk=True, vocab="llama"),
          "mixtral": Arch(gguf.MODEL_ARCH.LLAMA, llama_hparams, permute_qk=True, vocab="llama",
                          experts=MIXTRAL_EXPERTS, renormalizes=True),
          "qwen2": Arch(gguf.MODEL_ARCH.QWEN2),
          "qwen3": Arch(gguf.MODEL_ARCH.QWEN3),
          "qwen3_moe": Arch(gguf.MODEL_ARCH.QWEN3MOE, qwen_moe_hparams, vocab="bpe", renormalizes=True),
          "qwen2_moe": Arch(gguf.MODEL_ARCH.QWEN2MOE, qwen_moe_hparams, vocab="bpe", renormalizes=False),
          "olmoe": Arch(gguf.MODEL_ARCH.OLMOE, olmoe_hparams, vocab="bpe", renormalizes=False),
          "gemma2": Arch(gguf.MODEL_ARCH.GEMMA2, gemma2_hparams, space_prefix=True, norm_shift=True, drop_head=True),
          "gemma3": Arch(gguf.MODEL_ARCH.GEMMA3, gemma3_hparams, space_prefix=True, norm_shift=True),
          "phi3": Arch(gguf.MODEL_ARCH.PHI3, phi3_hparams, vocab="phi3"),
          "deepseek_v2": Arch(gguf.MODEL_ARCH.DEEPSEEK2, deepseek2_hparams, vocab="bpe", split_kv_b=True),
          "deepseek_v3": Arch(gguf.MODEL_ARCH.DEEPSEEK2, deepseek2_hparams, vocab="bpe", split_kv_b=True)}
# llama.cpp's Gemma graphs scale queries by head_dim^-1/2, but the 27B's (known by its depth) by (dim / heads)^-1/2
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
GEMMA_SWA_PERIOD = {"gemma2": 2, "gemma3": 6}  # llama.cpp's sliding pattern: every layer but each period-th slides


def refusal(cfg: ModelConfig) -> str | None:
    """Why llama.cpp would compute this model otherwise than phantom (what its GGUF cannot say), or None."""
    arch = ARCHES[cfg.family]
    name = arch.arch.name.lower()
    scalings = ("linear", "longrope") if cfg.family == "phi3" else ("linear", "llama3") if arch.permute_qk else \
        ("linear", "yarn") if arch.split_kv_b else ("linear",)
    if cfg.rope_scaling is not None and cfg.rope_scaling.rope_type not in scalings:
        return f"GGUF export of {name} covers RoPE scaling {', '.join(scalings)}, not {cfg.rope_scaling.rope_type!r}"
    if arch.renormalizes is not None and cfg.norm_topk_prob != arch.renormalizes:
        return (f"llama.cpp's {name} fixes norm_topk_prob (whether the chosen experts' weights are renormalized) at "
                f"{str(arch.renormalizes).lower()}, as the family's own configs set it, and this model sets it otherwise")
    if arch.split_kv_b:
        return deepseek_refusal(cfg)
    if cfg.family == "olmoe" and cfg.norm_eps != 1e-5:
        return f"llama.cpp's converter writes OLMoE's norm epsilon as 1e-5, and this model's is {cfg.norm_eps}"
    if cfg.family in GEMMA_SWA_PERIOD:
        return gemma_refusal(cfg)
    if cfg.family == "phi3" and cfg.rope_scaling is not None:
        want = longrope_attention_factor(cfg)
        if abs(cfg.rope_scaling.attention_factor - want) > 1e-6 * want:
            return (f"llama.cpp's converter writes LongRoPE's attention factor as {want:.6g} (from the context "
                    f"lengths), and this model's is {cfg.rope_scaling.attention_factor}")
    return None


def deepseek_refusal(cfg: ModelConfig) -> str | None:
    """llama.cpp's deepseek2 rotates adjacent pairs (the checkpoint's interleaved layout), ranks expert groups by
    their two best scores (DeepSeek-V3's rule), and routes with softmax unless the file says sigmoid."""
    if not cfg.rope_interleave:
        return "llama.cpp's deepseek2 rotates q/k in interleaved pairs, and this model sets rope_interleave false"
    if cfg.family == "deepseek_v2" and 1 < cfg.router_groups and cfg.router_topk_groups < cfg.router_groups:
        return ("llama.cpp's deepseek2 ranks expert groups by their two best scores (DeepSeek-V3's rule), and this "
                "DeepSeek-V2 model ranks them by their best (group_limited_greedy)")
    return None


def gemma_refusal(cfg: ModelConfig) -> str | None:
    period, name = GEMMA_SWA_PERIOD[cfg.family], {"gemma2": "Gemma-2", "gemma3": "Gemma-3"}[cfg.family]
    if cfg.family == "gemma2" and not cfg.tie_embeddings:
        return "llama.cpp's converter drops Gemma-2's lm_head (its embeddings are tied), and this model's is untied"
    if cfg.family == "gemma2" and cfg.rope_theta != 10000:
        return f"llama.cpp reads Gemma-2's RoPE base as 10000 (the converter writes none), and this model's is {cfg.rope_theta}"
    if cfg.sliding_window is None:
        return f"llama.cpp's converter needs {name}'s sliding_window, and this model has none"
    if cfg.family == "gemma3" and cfg.attn_softcap:
        return "llama.cpp's converter refuses Gemma-3 with attention soft-capping, and this model has it"
    if any(bool(cfg.window(i)) != (i % period < period - 1)
                                              for i in range(cfg.n_layers)):
        return f"llama.cpp's {name} slides every layer but each {period}th, and this model's layers differ"
    scalar = cfg.dim / cfg.n_heads if cfg.n_layers == GEMMA_27B_LAYERS[cfg.family] else cfg.head_dim
    if cfg.query_pre_attn_scalar is not None and cfg.query_pre_attn_scalar != scalar:
        return (f"llama.cpp scales this {name}'s queries by {scalar:g}^-1/2 (from its shape), and its "
                f"query_pre_attn_scalar is {cfg.query_pre_attn_scalar:g}")
    return None


def llama3_factors(cfg: ModelConfig) -> torch.Tensor:
    """Llama-3.1's RoPE scaling as llama.cpp reads it: each frequency's divisor (LlamaModel.generate_extra_tensors)."""
    s = cfg.rope_scaling
    freqs = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim))
    low, high = s.original_max_seq_len / s.low_freq_factor, s.original_max_seq_len / s.high_freq_factor
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high:
            factors.append(1)
        elif wavelen > low:
            factors.append(s.factor)
        else:
            smooth = (s.original_max_seq_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
            factors.append(1 / ((1 - smooth) / s.factor + smooth))
    return torch.tensor(factors, dtype=torch.float32)


def longrope_attention_factor(cfg: ModelConfig) -> float:
    """Phi3MiniModel's LongRoPE attention factor, from the context lengths alone."""
    scale = cfg.max_seq_len / cfg.rope_scaling.original_max_seq_len
    return math.sqrt(1 + math.log(scale) / math.log(cfg.rope_scaling.original_max_seq_len)) if scale > 1 else 1.0


def extra_tensors(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The tensors the converter's generate_extra_tensors makes (written first, f32): Llama-3.1's rope_freqs,
    LongRoPE's long and short factors."""
    s = cfg.rope_scaling
    if s is None or s.rope_type not in ("llama3", "longrope"):
        return {}
    if s.rope_type == "llama3":
        return {"rope_freqs.weight": llama3_factors(cfg)}
    return {"rope_factors_long.weight": torch.tensor(s.long_factor, dtype=torch.float32),
            "rope_factors_short.weight": torch.tensor(s.short_factor, dtype=torch.float32)}


def add_early_keys(w: gguf.GGUFWriter, cfg: ModelConfig) -> None:
    """The keys the converter writes while making its extra tensors, before general.*: LongRoPE's attention factor."""
    if cfg.rope_scaling is not None and cfg.rope_scaling.rope_type == "longrope":
        w.add_rope_scaling_attn_factors(longrope_attention_factor(cfg))


def embed_rows(cfg: ModelConfig, arch: Arch, folder) -> int | None:
    """Gemma3Model's embedding rows: as many as the tokenizer has (tokenizer.model: the padded vocabulary;
    tokenizer.json: its vocabulary plus its added tokens); None: all (the other classes)."""
    if arch.arch != gguf.MODEL_ARCH.GEMMA3 or (folder / "tokenizer.model").is_file():
        return None
    spec = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    return len(spec["model"]["vocab"]) + len(spec["added_tokens"])
