"""Checkpoints phantom did not write, read one part at a time: Meta's params.json and model-parallel
consolidated.NN.pth shards (merged), Hugging Face folders of any family in phantom.arch.family
(safetensors shards, fused tensors as row ranges, tensors located in place for a linked store), and
the tokenizer files they come with. Apart from the converter so a new checkpoint layout is one reader.
"""
from __future__ import annotations

import ctypes
import dataclasses
import json
import logging
import math
import mmap
import os
import sys
from pathlib import Path

import torch
from safetensors import safe_open

from phantom.arch.config import (
    ModelConfig,
    block_tensor_shapes,
    embed_tensor_shapes,
    head_tensor_shapes,
)
from phantom.arch.family import family, from_hf_config, from_meta_params
from phantom.arch.quantformat import (
    SCALE_DTYPES,
    QuantFormat,
    block_layout,
    gate_up_part,
    quantized,
    shipped_format,
    stored_layout,
)
from phantom.base import safejson
from phantom.files.fusedrows import RowSpec, float_scale, fp4_parts, fused_rows, gate_up_biases, read_rows, \
    scale_key
from phantom.files.storeformat import safe_join
from phantom.files.tensorfile import StoreError, dtype_name, parse_stored, read_header

# Meta's model-parallel split: the dims along which consolidated.NN.pth shards cut each tensor.
# Column-parallel weights split their output rows (0), row-parallel ones their input columns (1);
# norms are replicated (()). Llama-2 cuts the embedding along dim 1, Llama-3 along 0: the shapes tell.
META_SPLIT_DIMS = {
    "tok_embeddings.weight": (1, 0), "output.weight": (0,), "norm.weight": (),
    "attention.wq.weight": (0,), "attention.wk.weight": (0,), "attention.wv.weight": (0,),
    "attention.wo.weight": (1,), "feed_forward.w1.weight": (0,), "feed_forward.w2.weight": (1,),
    "feed_forward.w3.weight": (0,), "attention_norm.weight": (), "ffn_norm.weight": (),
}

HF_PERMUTED = {"attention.wq.weight": "n_heads", "attention.wk.weight": "kv_heads"}  # rows in HF's RoPE layout

PARTS = ("embed", "head")  # besides the blocks 0..n_layers-1

# The tokenizer's files in a Hugging Face folder. The store keeps every one it finds (checksummed in the
# manifest's "tokenizer_files"), so an export hands the ecosystem the files the model came with.
TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "chat_template.jinja", "chat_template.json", "preprocessor_config.json",
                   "processor_config.json", "video_preprocessor_config.json")  # the last three: a VL model's processor

log = logging.getLogger(__name__)


def tokenizer_sources(src: Path, root: Path | None = None) -> list[Path]:
    """The TOKENIZER_FILES a Hugging Face folder holds, each inside src or, through a link, inside root (a
    hub cache repository, whose snapshots link to its blobs).

    Raises StoreError where one of them is a link that leads outside (it would copy that file into the store).
    """
    inside, out = (root or src).resolve(), []
    for name in TOKENIZER_FILES:
        path = src / name
        if not path.is_symlink() and not path.is_file():
            continue
        if not path.resolve().is_relative_to(inside):
            raise StoreError(f"{path}: a link to {path.resolve()}, outside {root or src}; copy the file into the "
                             f"model folder if it is the model's")
        if path.is_file():
            out.append(path)
    return out


def part_shapes(cfg: ModelConfig, part: str | int) -> dict[str, tuple[int, ...]]:
    """Store names and shapes of one part of the model: "embed", "head" or block i."""
    if part == "embed":
        return embed_tensor_shapes(cfg)
    if part == "head":
        return head_tensor_shapes(cfg)
    return block_tensor_shapes(cfg, part)


def release_pages(tensors) -> None:
    """Tell Linux it may drop the pages of memory-mapped tensors we are done with.

    Pages of a file mapping count in the process's RSS until unmapped; without this, converting
    from memory-mapped torch.load shards would end with the whole checkpoint resident. The mapping is
    private and never written, so dropped pages are simply read from the file again if touched.
    """
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None)
    for t in tensors:
        s = t.untyped_storage()
        start = s.data_ptr() // mmap.PAGESIZE * mmap.PAGESIZE
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(s.data_ptr() + s.nbytes() - start), 4)  # DONTNEED


