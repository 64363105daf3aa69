"""A vision-language checkpoint (Llama 4, Kimi-K2.5, Qwen3.5) kept whole through a store and written back whole.

phantom trains the text model; what the family's text mapping leaves out of it (the vision tower, its projector,
whatever else ships beside the text: Qwen3.5's prediction layers) is kept in the store as shipped, in one file
(vision.safetensors: copied byte for byte, or linked in place with --link, checksummed as any store file), and
the manifest's "vision_language" record keeps what an export needs to write the checkpoint back: config.json as
shipped, the (text model's, checkpoint's) name prefixes, the experts' layout, each kept tensor's dtype and shape.
A run never opens the file; only the HF export reads it: the merged text model under the checkpoint's names, the
kept tensors as they are, config.json as shipped with its dtype the export's (and a 16-bit export's
quantization_config dropped). A store without the record exports the text model, as stores made before it.
"""
from __future__ import annotations

import copy
import logging
import math
from pathlib import Path

import torch

from phantom.arch.family import family
from phantom.base import safejson
from phantom.files.hfshards import ShardWriter
from phantom.files.store import BlockStore
from phantom.files.storewriter import StoreWriter
from phantom.files.tensorfile import StoreError, dtype_name, parse_stored

RECORD, FILE = "vision_language", "vision.safetensors"

log = logging.getLogger(__name__)


# -- converting: what the text model leaves out, kept ---------------------------------------------

def prefix_pair(ours: str, theirs: str) -> tuple[str, str]:
    """The prefixes before the dotted parts two names end in alike: ("model.", "model.language_model.") for
    model.norm.weight and model.language_model.norm.weight."""
    a, b, n = ours.split("."), theirs.split("."), 0
    while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
        n += 1
    return "".join(p + "." for p in a[:len(a) - n]), "".join(p + "." for p in b[:len(b) - n])


def renamed(name: str, prefixes) -> str:
    """A text model's tensor name as the checkpoint names it (prefixes: (text model's, checkpoint's), the longest
    text prefix first)."""
    for ours, theirs in prefixes:
        if name.startswith(ours):
            return theirs + name[len(ours):]
    return name


def text_prefixes(names: dict[str, str], src: Path) -> list[list[str]]:
    """The (text model's, checkpoint's) name prefixes, longest first, that turn every text name of the family's
    mapping (names: text name -> checkpoint name) into the checkpoint's: a few pairs, not one per tensor.

    Raises:
        ValueError: a mapping no fixed prefixes give (a text model's name turned otherwise).
    """
    pairs = sorted({prefix_pair(ours, theirs) for ours, theirs in names.items()}, key=lambda p: (-len(p[0]), p))
    if len({ours for ours, _ in pairs}) != len(pairs) or any(renamed(o, pairs) != t for o, t in names.items()):
        raise ValueError(f"{src}: the text model's tensors are not under fixed prefixes of the checkpoint's names; "
                         f"phantom keeps a vision-language checkpoint whose text model's names are")
    return [list(p) for p in pairs]


def kept_tensors(ckpt) -> dict[str, tuple]:
    """name -> (shard, byte offset, dtype, shape) of the tensors of a Hugging Face checkpoint (HFCheckpoint) that
    its text mapping leaves out."""
    weight_map, headers, files = ckpt.shipped
    text, out = set(ckpt.names.values()), {}
    for key, file in weight_map.items():
        if key in text:
            continue
        specs, start = headers[file]
        if (spec := specs.get(key)) is None:
            raise ValueError(f"{files[file]}: tensor {key} missing (the index says it is here)")
        out[key] = (files[file], start + spec.start, spec.dtype, spec.shape)
    return out


def keep(w: StoreWriter, ckpt, link: bool) -> dict | None:
    """Keep what a vision-language checkpoint's text model leaves out: its tensors in FILE of the store being
    written (copied, or with link linked in place), and the manifest's record, returned. None (nothing kept) for
    any other checkpoint."""
    config = safejson.load(ckpt.src / "config.json", what="config.json") if ckpt.format == "hf" else {}
    if family(ckpt.cfg).text is None or not isinstance(config.get("text_config"), dict):
        return None
    kept = kept_tensors(ckpt)
    if kept:
        w.keep_file(FILE, kept, link)
        size = sum(v[2].itemsize * math.prod(v[3]) for v in kept.values())
        log.info("%s: %d tensors beside the text model (%s, ...) kept as shipped in %s (%.1f MB, %s) for the "
                 "export", ckpt.src, len(kept), next(iter(kept)), FILE, size / 1e6, "linked" if link else "copied")
    return {"config": config, "prefixes": text_prefixes(ckpt.names, ckpt.src),
            "fused_experts": ckpt.fused_experts(ckpt.names),
            "tensors": {k: [dtype_name(v[2]), list(v[3])] for k, v in kept.items()}}


