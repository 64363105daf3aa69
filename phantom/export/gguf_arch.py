"""What llama.cpp's convert_hf_to_gguf.py does per family: its converter class's architecture, which of
gguf_hparams' key writers it is (set_gguf_parameters, read as it reads them from the config.json of phantom's
HF export), how it renames and reshapes tensors, and what a family's GGUF cannot say (refused, one line).

gguf_export plans and writes the file from these. May import gguf, phantom.arch and gguf_hparams.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Callable

import gguf
import torch

from phantom.arch.config import ModelConfig
from phantom.arch.family_llama4 import moe_step
from phantom.arch.family_qwen35 import full_attention_interval
from phantom.export.gguf_hparams import deepseek2_hparams, dsa_hparams, gemma2_hparams, gemma3_hparams, \
    glm4moe_hparams, glm_dsa_hparams, gpt_oss_hparams, llama4_hparams, llama_hparams, minimax_m2_hparams, \
    olmoe_hparams, phi3_hparams, qwen35moe_hparams, qwen3next_hparams, qwen_moe_hparams, text_hparams

T = gguf.GGMLQuantizationType


@dataclass(frozen=True)
class Arch:
    """How llama.cpp's converter class for a family writes it.

    permute_qk: LlamaModel's undo_permute: llama.cpp's `llama` rotates adjacent pairs, so q/k rows go back
    into Meta's interleaved order (the store's own); the other archs rotate Hugging Face's halves.
    vocab: the class's set_vocab: "llama" (tokenizer.model, else a Llama-style tokenizer.json, else BPE),
    "sentencepiece" (tokenizer.model first, then BPE), "bpe" (byte-level BPE alone), "glm" (BPE with GLM's
    special ids), "phi3" (Phi3MiniModel's own reading of tokenizer.model, or BPE for a GPT2Tokenizer).
    space_prefix: add_space_prefix false after the vocabulary (Gemma). experts: (the HF name of a layer's
    experts, one tensor each, their projections in the order the converter stacks them).
    norm_shift: 1 added to every *norm.weight but Gated DeltaNet's gated one (Gemma's, Qwen3-Next's (1 + w)
    norms, as llama.cpp multiplies by w).
    drop_head: lm_head not written (Gemma2Model: tied embeddings). renormalizes: whether llama.cpp's graph
    renormalizes the chosen experts' weights (build_moe_ffn's norm_w in its src/models/*.cpp), a mixture's
    norm_topk_prob must be that. reshape: the class's own tensor changes, (cfg, HF name, tensor) -> [(a name
    gguf maps, tensor)], written where the converter reads the HF tensor, in that order (None: as they are).
    name: the architecture written, where it is not gguf's name of arch (DeepSeek-V3.2's deepseek32, which gguf's
    releases before llama.cpp's own gguf-py lack; its tensors are named as glm-dsa's, arch here)."""

    arch: gguf.MODEL_ARCH
    hparams: Callable = text_hparams
    permute_qk: bool = False
    vocab: str = "sentencepiece"
    space_prefix: bool = False
    experts: tuple[str, tuple[str, ...]] = ("model.layers.{}.mlp.experts", ("down_proj", "gate_proj", "up_proj"))
    norm_shift: bool = False
    drop_head: bool = False
    renormalizes: bool | None = None
    reshape: Callable | None = None
    name: str | None = None

    @property
    def file_arch(self) -> str:
        """general.architecture, the prefix of the file's hyperparameter keys."""
        return self.name or gguf.MODEL_ARCH_NAMES[self.arch]


def split_kv_b(cfg: ModelConfig, name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """DeepseekV2Model: latent attention's kv_b_proj as k_b_proj (heads, kv rank, nope dims) and v_b_proj
    (heads, v dims, kv rank)."""
    if not name.endswith("kv_b_proj.weight"):
        return [(name, t)]
    kv_b = t.reshape(cfg.kv_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, t.shape[-1])
    k_b, v_b = kv_b.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=1)
    return [(name.replace("kv_b_proj", "k_b_proj"), k_b.transpose(1, 2)), (name.replace("kv_b_proj", "v_b_proj"), v_b)]


def gpt_oss_split(cfg: ModelConfig, name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """GptOssModel: the sinks named .weight; the experts' (experts, in, out) weights transposed, gate_up_proj's
    alternating gate and up rows (its bias's entries) split in two."""
    stem = name.rpartition(".")[0] + "."
    if name.endswith("self_attn.sinks"):
        return [(name + ".weight", t)]
    if name.endswith("mlp.experts.gate_up_proj"):
        t = t.transpose(-1, -2)
        return [(stem + "gate_proj.weight", t[:, ::2]), (stem + "up_proj.weight", t[:, 1::2])]
    if name.endswith("mlp.experts.gate_up_proj_bias"):
        return [(stem + "gate_proj.bias", t[..., ::2]), (stem + "up_proj.bias", t[..., 1::2])]
    if name.endswith("mlp.experts.down_proj"):
        return [(stem + "down_proj.weight", t.transpose(-1, -2))]
    if name.endswith("mlp.experts.down_proj_bias"):
        return [(stem + "down_proj.bias", t)]
    return [(name, t)]


def v_heads_tiled(t: torch.Tensor, dim: int, k_heads: int, width: int) -> torch.Tensor:
    """_LinearAttentionVReorderBase._reorder_v_heads: v heads grouped by their k head -> tiled over the k heads."""
    shape = list(t.shape)
    dim %= len(shape)
    t = t.reshape(*shape[:dim], k_heads, shape[dim] // k_heads // width, width, *shape[dim + 1:])
    return t.transpose(dim, dim + 1).contiguous().reshape(shape)


def qwen35_v_order(cfg: ModelConfig, name: str, t: torch.Tensor) -> torch.Tensor:
    """Qwen3.5's classes' V-head reorder, where fewer k heads than v heads serve them."""
    k, kd, vd = cfg.linear_k_heads, cfg.linear_k_dim, cfg.linear_v_dim
    if k == cfg.linear_v_heads or "linear_attn." not in name:
        return t
    if ".in_proj_qkv." in name:
        return torch.cat([t[:2 * k * kd], v_heads_tiled(t[2 * k * kd:], 0, k, vd)])
    if ".in_proj_z." in name:
        return v_heads_tiled(t, 0, k, vd)
    if ".in_proj_b." in name or ".in_proj_a." in name or name.endswith((".A_log", ".dt_bias")):
        return v_heads_tiled(t, 0, k, 1)
    if ".conv1d" in name:
        t = t.squeeze()
        return torch.cat([t[:2 * k * kd], v_heads_tiled(t[2 * k * kd:], 0, k, vd)])
    if ".out_proj." in name:
        return v_heads_tiled(t, 1, k, vd)
    return t


def linear_attention_split(cfg: ModelConfig, name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Qwen3NextModel (Qwen3.5's reordering its v heads first): A_log as -exp(A_log), dt_bias named dt_proj.bias,
    conv1d squeezed, in_proj_qkvz as q, k, v of every head (attn_qkv) and z (attn_gate); then Qwen2MoeModel's
    3-D experts, gate_up_proj's halves split."""
    if cfg.family == "qwen3_5_moe":
        t = qwen35_v_order(cfg, name, t)
    if name.endswith(".A_log"):
        t = -torch.exp(t if t.dtype in (torch.float16, torch.float32) else t.to(torch.float32))
    elif name.endswith(".dt_bias"):
        name = name.rpartition(".dt_bias")[0] + ".dt_proj.bias"
    elif "conv1d" in name:
        t = t.squeeze()
    if "in_proj_qkvz.weight" in name:
        kd, vd = cfg.linear_k_dim, cfg.linear_v_heads // cfg.linear_k_heads * cfg.linear_v_dim
        parts = t.transpose(0, 1).reshape(-1, cfg.linear_k_heads, 2 * kd + 2 * vd).split([kd, kd, vd, vd], dim=-1)
        q, k, v, z = (p.reshape(cfg.dim, -1) for p in parts)
        return [(name.replace("in_proj_qkvz", "in_proj_qkv"), torch.cat([q, k, v], dim=-1).transpose(0, 1)),
                (name.replace("in_proj_qkvz", "in_proj_z"), z.transpose(0, 1))]
    if name.endswith("mlp.experts.gate_up_proj"):
        half = t.shape[-2] // 2
        return [(name[:-len("gate_up_proj")] + "gate_proj.weight", t[..., :half, :]),
                (name[:-len("gate_up_proj")] + "up_proj.weight", t[..., half:, :])]
    if name.endswith("mlp.experts.down_proj"):
        return [(name + ".weight", t)]
    return [(name, t)]


def llama4_split(cfg: ModelConfig, name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Llama4Model: the experts' (experts, in, out) weights transposed, gate_up_proj's halves (gate, then up) split."""
    stem = name.rpartition(".")[0] + "."
    if name.endswith("feed_forward.experts.gate_up_proj"):
        gate, up = t.transpose(-1, -2).split(t.shape[-1] // 2, dim=-2)
        return [(stem + "gate_proj.weight", gate), (stem + "up_proj.weight", up)]
    if name.endswith("feed_forward.experts.down_proj"):
        return [(name + ".weight", t.transpose(-1, -2))]
    return [(name, t)]


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
          "deepseek_v2": Arch(gguf.MODEL_ARCH.DEEPSEEK2, deepseek2_hparams, vocab="bpe", reshape=split_kv_b),
          "deepseek_v3": Arch(gguf.MODEL_ARCH.DEEPSEEK2, deepseek2_hparams, vocab="bpe", reshape=split_kv_b),
          "deepseek_v32": Arch(gguf.MODEL_ARCH.GLM_DSA, dsa_hparams, vocab="bpe", reshape=split_kv_b,
                               name="deepseek32"),
          "glm_moe_dsa": Arch(gguf.MODEL_ARCH.GLM_DSA, glm_dsa_hparams, vocab="glm", reshape=split_kv_b),
          "glm4_moe": Arch(gguf.MODEL_ARCH.GLM4_MOE, glm4moe_hparams, vocab="glm"),
          "llama4": Arch(gguf.MODEL_ARCH.LLAMA4, llama4_hparams, vocab="bpe", reshape=llama4_split),
          "minimax_m2": Arch(gguf.MODEL_ARCH.MINIMAXM2, minimax_m2_hparams, vocab="bpe", experts=MIXTRAL_EXPERTS,
                             renormalizes=True),
          "gpt_oss": Arch(gguf.MODEL_ARCH.GPT_OSS, gpt_oss_hparams, vocab="bpe", reshape=gpt_oss_split),
          "qwen3_next": Arch(gguf.MODEL_ARCH.QWEN3NEXT, qwen3next_hparams, vocab="bpe", norm_shift=True,
                             renormalizes=True, reshape=linear_attention_split),
          "qwen3_5_moe": Arch(gguf.MODEL_ARCH.QWEN35MOE, qwen35moe_hparams, vocab="bpe", norm_shift=True,
                              renormalizes=True, reshape=linear_attention_split)}
# llama.cpp's Gemma graphs scale queries by head_dim^-1/2, but the 27B's (known by its depth) by (dim / heads)^-1/2
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
GEMMA_SWA_PERIOD = {"gemma2": 2, "gemma3": 6}  # llama.cpp's sliding pattern: every layer but each period-th slides


def refusal(cfg: ModelConfig) -> str | None:
    """Why llama.cpp would compute this model otherwise than phantom (what its GGUF cannot say), or None."""
    arch = ARCHES[cfg.family]
    name = arch.name or arch.arch.name.lower()
    scalings = ("linear", "longrope") if cfg.family == "phi3" else \
        ("linear", "llama3") if arch.permute_qk or arch.reshape is llama4_split else \
        ("linear", "yarn") if arch.reshape in (split_kv_b, gpt_oss_split) else ("linear",)
    if cfg.rope_scaling is not None and cfg.rope_scaling.rope_type not in scalings:
        return f"GGUF export of {name} covers RoPE scaling {', '.join(scalings)}, not {cfg.rope_scaling.rope_type!r}"
    if arch.renormalizes is not None and cfg.norm_topk_prob != arch.renormalizes:
        return (f"llama.cpp's {name} fixes norm_topk_prob (whether the chosen experts' weights are renormalized) at "
                f"{str(arch.renormalizes).lower()}, as the family's own configs set it, and this model sets it otherwise")
    if arch.reshape is split_kv_b:
        return (dsa_refusal(cfg, arch.file_arch) if cfg.index_topk else None) or deepseek_refusal(cfg, arch.file_arch)
    if cfg.family == "olmoe" and cfg.norm_eps != 1e-5:
        return f"llama.cpp's converter writes OLMoE's norm epsilon as 1e-5, and this model's is {cfg.norm_eps}"
    if cfg.family == "olmoe" and cfg.kv_heads != cfg.n_heads:
        return (f"llama.cpp's olmoe loads the key norm as wide as the model (no grouped-query attention), and this "
                f"model has {cfg.kv_heads} key/value heads of {cfg.n_heads}")
    if cfg.family in GEMMA_SWA_PERIOD:
        return gemma_refusal(cfg)
    if cfg.family == "gpt_oss":
        return gpt_oss_refusal(cfg)
    if cfg.family == "llama4":
        return llama4_refusal(cfg)
    if arch.reshape is linear_attention_split and full_attention_interval(cfg) is None:
        return (f"llama.cpp's {name} makes every full_attention_interval-th layer full attention, and this model's "
                f"layer_types follow no such period")
    if arch.reshape is linear_attention_split and cfg.o_bias:
        return f"llama.cpp's {name} has no attention output bias, and this model sets attention_bias"
    if cfg.family == "phi3" and cfg.rope_scaling is not None:
        want = longrope_attention_factor(cfg)
        if abs(cfg.rope_scaling.attention_factor - want) > 1e-6 * want:
            return (f"llama.cpp's converter writes LongRoPE's attention factor as {want:.6g} (from the context "
                    f"lengths), and this model's is {cfg.rope_scaling.attention_factor}")
    return None


def config_refusal(cfg: ModelConfig, arch: Arch, config: dict) -> str | None:
    """What the config.json the converter reads (a vision-language checkpoint's text_config, as shipped) leaves out:
    llama.cpp's deepseek2 routes a file that names no scoring function with softmax, and these models score with
    sigmoid (the Hub's files say scoring_func; transformers' save_pretrained of Kimi-K2.5 leaves it out); llama.cpp's
    llama4 takes the sparse layers from interleave_moe_layer_step, which a shipped config may leave at 1 beside
    moe_layers of another period."""
    if arch.hparams is deepseek2_hparams and cfg.router_score == "sigmoid" and config.get("scoring_func") != "sigmoid":
        return ("llama.cpp's deepseek2 routes with softmax unless config.json says scoring_func sigmoid, and this "
                "checkpoint's text_config does not (the Hub's files do); export --format hf, add it there and convert "
                "that with llama.cpp's convert_hf_to_gguf.py")
    step = config.get("interleave_moe_layer_step", 1)  # Llama4TextConfig's default, which the converter reads
    if cfg.family == "llama4" and step != moe_step(cfg):
        return (f"llama.cpp's llama4 reads the sparse layers from interleave_moe_layer_step alone, and this "
                f"checkpoint's config.json says {step} where its moe_layers make it {moe_step(cfg)}")
    return None


def yarn_difference(cfg: ModelConfig) -> str | None:
    """llama.cpp (ggml_rope_yarn_corr_dims) rounds YaRN's ramp out to whole dims, floor(low) and ceil(high); a
    config with truncate false ramps between the unrounded ones (gpt-oss's published configs), other rotations.
    Said as a warning, not refused: llama.cpp's converter writes the same file for the published model, and every
    gpt-oss GGUF runs so in llama.cpp."""
    s = cfg.rope_scaling
    if s is None or s.rope_type != "yarn" or s.truncate:
        return None
    def pair_of(rotations: float) -> float:
        return cfg.rope_dim * math.log(s.original_max_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(cfg.rope_theta))
    low, high = pair_of(s.beta_fast), pair_of(s.beta_slow)
    exact = (max(low, 0), min(high, cfg.rope_dim - 1))
    whole = (max(math.floor(low), 0), min(math.ceil(high), cfg.rope_dim - 1))
    if exact == whole:
        return None
    return (f"llama.cpp ramps YaRN between whole dims ({whole[0]} and {whole[1]}), and this model says truncate "
            f"false: it ramps between {exact[0]:.4g} and {exact[1]:.4g}, so llama.cpp rotates some dims otherwise than "
            f"transformers (as in every GGUF of this model llama.cpp's converter writes)")


def gpt_oss_refusal(cfg: ModelConfig) -> str | None:
    """llama.cpp's gpt-oss (openai-moe.cpp, build_moe_ffn) clamps the experts' SwiGLU at fixed constants, needs the
    attention biases, slides the even layers' attention, and scales YaRN's attention by 0.1 ln(factor) + 1
    whatever the file says."""
    if (cfg.swiglu_limit, cfg.swiglu_alpha) != (7.0, 1.702):
        return (f"llama.cpp's gpt-oss clamps the experts' SwiGLU at limit 7 with alpha 1.702, and this model's are "
                f"{cfg.swiglu_limit:g} and {cfg.swiglu_alpha:g}")
    if not (cfg.qkv_bias and cfg.o_bias):
        return "llama.cpp's gpt-oss loads attention biases (every gpt-oss has them), and this model has none"
    if cfg.sliding_window is None or any(bool(cfg.window(i)) != (i % 2 == 0) for i in range(cfg.n_layers)):
        return "llama.cpp's gpt-oss slides the even layers' attention (the first included), and this model's layers differ"
    s = cfg.rope_scaling
    if s is not None and s.rope_type == "yarn":
        want = 0.1 * math.log(s.factor) + 1 if s.factor > 1 else 1.0
        if abs(s.attention_factor - want) > 1e-6 * want:
            return (f"llama.cpp scales YaRN's attention by 0.1 ln(factor) + 1 = {want:.6g}, and this model's "
                    f"attention factor is {s.attention_factor:g}")
    return None


LLAMA4_CHUNK, LLAMA4_PERIOD = 8192, 4  # llama.cpp's llama4 (load_arch_hparams): fixed, as in Scout and Maverick


def llama4_refusal(cfg: ModelConfig) -> str | None:
    """llama.cpp's llama4 (src/models/llama4.cpp) fixes what Llama4TextConfig leaves open: every 4th layer without
    RoPE and unchunked, the rest chunked by 8192; the temperature of the RoPE-less layers' queries at attn_scale 0.1
    and floor_scale 8192; q/k L2 norms on the RoPE layers unless there are 128 experts; the sparse layers every
    interleave_moe_layer_step-th (the one key the converter writes); no attention biases."""
    if any(cfg.layer_types[i % len(cfg.layer_types)] != ("full_attention" if (i + 1) % LLAMA4_PERIOD == 0 else
                                                         "chunked_attention") for i in range(cfg.n_layers)):
        return (f"llama.cpp's llama4 has RoPE and chunked attention on every layer but each {LLAMA4_PERIOD}th, and "
                f"this model's layers differ")
    if cfg.attn_chunk != LLAMA4_CHUNK:
        return (f"llama.cpp's llama4 attends in chunks of {LLAMA4_CHUNK} positions, and this model's "
                f"attention_chunk_size is {cfg.attn_chunk}")
    if (cfg.attn_scale, cfg.floor_scale) != (0.1, LLAMA4_CHUNK):
        return ("llama.cpp's llama4 tunes the RoPE-less layers' attention temperature with attn_scale 0.1 and "
                f"floor_scale {LLAMA4_CHUNK}, and this model " + ("has none" if not cfg.attn_scale else
                f"has {cfg.attn_scale:g} and {cfg.floor_scale:g}"))
    if cfg.qk_l2 != (cfg.n_experts != 128):
        return (f"llama.cpp's llama4 L2-norms q and k on its RoPE layers exactly where there are not 128 experts, and "
                f"this model with {cfg.n_experts} sets use_qk_norm {str(cfg.qk_l2).lower()}")
    if moe_step(cfg) is None:
        return ("llama.cpp's llama4 reads the sparse layers as every interleave_moe_layer_step-th, and this model's "
                "moe_layers follow no such period")
    if cfg.qkv_bias:
        return "llama.cpp's llama4 loads no attention output bias, and this model sets attention_bias"
    return None


def deepseek_refusal(cfg: ModelConfig, name: str = "deepseek2") -> str | None:
    """llama.cpp's deepseek2 rotates adjacent pairs (the checkpoint's interleaved layout), scales YaRN's attention
    from mscale_all_dim alone (the published models' mscale equals it), reads a model without q_lora_rank only at
    DeepSeek-V2-Lite's depths, ranks expert groups by their two best scores (DeepSeek-V3's rule), and routes with
    softmax unless the file says sigmoid (name: the file's architecture, deepseek2 or one of DeepSeek Sparse
    Attention's)."""
    if not cfg.rope_interleave:
        return f"llama.cpp's {name} rotates q/k in interleaved pairs, and this model sets rope_interleave false"
    s = cfg.rope_scaling
    if s is not None and s.rope_type == "yarn" and abs(s.attention_factor - 1.0) > 1e-6:
        return (f"llama.cpp's {name} scales YaRN's attention by mscale_all_dim alone, its rotations unscaled, and "
                f"this model's mscale differs from its mscale_all_dim (rotations scaled by {s.attention_factor:.6g})")
    if not cfg.q_lora_rank and cfg.n_layers not in (26, 27) and (cfg.n_layers, cfg.vocab_size) != (48, 128256):
        return ("llama.cpp's deepseek2 reads a model without q_lora_rank (queries projected directly) only at "
                f"DeepSeek-V2-Lite's depths (26 or 27 layers), and this model has {cfg.n_layers}")
    if cfg.family == "deepseek_v2" and 1 < cfg.router_groups and cfg.router_topk_groups < cfg.router_groups:
        return ("llama.cpp's deepseek2 ranks expert groups by their two best scores (DeepSeek-V3's rule), and this "
                "DeepSeek-V2 model ranks them by their best (group_limited_greedy)")
    return None


def dsa_refusal(cfg: ModelConfig, name: str) -> str | None:
    """llama.cpp's deepseek32 and glm-dsa (src/models/deepseek32.cpp, glm-dsa.cpp) read the indexer's queries from
    the query latent (q_lora_rank), rotate its heads as transformers does (V3.2 in halves, GLM-5 in pairs) and turn
    its queries and keys by a Hadamard matrix of 64 or more dims dividing their width (build_input_k_rot); glm-dsa
    reads no YaRN log multiplier (mscale_all_dim), so its YaRN attention goes unscaled. Which layers share an
    indexer the file says (indexer_types: phantom's HF export writes them, the converter copies them)."""
    if not cfg.q_lora_rank:
        return (f"llama.cpp's {name} reads the indexer's queries from the query latent (q_lora_rank), and this model "
                f"has none")
    if cfg.index_head_dim % 64:
        return (f"llama.cpp's {name} turns the indexer's queries and keys by a Hadamard matrix of 64 or more dims, and "
                f"this model's indexer heads are {cfg.index_head_dim} wide")
    yarn = cfg.rope_scaling if cfg.rope_scaling is not None and cfg.rope_scaling.rope_type == "yarn" else None
    if cfg.family == "glm_moe_dsa" and yarn:
        return (f"llama.cpp's {name} reads no YaRN log multiplier (mscale_all_dim): it scales this model's YaRN "
                f"attention otherwise than transformers")
    if cfg.family == "deepseek_v32" and yarn and yarn.mscale_all_dim != 1.0:
        return (f"llama.cpp's {name} takes YaRN's mscale as 1 (llama_context sets it from mscale_all_dim for "
                f"deepseek2 alone), and this model's mscale_all_dim is {yarn.mscale_all_dim:g}, not 1 (the published "
                f"DeepSeek-V3.2's mscale and mscale_all_dim are 1)")
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