# ---------------------------------------------------------------------------------------------
# Meta: params.json + consolidated.NN.pth (model-parallel shards)

class MetaCheckpoint:
    """Meta's shards, memory-mapped once; `part()` merges one part's slices on demand."""

    format = "meta"
    quant = None  # Meta's shards are 16-bit

    def shapes(self, part: str | int) -> dict[str, tuple[int, ...]]:
        return part_shapes(self.cfg, part)

    def __init__(self, src: Path):
        params = src / "params.json"
        if not params.is_file():
            raise FileNotFoundError(f"{params}: missing; a Meta checkpoint folder holds params.json next to "
                                    f"its consolidated.NN.pth shards")
        self.files = sorted(src.glob("consolidated.*.pth"))
        if not self.files:
            raise FileNotFoundError(f"{src}: no consolidated.NN.pth shards next to params.json")
        for k, f in enumerate(self.files):
            if f.name != f"consolidated.{k:02d}.pth":
                raise FileNotFoundError(f"{src / f'consolidated.{k:02d}.pth'}: shard missing from the set")
        self.shards = [self._load(f) for f in self.files]
        emb = self._get(0, "tok_embeddings.weight")
        self.cfg = self._config(params, tuple(emb.shape))
        wq_rows = self._get(0, "layers.0.attention.wq.weight").shape[0]
        if wq_rows * len(self.files) != self.cfg.dim:
            n = self.cfg.dim // max(wq_rows, 1)
            raise FileNotFoundError(f"{src / f'consolidated.{len(self.files):02d}.pth'}: shard missing from the set "
                                    f"(each shard holds {wq_rows} of wq's {self.cfg.dim} rows: {n} shards expected, "
                                    f"{len(self.files)} found)")
        self.dtype = emb.dtype
        self.tokenizer = next((p for p in (src / "tokenizer.model", src.parent / "tokenizer.model") if p.is_file()),
                              None)
        self.tokenizer_files = [self.tokenizer] if self.tokenizer else []

    def _load(self, f: Path) -> dict:
        try:
            return torch.load(f, map_location="cpu", mmap=True, weights_only=True)
        except Exception as e:  # a truncated zip, a pickle with forbidden objects, ...
            raise ValueError(f"{f}: cannot read this shard ({str(e).splitlines()[0].split('. ')[0]}); "
                             f"it is truncated or not a PyTorch checkpoint, download it again") from None

    def _get(self, k: int, key: str) -> torch.Tensor:
        if key not in self.shards[k]:
            raise ValueError(f"{self.files[k]}: tensor {key} missing; is this a Llama checkpoint?")
        return self.shards[k][key]

    def _config(self, params: Path, emb_shape: tuple[int, ...]) -> ModelConfig:
        try:
            dim = safejson.load(params)["dim"]
            vocab = emb_shape[0] * (len(self.files) if emb_shape[1] == dim and len(self.files) > 1 else 1)
            return from_meta_params(params, vocab_size=vocab)
        except (KeyError, TypeError, json.JSONDecodeError) as e:
            raise ValueError(f"{params}: not a Llama params.json ({type(e).__name__}: {e})") from None

    def part(self, part: str | int) -> dict[str, torch.Tensor]:
        out = {}
        for name, shape in part_shapes(self.cfg, part).items():
            key = name if isinstance(part, str) else f"layers.{part}.{name}"
            parts = [self._get(k, key) for k in range(len(self.files))]
            out[name] = self._merge(key, META_SPLIT_DIMS[name], parts, shape)
            release_pages(parts)  # copied into our own memory: the mapped pages can go
        return out

    def _merge(self, key: str, dims: tuple[int, ...], parts: list[torch.Tensor], shape: tuple[int, ...]):
        for k, p in enumerate(parts):
            if p.shape != parts[0].shape:
                raise ValueError(f"{self.files[k]}: {key} has shape {tuple(p.shape)}, shard 0 has "
                                 f"{tuple(parts[0].shape)}; the shards are from different models")
        if tuple(parts[0].shape) == shape and (not dims or len(parts) == 1):
            return parts[0].clone()  # replicated, or a single shard
        for d in dims:
            cat_shape = list(parts[0].shape)
            cat_shape[d] *= len(parts)
            if tuple(cat_shape) == shape:  # torch.cat, one shard at a time: only one slice's pages are mapped in
                out = torch.empty(shape, dtype=parts[0].dtype)
                for k, p in enumerate(parts):
                    out.narrow(d, k * p.shape[d], p.shape[d]).copy_(p)
                    release_pages([p])
                return out
        raise ValueError(f"{self.files[0]}: {key} has shape {tuple(parts[0].shape)} in each of {len(parts)} shards, "
                         f"which does not make {shape} as params.json says; the shards do not match params.json")


