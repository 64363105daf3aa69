"""Model architecture: a frozen `ModelConfig` (Llama's shapes plus the fields other families set) and the shapes of
its tensors. Hugging Face's config.json is read per family (phantom.arch.family), Meta's params.json by
phantom.convert.checkpoints.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass

ROPE_TYPES = ("llama3", "linear", "yarn", "longrope")  # RoPE scalings phantom computes (transformers' names)


@dataclass(frozen=True)
class RopeScaling:
    """RoPE scaling: "llama3" (Llama-3.1's frequency-dependent one), "linear" (every frequency over
    factor; Gemma-3's global layers) or "yarn" (YaRN: low frequencies interpolated, high ones kept,
    a ramp between beta_fast and beta_slow rotations, cos and sin times attention_factor; Qwen2.5's
    long-context configs) or "longrope" (each frequency over its own factor: short_factor for
    sequences up to original_max_seq_len, long_factor past it; cos and sin times attention_factor;
    Phi-3-*-128k, Phi-3.5). Each type reads the fields its transformers function reads."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_seq_len: int = 8192
    rope_type: str = "llama3"
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0
    truncate: bool = True
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    mscale_all_dim: float = 0.0  # YaRN: latent attention's softmax scale times mscale(factor, this)^2 (DeepSeek)

    def __post_init__(self):
        for name in ("short_factor", "long_factor"):  # JSON gives lists
            object.__setattr__(self, name, tuple(getattr(self, name)))
        check_numbers(self)
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type {self.rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})")


def check_numbers(cfg, positive: tuple[str, ...] = ()) -> None:
    """Refuse a field that is not a number of its declared kind: a NaN or infinite float (a norm_eps
    of NaN would only show as a NaN loss at step 1), a float, bool or negative value where an int is
    declared, 0 for a size named in positive. Tuples are checked element by element."""
    for f in dataclasses.fields(cfg):
        kind, value = str(f.type), getattr(cfg, f.name)
        for v in value if isinstance(value, tuple) else (value,):
            if kind.startswith("bool"):
                ok, what = isinstance(v, bool), "true or false"
            elif kind.startswith("int"):
                ok, what = v is None or (type(v) is int and v >= (f.name in positive)), \
                    "an integer >= 1" if f.name in positive else "an integer >= 0"
            elif "float" in kind:
                ok, what = v is None or (type(v) in (int, float) and math.isfinite(v)), "a finite number"
            else:
                continue
            if not ok:
                raise ValueError(f"{f.name} {value!r:.40} is not {what}")


class ConfigError(ValueError):
    """A config.json phantom does not model: its message names the field and what is supported."""


def refuse(path, key: str, value, supported: str):
    """Raise the ConfigError of a config.json field whose value phantom does not model."""
    raise ConfigError(f"{path}: {key}={json.dumps(value)} is not supported (supported: {supported})")


SLIDING = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")  # slide over raw keys
ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh")  # the MLP's gate activation (transformers' names)
LAYER_TYPES = ("full_attention", "linear_attention", "chunked_attention", *SLIDING)  # compressed: DeepSeek-V4's
# how a router scores: softmax over every expert, sigmoid, softmax over the top-k logits alone (gpt-oss), sqrt(softplus)
ROUTER_SCORES = ("softmax", "sigmoid", "topk_softmax", "topk_sigmoid", "sqrtsoftplus")  # topk_sigmoid: scales the input


