"""A merged model written back in the quantized format its checkpoint shipped (merge_lora.py --requantize): FP8
in blocks (fp8-block), compressed-tensors' pack-quantized INT4 (int4-group) or gpt-oss's MXFP4 (mxfp4), under the
checkpoint's own tensor names and config.json's quantization_config as the checkpoint had it, so transformers
(and vLLM, SGLang) load it as they load the published model.

A weight the adapter leaves as it is (no LoRA on it, or a zero delta) keeps its shipped bytes, read from the
store: requantizing its dequantized values would not give them back in general (compressed-tensors' INT4 rule,
absmax / 7.5, moves every group's scale when applied to its own output). A weight with a delta is quantized from
its merged value in the export's dtype (base dequantized in fp32 plus the delta, rounded once) by the published
rule (phantom.arch.quant): transformers' FP8 quantizer per 128 x 128 tile, compressed-tensors' group quantizer,
transformers' (OpenAI triton_kernels') MXFP4 one. The rest of the model is written as the 16-bit export writes
it, one block in memory at a time.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from tqdm import tqdm

from phantom.arch import quant
from phantom.arch.family import family
from phantom.arch.ops import permute_for_hf, rope_rows
from phantom.arch.quantformat import stored_layout
from phantom.files.hfshards import parse_size
from phantom.files.store import BlockStore
from phantom.convert import visionlanguage
from phantom.convert.checkpoints import part_shapes
from phantom.convert.hflayout import hf_config, to_hf

RECORD = "shipped_quantization"  # the manifest's record of what the checkpoint shipped (phantom.convert.convert)
SUFFIXES = {"fp8-block": {"fp8": "", "scale_inv": "_scale_inv"},  # a weight's parts -> its checkpoint keys
            "int4-group": {"packed": "_packed", "scale": "_scale"}}


def shipped_record(store: BlockStore) -> dict:
    """The store's record of its checkpoint's quantization (config.json's quantization_config, as shipped).

    Raises:
        ValueError: the store holds no shipped quantized format (16-bit, or quantized by phantom), or was
            prepared before the record was kept.
    """
    if store.quant is None or not store.quant.shipped:
        what = "16-bit" if store.quant is None else f"{store.quant.method}, quantized by phantom"
        raise ValueError(f"{store.path}: --requantize writes the format a checkpoint shipped (FP8 in blocks, "
                         f"compressed-tensors INT4, MXFP4), and this store is {what}; drop --requantize")
    if store.quant.experts:
        raise ValueError(f"{store.path}: --requantize does not write DeepSeek-V4's FP8 beside FP4 experts; drop it "
                         f"(the export is then 16-bit)")
    rec = store.manifest.get(RECORD)
    if not isinstance(rec, dict) or not isinstance(rec.get("quantization_config"), dict):
        raise ValueError(f"{store.path}: the store does not record its checkpoint's quantization_config (prepared "
                         f"by an older phantom); prepare it again from the checkpoint to use --requantize")
    return rec


def _fused(cfg) -> dict[str, tuple[str, ...]]:
    """Hugging Face name -> the store names it stacks, for the blocks' fused tensors (gpt-oss's experts)."""
    return family(cfg).layout(cfg, cfg.interleaved_experts)[1]


def _name(cfg, i: int, name: str) -> str:
    return family(cfg).layout(cfg, cfg.interleaved_experts)[0][(True, name)].format(i)


def quantized_names(store: BlockStore, i: int) -> list[str]:
    """Block i's weights the checkpoint shipped quantized; refused where one is fused with other weights into
    one Hugging Face tensor (only gpt-oss's MXFP4 experts are, and they are quantized row by row)."""
    fmt, cfg = store.quant, store.cfg
    names = [n for n, s in part_shapes(cfg, i).items() if fmt.quantizes(n, s)]
    fused = {n for names_ in _fused(cfg).values() for n in names_}
    if fmt.method != "mxfp4" and (bad := sorted(set(names) & fused)):
        raise ValueError(f"{store.path}: {bad[0]} is written fused with other weights into one tensor; --requantize "
                         f"writes FP8 and INT4 weights one tensor each")
    return names


def hf_quantized(store: BlockStore, i: int, parts: dict[str, dict[str, torch.Tensor]],
                 scale_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Block i's quantized weights (store name -> its parts, q/k rows in the checkpoint's order) under the
    checkpoint's keys: FP8 `W.weight` and `W.weight_scale_inv`; INT4 `W.weight_packed`, `_scale`, `_shape`;
    MXFP4 gpt-oss's `*_blocks` and `*_scales` of every expert, gate and up rows alternating. Shapes and dtypes
    alone where the parts are meta tensors (the shard plan)."""
    cfg, method, out = store.cfg, store.quant.method, {}
    if method == "mxfp4":
        for key, names in _fused(cfg).items():
            if names[0] not in parts:
                continue
            n_parts = len(names) // cfg.n_experts
            for part in ("blocks", "scales"):
                rows = [torch.stack([parts[n][part] for n in names[e * n_parts:(e + 1) * n_parts]], dim=1).flatten(0, 1)
                        for e in range(cfg.n_experts)]
                out[f"{key.format(i)}_{part}"] = torch.stack(rows)
        return out
    for name, p in parts.items():
        hf = _name(cfg, i, name)
        for part, suffix in SUFFIXES[method].items():
            out[hf + suffix] = p[part].to(scale_dtype) if part == "scale_inv" else p[part]
        if method == "int4-group":  # compressed-tensors' weight_shape: the unpacked shape, int64
            shape = part_shapes(cfg, i)[name]
            out[hf + "_shape"] = torch.tensor(shape, dtype=torch.int64) if p["packed"].device.type != "meta" else \
                torch.empty(2, dtype=torch.int64, device="meta")
    return out


def specs(store: BlockStore, dtype: torch.dtype, rec: dict, scale_dtype: torch.dtype) -> list[tuple[str, torch.dtype, tuple]]:
    """(name, dtype, shape) of every tensor the requantized checkpoint holds, from shapes alone."""
    out = []
    for part in ("embed", *range(store.n_blocks), "head"):
        shapes = part_shapes(store.cfg, part)
        q = quantized_names(store, part) if isinstance(part, int) else []
        hf = to_hf(store.cfg, part, {n: torch.empty(s, dtype=plain_dtype(rec, n, dtype) if isinstance(part, int) else dtype, device="meta")
                                     for n, s in shapes.items() if n not in q})
        if q:
            layouts = {n: stored_layout(store.quant, n, shapes[n]) for n in q}
            hf |= hf_quantized(store, part, {n: {k[len(n) + 1:]: torch.empty(s, dtype=getattr(torch, d), device="meta")
                                                 for k, (s, d) in layouts[n].items()} for n in q}, scale_dtype)
        out += [(name, t.dtype, tuple(t.shape)) for name, t in hf.items()]
    return out


def plain_dtype(rec: dict, name: str, dtype: torch.dtype) -> torch.dtype:
    """A block tensor the checkpoint ships unquantized: in the export's dtype, or the checkpoint's where it is wider
    (DeepSeek-V3's and Kimi-K2's float32 router bias: its value the store's, kept in float32 as shipped by a store
    that records it in its format's float32, rounded to the store's dtype by one made before)."""
    wider = getattr(torch, rec.get("wider", {}).get(name, "bfloat16"))
    return wider if wider.itemsize > dtype.itemsize else dtype


def requantize(store: BlockStore, name: str, w: torch.Tensor, rec: dict) -> dict[str, torch.Tensor]:
    """A merged weight (phantom's layout) quantized by the published rule, q/k rows put back in the
    checkpoint's order first (a tile of 128 rows spans heads)."""
    if name in (rows := rope_rows(store.cfg)):
        w = permute_for_hf(w, rows[name], store.cfg.rope_dim)
    fmt = store.quant
    if fmt.method == "fp8-block":
        return quant.quantize_fp8(w, fmt, pow2=rec["quantization_config"].get("scale_fmt") == "ue8m0",
                                  scale_dtype=getattr(torch, rec.get("scale_dtype") or "float32"))
    if fmt.method == "int4-group":
        return quant.quantize_int4(w, fmt)
    return quant.quantize_mxfp4(w)


def blocks(store: BlockStore, loras: dict, dtype: torch.dtype, rec: dict, scale_dtype: torch.dtype,
           progress: bool = True) -> Iterator[tuple[str | int, dict[str, torch.Tensor]]]:
    """("embed" | block index | "head", Hugging Face-named tensors), one part at a time: each block read once,
    its stored parts kept for the weights the adapter leaves as they are, the rest dequantized and merged."""
    yield "embed", to_hf(store.cfg, "embed", {k: v.to(dtype) for k, v in store.load_embed().items()})
    for i in tqdm(range(store.n_blocks), desc="requantizing", unit="block", disable=not progress or None):
        buf = torch.empty(store.block_size(i), dtype=torch.uint8)
        store.read_block_into(i, buf)
        stored = store.block_views(buf, i)
        dense = store.dense_empty(torch.float32, block=i)
        store.dequantize_block(i, stored, dense)
        quantized, plain = {}, {}
        q = set(quantized_names(store, i))
        with torch.no_grad():
            for name, w in dense.items():
                delta = loras[i][name].delta_weight() if name in loras.get(i, {}) else None
                if delta is not None and not bool(delta.any()):
                    delta = None  # a zero delta (an adapter as initialized): the weight is the base's
                if name not in q:
                    plain[name] = (w if delta is None else w + delta).to(plain_dtype(rec, name, dtype))
                elif delta is None:  # the shipped bytes, as they are
                    quantized[name] = {k: v.clone(memory_format=torch.contiguous_format)
                                       for k, v in quant.stored_parts(store.quant, stored, name).items()}
                else:
                    quantized[name] = requantize(store, name, (w + delta).to(dtype), rec)
        yield i, to_hf(store.cfg, i, plain) | hf_quantized(store, i, quantized, scale_dtype)
        del buf, stored, dense, quantized, plain  # before the next block is read
    yield "head", to_hf(store.cfg, "head", {k: v.to(dtype) for k, v in store.load_head().items()})


def write_requantized(tmp: Path, store: BlockStore, loras: dict, dtype: torch.dtype, max_shard_size: str | int,
                      progress: bool = True) -> None:
    """The checkpoint's format again: shards by size as save_pretrained writes them, one block in memory at a
    time; config.json with the checkpoint's quantization_config."""
    rec = shipped_record(store)
    scale_dtype = getattr(torch, rec.get("scale_dtype") or "float32")
    writer = visionlanguage.shard_writer(tmp, store, specs(store, dtype, rec, scale_dtype), parse_size(max_shard_size))
    for _, tensors in blocks(store, loras, dtype, rec, scale_dtype, progress):
        for name in list(tensors):
            writer.write(name, tensors.pop(name))
    writer.finish()
    config = visionlanguage.checkpoint_config(store, hf_config(store.cfg, dtype) | {
        "quantization_config": rec["quantization_config"]}, dtype, quantized=True)
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