# ---------------------------------------------------------------------------------------------
# Hugging Face: config.json + model*.safetensors (+ model.safetensors.index.json)

PACKED = {"int4-group": "_packed", "mxfp4": "_blocks"}  # a shipped 4-bit weight's first part, by its key


class HFCheckpoint:
    """A Hugging Face folder of a family in phantom.arch.family; `part()` reads one part's tensors lazily (safetensors)."""

    format = "hf"

    def __init__(self, src: Path, root: Path | None = None):
        """root: a folder the shards may be links into (the hub cache's repository: snapshots link to
        its blobs); each shard is then read through its resolved path. None: no shard may leave src."""
        config = src / "config.json"
        if not config.is_file():
            raise FileNotFoundError(f"{config}: missing; a Hugging Face checkpoint folder holds config.json")
        try:
            self.cfg = as_shipped(from_hf_config(config))
        except (KeyError, TypeError, json.JSONDecodeError) as e:
            raise ValueError(f"{config}: not a decoder config.json phantom reads ({type(e).__name__}: {e})") from None
        except ValueError as e:
            raise ValueError(str(e)) from None
        weight_map = self._weight_map(src)
        headers = {}
        files = {}
        for file in sorted(set(weight_map.values())):
            path = files[file] = safe_join(src, file) if root is None else linked_shard(src, file, root)
            if not path.is_file():
                raise FileNotFoundError(f"{path}: shard missing from the set (listed in model.safetensors.index.json)")
            specs, start = read_header(path)
            headers[file] = ({s.name: s for s in specs}, start)
        text = family(self.cfg).text  # a vision-language checkpoint's text model: its tensors under their own names
        named = text[1](weight_map) if text is not None else {k: k for k in weight_map}  # our name -> the file's
        # index: (part, store name) -> (path, TensorSpec, data start), a part of a fused tensor a spec of its rows;
        # names and shipped (every tensor's shard and header): what phantom.convert.visionlanguage keeps beside
        self.src, self.index, self.names, self.shipped = src, {}, named, (weight_map, headers, files)
        hf_names, fused = family(self.cfg).layout(self.cfg, fused_experts=self.fused_experts(named))
        moe = family(self.cfg).moe  # (experts, in, out) experts: gpt-oss's parts alternate, Llama 4's are halves
        turned = self.cfg.interleaved_experts or (moe is not None and moe.turned == "halves" and "halves")
        qc = safejson.load(config, what="config.json").get("quantization_config")
        fmt, packed = None if qc is None else shipped_format(qc, config), {}
        self.quantization_config, self.scale_dtypes = qc, set()  # as shipped: what --requantize writes back
        for part in (*PARTS, *range(self.cfg.n_layers)):
            shapes = part_shapes(self.cfg, part)
            for name, shape in shapes.items():
                hf = hf_names[(isinstance(part, int), name)].format(part)
                if (shipped := named.get(hf + (s := PACKED.get(getattr(fmt, "method", 0), "-")), hf + s)) in weight_map:
                    packed[(part, name)] = shipped[:-len(s)]  # weight_packed, *_blocks: their parts, as the file names
                    continue
                key = named.get(hf)
                if key not in weight_map:
                    raise ValueError(f"{src}: tensor {hf} is in no shard; the checkpoint is incomplete")
                specs, start = headers[weight_map[key]]
                spec, path = specs.get(key), files[weight_map[key]]
                if spec is None:
                    raise ValueError(f"{path}: tensor {key} missing (the index says it is here)")
                self.index[(part, name)] = (path, fused_rows(fused, spec, name, shapes, path, turned), start)
        self.dtype = self.index[("embed", "tok_embeddings.weight")][1].dtype
        if fmt is not None and fmt.method == "mxfp4":
            self.quant = self._shipped_mxfp4(packed, fused, weight_map, headers, files)
        else:
            self.quant = None if fmt is None else self._shipped_int4(fmt, packed, weight_map, headers, files) \
                if fmt.method == "int4-group" else self._shipped_fp8(fmt, weight_map, headers, files)
        self.quant = self.quant and dataclasses.replace(self.quant, float32=float32_tensors(self.index, self.dtype))
        self.tokenizer_files = tokenizer_sources(src, root)
        self.tokenizer = next((p for p in self.tokenizer_files if p.name in ("tokenizer.model", "tokenizer.json")), None)
        if self.tokenizer is None and (src / "tiktoken.model").is_file():
            log.warning("%s: tiktoken.model splits text with a pattern written in the model's own code (Kimi-K2's "
                        "tokenization_kimi.py), which phantom does not run: the store has no tokenizer; train on "
                        "token ids", src)

    def _shipped_fp8(self, fmt: QuantFormat, weight_map: dict, headers: dict, files: dict) -> QuantFormat:
        """The store format of an FP8 checkpoint, its index moved to the stored parts: each FP8 weight as
        NAME.fp8 and its `weight_scale_inv` as NAME.scale_inv, read as shipped (q/k rows too, in the halves the
        store's config says: as_shipped). The linear weights the checkpoint keeps in 16 bits (its
        modules_to_not_convert) become the format's `unquantized`: one layout for every block (DeepSeek-V4: fp4_parts)."""
        fp8 = {}
        for (part, name), (path, spec, _) in self.index.items():
            is_fp8, fp4 = spec.dtype in (torch.float8_e4m3fn, torch.int8), fmt.experts and "experts." in name  # V4: int8
            if is_fp8 and (isinstance(part, str) or not quantized(name, spec.shape) or spec.rows is not None or
                           (spec.dtype == torch.int8) != bool(fp4)):
                raise ValueError(f"{path}: {spec.name} is FP8; phantom reads FP8 only in a block's linear weights, "
                                 f"each a tensor of its own")
            if isinstance(part, int) and quantized(name, spec.shape):
                fp8.setdefault(name, set()).add(is_fp8)
        if mixed := sorted(n for n, kinds in fp8.items() if len(kinds) > 1):
            raise ValueError(f"{self.src}: {mixed[0]} is FP8 in some layers and 16-bit in others; a store keeps "
                             f"one layout for every block")
        fmt = dataclasses.replace(fmt, unquantized=tuple(sorted(n for n, k in fp8.items() if k == {False})))
        for part in range(self.cfg.n_layers):
            for name, shape in part_shapes(self.cfg, part).items():
                if not fmt.quantizes(name, shape):
                    continue
                path, spec, start = self.index.pop((part, name))
                key = scale_key(spec.name, weight_map)
                if key not in weight_map or key not in headers[weight_map[key]][0]:
                    raise ValueError(f"{path}: {spec.name} is FP8 without its {key}; the checkpoint is incomplete")
                scale, sstart = headers[weight_map[key]][0][key], headers[weight_map[key]][1]
                self.scale_dtypes.add(dtype_name(scale.dtype))
                if (layout := stored_layout(fmt, name, shape)).get(f"{name}.blocks"):  # FP4's bytes are MXFP4's
                    self.index |= fp4_parts(part, name, (path, spec, start), (files[weight_map[key]], scale, sstart), layout)
                    continue
                want = layout[f"{name}.scale_inv"][0]
                if scale.shape != want or not float_scale(scale):
                    raise ValueError(f"{files[weight_map[key]]}: {key} is {scale.dtype} {list(scale.shape)}, not "
                                     f"one float scale per {fmt.block[0]}x{fmt.block[1]} block ({list(want)})")
                self.index[(part, f"{name}.fp8")] = (path, spec, start)
                self.index[(part, f"{name}.scale_inv")] = (files[weight_map[key]], fused_rows({}, scale, key, {key: want},
                                                                                         path), sstart)
        return fmt

    def _shipped_int4(self, fmt: QuantFormat, packed: dict, weight_map: dict, headers: dict, files: dict) -> QuantFormat:
        """The store format of a compressed-tensors INT4 checkpoint (packed: (part, name) -> the weight's key), its
        index given the stored parts: each weight's `weight_packed` as NAME.packed and `weight_scale` as NAME.scale,
        read as shipped; `weight_shape` checked against config.json. The linear weights it keeps in 16 bits (its
        `ignore`) become the format's `unquantized`, its scales' dtype the format's: one layout for every block."""
        unquantized = self._unquantized(packed, "INT4")
        spec = lambda key: headers[weight_map[key]][0].get(key) if key in weight_map else None  # noqa: E731
        scales = {spec(k + "_scale").dtype for k in packed.values() if spec(k + "_scale") is not None}
        if len(scales) != 1 or dtype_name(next(iter(scales))) not in SCALE_DTYPES:
            raise ValueError(f"{self.src}: weight_scale dtypes {sorted(map(str, scales))}; phantom reads one of "
                             f"{', '.join(SCALE_DTYPES)} for every INT4 weight")
        fmt = QuantFormat("int4-group", group=fmt.group, scale_dtype=dtype_name(scales.pop()),
                          unquantized=unquantized)
        shapes = {}
        for (part, name), key in packed.items():
            shape = part_shapes(self.cfg, part)[name]
            for suffix, part_name in (("_packed", "packed"), ("_scale", "scale"), ("_shape", None)):
                got, path = spec(key + suffix), files.get(weight_map.get(key + suffix))
                if got is None:
                    raise ValueError(f"{self.src}: {key}_packed without its {key}{suffix}; the checkpoint is incomplete")
                if part_name is None:
                    shapes.setdefault(path, []).append((key + suffix, shape))
                    continue
                want, dtype = stored_layout(fmt, name, shape)[f"{name}.{part_name}"]
                if got.shape != want or dtype_name(got.dtype) != dtype or shape[1] % fmt.group:
                    raise ValueError(f"{path}: {got.name} is {got.dtype} {list(got.shape)}, not the {dtype} "
                                     f"{list(want)} of a {list(shape)} weight in groups of {fmt.group}")
                self.index[(part, f"{name}.{part_name}")] = (path, fused_rows({}, got, key, {key: want}, path),
                                                             headers[weight_map[key + suffix]][1])
        for path, pairs in shapes.items():  # weight_shape: the unpacked shape, a few bytes each
            with safe_open(path, framework="pt") as f:
                for key, shape in pairs:
                    if f.get_tensor(key).tolist() != list(shape):
                        raise ValueError(f"{path}: {key} is {f.get_tensor(key).tolist()}, config.json implies {list(shape)}")
        return fmt

    def _unquantized(self, packed: dict, what: str) -> tuple[str, ...]:
        """The linear weights of the blocks a checkpoint ships in 16 bits (packed: the (part, name) it ships as
        `what`); a weight `what` in some layers and 16-bit in others, or outside a block's linear weights, refused."""
        if not packed:
            raise ValueError(f"{self.src}: config.json's quantization_config says {what}, but no weight is shipped so")
        kinds = {}
        for part in range(self.cfg.n_layers):
            for name, shape in part_shapes(self.cfg, part).items():
                if quantized(name, shape):
                    kinds.setdefault(name, set()).add((part, name) in packed)
        if mixed := sorted(n for n, k in kinds.items() if len(k) > 1):
            raise ValueError(f"{self.src}: {mixed[0]} is {what} in some layers and 16-bit in others; a store keeps "
                             f"one layout for every block")
        if bad := sorted(k for (part, name), k in packed.items() if isinstance(part, str) or name not in kinds):
            raise ValueError(f"{self.src}: {bad[0]} is {what}; phantom reads {what} only in a block's linear weights")
        return tuple(sorted(n for n, k in kinds.items() if k == {False}))

    def _shipped_mxfp4(self, packed: dict, fused: dict, weight_map: dict, headers: dict, files: dict) -> QuantFormat:
        """The store format of gpt-oss's MXFP4 experts (packed: (part, name) -> the fused experts' key), its index
        given each expert weight's rows of `*_blocks` and `*_scales` as NAME.blocks and NAME.scales: down_proj's
        an expert's contiguous rows, gate's and up's together as gate_up_proj's (its alternating rows, the format's
        gate_up: w13), all read in place. Attention, routers and the experts' biases stay bf16
        (modules_to_not_convert; gate's and up's as gate_up_proj_bias's rows, w13's)."""
        fmt = QuantFormat("mxfp4", unquantized=self._unquantized(packed, "MXFP4"),
                          gate_up=any(len(g) == 2 * self.cfg.n_experts for g in fused.values()))
        for (part, name), key in packed.items():
            group = next((g for g in fused.values() if name in g), None)
            shape = part_shapes(self.cfg, part)[name]
            for suffix, part_name in (("_blocks", "blocks"), ("_scales", "scales")):
                file = weight_map.get(key + suffix)
                got = headers[file][0].get(key + suffix) if file else None
                if got is None or group is None:
                    raise ValueError(f"{self.src}: {key}_blocks without its {key}{suffix}, or outside a mixture of "
                                     f"experts' fused tensors; phantom reads MXFP4 in gpt-oss's experts")
                want = stored_layout(fmt, name, shape)[f"{name}.{part_name}"][0]
                n = got.shape[0] if got.shape else 0
                parts = len(group) // max(n, 1)
                if got.dtype != torch.uint8 or parts * n != len(group) or got.shape != (n, parts * want[0], *want[1:]):
                    raise ValueError(f"{files[file]}: {got.name} is {got.dtype} {list(got.shape)}, not uint8 "
                                     f"[{len(group) // max(parts, 1)}, {parts * want[0]}, {', '.join(map(str, want[1:]))}]")
                e, p = divmod(group.index(name), parts)
                stored, p = gate_up_part(fmt, name) or (name, 0)
                size, rows = math.prod(got.shape[1:]), parts * want[0]  # an expert's whole gate_up rows where fused
                spec = RowSpec(got.name, got.dtype, (rows, *want[1:]), got.start + e * size, got.start + (e + 1) * size,
                               rows=(e * rows, (e + 1) * rows))
                if p == 0:
                    self.index[(part, f"{stored}.{part_name}")] = (files[file], spec, headers[file][1])
        gate_up_biases(self.index, fmt)
        return fmt

    def shapes(self, part: str | int) -> dict[str, tuple[int, ...]]:
        """The names and shapes `part` reads: a block's stored parts where the checkpoint ships FP8 or INT4."""
        return {n: s for n, (s, _) in self._parts(part).items()}

    def _parts(self, part: str | int) -> dict[str, tuple[tuple[int, ...], str | None]]:
        shapes = part_shapes(self.cfg, part)
        if self.quant is None or isinstance(part, str):
            return {n: (s, None) for n, s in shapes.items()}
        return block_layout(self.quant, shapes, dtype_name(self.dtype))

    def fused_experts(self, weight_map: dict[str, str]) -> bool:
        """Whether a mixture of experts is stored as transformers 5's 3-D tensors (else one per expert), as
        its first sparse layer holds them (dense layers among sparse ones have none)."""
        fused = family(self.cfg).moe.fused if family(self.cfg).moe else {}
        first = next((i for i in range(self.cfg.n_layers) if self.cfg.sparse(i)), 0)
        return any(key.format(first) in weight_map for key in fused)

    @staticmethod
    def _weight_map(src: Path) -> dict[str, str]:
        index = src / "model.safetensors.index.json"
        if index.is_file():
            try:
                wm = safejson.load(index)["weight_map"]
                assert isinstance(wm, dict)
                return wm
            except (KeyError, AssertionError, json.JSONDecodeError) as e:
                raise ValueError(f"{index}: not a safetensors index ({type(e).__name__}: {e})") from None
        single = src / "model.safetensors"
        if single.is_file():
            return {s.name: single.name for s in read_header(single)[0]}
        raise FileNotFoundError(f"{src}: config.json but no model.safetensors or model.safetensors.index.json "
                                f"(only safetensors checkpoints are read; save with safe_serialization=True)")

    def part(self, part: str | int, names=None) -> dict[str, torch.Tensor]:
        by_file: dict[Path, list[tuple[str, str]]] = {}
        for name in names if names is not None else self.shapes(part):
            path, spec, _ = self.index[(part, name)]
            by_file.setdefault(path, []).append((name, spec.name))
        out = {}
        for path, names in by_file.items():
            with safe_open(path, framework="pt") as f:  # opened per part: its mapping is dropped on close
                for name, key in names:
                    out[name] = read_rows(f, key, self.index[(part, name)][1])
                    if name.endswith(".scale_inv"):  # 16-bit scales widen exactly to the store's float32
                        out[name] = out[name].float()
        return out

    def located(self, part: str | int, dtype: torch.dtype) -> dict[str, tuple[Path, int, torch.dtype, tuple]]:
        """name -> (file, byte offset, dtype, shape) of a part's tensors usable in place: in dtype (FP8 parts in
        their stored dtype), not picked value by value or turned (an expert's part of gpt-oss's 16-bit experts; its
        biases and its MXFP4 rows are whole ranges)."""
        out = {}
        for name, (_, stored) in self._parts(part).items():
            path, spec, start = self.index[(part, name)]
            if (spec.pick is None or (spec.pick[2] == 1 and (spec.pick_rows or len(spec.shape) == 1))) and \
                    spec.dtype == (dtype if stored is None else parse_stored(stored)):
                out[name] = (path, start + spec.start, spec.dtype, spec.shape)
        return out


