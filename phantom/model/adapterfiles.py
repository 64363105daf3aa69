"""LoRA adapters as files, in peft's layout: adapter_config.json and adapter_model.safetensors written and
read (lora_B of q and k in Hugging Face's row order; a fused module's B its parts' rows stacked; a mixture
of experts' experts as peft's two stacked tensors a layer), checked before anything is allocated.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.nn as nn
from safetensors.torch import load_file

from phantom.arch.config import ModelConfig
from phantom.arch.expertlora import EXPERT_MODULES, EXPERT_PARAMS, bank_wrappers, expert_banks, peft_parameter, \
    peft_wrappers, target_of
from phantom.arch.ops import permute_for_hf, permute_from_hf, rope_rows
from phantom.base import fileio, safejson
from phantom.base.fileio import atomic_write_json
from phantom.files.storeformat import safe_join
from phantom.files.tensorfile import StoreError, read_header, write_safetensors
from phantom.model.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, EXPERT_TARGETS, GROUPS, PARAMETER_TARGETS, TARGETS, \
    V4_TARGETS, LoraConfig, adapted_modules, config_module, expert_names, peft_modules

def _peft_key(i: int, module: str, ab: str) -> str:
    return f"base_model.model.model.layers.{i}.{module}.lora_{ab}.weight"


def _hf_heads(cfg: ModelConfig, t: str) -> int | None:
    """The heads whose RoPE rows a target's lora_B permutes to Hugging Face's layout; None: kept as it is."""
    return rope_rows(cfg).get(f"{TARGETS[t][0]}.weight")


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
    for i, block in enumerate(layers):  # a mixture of experts' experts: held in peft's layout
        banks = expert_banks(block)
        for target, module in bank_wrappers(banks).items():
            for ab in "AB":
                out[_peft_key(i, module, ab)] = getattr(banks[target], f"lora_{ab}").detach().float().cpu().contiguous()
    return out


def save_adapter(layers: nn.ModuleList, model_cfg: ModelConfig, lora_cfg: LoraConfig, out: Path,
                 base_model: str = "", revision: str | None = None) -> Path:
    """Write adapter_config.json + adapter_model.safetensors (PEFT layout), each atomically.

    base_model and revision are what peft's AutoPeftModel loads the base from (a Hub id and its
    commit, or a folder; phantom.base.provenance.base_model)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with fileio.replacing(out / ADAPTER_WEIGHTS) as tmp:
        write_safetensors(tmp, adapter_tensors(layers, model_cfg), metadata={"format": "pt"})
    atomic_write_json(out / ADAPTER_CONFIG, {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "revision": revision,
        "r": lora_cfg.rank, "lora_alpha": lora_cfg.alpha, "lora_dropout": lora_cfg.dropout,
        "target_modules": sorted(config_module(model_cfg, peft_modules(model_cfg)[t][0]) for t in lora_cfg.targets
                                 if t not in EXPERT_TARGETS and t not in PARAMETER_TARGETS),
        "target_parameters": [*(peft_parameter(t, expert_names(model_cfg).module) for t in EXPERT_TARGETS
                                if t in lora_cfg.targets),
                              *(PARAMETER_TARGETS[t] for t in PARAMETER_TARGETS if t in lora_cfg.targets)] or None,
        "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
        "modules_to_save": None, "use_dora": False, **peft_fields(lora_cfg),
    })
    return out


def peft_fields(cfg: LoraConfig) -> dict:
    """The adapter_config.json fields that say how cfg departs from one rank and alpha everywhere."""
    return {"use_rslora": cfg.rslora, "rank_pattern": dict(cfg.rank_pattern), "alpha_pattern": dict(cfg.alpha_pattern),
            "layers_to_transform": list(cfg.layers) if cfg.layers is not None else None}


# adapter_config.json fields that change what an adapter computes and that phantom does not model: a
# value other than a neutral one (NEUTRAL) is refused, naming the field
UNMODELLED = ("use_dora", "bias", "fan_in_fan_out", "modules_to_save", "lora_bias", "layer_replication",
              "trainable_token_indices", "alora_invocation_tokens", "use_qalora",
              "exclude_modules", "use_bdlora", "arrow_config", "kasa_config", "monteclora_config")
