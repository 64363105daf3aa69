"""Tiny INT4 checkpoints in the layout Kimi-K2-Thinking ships (compressed-tensors' symmetric pack-quantized INT4 in
groups of 32), written from a transformers model by compressed-tensors' own code: each quantized linear weight's
scales by its qparams rule (calculate_qparams over each group's min and max, in the weight's bf16), then its
PackedQuantizationCompressor: `weight_packed` (int32 words of eight 4-bit values), `weight_scale` (bf16, one per
group) and `weight_shape`; the experts one tensor each; the rest in bf16 (DeepSeek's router correction bias in
float32); config.json's quantization_config as Kimi-K2-Thinking's, its `ignore` naming what stays 16-bit.

The reference is the same transformers model holding what compressed-tensors' decompression makes of those bytes.
"""
from __future__ import annotations

import copy
import json
import re

import torch
from safetensors.torch import save_file

from conftest import need
from fp8_checkpoint import per_expert, reference

need("compressed_tensors")
from compressed_tensors.compressors import PackedQuantizationCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme  # noqa: E402
from compressed_tensors.quantization.utils import calculate_qparams  # noqa: E402

GROUP = 32
WEIGHTS = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP,
           "dynamic": False, "actorder": None, "block_structure": None, "observer": "minmax", "observer_kwargs": {}}
SCHEME = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**{k: v for k, v in WEIGHTS.items()
                                                                          if k != "observer_kwargs"}))
# Kimi-K2-Thinking's: only the routed experts are INT4
KIMI_IGNORE = ["lm_head", r"re:.*self_attn.*", r"re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"]
LINEAR = re.compile(r"model\.layers\.\d+\..*_proj(_with_mqa)?\.weight$")


def ignored(key: str, ignore: list[str]) -> bool:
    """Whether a weight's module matches the config's `ignore` (names, or "re:" patterns as compressed-tensors
    matches them: re.match on the module's name)."""
    module = key.removesuffix(".weight")
    return any(re.match(p[3:], module) if p.startswith("re:") else p == module for p in ignore)


def compress(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """One bf16 weight as compressed-tensors writes it: weight_packed, weight_scale, weight_shape."""
    groups = w.unflatten(-1, (-1, GROUP))
    scale, zero = calculate_qparams(groups.amin(dim=-1), groups.amax(dim=-1), SCHEME.weights)
    out = PackedQuantizationCompressor.compress({"weight": w, "weight_scale": scale, "weight_zero_point": zero}, SCHEME)
    return {k: v.contiguous() for k, v in out.items()}


def decompress(shipped: dict[str, torch.Tensor], key: str) -> torch.Tensor:
    base = key.removesuffix("_packed")
    parts = {"weight_packed": shipped[key], "weight_scale": shipped[base + "_scale"],
             "weight_shape": shipped[base + "_shape"]}
    return PackedQuantizationCompressor.decompress(parts, SCHEME)["weight"]


def write_int4(model, folder, ignore=("lm_head",)):
    """model as a compressed-tensors INT4 checkpoint in folder (two shards, an index, config.json with its
    quantization_config); returns (the shipped tensors, the reference: model holding compressed-tensors'
    decompression of them)."""
    folder.mkdir(parents=True)
    shipped = {}
    for k, v in per_expert(model).items():
        if LINEAR.match(k) and not ignored(k, list(ignore)):
            shipped.update({f"{k}_{p.removeprefix('weight_')}": t for p, t in compress(v.to(torch.bfloat16)).items()})
        else:
            shipped[k] = v.contiguous().to(torch.float32 if k.endswith("e_score_correction_bias") else torch.bfloat16)
    names = sorted(shipped)
    half = {n: "model-00001-of-00002.safetensors" if i < len(names) // 2 else "model-00002-of-00002.safetensors"
            for i, n in enumerate(names)}
    for shard in sorted(set(half.values())):
        save_file({n: shipped[n] for n in names if half[n] == shard}, folder / shard, metadata={"format": "pt"})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": half}))
    model.config.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {
        "config_groups": {"group_0": {"input_activations": None, "output_activations": None, "targets": ["Linear"],
                                      "weights": WEIGHTS}},
        "format": "pack-quantized", "ignore": list(ignore), "kv_cache_scheme": None,
        "quant_method": "compressed-tensors", "quantization_status": "compressed"}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    weights = {k.removesuffix("_packed"): decompress(shipped, k).float() if k.endswith("_packed") else v.float()
               for k, v in shipped.items() if not k.endswith(("_scale", "_shape"))}
    return shipped, reference(copy.deepcopy(model), weights)