@dataclass(frozen=True)
class ModelConfig:
    """The shapes and maths of a decoder-only transformer; nothing about how it is run.

    The defaults are Llama's; the fields after max_seq_len describe what other families change
    (phantom.arch.family reads them from each family's config.json). The block maths read these
    fields, never a family's name; `family` only names the checkpoint layout (keys, exporter).
    """

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
    family: str = "llama"  # checkpoint layout: phantom.arch.family.FAMILIES
    explicit_head_dim: int | None = None  # head width when not dim / n_heads (Qwen3, Gemma)
    qkv_bias: bool = False  # biases on q, k, v (Qwen2, Llama's attention_bias)
    o_bias: bool = False  # a bias on the attention output (Llama's attention_bias)
    mlp_bias: bool = False  # biases on gate, up, down
    activation: str = "silu"  # one of ACTIVATIONS
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3)
    tie_embeddings: bool = False  # the output projection is the embedding table
    sliding_window: int | None = None  # keys a query sees in a sliding_attention layer, itself included
    # per layer, one of LAYER_TYPES, repeating (a preset gives one period; a cut-down model keeps it);
    # None: every layer slides when sliding_window is set (Mistral), else none does
    layer_types: tuple[str, ...] | None = None
    norm_offset: float = 0.0  # RMSNorm scales by (norm_offset + weight): Gemma's (1 + w)
    embed_scale: bool = False  # embeddings times sqrt(dim) (Gemma)
    post_norms: bool = False  # an RMSNorm on attention's and the MLP's outputs too, before each residual add
    query_pre_attn_scalar: float | None = None  # scores scaled by its -1/2 power instead of head_dim's (Gemma)
    attn_softcap: float | None = None  # attention scores -> cap * tanh(scores / cap) (Gemma-2)
    final_softcap: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma-2)
    local_rope_theta: float | None = None  # sliding layers' own RoPE base, unscaled (Gemma-3); None: shared
    rotary_dim: int | None = None  # the leading dims of each q/k head RoPE turns (Phi-4-mini's 3/4); None: all
    qk_norm_over: str = "head"  # q/k norms over each head ("head": Qwen3) or the whole projection (OLMoE)
    # mixture of experts (phantom.arch.moe): every block's MLP is n_experts experts of width expert_dim, each
    # token run through the experts_per_token its router ranks first, their outputs weighted by the
    # router's softmax (renormalised over those chosen with norm_topk_prob); shared_expert_dim: one more
    # expert every token runs, scaled by sigmoid of its own gate (Qwen2-MoE). 0 experts: a dense MLP.
    n_experts: int = 0
    experts_per_token: int = 0
    expert_dim: int = 0
    norm_topk_prob: bool = False
    shared_expert_dim: int = 0
    router_aux_coef: float = 0.0  # the router's load-balancing loss weight in full finetuning
    # layers whose MLP is dense (hidden_dim wide) among a mixture of experts' sparse ones (Qwen-MoE's
    # mlp_only_layers, decoder_sparse_step): their blocks have their own tensor layout (block_tensor_shapes)
    dense_layers: tuple[int, ...] = ()
    # DeepSeekMoE routing (phantom.arch.moe.route): scores by softmax or sigmoid of logits computed in fp32
    # (router_fp32), a correction bias added for the choice alone (router_bias), the choice limited to the
    # router_topk_groups best of router_groups groups of experts (a group's best score, "max", or its two best
    # summed, "top2"), the chosen weights times routed_scale; a shared expert ungated (shared_expert_gate False)
    router_score: str = "softmax"
    router_fp32: bool = False
    router_bias: bool = False
    router_groups: int = 1
    router_topk_groups: int = 1
    router_group_score: str = "max"
    routed_scale: float = 1.0
    shared_expert_gate: bool = True
    # multi-head latent attention (phantom.arch.mla) where kv_lora_rank > 0: q through a q_lora_rank bottleneck (0: one
    # projection), k, v from a kv_lora_rank latent and one rotated key for all heads; q/k heads nope then rope_dim dims
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = True  # rotated dims in pairs (2i, 2i+1), as Meta's; False: halves (i, i + R/2), as HF ships
    index_heads: int = 0; index_head_dim: int = 0; index_topk: int = 0; index_pairs: bool = False; index_shared: tuple[int, ...] = ()  # noqa: E702, DeepSeek Sparse Attention's indexer (dsa): RoPE in pairs (GLM-5) or halves; index_shared: layers reusing the top-k of the indexer layer before them
    # gpt-oss (family_gptoss): sinks in each softmax's denominator; a router bias on the logits (a parameter, unlike
    # router_bias); biased experts; SwiGLU clamped: (clamp(up, -l, l) + 1) * g * sigmoid(swiglu_alpha * g), g = min(gate, l)
    attn_sinks: bool = False
    router_logit_bias: bool = False
    expert_bias: bool = False
    swiglu_limit: float | None = None; swiglu_alpha: float = 1.702  # noqa: E702
    interleaved_experts: bool = False  # 3-D experts (experts, in, out), gate and up alternating on out (gpt-oss)
    attn_output_gate: bool = False  # wq yields each head's query then its output gate: sigmoid(gate) before wo
    # Gated DeltaNet (phantom.arch.deltanet) where layer_types says linear_attention: linear_k_heads q/k heads of
    # linear_k_dim, linear_v_heads v heads of linear_v_dim, a causal conv of linear_conv taps; linear_grouped: one
    # projection grouped by key head (Qwen3-Next's in_proj_qkvz, in_proj_ba), else four (Qwen3.5's)
    linear_k_heads: int = 0
    linear_v_heads: int = 0
    linear_k_dim: int = 0
    linear_v_dim: int = 0
    linear_conv: int = 0
    linear_grouped: bool = False
    attn_chunk: int = 0; nope_full: bool = False; qk_l2: bool = False; attn_scale: float = 0.0; floor_scale: float = 0.0  # noqa: E702, Llama 4 (family_llama4)
    # DeepSeek-V4 (family_deepseek_v4, arch.hyper, arch.compressed): streams, Sinkhorn steps, compression, hashed layers
    hc_mult: int = 0; hc_iters: int = 0; hc_eps: float = 0.0; csa_rate: int = 0; hca_rate: int = 0  # noqa: E702
    o_groups: int = 0; o_lora_rank: int = 0; hash_layers: tuple[int, ...] = (); swiglu_clamped: bool = False  # noqa

    def __post_init__(self):
        check_numbers(self, positive=("dim", "n_layers", "n_heads", "vocab_size", "max_seq_len", "multiple_of"))
        if self.explicit_head_dim is None and self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} is not divisible by n_heads {self.n_heads}")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for RoPE")
        if self.rope_dim % 2 or not 0 < self.rope_dim <= self.head_dim:
            raise ValueError(f"rotary_dim {self.rotary_dim} must be even and in (0, head_dim {self.head_dim}]")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation {self.activation!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
        if self.layer_types is not None:
            if not self.layer_types or set(self.layer_types) - set(LAYER_TYPES):
                raise ValueError(f"layer_types must name one of {', '.join(LAYER_TYPES)} per layer, "
                                 f"got {list(self.layer_types)}")
            if "sliding_attention" in self.layer_types and not self.sliding_window:
                raise ValueError("sliding_attention layers need a sliding_window")
            if "linear_attention" in self.layer_types and not (
                    self.linear_k_heads and self.linear_v_heads % self.linear_k_heads == 0 and self.linear_k_dim
                    and self.linear_v_dim and self.linear_conv and not self.dense_layers):
                raise ValueError(f"linear_attention layers need linear_k_heads ({self.linear_k_heads}) dividing "
                                 f"linear_v_heads ({self.linear_v_heads}), linear_k_dim, linear_v_dim, linear_conv > 0 "
                                 f"and no dense layers among them")
        if self.qk_norm_over not in ("head", "projection"):
            raise ValueError(f"qk_norm_over must be head or projection, not {self.qk_norm_over!r}")
        if self.dense_layers and (not self.n_experts or list(self.dense_layers) != sorted(set(self.dense_layers))
                                  or not 0 <= self.dense_layers[0] <= self.dense_layers[-1] < self.n_layers):
            raise ValueError(f"dense_layers {list(self.dense_layers)} must be distinct layers in increasing order, "
                             f"of a mixture of experts' {self.n_layers}")
        if self.n_experts and not (0 < self.experts_per_token <= self.n_experts and self.expert_dim > 0):
            raise ValueError(f"a mixture of {self.n_experts} experts needs 0 < experts_per_token "
                             f"({self.experts_per_token}) <= n_experts and expert_dim > 0 ({self.expert_dim})")
        check_routing_and_latents(self)

    def sparse(self, layer: int | None) -> bool:
        """Whether the layer's MLP is a mixture of experts (None: a sparse layer of the model, if it has any)."""
        return bool(self.n_experts) and layer not in self.dense_layers

    def first_layers(self, n: int) -> "ModelConfig":
        """The model cut to n layers (a benchmark's, a profile's, a plan's check), its dense layers among them;
        where those would all be dense, every one sparse: a cut mixture of experts still has its experts."""
        dense, shared = tuple(i for i in self.dense_layers if i < n), tuple(i for i in self.index_shared if i < n)
        return dataclasses.replace(self, n_layers=n, dense_layers=dense if len(dense) < n else (), index_shared=shared)

    def linear(self, layer: int | None) -> bool:
        """Whether the layer's token mixer is Gated DeltaNet (layer_types' linear_attention); None: no."""
        return layer is not None and self.layer_types is not None and \
            self.layer_types[layer % len(self.layer_types)] == "linear_attention"

    def layout_key(self, layer: int) -> tuple:
        """What decides a block's tensor layout: MLP sparse, linear attention, indexer (V4: attention kind, hashed)."""
        v4 = (self.kind(layer), layer in self.hash_layers) if self.hc_mult else ()
        return self.sparse(layer), self.linear(layer), layer in self.index_shared, *v4

    def window(self, layer: int) -> int | None:
        """How many keys (itself included) a query of this layer sees; None: all before it."""
        if self.layer_types is None:
            return self.sliding_window
        return self.sliding_window if self.kind(layer) in SLIDING else None

    def kind(self, layer: int | None) -> str | None:
        """The layer's layer_types entry (None: none given); layer None: DeepSeek-V4's widest, compressed sparse."""
        if self.layer_types is None or layer is None:
            return self.layer_types and max(self.layer_types, key=lambda k: k == "compressed_sparse_attention")
        return self.layer_types[layer % len(self.layer_types)]

    @property
    def mixed_layers(self) -> bool:
        """Whether blocks have more than one tensor layout (dense layers among sparse ones, or linear
        attention among full attention, layers without an indexer): counts per layer then."""
        return bool(self.dense_layers or self.index_shared or self.hash_layers) or \
            (self.layer_types is not None and bool({"linear_attention", *SLIDING[1:]} & set(self.layer_types)))

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.dim // self.n_heads

    @property
    def rope_dim(self) -> int:
        """The leading dims of each q/k head RoPE turns (the rest pass through)."""
        return self.rotary_dim or self.head_dim

    @property
    def q_dim(self) -> int:
        """Width of q and of the attention output (n_heads * head_dim; dim unless head_dim is explicit)."""
        return self.n_heads * self.head_dim

    @property
    def hidden_dim(self) -> int:
        """FFN width, computed as Meta's Llama-2 code does unless given explicitly."""
        if self.intermediate_size:
            return self.intermediate_size
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    def block_params(self, layer: int | None = None) -> int:
        """Weights of block `layer` (None: a sparse one where the model has any, see sparse)."""
        return sum(math.prod(shape) for shape in block_tensor_shapes(self, layer).values())

    def active_block_params(self, layer: int | None = None) -> int:
        """The block's weights one token runs through: all of a dense block's; a mixture of experts' minus
        the experts it does not route to (experts_per_token of n_experts run)."""
        idle = self.n_experts - self.experts_per_token if self.sparse(layer) else 0
        one = sum(math.prod(s) for s in expert_shapes(self.dim, self.expert_dim, "e", self.expert_bias).values())
        return self.block_params(layer) - idle * one

    def mean_block_params(self, active: bool = False) -> float:
        """Weights per block averaged over the layers (all of them, or those a token runs through): what
        n_layers blocks hold where dense layers sit among sparse ones."""
        count = self.active_block_params if active else self.block_params
        if not self.mixed_layers:
            return count()
        return sum(count(i) for i in range(self.n_layers)) / self.n_layers

    @property
    def token_hidden_dim(self) -> int:
        """The MLP's hidden width one token computes: hidden_dim, or its experts' (and a shared expert's)."""
        return self.experts_per_token * self.expert_dim + self.shared_expert_dim if self.n_experts else self.hidden_dim

    def n_params(self) -> int:
        blocks = sum(self.block_params(i) for i in range(self.n_layers)) if self.mixed_layers else \
            self.n_layers * self.block_params()
        ids = len(self.hash_layers) * self.vocab_size * self.experts_per_token  # tid2eid's ids, kept as two digits each
        return blocks - ids + sum(math.prod(s) for s in {**embed_tensor_shapes(self), **head_tensor_shapes(self)}.values())

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown ModelConfig fields {sorted(unknown)}")
        d = dict(d)
        for name in ("layer_types", "dense_layers", "index_shared", "hash_layers"):
            if d.get(name) is not None:
                d[name] = tuple(d[name])  # JSON gives a list
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        return cls(**d)


def check_routing_and_latents(cfg: "ModelConfig") -> None:
    """ModelConfig's checks of its routing, latent attention and hyper-connections (DeepSeek-V4)."""
    if cfg.router_score not in ROUTER_SCORES or cfg.router_group_score not in ("max", "top2"):
        raise ValueError(f"router_score {cfg.router_score!r} / router_group_score {cfg.router_group_score!r} "
                         f"must be one of {', '.join(ROUTER_SCORES)} / max or top2")
    if cfg.n_experts % cfg.router_groups or not 0 < cfg.router_topk_groups <= cfg.router_groups:
        raise ValueError(f"{cfg.n_experts} experts in router_groups {cfg.router_groups} with router_topk_groups "
                         f"{cfg.router_topk_groups}: the groups must divide the experts, 0 < topk_groups <= groups")
    if cfg.router_groups > 1 and cfg.router_topk_groups * cfg.n_experts // cfg.router_groups < cfg.experts_per_token:
        raise ValueError(f"the {cfg.router_topk_groups} groups chosen hold fewer experts than the "
                         f"{cfg.experts_per_token} a token needs")
    if cfg.kv_lora_rank and (cfg.head_dim != cfg.qk_nope_head_dim + cfg.rope_dim or not cfg.v_head_dim
                              or cfg.qkv_bias or cfg.o_bias or cfg.qk_norm):
        raise ValueError(f"latent attention needs head_dim {cfg.head_dim} = qk_nope_head_dim "
                         f"{cfg.qk_nope_head_dim} + rotary_dim {cfg.rope_dim}, v_head_dim > 0, no biases or q/k norms")
    if cfg.hc_mult and (set(cfg.layer_types or "?") - set(SLIDING) or cfg.kv_heads != 1 or not cfg.n_experts):
        raise ValueError(f"hyper-connections (DeepSeek-V4) need layer_types in {SLIDING}, one kv head, experts")

def block_tensor_shapes(cfg: ModelConfig, layer: int | None = None) -> dict[str, tuple[int, ...]]:
    """Names and shapes of block `layer`'s tensors, in Meta's naming: the same in every block but where
    dense layers sit among a mixture of experts' (cfg.dense_layers); None: a sparse block's, if any."""
    if cfg.hc_mult:
        return hyper_block_shapes(cfg, layer)
    kv = cfg.kv_heads * cfg.head_dim
    shapes = linear_attention_shapes(cfg) if cfg.linear(layer) else latent_attention_shapes(cfg, layer) if cfg.kv_lora_rank \
        else {
        "attention.wq.weight": (cfg.q_dim * (2 if cfg.attn_output_gate else 1), cfg.dim),
        "attention.wk.weight": (kv, cfg.dim),
        "attention.wv.weight": (kv, cfg.dim),
        "attention.wo.weight": (cfg.dim, cfg.q_dim)}
    shapes |= {
        "feed_forward.w1.weight": (cfg.hidden_dim, cfg.dim),
        "feed_forward.w2.weight": (cfg.dim, cfg.hidden_dim),
        "feed_forward.w3.weight": (cfg.hidden_dim, cfg.dim),
        "attention_norm.weight": (cfg.dim,),
        "ffn_norm.weight": (cfg.dim,),
    }
    if cfg.linear(layer):
        pass
    elif cfg.qkv_bias:
        shapes.update({"attention.wq.bias": (cfg.q_dim * (2 if cfg.attn_output_gate else 1),),
                       "attention.wk.bias": (kv,), "attention.wv.bias": (kv,)})
    if cfg.o_bias and not cfg.linear(layer):
        shapes["attention.wo.bias"] = (cfg.dim,)
    if cfg.mlp_bias:
        shapes.update({"feed_forward.w1.bias": (cfg.hidden_dim,), "feed_forward.w2.bias": (cfg.dim,),
                       "feed_forward.w3.bias": (cfg.hidden_dim,)})
    if cfg.sparse(layer):
        for name in ("feed_forward.w1.weight", "feed_forward.w2.weight", "feed_forward.w3.weight"):
            del shapes[name]
        shapes.update(moe_tensor_shapes(cfg))
    if cfg.qk_norm and not cfg.linear(layer):
        per_head = cfg.qk_norm_over == "head"
        shapes.update({"attention.q_norm.weight": (cfg.head_dim if per_head else cfg.q_dim,),
                       "attention.k_norm.weight": (cfg.head_dim if per_head else kv,)})
    if cfg.post_norms:
        shapes.update({"attention_post_norm.weight": (cfg.dim,), "ffn_post_norm.weight": (cfg.dim,)})
    if cfg.attn_sinks:
        shapes["attention.sinks"] = (cfg.n_heads,)
    return shapes


def linear_attention_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Gated DeltaNet's weights (phantom.arch.deltanet), in the checkpoint's own names under attention."""
    key, value, heads = cfg.linear_k_heads * cfg.linear_k_dim, cfg.linear_v_heads * cfg.linear_v_dim, cfg.linear_v_heads
    if cfg.linear_grouped:
        inputs = {"attention.in_proj_qkvz.weight": (2 * key + 2 * value, cfg.dim),
                  "attention.in_proj_ba.weight": (2 * heads, cfg.dim)}
    else:
        inputs = {"attention.in_proj_qkv.weight": (2 * key + value, cfg.dim),
                  "attention.in_proj_z.weight": (value, cfg.dim),
                  "attention.in_proj_b.weight": (heads, cfg.dim), "attention.in_proj_a.weight": (heads, cfg.dim)}
    return {**inputs, "attention.conv1d.weight": (2 * key + value, 1, cfg.linear_conv), "attention.dt_bias": (heads,),
            "attention.A_log": (heads,), "attention.norm.weight": (cfg.linear_v_dim,),
            "attention.out_proj.weight": (cfg.dim, value)}


def latent_attention_shapes(cfg: ModelConfig, layer: int | None = None) -> dict[str, tuple[int, ...]]:
    """Multi-head latent attention's weights (phantom.arch.mla), in DeepSeek's own names; its indexer's, if any."""
    if cfg.q_lora_rank:
        q = {"attention.wq_a.weight": (cfg.q_lora_rank, cfg.dim), "attention.q_a_norm.weight": (cfg.q_lora_rank,),
             "attention.wq_b.weight": (cfg.q_dim, cfg.q_lora_rank)}
    else:
        q = {"attention.wq.weight": (cfg.q_dim, cfg.dim)}
    return q | {"attention.wkv_a.weight": (cfg.kv_lora_rank + cfg.rope_dim, cfg.dim),
                "attention.kv_a_norm.weight": (cfg.kv_lora_rank,),
                "attention.wkv_b.weight": (cfg.n_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
                "attention.wo.weight": (cfg.dim, cfg.n_heads * cfg.v_head_dim)} | indexer_shapes(cfg, layer)


def indexer_shapes(cfg: ModelConfig, layer: int | None = None) -> dict[str, tuple[int, ...]]:
    """The lightning indexer of block `layer` (none where cfg.index_topk is 0 or the layer shares another's), in
    transformers' names."""
    d = cfg.index_head_dim
    return {} if not cfg.index_topk or layer in cfg.index_shared else {
        "attention.indexer.wq_b.weight": (cfg.index_heads * d, cfg.q_lora_rank), "attention.indexer.wk.weight": (d, cfg.dim),
        "attention.indexer.k_norm.weight": (d,), "attention.indexer.k_norm.bias": (d,),
        "attention.indexer.weights_proj.weight": (cfg.index_heads, cfg.dim)}


def expert_shapes(dim: int, width: int, prefix: str, bias: bool = False) -> dict[str, tuple[int, ...]]:
    """One gated MLP's weights (gate w1, down w2, up w3) under prefix, and their biases where bias (gpt-oss)."""
    shapes = {f"{prefix}.w1.weight": (width, dim), f"{prefix}.w2.weight": (dim, width),
              f"{prefix}.w3.weight": (width, dim)}
    if bias:
        shapes |= {f"{prefix}.w1.bias": (width,), f"{prefix}.w2.bias": (dim,), f"{prefix}.w3.bias": (width,)}
    return shapes


def moe_tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """A mixture-of-experts MLP's tensors: the router, each expert (its three weights named alike, so they
    lie back to back in the file: tensorfile.tensor_order sorts by name), the shared expert and its gate."""
    shapes = {"feed_forward.gate.weight": (cfg.n_experts, cfg.dim)}
    if cfg.router_bias:
        shapes["feed_forward.gate.e_score_correction_bias"] = (cfg.n_experts,)
    if cfg.router_logit_bias:
        shapes["feed_forward.gate.bias"] = (cfg.n_experts,)
    for e in range(cfg.n_experts):
        shapes.update(expert_shapes(cfg.dim, cfg.expert_dim, f"feed_forward.experts.{e}", cfg.expert_bias))
    if cfg.shared_expert_dim:
        shapes.update(expert_shapes(cfg.dim, cfg.shared_expert_dim, "feed_forward.shared_expert"))
        if cfg.shared_expert_gate:
            shapes["feed_forward.shared_expert_gate.weight"] = (1, cfg.dim)
    return shapes


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
    """The final norm and the output projection (none when tied: the head is the embedding table)."""
    n, out = cfg.hc_mult, {} if cfg.tie_embeddings else {"output.weight": (cfg.vocab_size, cfg.dim)}
    hyper = {"hc_head.fn": (n, n * cfg.dim), "hc_head.base": (n,), "hc_head.scale": (1,)} if n else {}  # DeepSeek-V4
    return {"norm.weight": (cfg.dim,), **out, **hyper}


def hyper_block_shapes(cfg: ModelConfig, layer: int | None) -> dict[str, tuple[int, ...]]:
    """A DeepSeek-V4 block's weights (arch.hyper, arch.compressed), DeepSeek's names; a hashed layer's tid2eid (each
    token id's experts as two base-256 digits, exact in any 16-bit float) in place of the router's correction bias."""
    n, d, D, di, q, o, kind = cfg.hc_mult, cfg.dim, cfg.head_dim, cfg.index_head_dim, cfg.q_lora_rank, \
        cfg.o_groups * cfg.o_lora_rank, cfg.kind(layer)
    shapes = {f"hc_{p}.{w}": s for p in ("attn", "ffn") for w, s in (("fn", ((2 + n) * n, n * d)),
                                                                    ("base", ((2 + n) * n,)), ("scale", (3,)))}
    shapes |= {f"attention.{k}": s for k, s in (
        ("wq_a.weight", (q, d)), ("q_a_norm.weight", (q,)), ("wq_b.weight", (cfg.q_dim, q)), ("wkv.weight", (D, d)),
        ("kv_norm.weight", (D,)), ("wo_a.weight", (o, cfg.q_dim // cfg.o_groups)), ("wo_b.weight", (d, o)),
        ("sinks", (cfg.n_heads,)))} | {"attention_norm.weight": (d,), "ffn_norm.weight": (d,)}
    wide, rate = (2, cfg.csa_rate) if kind == "compressed_sparse_attention" else (1, cfg.hca_rate)
    parts = {"compressor": (D, wide, rate)} if kind != "sliding_attention" else {}
    if kind == "compressed_sparse_attention":
        parts["indexer.compressor"] = (di, 2, rate)
        shapes |= {"attention.indexer.wq_b.weight": (cfg.index_heads * di, q),
                   "attention.indexer.weights_proj.weight": (cfg.index_heads, d)}
    for part, (w, k, r) in parts.items():
        shapes |= {f"attention.{part}.{t}": s for t, s in (("wkv.weight", (k * w, d)), ("wgate.weight", (k * w, d)),
                                                            ("ape", (r, k * w)), ("norm.weight", (w,)))}
    shapes |= moe_tensor_shapes(cfg)
    if layer in cfg.hash_layers:
        del shapes["feed_forward.gate.e_score_correction_bias"]
        shapes["feed_forward.gate.tid2eid"] = (cfg.vocab_size, cfg.experts_per_token, 2)
    return shapes
