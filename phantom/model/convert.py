"""Checkpoints into block stores: Meta and Hugging Face readers, synthetic weights, the tiny model.

Every writer streams one block at a time into a `StoreWriter`, so peak memory is about one block.
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import math
import mmap
import os
import shutil
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from phantom.base import provenance, safejson
from phantom.data.chat import TINY_CHAT_TEMPLATE
from phantom.arch.config import (ModelConfig, block_tensor_shapes, embed_tensor_shapes, from_meta_params,
                            head_tensor_shapes, preset, rope_rows)
from phantom.arch.family import LLAMA_KEYS, family, from_hf_config
from phantom.arch.layers import permute_from_hf
from phantom.files.fusedrows import fused_rows, read_rows
from phantom.arch.quantformat import QuantFormat
from phantom.files.store import BlockStore, StoreError, StoreWriter, block_file, safe_join
from phantom.files.tensorfile import read_header
from phantom.data.tokenizer import train_tiny_tokenizer

log = logging.getLogger(__name__)

# Meta's model-parallel split: the dims along which consolidated.NN.pth shards cut each tensor.
# Column-parallel weights split their output rows (0), row-parallel ones their input columns (1);
# norms are replicated (()). Llama-2 cuts the embedding along dim 1, Llama-3 along 0: the shapes tell.
META_SPLIT_DIMS = {
    "tok_embeddings.weight": (1, 0), "output.weight": (0,), "norm.weight": (),
    "attention.wq.weight": (0,), "attention.wk.weight": (0,), "attention.wv.weight": (0,),
    "attention.wo.weight": (1,), "feed_forward.w1.weight": (0,), "feed_forward.w2.weight": (1,),
    "feed_forward.w3.weight": (0,), "attention_norm.weight": (), "ffn_norm.weight": (),
}

# Llama's Hugging Face name -> store name ({} is the layer index); every family's is in phantom.arch.family.
HF_KEYS = LLAMA_KEYS
HF_NAMES = {("{}" in hf, name): hf for hf, name in HF_KEYS.items()}  # (in a block?, store name) -> HF name
HF_PERMUTED = {"attention.wq.weight": "n_heads", "attention.wk.weight": "kv_heads"}  # rows in HF's RoPE layout

PARTS = ("embed", "head")  # besides the blocks 0..n_layers-1

# The tokenizer's files in a Hugging Face folder. The store keeps every one it finds (checksummed in the
# manifest's "tokenizer_files"), so an export hands the ecosystem the files the model came with.
TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "chat_template.jinja", "chat_template.json")


def tokenizer_sources(src: Path, root: Path | None = None) -> list[Path]:
    """The TOKENIZER_FILES a Hugging Face folder holds, each inside src or, through a link, inside root (a
    hub cache repository, whose snapshots link to its blobs).

    Raises:
        StoreError: one of them is a link that leads outside (it would copy that file into the store).
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
    return block_tensor_shapes(cfg)


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
            self.cfg = from_hf_config(config)
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
        # (part, store name) -> (path, TensorSpec, data start); a part of a fused tensor has a spec of its rows
        self.src, self.index = src, {}
        hf_names, fused = family(self.cfg).layout(self.cfg, fused_experts=self._fused_experts(weight_map))
        self.permuted = rope_rows(self.cfg)
        for part in (*PARTS, *range(self.cfg.n_layers)):
            shapes = part_shapes(self.cfg, part)
            for name, shape in shapes.items():
                key = hf_names[(isinstance(part, int), name)].format(part)
                if key not in weight_map:
                    raise ValueError(f"{src}: tensor {key} is in no shard; the checkpoint is incomplete")
                specs, start = headers[weight_map[key]]
                spec, path = specs.get(key), files[weight_map[key]]
                if spec is None:
                    raise ValueError(f"{path}: tensor {key} missing (the index says it is here)")
                self.index[(part, name)] = (path, fused_rows(fused, spec, name, shapes, path), start)
        self.dtype = self.index[("embed", "tok_embeddings.weight")][1].dtype
        self.tokenizer_files = tokenizer_sources(src, root)
        self.tokenizer = next((p for p in self.tokenizer_files if p.name in ("tokenizer.model", "tokenizer.json")), None)

    def _fused_experts(self, weight_map: dict[str, str]) -> bool:
        """Whether a mixture of experts is stored as transformers 5's 3-D tensors (else one per expert)."""
        fused = family(self.cfg).moe.fused if family(self.cfg).moe else {}
        return any(key.format(0) in weight_map for key in fused)

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
        for name in names if names is not None else part_shapes(self.cfg, part):
            path, spec, _ = self.index[(part, name)]
            by_file.setdefault(path, []).append((name, spec.name))
        out = {}
        for path, names in by_file.items():
            with safe_open(path, framework="pt") as f:  # opened per part: its mapping is dropped on close
                for name, key in names:
                    out[name] = read_rows(f, key, self.index[(part, name)][1])
        for name, heads in self.permuted.items():
            if name in out:
                out[name] = permute_from_hf(out[name], heads, self.cfg.rope_dim)
        return out

    def located(self, part: str | int, dtype: torch.dtype) -> dict[str, tuple[Path, int, torch.dtype, tuple]]:
        """name -> (file, byte offset, dtype, shape) of a part's tensors usable in place: in dtype, not permuted."""
        out = {}
        for name in part_shapes(self.cfg, part):
            path, spec, start = self.index[(part, name)]
            if name not in self.permuted and spec.dtype == dtype:
                out[name] = (path, start + spec.start, spec.dtype, spec.shape)
        return out


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


