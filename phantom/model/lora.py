"""LoRA applied to built blocks from outside, and adapters saved/loaded in PEFT's layout.

PEFT's files describe the family's Hugging Face model; where a store keeps q/k rows in Meta's pairs
(rope_rows) lora_B of q and k is permuted on the way out and back on the way in, so the adapter is
correct for the HF model that `peft` loads it onto. Where the family's
checkpoint fuses projections (Phi-3's qkv_proj, gate_up_proj) peft puts one LoRA on the fused
module: phantom's parts of it then share one A, each with its rows of B. On a mixture of experts the MLP
targets are its experts, as peft's target_parameters adapts transformers 5's stacked expert tensors
(phantom.arch.expertlora: peft's two stacked tensors a layer, each expert's modules computing with its views).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import re
from dataclasses import dataclass

import torch
import torch.nn as nn

from phantom.arch.config import ModelConfig
from phantom.arch.expertlora import EXPERT_PARAMS, ExpertNames, apply_expert_lora, peft_parameter
from phantom.arch.family import family
from phantom.arch.layers import LoraLinear
from phantom.data.special_tokens import nested_repeat
from phantom.stream.placement import knob

log = logging.getLogger(__name__)

# short target name -> (module path inside a block, PEFT/HF module name)
TARGETS = {
    "q": ("attention.wq", "self_attn.q_proj"),
    "k": ("attention.wk", "self_attn.k_proj"),
    "v": ("attention.wv", "self_attn.v_proj"),
    "o": ("attention.wo", "self_attn.o_proj"),
    "gate": ("feed_forward.w1", "mlp.gate_proj"),
    "up": ("feed_forward.w3", "mlp.up_proj"),
    "down": ("feed_forward.w2", "mlp.down_proj"),
    # multi-head latent attention (DeepSeek-V2/V3)
    "q_a": ("attention.wq_a", "self_attn.q_a_proj"),
    "q_b": ("attention.wq_b", "self_attn.q_b_proj"),
    "kv_a": ("attention.wkv_a", "self_attn.kv_a_proj_with_mqa"),
    "kv_b": ("attention.wkv_b", "self_attn.kv_b_proj"),
    # DeepSeek-V4: its one key-value head, the grouped output's two projections, the compressors' series and gates
    # (the indexer's projections get no gradient in transformers: no targets), the shared expert's linears
    "kv": ("attention.wkv", "self_attn.kv_proj"),
    "o_a": ("attention.wo_a", "self_attn.o_a_proj"),
    "o_b": ("attention.wo_b", "self_attn.o_b_proj"),
    "compressor_kv": ("attention.compressor.wkv", "self_attn.compressor.kv_proj"),
    "compressor_gate": ("attention.compressor.wgate", "self_attn.compressor.gate_proj"),
    **{f"shared_{t}": (f"feed_forward.shared_expert.{w}", f"mlp.shared_experts.{t}_proj")
       for t, w in (("gate", "w1"), ("up", "w3"), ("down", "w2"))},
    # Gated DeltaNet (Qwen3.5's four input projections, Qwen3-Next's two), in linear_attention layers
    **{p: (f"attention.{p}", f"linear_attn.{p}") for p in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a",
                                                            "in_proj_qkvz", "in_proj_ba", "out_proj")},
}
LINEAR_TARGETS = {False: ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"),  # by cfg.linear_grouped
                  True: ("in_proj_qkvz", "in_proj_ba", "out_proj")}
GQA = ("q", "k", "v", "o")  # the attention targets of a block without latent attention
PROJECTIONS = (*GQA, "gate", "up", "down")  # every projection of such a block
# what q, k and v mean on latent attention: the query's (second) projection, and the one that makes every head's
# keys and values from the latent (the names of the modules themselves are targets too)
LATENT_ALIASES = {"q": "q_b", "k": "kv_b", "v": "kv_b"}
# DeepSeek-V4's: q its query's second projection, k and v its one key-value head, o its output's second projection
V4_ALIASES = {"q": "q_b", "k": "kv", "v": "kv", "o": "o_b"}
V4_ATTENTION = ("q_a", "q_b", "kv", "o_a", "o_b", "compressor_kv", "compressor_gate")
V4_SHARED = ("shared_gate", "shared_up", "shared_down")
V4_TARGETS = ("q_a", "q_b", *V4_ATTENTION[2:], *V4_SHARED)  # adapter files name them by their path in the layer
# a module some families' checkpoints fuse (phantom.arch.family.Family.fused) -> the targets it holds, in row order
GROUPS = {"qkv": ("q", "k", "v"), "gate_up": ("gate", "up")}
# targets whose module peft's LoRA cannot wrap -> the weight peft adapts instead, by target_parameters (its ParamWrapper:
# W + scale B A): DeepSeek-V4's o_a_proj is a DeepseekV4GroupedLinear, whose input is (..., groups, in), and peft
# 0.21's LoRA module on it adds (..., groups, groups * o_lora_rank) to (..., groups, o_lora_rank) and fails
PARAMETER_TARGETS = {"o_a": "self_attn.o_a_proj.weight"}
ALL_LINEAR = ("all-linear",)
AUTO = ("auto",)  # the default: q, v, and on Gated DeltaNet layers their input projection (auto_targets)
# a mixture of experts' stacked expert tensors (peft's target_parameters) -> the targets each holds
EXPERT_TARGETS = {"experts_gate_up": ("gate", "up"), "experts_down": ("down",)}
# mixture-of-experts model types whose plain MLP linears (a shared expert, dense layers among sparse ones) peft
# adapts by target_modules; on the others (qwen3_moe, olmoe, mixtral) peft 0.21 rewrites gate_proj, up_proj and
# down_proj there to the experts' tensors (transformers 5's conversion mapping)
PLAIN_MLP = ("qwen2_moe", "qwen3_5_moe_text")
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


@dataclass(frozen=True)
class LoraConfig:
    """Which projections get a LoRA and how big it is.

    Args:
        rank: r, the inner dimension of A (r x in) and B (out x r).
        alpha: the update is scaled by alpha / rank.
        dropout: dropout on the LoRA branch's input (replayed exactly in the recompute).
        targets: ("auto",) (the default: auto_targets, q and v, and on a model with Gated DeltaNet layers their
            input projection too, so every block is adapted), any of q, k, v, o, gate, up, down, qkv (q, k, v),
            gate_up (gate, up), or ("all-linear",):
            every one (peft's all-linear: each projection of every block, not the head; refused on a mixture
            of experts). On a family whose checkpoint fuses q, k, v (or gate, up) into one module, naming any
            of them targets the module (see for_family); on a mixture of experts gate, up and down are its
            experts (gate and up: each expert's one LoRA on gate_up_proj), as peft's target_parameters, and
            Qwen2-MoE's shared expert's and dense layers' linears; experts_gate_up, experts_down: the tensors alone.
        exact: targets name modules one to one, as an adapter file does (read_adapter_config).
        seed: seeds the init of A, per layer, so two models built alike start alike.
        rslora: scale by alpha / sqrt(rank) instead (peft's use_rslora).
        rank_pattern, alpha_pattern: (regex, value) pairs, in order: a module whose peft name
            ("model.layers.3.self_attn.q_proj") the first regex matches at its end takes that rank
            (alpha) instead of rank (alpha), as peft's rank_pattern and alpha_pattern.
        layers: the blocks that get a LoRA (peft's layers_to_transform); None: every one.
    """

    rank: int = knob(8, "LoRA rank r")
    alpha: float = knob(16.0, "LoRA scale is alpha / r")
    dropout: float = knob(0.0, "dropout on the LoRA branch's input, replayed exactly in the recompute")
    targets: tuple[str, ...] = knob(AUTO, "auto: q,v, and on Gated DeltaNet layers (Qwen3.5, Qwen3-Next) their "
                                          "input projection in_proj_qkv (Qwen3.5) or in_proj_qkvz (Qwen3-Next), so "
                                          "every block of a hybrid model is adapted; or comma-separated "
                                          "projections, exactly those: q,k,v,o,gate,up,down (qkv, gate_up: those "
                                          "together), or all-linear (every one, as peft's all-linear); on Phi-3 "
                                          "any of q,k,v is its fused qkv_proj, as peft has it; on a mixture of "
                                          "experts gate,up,down are its experts (gate_up_proj, down_proj, as "
                                          "peft's target_parameters; experts_gate_up, experts_down: those alone) "
                                          "and Qwen2-MoE's plain MLP linears; on latent attention (DeepSeek) "
                                          "q_a,q_b,kv_a,kv_b,o, q meaning q_b and k,v kv_b; on DeepSeek-V4 "
                                          "q_a,q_b,kv,o_a,o_b,compressor_kv,compressor_gate,shared_gate,"
                                          "shared_up,shared_down, q meaning q_b, k,v kv and o o_b (o_a as "
                                          "peft's target_parameters); on Gated DeltaNet "
                                          "layers in_proj_qkv,in_proj_z,in_proj_b,in_proj_a or in_proj_qkvz,"
                                          "in_proj_ba, and out_proj",
                                    type="csv")
    seed: int = knob(0, "", cli=False)  # a run seeds its LoRA with its --seed (RunConfig)
    rslora: bool = knob(False, "", cli=False)  # the patterns and layers come from adapter_config.json files
    rank_pattern: tuple[tuple[str, int], ...] = knob((), "", cli=False)
    alpha_pattern: tuple[tuple[str, float], ...] = knob((), "", cli=False)
    layers: tuple[int, ...] | None = knob(None, "", cli=False)
    exact: bool = knob(False, "", cli=False)  # targets name modules one to one, as an adapter file's (for_family)

    def __post_init__(self):
        object.__setattr__(self, "targets", tuple(self.targets))  # all-linear: expanded by family_targets
        known = (*TARGETS, *GROUPS, *EXPERT_TARGETS)
        bad = [t for t in self.targets if t not in known] if self.targets not in (ALL_LINEAR, AUTO) else []
        if bad:
            raise ValueError(f"unknown LoRA targets {bad}; choose from {', '.join([*TARGETS, *GROUPS])}, all-linear "
                             f"or auto")
        for name in ("rank_pattern", "alpha_pattern"):  # JSON and YAML give dicts and lists
            object.__setattr__(self, name, tuple(tuple(kv) for kv in dict(getattr(self, name)).items()))
        if self.layers is not None:
            object.__setattr__(self, "layers", tuple(self.layers))
            if not all(type(i) is int and i >= 0 for i in self.layers):
                raise ValueError(f"LoRA layers must be block indices, got {list(self.layers)!r:.60}")
        for rank in (self.rank, *dict(self.rank_pattern).values()):
            if type(rank) is not int or rank < 1:
                raise ValueError(f"LoRA rank must be >= 1, got {rank}")
        for alpha in (self.alpha, *dict(self.alpha_pattern).values()):
            if type(alpha) not in (int, float) or not math.isfinite(alpha):
                raise ValueError(f"LoRA alpha must be a finite number, got {alpha!r}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout}")
        for pattern, _ in self.rank_pattern + self.alpha_pattern:
            try:
                re.compile(pattern)
            except (re.error, TypeError) as e:
                raise ValueError(f"LoRA rank or alpha pattern {pattern!r} is not a regular expression ({e})") from None
            if nested_repeat(pattern):  # matching a module name would backtrack for hours
                raise ValueError(f"LoRA rank or alpha pattern {pattern!r} repeats a group that repeats; write it "
                                 f"without nested repeats")

    def module_rank(self, layer: int, module: str) -> tuple[int, float] | None:
        """(rank, alpha) of the LoRA on a layer's Hugging Face module ("self_attn.q_proj"), as peft
        picks them from rank_pattern and alpha_pattern; None where `layers` leaves the layer out."""
        if self.layers is not None and layer not in self.layers:
            return None
        key = f"model.layers.{layer}.{module}"
        return _pattern_value(self.rank_pattern, key, self.rank), _pattern_value(self.alpha_pattern, key, self.alpha)


def _pattern_value(patterns: tuple, key: str, default):
    """peft's get_pattern_key: the first pattern matching the end of key at a dot; else key's own entry."""
    for pattern, value in patterns:
        if re.match(rf"(.*\.)?({pattern})$", key):
            return value
    return dict(patterns).get(key, default)


def peft_modules(cfg: ModelConfig) -> dict[str, tuple[str, tuple[str, ...]]]:
    """The family's LoRA-able modules as peft sees them: short name -> (HF module inside a layer, the
    targets it holds). A tensor the checkpoint fuses is one module (Phi-3: qkv -> self_attn.qkv_proj); a
    mixture of experts' MLP is its experts' stacked tensors (experts_gate_up -> mlp.experts.gate_up_proj), and
    on Qwen2-MoE its plain linears too (gate -> mlp.gate_proj: a shared expert's, a dense layer's)."""
    if cfg.n_experts:
        plain = family(cfg).model_type in PLAIN_MLP and (cfg.shared_expert_dim or cfg.dense_layers)
        return {**{t: (TARGETS[t][1], (t,)) for t in (*attention_targets(cfg), *(V4_SHARED if cfg.hc_mult else ()))},
                **{t: (peft_parameter(t, expert_names(cfg).module), parts) for t, parts in EXPERT_TARGETS.items()},
                **{t: (TARGETS[t][1], (t,)) for t in (("gate", "up", "down") if plain else ())}}
    by_weight = {f"{path}.weight": t for t, (path, _) in TARGETS.items()}
    fused = {}  # first target of a fused module -> (its short name, HF module, its targets)
    for key, names in family(cfg).fused.items():
        module = key.removeprefix("model.layers.{}.").removesuffix(".weight")
        fused[by_weight[names[0]]] = (module.rsplit(".", 1)[1].removesuffix("_proj"), module,
                                      tuple(by_weight[n] for n in names))
    inside = {t for _, _, parts in fused.values() for t in parts}
    linear = [t for t in attention_targets(cfg) if t not in GQA]  # Gated DeltaNet's, where some layers have it
    out = {}
    for t, (_, module) in TARGETS.items():
        if t.startswith(("q_", "kv_")) or (t.startswith(("in_proj", "out_proj")) and t not in linear) or \
                t in (*V4_ATTENTION, *V4_SHARED):
            continue
        if t in fused:
            short, module, parts = fused[t]
            out[short] = (module, parts)
        elif t not in inside:
            out[t] = (module, (t,))
    return out


def attention_targets(cfg: ModelConfig) -> tuple[str, ...]:
    """The attention projections blocks of cfg have: q, k, v, o, or latent attention's; and Gated DeltaNet's
    where some layers are linear attention."""
    if any(cfg.linear(i) for i in range(cfg.n_layers)):
        return (*GQA, *LINEAR_TARGETS[cfg.linear_grouped])
    if cfg.hc_mult:
        return V4_ATTENTION if any(cfg.kind(i) != "sliding_attention" for i in range(cfg.n_layers)) else V4_ATTENTION[:5]
    if not cfg.kv_lora_rank:
        return GQA
    return ("q_a", "q_b", "kv_a", "kv_b", "o") if cfg.q_lora_rank else ("q", "kv_a", "kv_b", "o")


def auto_targets(cfg: ModelConfig) -> tuple[str, ...]:
    """The default targets (AUTO): q and v, as peft's default for Llama-like models; on a model mixing Gated DeltaNet
    layers among attention ones (Qwen3.5, Qwen3-Next) also the linear-attention layers' input projection, which
    makes their queries, keys and values as q and v do attention's (in_proj_qkv, or Qwen3-Next's in_proj_qkvz,
    which also makes the gate z), so no block is left without a LoRA."""
    if any(cfg.linear(i) for i in range(cfg.n_layers)):
        return ("q", "v", "in_proj_qkvz" if cfg.linear_grouped else "in_proj_qkv")
    return ("q", "v")


def latent_names(targets: tuple[str, ...], cfg: ModelConfig) -> tuple[str, ...]:
    """targets with q, k, v read as latent attention's projections (LATENT_ALIASES) where cfg has it (q is
    q_proj itself where there is no q bottleneck); a latent projection named on a model without it refused."""
    if cfg.hc_mult:  # DeepSeek-V4's names (V4_ALIASES)
        return tuple(V4_ALIASES.get(t, t) for t in targets)
    latent = [t for t in targets if t.startswith(("q_", "kv_"))]
    if not cfg.kv_lora_rank:
        if latent:
            raise ValueError(f"LoRA targets {', '.join(latent)} name latent attention's projections; "
                             f"{family(cfg).hf_class} has q, k, v, o")
        return targets
    have = attention_targets(cfg)
    out = tuple(t if t in have or t not in LATENT_ALIASES or (t == "q" and "q" in have) else LATENT_ALIASES[t]
                for t in targets)
    if missing := [t for t in out if t.startswith(("q_", "kv_")) and t not in have]:
        raise ValueError(f"LoRA targets {', '.join(missing)}: this model's latent attention has no q bottleneck "
                         f"(q_lora_rank is null); its query is q (q_proj)")
    return out


def family_targets(targets: tuple[str, ...], cfg: ModelConfig, exact: bool = False) -> tuple[str, ...]:
    """targets named as the family's modules, in the order given: on Phi-3 any of q, k, v is its fused
    qkv_proj, which peft gives one LoRA; on a family that keeps them apart, qkv is q, k, v; on a mixture of
    experts gate, up, down are its experts' tensors (and on Qwen2-MoE its plain linears too), unless `exact`
    (an adapter file's modules, one to one). all-linear is every module, refused on a mixture of experts.

    Raises:
        ValueError: all-linear or a module the family lacks (experts_* on a dense model, an adapter's
            gate_proj where peft makes it the experts') on a mixture of experts."""
    modules = peft_modules(cfg)
    if tuple(targets) == AUTO:
        targets = auto_targets(cfg)
    if tuple(targets) != ALL_LINEAR:
        targets = latent_names(tuple(t for name in targets for t in GROUPS.get(name, (name,)))
                               if cfg.kv_lora_rank or cfg.hc_mult else tuple(targets), cfg)
    experts = [t for t in targets if t in EXPERT_TARGETS]
    if experts and not cfg.n_experts:
        raise ValueError(f"LoRA targets {', '.join(experts)} name a mixture of experts' tensors; "
                         f"{family(cfg).hf_class} has no experts")
    if cfg.n_experts and exact and (missing := [t for t in targets if t not in modules]):
        raise ValueError(f"LoRA targets {', '.join(missing)}: {family(cfg).hf_class} has no such plain module (on "
                         f"Qwen3-MoE, OLMoE and Mixtral peft 0.21 turns target_modules gate_proj, up_proj, down_proj "
                         f"into the experts' tensors at twice the rank, which phantom does not model)")
    if tuple(targets) == ALL_LINEAR:
        if cfg.n_experts:
            raise ValueError("LoRA targets all-linear: peft 0.21's all-linear on a mixture of experts adapts the "
                             "routers and gate_up_proj at twice the rank (Qwen3-MoE, OLMoE, Mixtral) or no expert "
                             "(Qwen2-MoE); name the targets instead (q,k,v,o,gate,up,down: gate,up,down are the "
                             "experts, as peft's target_parameters)")
        return tuple(modules)
    if cfg.n_experts and exact:
        return tuple(dict.fromkeys(targets))
    owners: dict[str, list[str]] = {}
    for m, (_, parts) in modules.items():
        for t in parts:
            owners.setdefault(t, []).append(m)
    out = []
    for name in targets:  # an experts_* name is its tensor; any other, every module holding its targets
        out += [name] if name in EXPERT_TARGETS else [m for t in GROUPS.get(name, (name,)) for m in owners[t]]
    return tuple(dict.fromkeys(out))


def for_family(lora: LoraConfig, cfg: ModelConfig) -> LoraConfig:
    """lora with its targets as family_targets names them (logged where that adds a projection). On a
    mixture of experts the MLP targets are its experts (routers stay frozen); they and DeepSeek-V4's o_a
    (PARAMETER_TARGETS) without what peft's target_parameters LoRA cannot do: dropout, and layers (peft applies
    layers_to_transform to modules only)."""
    modules = peft_modules(cfg)
    given = auto_targets(cfg) if lora.targets == AUTO else lora.targets
    targets = family_targets(given, cfg, lora.exact)
    asked = targets if given == ALL_LINEAR else latent_names(given, cfg)
    if mapped := [f"{a} -> {b}" for a, b in zip(given, asked) if a != b and given != ALL_LINEAR]:
        log.info("%s: LoRA targets %s", family(cfg).hf_class, ", ".join(mapped))
    wanted = [t for name in asked for t in GROUPS.get(name, (name,))]
    experts = [peft_parameter(t, expert_names(cfg).module) for t in targets if t in EXPERT_PARAMS and cfg.n_experts]
    if tensors := [*experts, *(PARAMETER_TARGETS[t] for t in targets if t in PARAMETER_TARGETS)]:
        if lora.dropout:
            raise ValueError(f"LoRA dropout {lora.dropout:g} on {', '.join(tensors)}: peft's LoRA on a tensor "
                             f"(target_parameters) has no dropout; use dropout 0 or leave those out of the targets")
        if lora.layers is not None:
            raise ValueError(f"LoRA layers {list(lora.layers)} with {', '.join(tensors)}: peft applies "
                             f"layers_to_transform to target_modules only, so these would take a LoRA in every layer")
    if experts and cfg.dense_layers and family(cfg).model_type not in PLAIN_MLP:
        log.info("%s: gate, up, down adapt its experts (peft's target_parameters); its dense layers' MLP stays "
                 "frozen (peft 0.21 turns target_modules gate_proj, up_proj, down_proj into the experts' tensors "
                 "there)", family(cfg).hf_class)
    added = [t for m in targets for t in modules[m][1] if t not in wanted]
    if added:
        fused = "; ".join(f"{modules[m][0].rsplit('.', 1)[1]} holds {', '.join(modules[m][1])}"
                          for m in targets if len(modules[m][1]) > 1)
        log.info("%s: %s, and peft has one LoRA on each: it covers %s too", family(cfg).hf_class, fused,
                 ", ".join(added))
    return dataclasses.replace(lora, targets=targets)


def config_module(cfg: ModelConfig, module: str) -> str:
    """A module as adapter_config.json's target_modules names it: its own name (q_proj), or on DeepSeek-V4 its path in
    the layer (self_attn.kv_proj), as peft matches a name's end and there kv_proj, gate_proj and q_b_proj are also
    the compressors', the indexer's and the shared expert's."""
    return module if cfg.hc_mult else module.split(".")[1]


def hf_module(target: str) -> str:
    """The Hugging Face module a target (or a fused GROUPS name) is: "q" -> "self_attn.q_proj",
    "qkv" -> "self_attn.qkv_proj"."""
    if target in GROUPS:
        return f"{TARGETS[GROUPS[target][0]][1].rsplit('.', 1)[0]}.{target}_proj"
    return TARGETS[target][1]


def expert_names(cfg: ModelConfig) -> ExpertNames:
    """Where peft finds the family's stacked expert tensors, and whether it swaps their sides."""
    moe = family(cfg).moe
    return ExpertNames(moe.peft_module, moe.peft_swapped) if moe is not None else ExpertNames()


def apply_lora(block: nn.Module, cfg: LoraConfig, layer: int, experts: ExpertNames = ExpertNames()) -> None:
    """Replace the target linears of one block by LoraLinear (in place); cfg's targets as for_family
    names them, each with the rank and alpha cfg.module_rank gives it. The parts of a fused module
    (GROUPS) share one A. A mixture of experts' experts_* targets are its experts' stacked tensors
    (phantom.arch.expertlora); its plain gate, up, down (Qwen2-MoE) a dense layer's or the shared expert's."""
    gen = torch.Generator().manual_seed(cfg.seed * 100003 + layer)
    sparse = hasattr(block.feed_forward, "experts")
    for target in cfg.targets:
        if target in EXPERT_PARAMS:
            rank_alpha = cfg.module_rank(layer, peft_parameter(target, experts.module))
            if rank_alpha and sparse:  # not a dense layer among sparse ones
                apply_expert_lora(block.feed_forward, target, *rank_alpha, cfg.rslora, gen, experts)
            continue
        shared, rank_alpha = None, cfg.module_rank(layer, PARAMETER_TARGETS.get(target) or
                                                   in_layer(block, hf_module(target)))
        if rank_alpha is None:
            continue
        for t in GROUPS.get(target, (target,)):
            parent_path, name = TARGETS[t][0].rsplit(".", 1)
            parent = mlp_owner(submodule(block, parent_path))
            if parent is None or not hasattr(parent, name):  # a sparse layer without a shared expert; another mixer's
                break
            base = getattr(parent, name)
            if rank_alpha[0] > max(base.in_features, base.out_features):  # checked before allocating A and B
                raise ValueError(f"LoRA rank {rank_alpha[0]} of layer {layer} {hf_module(target)} exceeds both sides "
                                 f"of its {base.out_features}x{base.in_features} weight")
            lora = LoraLinear(base, *rank_alpha, cfg.dropout, generator=gen, lora_A=shared,
                              rslora=cfg.rslora)
            setattr(parent, name, lora)
            shared = lora.lora_A


def submodule(block: nn.Module, path: str) -> nn.Module | None:
    """block's module at path, or None where the block has none there (DeepSeek-V4's sliding layers: no
    compressor)."""
    module = block
    for part in path.split("."):
        module = getattr(module, part, None)
        if module is None:
            return None
    return module


def mlp_owner(module: nn.Module | None) -> nn.Module | None:
    """Where a block's plain gate, up, down are: module itself, or a sparse MLP's shared expert (or None)."""
    return module.shared_expert if hasattr(module, "experts") else module


def in_layer(block: nn.Module, module: str) -> str:
    """A plain module's Hugging Face name in this block: a sparse layer's MLP ones are its shared expert's."""
    sparse = hasattr(getattr(block, "feed_forward", None), "experts")
    plain = module.startswith("mlp.") and not module.startswith("mlp.shared_experts.")  # DeepSeek-V4's: as named
    return f"mlp.shared_expert.{module.removeprefix('mlp.')}" if sparse and plain else module


def lora_modules(layers: nn.ModuleList) -> dict[tuple[int, str], LoraLinear]:
    """(layer index, target short name) -> its LoraLinear (a sparse layer's gate, up, down: its shared expert's)."""
    out = {}
    for i, block in enumerate(layers):
        for t, (path, _) in TARGETS.items():
            parent, _, leaf = path.rpartition(".")
            m = getattr(mlp_owner(submodule(block, parent)), leaf, None)
            if isinstance(m, LoraLinear):
                out[(i, t)] = m
    return out


def adapted_modules(layers: nn.ModuleList, cfg: ModelConfig):
    """(layer, HF module, [(target, its LoraLinear)] in row order) for every module with a LoRA."""
    mods = lora_modules(layers)
    for i, block in enumerate(layers):
        for key, (module, parts) in peft_modules(cfg).items():
            if key not in EXPERT_TARGETS and (i, parts[0]) in mods:
                yield i, in_layer(block, module), [(t, mods[(i, t)]) for t in parts]