def carry(w: StoreWriter, store: BlockStore) -> dict | None:
    """A new store made from another (a quantized copy: phantom.convert.quantstore) keeps its vision-language
    record and its kept tensors, read (checked) and written as they are; the record returned (None: none)."""
    if (rec := record(store)) is not None and rec["tensors"]:
        w.write_kept(FILE, load_kept(store))
    return rec


# -- exporting: the checkpoint written back -----------------------------------------------------------

def record(store: BlockStore) -> dict | None:
    """The store's vision-language record (None: a text model's store, or one made before it was kept)."""
    return store.manifest.get(RECORD)


def fused_experts(store: BlockStore) -> bool:
    """Whether the checkpoint ships its experts as transformers 5's 3-D tensors: the export writes them so."""
    return bool((record(store) or {}).get("fused_experts"))


def kept_specs(rec: dict) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    return {name: (parse_stored(dtype), tuple(shape)) for name, (dtype, shape) in rec["tensors"].items()}


def load_kept(store: BlockStore) -> dict[str, torch.Tensor]:
    """The kept tensors of a store with a vision-language record, read whole and checked."""
    kept = kept_specs(record(store))
    return store.load_kept(FILE, {k: s for k, (_, s) in kept.items()}, {k: d for k, (d, _) in kept.items()})


class CheckpointWriter(ShardWriter):
    """The shards of a vision-language checkpoint: the text model's tensors, given under the text model's names,
    written under the checkpoint's; the kept ones read from the store (checked) and written as they are, byte for
    byte, by finish()."""

    def __init__(self, folder: Path, store: BlockStore, specs: list[tuple], max_bytes: int):
        self.store, self.prefixes = store, [tuple(p) for p in record(store)["prefixes"]]
        self.kept = kept_specs(record(store))
        text = [(renamed(name, self.prefixes), dtype, shape) for name, dtype, shape in specs]
        names = [name for name, _, _ in text]
        if (clash := sorted(set(names) & set(self.kept))) or len(set(names)) != len(names):
            raise StoreError(f"{store.path}: the text model's tensors, named as the checkpoint names them, clash "
                             f"({clash[:1] or 'two alike'}); the store's vision-language record is not this model's")
        super().__init__(folder, text + [(name, *spec) for name, spec in self.kept.items()], max_bytes)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        super().write(renamed(name, self.prefixes), tensor)

    def finish(self) -> list[str]:
        if self.kept:
            tensors = load_kept(self.store)
            for name in list(tensors):
                ShardWriter.write(self, name, tensors.pop(name))
        return super().finish()


def shard_writer(folder: Path, store: BlockStore, specs: list[tuple], max_bytes: int) -> ShardWriter:
    """The HF export's shard writer (specs: the text model's (name, dtype, shape)): the vision-language
    checkpoint's where the store keeps one, else the text model's."""
    if record(store) is None:
        return ShardWriter(folder, specs, max_bytes)
    return CheckpointWriter(folder, store, specs, max_bytes)


def checkpoint_config(store: BlockStore, text_config: dict, dtype: torch.dtype, quantized: bool) -> dict:
    """config.json of the HF export: text_config (the text model's) for a store without a vision-language record,
    else the checkpoint's as shipped, its dtype (outer and text_config's) the export's, and its quantization_config
    dropped unless the export writes the shipped format again (quantized)."""
    rec = record(store)
    if rec is None:
        return text_config
    config = copy.deepcopy(rec["config"])
    for part in (config, config["text_config"]):
        part.update({key: dtype_name(dtype) for key in ("dtype", "torch_dtype") if key in part})
        if not quantized:
            part.pop("quantization_config", None)
    return config


def check_export(store: BlockStore, fmt: str, requantize: bool) -> None:
    """Refuse a 16-bit HF export of a store whose kept tensors ship quantized: it would drop the
    quantization_config they are read by. The GGUF export is the text model: said in one line."""
    rec = record(store)
    if rec is None:
        return
    if fmt == "gguf":
        log.info("%s: the GGUF file holds the text model; the vision tower stays in the store (llama.cpp's mmproj "
                 "file is not written)", store.path)
    quantized = sorted(name for name, (dtype, _) in kept_specs(rec).items()
                       if not dtype.is_floating_point or dtype.itemsize == 1)
    if fmt == "hf" and not requantize and quantized and "quantization_config" in rec["config"]:
        raise ValueError(f"{store.path}: {quantized[0]}, kept beside the text model as shipped, is quantized; a "
                         f"16-bit export drops the quantization_config it is read by: add --requantize")