def disk_usage(path: Path) -> int:
    """Bytes a folder takes on disk (allocated blocks; linked source files are not in it)."""
    return sum(p.lstat().st_blocks * 512 for p in Path(path).rglob("*") if p.is_file() and not p.is_symlink())


def part_file(part: str | int) -> str:
    return {"embed": "embed.safetensors", "head": "head.safetensors"}.get(part) or block_file(part)


def _write_part(w: StoreWriter, ckpt, part: str | int, link: bool) -> int:
    """Write (or link) one part; returns the bytes linked rather than copied."""
    if not link:
        tensors = ckpt.part(part)
        if part == "embed":
            w.write_embed(tensors)
        elif part == "head":
            w.write_head(tensors)
        else:
            w.write_block(part, tensors)
        return 0
    located = ckpt.located(part, w.dtype)
    copied = ckpt.part(part, [n for n in part_shapes(ckpt.cfg, part) if n not in located])
    w.link_file(part_file(part), part_shapes(ckpt.cfg, part), located, copied)
    return sum(dtype.itemsize * math.prod(shape) for _, _, dtype, shape in located.values())


def convert_checkpoint(src: Path | str, out: Path | str, dtype: torch.dtype | None = None, link: bool = False,
                       overwrite: bool = False, progress: bool = True, quant: QuantFormat | None = None,
                       root: Path | None = None) -> dict:
    """Convert a Meta or Hugging Face checkpoint folder into a block store, one block at a time.

    Args:
        src: the checkpoint folder.
        out: the store folder to create (written to a temporary folder, renamed when complete).
        dtype: the store's dtype (default: the checkpoint's).
        link: Hugging Face safetensors only: the store points at the tensors inside the checkpoint's
            files instead of copying them (they must stay, unchanged; the store checks their size and
            header when opened and their checksum when read: the manifest records a sha256 and a crc32
            record of every file, copied or linked; see store.Checksums). Tensors that need converting
            (q/k rows are permuted; another dtype) are still copied. Meta shards must be merged: always
            copied.
        overwrite: replace the phantom store at out (a folder that is not one is refused).
        progress: a tqdm bar over the blocks.
        quant: store every block's linear weights quantized (phantom.arch.quant; the rest in dtype, bf16
            unless the checkpoint is 16-bit).
        root: Hugging Face folders whose shards are links (the hub cache): the folder they may lead into.
            The manifest's origin (phantom.base.provenance) is the hub id and commit when src is a snapshot
            under a hub cache root (models--OWNER--NAME), else src's folder.

    Returns:
        {"out", "format", "config", "dtype", "disk_bytes", "linked_bytes"}.

    Raises:
        FileNotFoundError: a missing file. ValueError (StoreError): a corrupt or unsupported checkpoint.
    """
    ckpt = open_checkpoint(src, root)
    if quant is not None and link:
        raise ValueError("--link and --quantize: a quantized store holds its own (quantized) copy; drop one")
    dtype = dtype or (ckpt.dtype if quant is None or ckpt.dtype.itemsize == 2 else torch.bfloat16)
    if link and ckpt.format == "hf" and dtype != ckpt.dtype:
        raise ValueError(f"{src}: --link reads the tensors as they are, in {ckpt.dtype}; drop --dtype or drop --link")
    cfg, linked = ckpt.cfg, 0
    with StoreWriter(out, cfg, dtype, overwrite=overwrite, quant=quant) as w:
        for part in tqdm(["embed", *range(cfg.n_layers), "head"], desc="converting", unit="part",
                         disable=not progress or None):
            linked += _write_part(w, ckpt, part, link and ckpt.format == "hf")
        if ckpt.tokenizer is not None:
            w.add_tokenizer(ckpt.tokenizer)
        path = w.finish({"source": ckpt.format, "origin": provenance.of_checkpoint(src, ckpt.format, root),
                         "tokenizer_files": keep_tokenizer_files(w, ckpt.tokenizer_files)})
    return {"out": path, "format": ckpt.format, "config": cfg, "dtype": dtype, "disk_bytes": disk_usage(path),
            "linked_bytes": linked}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def keep_tokenizer_files(w: StoreWriter, files: list[Path]) -> dict[str, dict]:
    """Copy the tokenizer's files into the store being written; {name: {"size", "sha256"}} for its manifest."""
    kept = {}
    for src in files:
        dst = w.tmp / src.name
        if not dst.exists():  # the main tokenizer file is already there (add_tokenizer)
            dst.write_bytes(src.read_bytes())
            with open(dst, "rb") as f:
                os.fsync(f.fileno())
        kept[src.name] = {"size": dst.stat().st_size, "sha256": _sha256(dst)}
    return kept


