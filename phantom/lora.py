"""LoRA applied to built blocks from outside, and adapters saved/loaded in PEFT's layout.

PEFT's files describe the family's Hugging Face model, whose q/k rows are permuted relative to
Meta's layout that phantom keeps; lora_B of q and k is permuted on the way out and back on the way
in, so the adapter is correct for the HF model that `peft` loads it onto. Where the family's
checkpoint fuses projections (Phi-3's qkv_proj, gate_up_proj) peft puts one LoRA on the fused
module: phantom's parts of it then share one A, each with its rows of B.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
from safetensors.torch import load_file

from phantom.config import ModelConfig
from phantom.family import family
from phantom.layers import LoraLinear, permute_for_hf, permute_from_hf
from phantom import fileio
from phantom.fileio import atomic_write_json
from phantom.store import StoreError, safe_join
from phantom.tensorfile import write_safetensors

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
}
# a module some families' checkpoints fuse (phantom.family.Family.fused) -> the targets it holds, in row order
GROUPS = {"qkv": ("q", "k", "v"), "gate_up": ("gate", "up")}
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


@dataclass(frozen=True)
class LoraConfig:
    """Which projections get a LoRA and how big it is.

    Args:
        rank: r, the inner dimension of A (r x in) and B (out x r).
        alpha: the update is scaled by alpha / rank.
        dropout: dropout on the LoRA branch's input (replayed exactly in the recompute).
        targets: any of q, k, v, o, gate, up, down, qkv (q, k, v), gate_up (gate, up), or ("all-linear",):
            every one (peft's all-linear: each projection of every block, not the head). On a family whose
            checkpoint fuses q, k, v (or gate, up) into one module, naming any of them targets the module
            (see for_family).
        seed: seeds the init of A, per layer, so two models built alike start alike.
    """

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ("q", "v")
    seed: int = 0

    def __post_init__(self):
        if tuple(self.targets) == ("all-linear",):
            object.__setattr__(self, "targets", tuple(TARGETS))
        bad = [t for t in self.targets if t not in TARGETS and t not in GROUPS]
        if bad:
            raise ValueError(f"unknown LoRA targets {bad}; choose from {', '.join([*TARGETS, *GROUPS])} or all-linear")
        if self.rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {self.rank}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout}")


def peft_modules(cfg: ModelConfig) -> dict[str, tuple[str, tuple[str, ...]]]:
    """The family's LoRA-able modules as peft sees them: short name -> (HF module inside a layer, the
    targets it holds). A tensor the checkpoint fuses is one module (Phi-3: qkv -> self_attn.qkv_proj)."""
    by_weight = {f"{path}.weight": t for t, (path, _) in TARGETS.items()}
    fused = {}  # first target of a fused module -> (its short name, HF module, its targets)
    for key, names in family(cfg).fused.items():
        module = key.removeprefix("model.layers.{}.").removesuffix(".weight")
        fused[by_weight[names[0]]] = (module.rsplit(".", 1)[1].removesuffix("_proj"), module,
                                      tuple(by_weight[n] for n in names))
    inside = {t for _, _, parts in fused.values() for t in parts}
    out = {}
    for t, (_, module) in TARGETS.items():
        if t in fused:
            short, module, parts = fused[t]
            out[short] = (module, parts)
        elif t not in inside:
            out[t] = (module, (t,))
    return out


def family_targets(targets: tuple[str, ...], cfg: ModelConfig) -> tuple[str, ...]:
    """targets named as the family's modules, in the order given: on Phi-3 any of q, k, v is its fused
    qkv_proj, which peft gives one LoRA; on a family that keeps them apart, qkv is q, k, v."""
    owner = {t: m for m, (_, parts) in peft_modules(cfg).items() for t in parts}
    return tuple(dict.fromkeys(owner[t] for name in targets for t in GROUPS.get(name, (name,))))


def for_family(lora: LoraConfig, cfg: ModelConfig) -> LoraConfig:
    """lora with its targets as family_targets names them (logged where that adds a projection)."""
    modules = peft_modules(cfg)
    wanted = [t for name in lora.targets for t in GROUPS.get(name, (name,))]
    targets = family_targets(lora.targets, cfg)
    added = [t for m in targets for t in modules[m][1] if t not in wanted]
    if added:
        fused = "; ".join(f"{modules[m][0].rsplit('.', 1)[1]} holds {', '.join(modules[m][1])}"
                          for m in targets if len(modules[m][1]) > 1)
        log.info("%s: %s, and peft has one LoRA on each: it covers %s too", family(cfg).hf_class, fused,
                 ", ".join(added))
    return dataclasses.replace(lora, targets=targets)


def apply_lora(block: nn.Module, cfg: LoraConfig, layer: int) -> None:
    """Replace the target linears of one block by LoraLinear (in place); cfg's targets as for_family
    names them. The parts of a fused module (GROUPS) share one A."""
    gen = torch.Generator().manual_seed(cfg.seed * 100003 + layer)
    for target in cfg.targets:
        shared = None
        for t in GROUPS.get(target, (target,)):
            parent_path, name = TARGETS[t][0].rsplit(".", 1)
            parent = block.get_submodule(parent_path)
            lora = LoraLinear(getattr(parent, name), cfg.rank, cfg.alpha, cfg.dropout, generator=gen, lora_A=shared)
            setattr(parent, name, lora)
            shared = lora.lora_A


def lora_modules(layers: nn.ModuleList) -> dict[tuple[int, str], LoraLinear]:
    """(layer index, target short name) -> its LoraLinear."""
    out = {}
    for i, block in enumerate(layers):
        for t, (path, _) in TARGETS.items():
            m = block.get_submodule(path)
            if isinstance(m, LoraLinear):
                out[(i, t)] = m
    return out


def _peft_key(i: int, module: str, ab: str) -> str:
    return f"base_model.model.model.layers.{i}.{module}.lora_{ab}.weight"


def _hf_heads(cfg: ModelConfig, t: str) -> int | None:
    return {"q": cfg.n_heads, "k": cfg.kv_heads}.get(t)


def adapted_modules(layers: nn.ModuleList, cfg: ModelConfig):
    """(layer, HF module, [(target, its LoraLinear)] in row order) for every module with a LoRA."""
    mods = lora_modules(layers)
    for i in range(len(layers)):
        for module, parts in peft_modules(cfg).values():
            if (i, parts[0]) in mods:
                yield i, module, [(t, mods[(i, t)]) for t in parts]


def adapter_tensors(layers: nn.ModuleList, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """PEFT-named LoRA tensors, with q/k's lora_B rows in Hugging Face's layout (a fused module's
    B is its parts' rows stacked)."""
    out = {}
    for i, module, parts in adapted_modules(layers, cfg):
        bs = []
        for t, m in parts:
            b = m.lora_B.detach().float().cpu()
            bs.append(permute_for_hf(b, heads, cfg.rope_dim) if (heads := _hf_heads(cfg, t)) is not None else b)
        out[_peft_key(i, module, "A")] = parts[0][1].lora_A.detach().float().cpu().contiguous()
        out[_peft_key(i, module, "B")] = torch.cat(bs).contiguous()
    return out


def save_adapter(layers: nn.ModuleList, model_cfg: ModelConfig, lora_cfg: LoraConfig, out: Path,
                 base_model: str = "", revision: str | None = None) -> Path:
    """Write adapter_config.json + adapter_model.safetensors (PEFT layout), each atomically.

    base_model and revision are what peft's AutoPeftModel loads the base from (a Hub id and its
    commit, or a folder; phantom.provenance.base_model)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with fileio.replacing(out / ADAPTER_WEIGHTS) as tmp:
        write_safetensors(tmp, adapter_tensors(layers, model_cfg), metadata={"format": "pt"})
    atomic_write_json(out / ADAPTER_CONFIG, {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "revision": revision,
        "r": lora_cfg.rank, "lora_alpha": lora_cfg.alpha, "lora_dropout": lora_cfg.dropout,
        "target_modules": sorted(peft_modules(model_cfg)[t][0].split(".")[1] for t in lora_cfg.targets),
        "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
        "modules_to_save": None, "use_rslora": False, "use_dora": False,
    })
    return out


def read_adapter_config(path: Path) -> LoraConfig:
    cpath = Path(path) / ADAPTER_CONFIG
    if not cpath.is_file():
        raise FileNotFoundError(f"no LoRA adapter at {path} (missing {ADAPTER_CONFIG})")
    try:
        c = json.loads(cpath.read_text())
        by_hf = {v[1].split(".")[1]: k for k, v in TARGETS.items()} | {f"{g}_proj": g for g in GROUPS}
        targets = tuple(by_hf[m] for m in c["target_modules"])
        return LoraConfig(rank=int(c["r"]), alpha=float(c["lora_alpha"]), dropout=float(c.get("lora_dropout", 0)),
                          targets=targets)
    except (KeyError, TypeError, ValueError, json.JSONDecodeError) as e:
        raise StoreError(f"{cpath}: not a LoRA adapter config phantom can load ({type(e).__name__}: {e})") from None


def load_adapter(layers: nn.ModuleList, cfg: ModelConfig, path: Path) -> None:
    """Load PEFT-format LoRA weights into the model's LoraLinear modules (shapes checked)."""
    wpath = safe_join(Path(path), ADAPTER_WEIGHTS)
    if not wpath.is_file():
        raise FileNotFoundError(f"no LoRA weights at {wpath}")
    try:
        tensors = load_file(str(wpath))
    except Exception as e:  # safetensors raises its own error types for corrupt files
        raise StoreError(f"{wpath}: cannot read adapter weights ({e})") from None
    expected = {_peft_key(i, module, ab) for i, module, _ in adapted_modules(layers, cfg) for ab in "AB"}
    if set(tensors) != expected:
        missing, extra = sorted(expected - set(tensors))[:3], sorted(set(tensors) - expected)[:3]
        raise StoreError(f"{wpath}: adapter does not match the model (missing {missing}, unexpected {extra})")
    with torch.no_grad():
        for i, module, parts in adapted_modules(layers, cfg):
            a, b = tensors[_peft_key(i, module, "A")], tensors[_peft_key(i, module, "B")]
            first = parts[0][1]
            rows = [m.lora_B.shape[0] for _, m in parts]
            if a.shape != first.lora_A.shape or b.shape != (sum(rows), first.lora_B.shape[1]):
                raise StoreError(f"{wpath}: layer {i} {module}: shapes {tuple(a.shape)}, {tuple(b.shape)} do not "
                                 f"match {tuple(first.lora_A.shape)}, {(sum(rows), first.lora_B.shape[1])}")
            first.lora_A.copy_(a)  # the parts of a fused module share it
            for (t, m), part in zip(parts, b.split(rows)):
                m.lora_B.copy_(permute_from_hf(part, heads, cfg.rope_dim) if (heads := _hf_heads(cfg, t)) is not None
                               else part)
