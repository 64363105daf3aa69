"""A LoRA adapter alone as a GGUF LoRA adapter (llama.cpp's `--lora`, Ollama's ADAPTER), for a base GGUF of
the same model.

The file is the one llama.cpp's convert_lora_to_gguf.py writes from the same PEFT adapter folder (with the
base model's HF export as --base): general.type "adapter", adapter.type "lora", adapter.lora.alpha, and for
each adapted matrix its GGUF name + ".lora_a" (rank x in) and ".lora_b" (out x rank), B's q/k rows in the
base file's order. llama.cpp scales a LoRA by alpha / rank, so an adapter scaled otherwise (rsLoRA, rank or
alpha patterns) is refused: merge it with --format gguf. May import gguf and phantom.model.
"""
from __future__ import annotations

from pathlib import Path

import gguf
import torch
from safetensors.torch import load_file

from phantom.files.store import BlockStore
from phantom.export.gguf_arch import Arch
from phantom.export.gguf_export import OUTTYPES, T, check_supported, default_outtype, llama_permute
from phantom.model.adapterfiles import read_adapter_config
from phantom.model.lora import ADAPTER_WEIGHTS
from phantom.base import safejson


def lora_pairs(adapter: Path) -> dict[str, list[torch.Tensor | None]]:
    """{base Hugging Face weight name: [A, B]}, in the order the adapter file lists them (as the converter
    pairs them)."""
    pairs: dict[str, list[torch.Tensor | None]] = {}
    for name, t in load_file(adapter / ADAPTER_WEIGHTS, device="cpu").items():
        if ".lora_A.weight" not in name and ".lora_B.weight" not in name:
            raise ValueError(f"{adapter / ADAPTER_WEIGHTS}: {name} is not a LoRA A or B matrix; a GGUF LoRA "
                             f"adapter holds those alone (merge it with --format gguf)")
        base = name.replace("base_model.model.", "").replace(".lora_A.weight", ".weight")
        base = base.replace(".lora_B.weight", ".weight")
        pairs.setdefault(base, [None, None])[".lora_B." in name] = t
    return pairs


def gguf_lora_tensors(store: BlockStore, arch: Arch, adapter: Path) -> list[tuple[str, torch.Tensor]]:
    """(GGUF name, tensor) of each A and B, B's q/k rows permuted as the base file's (LlamaModel.permute
    applied to B @ A moves B's rows)."""
    cfg, out = store.cfg, []
    tmap = gguf.get_tensor_name_map(arch.arch, cfg.n_layers)
    for hf_name, (a, b) in lora_pairs(adapter).items():
        if a is None or b is None:
            raise ValueError(f"{adapter / ADAPTER_WEIGHTS}: {hf_name} has only one of its LoRA matrices")
        if arch.permute_qk and hf_name.endswith("q_proj.weight"):
            b = llama_permute(b, cfg.n_heads)
        elif arch.permute_qk and hf_name.endswith("k_proj.weight"):
            b = llama_permute(b, cfg.kv_heads)
        name = tmap.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ValueError(f"{adapter / ADAPTER_WEIGHTS}: llama.cpp's {arch.file_arch} has no tensor for "
                             f"{hf_name}; merge the adapter with --format gguf")
        out += [(name + ".lora_a", a), (name + ".lora_b", b)]
    return out


def check_scaling(adapter: Path) -> float:
    """lora_alpha, where llama.cpp's alpha / rank is the adapter's scale; else a ValueError."""
    raw = safejson.load(adapter / "adapter_config.json")
    read_adapter_config(adapter)  # the fields phantom reads, checked
    if raw.get("use_rslora") or raw.get("rank_pattern") or raw.get("alpha_pattern"):
        raise ValueError(f"{adapter}: llama.cpp scales a LoRA adapter by lora_alpha / r, and this one is scaled "
                         f"otherwise (use_rslora, rank_pattern or alpha_pattern); merge it with --format gguf")
    return float(raw["lora_alpha"])


def export_gguf_lora(store: BlockStore, out: Path, adapter: Path, outtype: str | None, name: str) -> Path:
    """Write the adapter as out/<Name-Size-LoRA-Type>.gguf (name: the base model's); returns its path."""
    arch, alpha = check_supported(store, outtype), check_scaling(adapter)
    if store.cfg.n_experts:
        raise ValueError("--format gguf-lora covers dense models (its adapters are 2-D matrices, where the file "
                         "stacks a mixture's experts in 3-D tensors); merge a mixture of experts' adapter with "
                         "--format gguf")
    tensors = gguf_lora_tensors(store, arch, adapter)
    outtype = outtype or default_outtype(next(t.dtype for _, t in tensors))
    ftype, qtype = OUTTYPES[outtype]
    w = gguf.GGUFWriter(path=None, arch=arch.file_arch)
    for tname, t in tensors:
        q = qtype if t.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0] == 0 else T.F16  # the converter's QuantError
        w.add_tensor(tname, gguf.quants.quantize(t.to(torch.float32).numpy(), q), raw_dtype=q)
    total, shared, expert, count = w.get_total_parameter_count()
    meta = gguf.Metadata.load(None, adapter, None, total)
    meta.name = meta.name or name
    if meta.size_label is None and total > 0:
        meta.size_label = gguf.size_label(total, shared, expert, count)
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    meta.set_gguf_meta_model(w)
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    kind = ftype.name.partition("_")[2]
    path = out / (gguf.naming_convention(meta.name, meta.basename, meta.finetune, meta.version, meta.size_label,
                                         kind, model_type="LoRA" if total < 0 else None) + ".gguf")
    w.write_header_to_file(path)
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path