def tokenizer_files(store: BlockStore) -> dict[str, Path]:
    """{name: path} of the store's tokenizer files, each checked against the manifest's size and sha256.

    Stores written before the manifest listed them give their one tokenizer file, unchecked.

    Raises:
        StoreError: a listed file that is missing, changed, or not a tokenizer file name (no escaping the folder).
    """
    listed = store.manifest.get("tokenizer_files")
    if listed is None:
        return {store.tokenizer_path.name: store.tokenizer_path} if store.tokenizer_path else {}
    out = {}
    for name, info in listed.items():
        if name not in TOKENIZER_FILES:
            raise StoreError(f"{store.path}: manifest lists {name!r} as a tokenizer file; expected one of "
                             f"{', '.join(TOKENIZER_FILES)}")
        path = safe_join(store.path, name)
        if not path.is_file() or path.stat().st_size != info.get("size") or _sha256(path) != info.get("sha256"):
            raise StoreError(f"{path}: missing or changed since the store was written (checksum differs); "
                             f"prepare the store again")
        out[name] = path
    return out


def _random_tensors(shapes: dict[str, tuple[int, ...]], gen: torch.Generator, std,
                    dtype: torch.dtype, offset: float = 0.0) -> dict[str, torch.Tensor]:
    """Norm weights 1 (0 where the norm scales by 1 + w: the same identity), biases 0, matrices N(0, std^2);
    std is a number or a function of the shape."""
    out = {}
    for name, shape in shapes.items():
        if name.endswith(".bias") or (len(shape) == 1 and offset):
            out[name] = torch.zeros(shape, dtype=dtype)
        elif len(shape) == 1:  # norm weights
            out[name] = torch.ones(shape, dtype=dtype)
        else:
            out[name] = (torch.randn(shape, generator=gen) * (std(shape) if callable(std) else std)).to(dtype)
    return out


SYNTHETIC_INITS = ("normal", "fan_in")


def write_synthetic(out: Path, cfg: ModelConfig, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                    tokenizer: Path | None = None, overwrite: bool = False, progress: bool = True,
                    init: str = "normal", extra: dict | None = None, tokenizer_extra: tuple[Path, ...] = (),
                    quant: QuantFormat | None = None) -> Path:
    """A store of random weights with cfg's exact shapes, written block by block (never the whole model).

    init "normal": every matrix N(0, 0.02) as in GPT-2/Llama init; "fan_in": the block and head
    matrices N(0, 1/in_features) (nn.Linear's scale; at dim 128 that is 0.088, so attention scores
    and logits are not all near zero), the embedding N(0, 0.02). Either way the residual projections
    (wo, w2) are scaled by 1/sqrt(2 * n_layers); the same seed and init give the same store. extra:
    more manifest fields; tokenizer_extra: more tokenizer files to keep (TOKENIZER_FILES names);
    quant: the blocks' linear weights quantized from those values.
    """
    if init not in SYNTHETIC_INITS:
        raise ValueError(f"unknown init {init!r}; choose from {', '.join(SYNTHETIC_INITS)}")
    std = 0.02 if init == "normal" else (lambda shape: shape[1] ** -0.5)
    resid_std = 0.02 / (2 * cfg.n_layers) ** 0.5
    with StoreWriter(out, cfg, dtype, overwrite=overwrite, quant=quant) as w:
        gen = torch.Generator().manual_seed(seed)
        w.write_embed(_random_tensors(embed_tensor_shapes(cfg), gen, 0.02, dtype))
        for i in tqdm(range(cfg.n_layers), desc="writing blocks", unit="block", disable=not progress or None):
            gen = torch.Generator().manual_seed(seed * 1000003 + i + 1)
            block = _random_tensors(block_tensor_shapes(cfg), gen, std, dtype, cfg.norm_offset)
            for name in [n for n in block if n == "attention.wo.weight" or n.endswith(".w2.weight")]:  # experts' too
                block[name] = (block[name].float() * (resid_std / 0.02)).to(dtype)
            w.write_block(i, block)
        gen = torch.Generator().manual_seed(seed * 1000003)
        w.write_head(_random_tensors(head_tensor_shapes(cfg), gen, std, dtype, cfg.norm_offset))
        if tokenizer is not None:
            w.add_tokenizer(tokenizer)
        kept = keep_tokenizer_files(w, ([w.tmp / w.tokenizer] if tokenizer is not None else []) + list(tokenizer_extra))
        return w.finish({"source": "synthetic", "origin": provenance.SYNTHETIC, "seed": seed,
                         **({"init": init} if init != "normal" else {}), "tokenizer_files": kept, **(extra or {})})


