"""Tiny FP8 checkpoints in the layout DeepSeek-V3, Kimi-K2, Qwen3-FP8 and GLM-4.5-FP8 ship, written from a
transformers model by the published recipe (DeepSeek-V3's inference/kernel.py weight quantization): each linear
weight of a block as float8_e4m3fn with a float32 `weight_scale_inv` per 128 x 128 tile, tiles at the right and
bottom edges cut short (scales of ceil(rows / 128) x ceil(cols / 128)), the experts one tensor each; norms,
embedding, head and routers in bf16 (DeepSeek's router correction bias in float32); config.json's
quantization_config as the Hub's files have it; two shards and an index.

The reference is the same transformers model holding the weights transformers' own dequantization routine
(`_dequantize_fp8_weight` with the explicit weight_block_size, in fp32) makes of those bytes.
"""
from __future__ import annotations

import copy
import json
import re

import torch
from safetensors.torch import save_file

from conftest import need

transformers = need("transformers")
from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight  # noqa: E402

BLOCK = [128, 128]
E4M3_MAX = 448.0
QUANTIZED = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\..*(proj|proj_with_mqa)\.weight$")


def quantize_tiles(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's weight quantization, tile by tile: s = amax / 448, q = e4m3(w / s); returns (q, s)."""
    rows, cols = w.shape
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    s = torch.empty(-(-rows // BLOCK[0]), -(-cols // BLOCK[1]), dtype=torch.float32)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            tile = w[i * BLOCK[0]:(i + 1) * BLOCK[0], j * BLOCK[1]:(j + 1) * BLOCK[1]].float()
            s[i, j] = tile.abs().max() / E4M3_MAX
            q[i * BLOCK[0]:(i + 1) * BLOCK[0], j * BLOCK[1]:(j + 1) * BLOCK[1]] = (tile / s[i, j]).to(torch.float8_e4m3fn)
    return q, s


def per_expert(model) -> dict[str, torch.Tensor]:
    """The model's weights with its experts one tensor each (transformers 5's 3-D gate_up_proj and down_proj
    split), as checkpoints ship them; a tied head left out (as save_pretrained does)."""
    out = {}
    for k, v in model.state_dict().items():
        if k.endswith("mlp.experts.gate_up_proj"):
            width = v.shape[1] // 2
            for e in range(v.shape[0]):
                out[k.replace("gate_up_proj", f"{e}.gate_proj.weight")] = v[e, :width]
                out[k.replace("gate_up_proj", f"{e}.up_proj.weight")] = v[e, width:]
        elif k.endswith("mlp.experts.down_proj"):
            for e in range(v.shape[0]):
                out[k.replace("down_proj", f"{e}.down_proj.weight")] = v[e]
        else:
            out[k] = v
    if model.config.tie_word_embeddings:  # a tied head is the embedding, not saved apart (as save_pretrained does)
        out.pop("lm_head.weight", None)
    return out


def shipped_tensors(model, keep=()) -> dict[str, torch.Tensor]:
    """The model's weights as an FP8 checkpoint holds them: experts one tensor each, linear weights of blocks
    quantized unless a name in keep matches."""
    shipped = {}
    for k, v in per_expert(model).items():
        if QUANTIZED.match(k) and not any(m in k for m in keep):
            shipped[k], shipped[k + "_scale_inv"] = quantize_tiles(v)
        else:
            shipped[k] = v.contiguous().to(torch.float32 if k.endswith("e_score_correction_bias") else torch.bfloat16)
    return shipped


def dequantized(shipped: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each weight in fp32: FP8 ones through transformers' _dequantize_fp8_weight with weight_block_size."""
    return {k: (_dequantize_fp8_weight(v.clone(), shipped[k + "_scale_inv"], BLOCK, torch.float32)
                if v.dtype == torch.float8_e4m3fn else v.float())
            for k, v in shipped.items() if not k.endswith("_scale_inv")}


def write_fp8(model, folder, keep=()):
    """model as an FP8 checkpoint in folder (two shards, an index, config.json with its quantization_config);
    returns (the shipped tensors, the reference: model holding what transformers dequantizes them to)."""
    folder.mkdir(parents=True)
    shipped = shipped_tensors(model, keep)
    names = sorted(shipped)
    half = {n: "model-00001-of-00002.safetensors" if i < len(names) // 2 else "model-00002-of-00002.safetensors"
            for i, n in enumerate(names)}
    for shard in sorted(set(half.values())):
        save_file({n: shipped[n] for n in names if half[n] == shard}, folder / shard, metadata={"format": "pt"})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": half}))
    model.config.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": BLOCK, **({"modules_to_not_convert": list(keep)} if keep else {})}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return shipped, reference(model, dequantized(shipped))


def reference(model, weights: dict[str, torch.Tensor]):
    """A copy of model holding weights (the checkpoint's names: experts stacked back into its 3-D tensors)."""
    ref = copy.deepcopy(model)
    state = {}
    for k in ref.state_dict():
        if k.endswith("mlp.experts.gate_up_proj"):
            n = ref.state_dict()[k].shape[0]
            state[k] = torch.stack([torch.cat([weights[k.replace("gate_up_proj", f"{e}.gate_proj.weight")],
                                               weights[k.replace("gate_up_proj", f"{e}.up_proj.weight")]])
                                    for e in range(n)])
        elif k.endswith("mlp.experts.down_proj"):
            n = ref.state_dict()[k].shape[0]
            state[k] = torch.stack([weights[k.replace("down_proj", f"{e}.down_proj.weight")] for e in range(n)])
        else:
            state[k] = weights[k if k in weights else "model.embed_tokens.weight"]  # a tied head
    ref.load_state_dict(state)
    return ref.eval()
