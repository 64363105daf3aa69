"""Tiny gpt-oss checkpoints with their experts in MXFP4, in the layout openai/gpt-oss-20b and -120b ship: per layer
`mlp.experts.gate_up_proj_blocks` (experts, 2 x width, dim / 32, 16) and `down_proj_blocks` (experts, dim, width /
32, 16), uint8, two e2m1 values a byte (the first in the low nibble), rows as the out side (gate and up rows
alternating), and `*_scales` (uint8 E8M0, one per 32 values of a row); the experts' biases, attention, sinks,
router, embedding and head in bf16; config.json's quantization_config as the Hub's files have it.

Quantized by the OCP Microscaling spec's recipe (v1.0, section 6.3): per 32 values the shared exponent
floor(log2(amax)) - 2 (e2m1's largest exponent), each value rounded to the nearest e2m1 level (ties to the even
level), saturated at 6. The reference is the transformers model loaded from the folder with
Mxfp4Config(dequantize=True) (transformers dequantizes the blocks itself).
"""
from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def to_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rows x cols (cols a multiple of 32) -> (blocks rows x cols/32 x 16, scales rows x cols/32), uint8."""
    rows, cols = w.shape
    g = w.float().view(rows, cols // 32, 32)
    amax = g.abs().amax(dim=2)
    exp = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp(min=2.0 ** -126))) - 2, torch.zeros_like(amax))
    x = (g.abs() / torch.pow(2.0, exp)[:, :, None]).clamp(max=6.0)
    dist = (x[..., None] - E2M1).abs()  # nearest level; on a tie the even code (lower index among two: even mantissa)
    best = dist.min(dim=-1, keepdim=True).values
    ties = (dist == best)
    code = torch.where(ties.sum(-1) > 1, (ties * (torch.arange(8) % 2 == 0)).int().argmax(-1), dist.argmin(-1))
    code = code + 8 * (g < 0)
    pairs = code.to(torch.uint8).view(rows, cols // 32, 16, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4), (exp + 127).to(torch.uint8)


def write_mxfp4(model, folder):
    """model (a GptOssForCausalLM) as the Hub ships gpt-oss in folder: experts in MXFP4, the rest bf16; returns
    the shipped tensors."""
    folder.mkdir(parents=True)
    shipped = {}
    for k, v in model.state_dict().items():
        if k.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):  # (experts, in, out): rows are out
            parts = [to_mxfp4(v[e].T) for e in range(v.shape[0])]
            shipped[k + "_blocks"] = torch.stack([b for b, _ in parts])
            shipped[k + "_scales"] = torch.stack([s for _, s in parts])
        else:
            shipped[k] = v.contiguous().to(torch.bfloat16)
    if model.config.tie_word_embeddings:
        shipped.pop("lm_head.weight", None)
    names = sorted(shipped)
    half = {n: "model-00001-of-00002.safetensors" if i < len(names) // 2 else "model-00002-of-00002.safetensors"
            for i, n in enumerate(names)}
    for shard in sorted(set(half.values())):
        save_file({n: shipped[n] for n in names if half[n] == shard}, folder / shard, metadata={"format": "pt"})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": half}))
    model.config.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"modules_to_not_convert": NOT_CONVERTED, "quant_method": "mxfp4"}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return shipped