PART_SUFFIXES = (".fp8", ".scale_inv", ".packed", ".scale", ".blocks", ".scales")  # a shipped weight's stored parts


def float32_tensors(index: dict, dtype: torch.dtype) -> tuple[str, ...]:
    """The block tensors a shipped 16-bit checkpoint (index: HFCheckpoint.index) keeps in float32 in every block
    that has them (DeepSeek-V3's router correction bias), not a quantized weight's parts: a store keeps them so."""
    kinds = {}
    for (part, name), (_, spec, _) in index.items():
        if isinstance(part, int) and not name.endswith(PART_SUFFIXES):
            kinds.setdefault(name, set()).add(spec.dtype == torch.float32 and spec.pick is None)
    return tuple(sorted(n for n, k in kinds.items() if k == {True})) if dtype.itemsize == 2 else ()


def as_shipped(cfg: ModelConfig) -> ModelConfig:
    """A Hugging Face checkpoint's config with its q/k rows' RoPE layout as shipped: transformers rotates halves
    (rotate_half), so the store keeps the rows as they are (rope_interleave False, recorded in the manifest's
    config) and the attention rotates halves; no row is permuted, so --link reads q and k in place too. Latent
    attention reads its layout from config.json (rope_interleave) and keeps it."""
    return cfg if cfg.kv_lora_rank or "rope_interleave" in family(cfg).fixed else dataclasses.replace(
        cfg, rope_interleave=False)  # a family whose class rotates one layout (Llama 4's pairs) ships that one


def linked_shard(src: Path, file: str, root: Path) -> Path:
    """src/file resolved, where it may be a link that stays inside root (a hub cache repository)."""
    if os.path.isabs(file) or ".." in Path(file).parts or not (src / file).resolve().is_relative_to(root.resolve()):
        raise StoreError(f"{src}: shard path {file!r} leads outside {root}")
    return (src / file).resolve()


def open_checkpoint(src: Path | str, root: Path | None = None) -> MetaCheckpoint | HFCheckpoint:
    """Detect the checkpoint format of a folder and open it (nothing is read beyond headers); root:
    see HFCheckpoint."""
    src = Path(src)
    if not src.is_dir():
        raise FileNotFoundError(f"{src}: no such checkpoint folder")
    if (src / "params.json").is_file() or any(src.glob("consolidated.*.pth")):
        return MetaCheckpoint(src)
    if (src / "config.json").is_file() or any(src.glob("*.safetensors")):
        return HFCheckpoint(src, root)
    raise ValueError(f"{src}: unknown checkpoint format (expected Meta's params.json + consolidated.NN.pth or "
                     f"Hugging Face's config.json + *.safetensors)")