NEUTRAL = (None, False, "none", [], {}, "")
_WEIGHT_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(.+)\.lora_([AB])\.weight")


def read_adapter_config(path: Path) -> LoraConfig:
    """The LoraConfig of a peft adapter folder, as peft reads adapter_config.json (use_rslora,
    rank_pattern, alpha_pattern, layers_to_transform), checked against its weights' header before
    anything is allocated.

    Raises:
        FileNotFoundError: no adapter_config.json or no weights.
        StoreError: a field phantom does not model (named), a value out of range, or a rank the
            weights do not have.
    """
    cpath = Path(path) / ADAPTER_CONFIG
    if not cpath.is_file():
        raise FileNotFoundError(f"no LoRA adapter at {path} (missing {ADAPTER_CONFIG})")
    c = safejson.load(cpath, what="LoRA adapter config", error=StoreError)
    try:
        cfg = _lora_config(cpath, c)
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, StoreError):
            raise
        raise StoreError(f"{cpath}: not a LoRA adapter config phantom can load ({type(e).__name__}: {e})") from None
    check_adapter_ranks(Path(path), cfg)
    return cfg


def _lora_config(cpath: Path, c) -> LoraConfig:
    if not isinstance(c, dict):
        raise StoreError(f"{cpath}: not a LoRA adapter config phantom can load (not a JSON object)")
    if c.get("peft_type", "LORA") != "LORA":
        raise StoreError(f"{cpath}: peft_type {c['peft_type']!r:.40} is not LORA; phantom loads LoRA adapters")
    for field in UNMODELLED:
        if c.get(field) not in NEUTRAL:
            raise StoreError(f"{cpath}: {field} {c[field]!r:.60} changes what the adapter computes, and phantom "
                             f"does not model it")
    if c.get("layers_pattern") not in (*NEUTRAL, "layers", ["layers"]):
        raise StoreError(f"{cpath}: layers_pattern {c['layers_pattern']!r:.60} is not supported (phantom's "
                         f"blocks are model.layers)")
    by_hf = {v[1].split(".")[1]: k for k, v in TARGETS.items() if k in V4_TARGETS[:2] or k not in V4_TARGETS} | \
        {f"{g}_proj": g for g in GROUPS} | {TARGETS[k][1]: k for k in V4_TARGETS if k not in PARAMETER_TARGETS}
    modules, layers = c.get("target_modules"), c.get("layers_to_transform")
    if modules is None and c.get("target_parameters"):  # peft writes [] there; null means no modules too
        modules = []
    grouped = {}  # a module peft adapts by its weight (PARAMETER_TARGETS), by path and by name -> that weight
    for full in PARAMETER_TARGETS.values():
        module = full.removesuffix(".weight")
        grouped |= {module: full, module.rsplit(".", 1)[1]: full}
    if isinstance(modules, list) and (named := [m for m in modules if m in grouped]):
        raise StoreError(f"{cpath}: target_modules {named[0]}: peft 0.21's LoRA module on this grouped linear fails in "
                         f"its forward; adapt its weight instead (target_parameters {grouped[named[0]]})")
    if not isinstance(modules, list) or any(m not in by_hf for m in modules):
        raise StoreError(f"{cpath}: target_modules {modules!r:.80} is not a list of modules phantom adapts "
                         f"({', '.join(by_hf)})")
    params = c.get("target_parameters") or []
    if not isinstance(params, list) or any(parameter_target(t) is None for t in params):
        raise StoreError(f"{cpath}: target_parameters {params!r:.80} is not a list of tensors phantom adapts "
                         f"({', '.join([*(peft_parameter(t) for t in EXPERT_PARAMS), *PARAMETER_TARGETS.values()])})")
    if not isinstance(c.get("use_rslora", False), bool):
        raise StoreError(f"{cpath}: use_rslora {c['use_rslora']!r:.40} is not true or false")
    return LoraConfig(rank=c["r"], alpha=c["lora_alpha"], dropout=c.get("lora_dropout") or 0.0,
                      targets=tuple(by_hf[m] for m in modules) + tuple(parameter_target(t) for t in params),
                      rslora=c.get("use_rslora", False), exact=True,
                      rank_pattern=c.get("rank_pattern") or {}, alpha_pattern=c.get("alpha_pattern") or {},
                      layers=[layers] if type(layers) is int else (layers or None))