TINY_RECIPE = 3  # in the tiny store's manifest; a weights/tiny made by another recipe is made again


def ensure_tiny(out: Path) -> Path:
    """The embedded `tiny` model: a tokenizer trained on the shipped text and random weights.

    Generated deterministically on first use, so a fresh checkout trains with no download. Recipe 2
    (the README's first command must visibly learn): 64 tokenizer pieces (the text's 48
    characters and its commonest pairs), so held-out text shares most of its statistics with the
    5 KB of training text (with 512 word-sized pieces it does not, and no model gets far below the
    uniform loss); fan_in weights, so a frozen random head can express the text's distributions
    (N(0, 0.02) caps its logits near 2.6). Recipe 3 adds the model's chat template (chat_template.jinja,
    phantom.data.chat.TINY_CHAT_TEMPLATE). A store made by an older recipe is made again.
    """
    out = Path(out)
    manifest = out / "manifest.json"
    if manifest.is_file():
        try:
            recipe = safejson.load(manifest)
        except (OSError, ValueError):
            return out  # damaged: opening the store says how
        if isinstance(recipe, dict) and recipe.get("tiny_recipe") == TINY_RECIPE:
            return out
        log.info("making the tiny model in %s again (it was made by an older recipe)", out)
    else:
        log.info("generating the tiny model in %s", out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tok = out.parent / f".{out.name}.tokenizer.model"
    template = out.parent / f".{out.name}.chat" / "chat_template.jinja"
    cfg = preset("tiny")
    for stale in (tok, template.parent):  # a killed run's leftovers; a link planted there goes, never followed
        stale.unlink() if stale.is_symlink() or stale.is_file() else shutil.rmtree(stale, ignore_errors=True)
    try:
        train_tiny_tokenizer(tok, vocab_size=cfg.vocab_size)
        template.parent.mkdir(exist_ok=True)
        template.write_text(TINY_CHAT_TEMPLATE)
        return write_synthetic(out, cfg, torch.float32, seed=0, tokenizer=tok, progress=False, init="fan_in",
                               overwrite=manifest.is_file(), extra={"tiny_recipe": TINY_RECIPE},
                               tokenizer_extra=(template,))
    finally:
        tok.unlink(missing_ok=True)
        shutil.rmtree(template.parent, ignore_errors=True)


def quantize_store(src: Path | str, out: Path | str, quant: QuantFormat, dtype: torch.dtype | None = None,
                   overwrite: bool = False, progress: bool = True) -> dict:
    """A quantized copy of a store, one block at a time (its weights read and checked as any read).
    Embedding, head and norms are kept in dtype (default: the store's if 16-bit, else bf16); the
    linear weights are quantized from their values in dtype.

    Returns:
        {"out", "format", "config", "dtype", "disk_bytes", "linked_bytes"}, as convert_checkpoint.
    """
    store = BlockStore(src)
    if store.quant is not None:
        raise ValueError(f"{src}: already quantized ({store.quant.method}); quantize the 16-bit store it came from")
    dtype = dtype or (store.dtype if store.dtype.itemsize == 2 else torch.bfloat16)
    keep = {k: v for k, v in store.manifest.items() if k in ("source", "origin", "seed", "init")}
    with StoreWriter(out, store.cfg, dtype, overwrite=overwrite, quant=quant) as w:
        w.write_embed(store.load_embed())
        for i in tqdm(range(store.n_blocks), desc="quantizing", unit="block", disable=not progress or None):
            w.write_block(i, store.load_block(i))
        w.write_head(store.load_head())
        if store.tokenizer_path is not None:
            w.add_tokenizer(store.tokenizer_path)
        files = list(tokenizer_files(store).values())
        path = w.finish({**keep, "quantized_from": str(Path(src).resolve()),
                         "tokenizer_files": keep_tokenizer_files(w, files)})
    return {"out": path, "format": f"store {src}", "config": store.cfg, "dtype": dtype,
            "disk_bytes": disk_usage(path), "linked_bytes": 0}
