"""LoRA applied to built blocks from outside, and adapters saved/loaded in PEFT's layout.

PEFT's files describe a Hugging Face Llama, whose q/k rows are permuted relative to Meta's layout
that phantom keeps; lora_B of q and k is permuted on the way out and back on the way in, so the
adapter is correct for the HF model that `peft` loads it onto.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
from safetensors.torch import load_file

from phantom.config import ModelConfig
from phantom.layers import LoraLinear, permute_for_hf, permute_from_hf
from phantom import fileio
from phantom.fileio import atomic_write_json
from phantom.store import StoreError, safe_join
from phantom.tensorfile import write_safetensors

# short target name -> (module path inside a block, PEFT/HF module name, HF parent)
TARGETS = {
    "q": ("attention.wq", "self_attn.q_proj"),
    "k": ("attention.wk", "self_attn.k_proj"),
    "v": ("attention.wv", "self_attn.v_proj"),
    "o": ("attention.wo", "self_attn.o_proj"),
    "gate": ("feed_forward.w1", "mlp.gate_proj"),
    "up": ("feed_forward.w3", "mlp.up_proj"),
    "down": ("feed_forward.w2", "mlp.down_proj"),
}
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


@dataclass(frozen=True)
class LoraConfig:
    """Which projections get a LoRA and how big it is.

    Args:
        rank: r, the inner dimension of A (r x in) and B (out x r).
        alpha: the update is scaled by alpha / rank.
        dropout: dropout on the LoRA branch's input (replayed exactly in the recompute).
        targets: any of q, k, v, o, gate, up, down, or ("all-linear",): every one (peft's all-linear:
            each projection of every block, not the head).
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
        bad = [t for t in self.targets if t not in TARGETS]
        if bad:
            raise ValueError(f"unknown LoRA targets {bad}; choose from {', '.join(TARGETS)} or all-linear")
        if self.rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {self.rank}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout}")


def apply_lora(block: nn.Module, cfg: LoraConfig, layer: int) -> None:
    """Replace the target linears of one block by LoraLinear (in place)."""
    gen = torch.Generator().manual_seed(cfg.seed * 100003 + layer)
    for t in cfg.targets:
        parent_path, name = TARGETS[t][0].rsplit(".", 1)
        parent = block.get_submodule(parent_path)
        lora = LoraLinear(getattr(parent, name), cfg.rank, cfg.alpha, cfg.dropout, generator=gen)
        setattr(parent, name, lora)


def lora_modules(layers: nn.ModuleList) -> dict[tuple[int, str], LoraLinear]:
    """(layer index, target short name) -> its LoraLinear."""
    out = {}
    for i, block in enumerate(layers):
        for t, (path, _) in TARGETS.items():
            m = block.get_submodule(path)
            if isinstance(m, LoraLinear):
                out[(i, t)] = m
    return out


def _peft_key(i: int, t: str, ab: str) -> str:
    return f"base_model.model.model.layers.{i}.{TARGETS[t][1]}.lora_{ab}.weight"


def _hf_heads(cfg: ModelConfig, t: str) -> int | None:
    return {"q": cfg.n_heads, "k": cfg.kv_heads}.get(t)


def adapter_tensors(layers: nn.ModuleList, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """PEFT-named LoRA tensors, with q/k's lora_B rows in Hugging Face's layout."""
    out = {}
    for (i, t), m in lora_modules(layers).items():
        b = m.lora_B.detach().float().cpu()
        if (heads := _hf_heads(cfg, t)) is not None:
            b = permute_for_hf(b, heads)
        out[_peft_key(i, t, "A")] = m.lora_A.detach().float().cpu().contiguous()
        out[_peft_key(i, t, "B")] = b.contiguous()
    return out


def save_adapter(layers: nn.ModuleList, model_cfg: ModelConfig, lora_cfg: LoraConfig, out: Path,
                 base_model: str = "") -> Path:
    """Write adapter_config.json + adapter_model.safetensors (PEFT layout), each atomically."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with fileio.replacing(out / ADAPTER_WEIGHTS) as tmp:
        write_safetensors(tmp, adapter_tensors(layers, model_cfg), metadata={"format": "pt"})
    atomic_write_json(out / ADAPTER_CONFIG, {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": lora_cfg.rank, "lora_alpha": lora_cfg.alpha, "lora_dropout": lora_cfg.dropout,
        "target_modules": sorted(TARGETS[t][1].split(".")[1] for t in lora_cfg.targets),
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
        by_hf = {v[1].split(".")[1]: k for k, v in TARGETS.items()}
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
    mods = lora_modules(layers)
    expected = {_peft_key(i, t, ab) for (i, t) in mods for ab in "AB"}
    if set(tensors) != expected:
        missing, extra = sorted(expected - set(tensors))[:3], sorted(set(tensors) - expected)[:3]
        raise StoreError(f"{wpath}: adapter does not match the model (missing {missing}, unexpected {extra})")
    with torch.no_grad():
        for (i, t), m in mods.items():
            a, b = tensors[_peft_key(i, t, "A")], tensors[_peft_key(i, t, "B")]
            if a.shape != m.lora_A.shape or b.shape != m.lora_B.shape:
                raise StoreError(f"{wpath}: layer {i} {t}: shapes {tuple(a.shape)}, {tuple(b.shape)} do not match "
                                 f"{tuple(m.lora_A.shape)}, {tuple(m.lora_B.shape)}")
            if (heads := _hf_heads(cfg, t)) is not None:
                b = permute_from_hf(b, heads)
            m.lora_A.copy_(a)
            m.lora_B.copy_(b)