def parameter_target(parameter) -> str | None:
    """The target a target_parameters entry names: an expert tensor's (target_of) or o_a's ("self_attn.o_a_proj.weight",
    or its end: peft matches an entry at the end of the parameter's name); None for anything else."""
    found = [t for t, full in PARAMETER_TARGETS.items() if isinstance(parameter, str) and
             (parameter == full or full.endswith(f".{parameter}") and "." in parameter)]
    return found[0] if found else target_of(parameter)


def check_adapter_ranks(folder: Path, cfg: LoraConfig) -> None:
    """Refuse weights whose lora_A or lora_B do not have the rank cfg gives their module, read from the
    safetensors header alone (a config claiming r = 10**12 is refused before anything is allocated). An
    expert tensor's LoRA has rank times the number of experts there."""
    wpath = safe_join(Path(folder), ADAPTER_WEIGHTS)
    if not wpath.is_file():
        raise FileNotFoundError(f"no LoRA weights at {wpath}")
    wrappers = {m: peft_parameter(t, module) for module in EXPERT_MODULES
                for t, m in peft_wrappers(cfg.targets, module).items()}
    tensors = {full.removesuffix(".weight"): full for full in PARAMETER_TARGETS.values()}  # rank and alpha keys
    for spec in read_header(wpath)[0]:
        key = _WEIGHT_KEY.fullmatch(spec.name)
        module = wrappers.get(key[2], tensors.get(key[2], key[2])) if key else None
        rank_alpha = cfg.module_rank(int(key[1]), module) if key and len(spec.shape) == 2 else None
        got = spec.shape[key[3] == "B"] if rank_alpha is not None else 0
        if rank_alpha is not None and (got % rank_alpha[0] if key[2] in wrappers else got != rank_alpha[0]):
            raise StoreError(f"{wpath}: {spec.name} has rank {spec.shape[key[3] == 'B']}, but {ADAPTER_CONFIG} gives "
                             f"its module rank {rank_alpha[0]} (r, rank_pattern)")


def load_adapter(layers: nn.ModuleList, cfg: ModelConfig, path: Path) -> None:
    """Load PEFT-format LoRA weights into the model's LoraLinear modules (shapes checked)."""
    wpath = safe_join(Path(path), ADAPTER_WEIGHTS)
    if not wpath.is_file():
        raise FileNotFoundError(f"no LoRA weights at {wpath}")
    try:
        tensors = load_file(str(wpath))
    except Exception as e:  # safetensors raises its own error types for corrupt files
        raise StoreError(f"{wpath}: cannot read adapter weights ({e})") from None
    experts = [(i, t, module, banks[t]) for i, block in enumerate(layers) if (banks := expert_banks(block))
               for t, module in bank_wrappers(banks).items()]
    expected = {_peft_key(i, module, ab) for i, module, _ in adapted_modules(layers, cfg) for ab in "AB"} | \
        {_peft_key(i, module, ab) for i, _, module, _ in experts for ab in "AB"}
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
        for i, t, module, bank in experts:
            a, b = tensors[_peft_key(i, module, "A")], tensors[_peft_key(i, module, "B")]
            if a.shape != bank.lora_A.shape or b.shape != bank.lora_B.shape:
                raise StoreError(f"{wpath}: layer {i} {peft_parameter(t, bank.names.module)}: shapes {tuple(a.shape)}, {tuple(b.shape)} "
                                 f"do not match {tuple(bank.lora_A.shape)}, {tuple(bank.lora_B.shape)}")
            bank.lora_A.copy_(a)
            bank.lora_B.copy_(b)
