"""Model architecture: a frozen `ModelConfig` for the Llama family and a table of presets.

Also reads Meta's params.json and Hugging Face's config.json.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3.1's frequency-dependent RoPE scaling (rope_type "llama3")."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_seq_len: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """The shapes of a Llama-family transformer; nothing about how it is run."""

    dim: int
    n_layers: int
    n_heads: int
    vocab_size: int
    n_kv_heads: int | None = None  # None: as many as n_heads (no GQA)
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    intermediate_size: int | None = None  # explicit FFN width (HF config); overrides the rule
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_seq_len: int = 4096

    def __post_init__(self):
        if self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} is not divisible by n_heads {self.n_heads}")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for RoPE")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def hidden_dim(self) -> int:
        """FFN width, computed as Meta's Llama-2 code does unless given explicitly."""
        if self.intermediate_size:
            return self.intermediate_size
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    def block_params(self) -> int:
        kv = self.kv_heads * self.head_dim
        return 2 * self.dim * self.dim + 2 * self.dim * kv + 3 * self.dim * self.hidden_dim + 2 * self.dim

    def n_params(self) -> int:
        return self.n_layers * self.block_params() + 2 * self.vocab_size * self.dim + self.dim

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown ModelConfig fields {sorted(unknown)}")
        d = dict(d)
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        return cls(**d)


# Shapes from Meta's params.json files (llama-2, codellama, llama-3 repos) and Mistral's config.json.
PRESETS: dict[str, ModelConfig] = {
    # Generated on first use (convert.ensure_tiny); small enough to train in a minute on 2 CPU cores.
    # 64 tokens: the shipped text's characters and their commonest pairs (see ensure_tiny for why).
    "tiny": ModelConfig(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=32,
                        max_seq_len=512),
    # Llama-2 (meta-llama/Llama-2-*b params.json)
    "7B": ModelConfig(dim=4096, n_layers=32, n_heads=32, vocab_size=32000),
    "13B": ModelConfig(dim=5120, n_layers=40, n_heads=40, vocab_size=32000),
    # CodeLlama-34b params.json: GQA, rope_theta 1e6, 16k context
    "34B": ModelConfig(dim=8192, n_layers=48, n_heads=64, n_kv_heads=8, vocab_size=32000,
                       ffn_dim_multiplier=1.0, rope_theta=1e6, max_seq_len=16384),
    "70B": ModelConfig(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=32000,
                       multiple_of=4096, ffn_dim_multiplier=1.3),
    # CodeLlama-7b params.json
    "codellama-7B": ModelConfig(dim=4096, n_layers=32, n_heads=32, vocab_size=32016, rope_theta=1e6,
                                max_seq_len=16384),
    # Meta-Llama-3-8B / 70B params.json
    "llama3-8B": ModelConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256,
                             multiple_of=1024, ffn_dim_multiplier=1.3, rope_theta=500000.0, max_seq_len=8192),
    "llama3-70B": ModelConfig(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256,
                              multiple_of=4096, ffn_dim_multiplier=1.3, rope_theta=500000.0, max_seq_len=8192),
    # mistralai/Mistral-7B-v0.1 config.json (sliding window not modelled: sequences <= 4096)
    "mistral-7B": ModelConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=32000,
                              intermediate_size=14336, max_seq_len=4096),
}


def preset(name: str, **overrides) -> ModelConfig:
    """A preset by name, with fields replaced (e.g. n_layers for a cut-down benchmark model)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return dataclasses.replace(PRESETS[name], **overrides)


def from_meta_params(path: Path, vocab_size: int | None = None) -> ModelConfig:
    """ModelConfig from Meta's params.json (vocab_size -1 there means: take it from the tokenizer)."""
    p = json.loads(Path(path).read_text())
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


HF_ARCHITECTURES = {"LlamaForCausalLM", "MistralForCausalLM"}


def from_hf_config(path: Path) -> ModelConfig:
    """ModelConfig from a Hugging Face config.json of a Llama or Mistral model."""
    c = json.loads(Path(path).read_text())
    archs = c.get("architectures") or [c.get("model_type", "?")]
    if not set(archs) & HF_ARCHITECTURES:
        raise ValueError(f"{path}: architecture {archs[0]} is not supported "
                         f"(supported: {', '.join(sorted(HF_ARCHITECTURES))})")
    if c.get("tie_word_embeddings"):
        raise ValueError(f"{path}: tied word embeddings are not supported")
    scaling = None
    rope = c.get("rope_parameters") or {}  # transformers >= 5 writes theta and scaling here
    rs = c.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    if rs:
        kind = rs.get("rope_type", rs.get("type"))
        if kind != "llama3":
            raise ValueError(f"{path}: rope_scaling type {kind!r} is not supported (only 'llama3')")
        scaling = RopeScaling(factor=rs["factor"], low_freq_factor=rs["low_freq_factor"],
                              high_freq_factor=rs["high_freq_factor"],
                              original_max_seq_len=rs["original_max_position_embeddings"])
    return ModelConfig(dim=c["hidden_size"], n_layers=c["num_hidden_layers"], n_heads=c["num_attention_heads"],
                       vocab_size=c["vocab_size"], n_kv_heads=c.get("num_key_value_heads"),
                       intermediate_size=c["intermediate_size"], norm_eps=c.get("rms_norm_eps", 1e-5),
                       rope_theta=c.get("rope_theta", rope.get("rope_theta", 10000.0)), rope_scaling=scaling,
                       max_seq_len=c.get("max_position_embeddings", 4096))


def block_tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Names and shapes of one transformer block's tensors, in Meta's naming (same in every block)."""
    kv = cfg.kv_heads * cfg.head_dim
    return {
        "attention.wq.weight": (cfg.dim, cfg.dim),
        "attention.wk.weight": (kv, cfg.dim),
        "attention.wv.weight": (kv, cfg.dim),
        "attention.wo.weight": (cfg.dim, cfg.dim),
        "feed_forward.w1.weight": (cfg.hidden_dim, cfg.dim),
        "feed_forward.w2.weight": (cfg.dim, cfg.hidden_dim),
        "feed_forward.w3.weight": (cfg.hidden_dim, cfg.dim),
        "attention_norm.weight": (cfg.dim,),
        "ffn_norm.weight": (cfg.dim,),
    }


# Projections that read the same input, run as one matmul (as gpt-fast does) when their weights lie
# back to back in memory: the store writes each group adjacent and in this order (store.tensor_order),
# and the block binds one view over the group (layers.fuse_adjacent). Names stay Meta's, one tensor
# each, so stores, PEFT adapters and LoRA on any single projection are unchanged.
FUSED_PROJECTIONS = {
    "attention.wqkv": ("attention.wq.weight", "attention.wk.weight", "attention.wv.weight"),
    "feed_forward.w13": ("feed_forward.w1.weight", "feed_forward.w3.weight"),
}


def embed_tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    return {"tok_embeddings.weight": (cfg.vocab_size, cfg.dim)}


def head_tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    return {"norm.weight": (cfg.dim,), "output.weight": (cfg.vocab_size, cfg.dim)}
