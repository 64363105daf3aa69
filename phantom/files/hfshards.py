"""Hugging Face's sharded safetensors layout, as transformers' save_pretrained writes it, streamed.

save_pretrained (transformers 5) takes a model's tensors in natural name order (its dot_natural_key:
numbers by value, so lm_head.weight, model.embed_tokens.weight, model.layers.0..., model.layers.10...
after 9, model.norm.weight) and splits them by size as huggingface_hub's
split_torch_state_dict_into_shards does: a tensor that would tip the current shard over
max_shard_size starts the next one; one bigger than the limit gets a shard of its own, numbered
where it came. One shard is model.safetensors with no index; several are
model-0000k-of-0000n.safetensors beside model.safetensors.index.json ({"metadata":
{"total_parameters", "total_size"}, "weight_map"}, keys sorted). (A model built from a config in
memory, never loaded, keeps its modules' order instead; a loaded one is what people save.)

Every tensor's name, shape and dtype is known before any is computed, so the plan and each shard's
header are made first and each tensor is written at its offset as it comes, in whatever order the
model's parts are read: memory holds what the caller holds (one block), never a shard.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from phantom.files.tensorfile import DTYPE_CODES

DEFAULT_MAX_SHARD_SIZE = "50GB"  # transformers 5's save_pretrained default
UNITS = {"TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3}  # huggingface_hub's parse_size_to_int
WEIGHTS, INDEX = "model.safetensors", "model.safetensors.index.json"


def parse_size(size: str | int) -> int:
    """Bytes of a size as save_pretrained takes it: an int, or digits and a unit (TB, GB, MB, KB: powers of 10).

    Raises:
        ValueError: anything else, or a size below one byte.
    """
    if isinstance(size, int):
        n = size
    else:
        text = str(size).strip()
        try:
            n = int(float(text[:-2]) * UNITS[text[-2:].upper()]) if text[-2:].upper() in UNITS else int(text)
        except ValueError:
            raise ValueError(f"--max-shard-size must be a number of bytes or a size like 5GB or 500MB "
                             f"(units TB, GB, MB, KB), not {size!r}") from None
    if n < 1:
        raise ValueError(f"--max-shard-size must be at least one byte, got {size!r}")
    return n


def natural_key(name: str) -> list[tuple]:
    """transformers' dot_natural_key: dotted parts, numbers by value before words, a word's trailing
    digits by value (shard_2 before shard_11)."""
    parts = []
    for part in name.split("."):
        if part.isdigit():
            parts.append((0, int(part)))
        else:
            word = part.rstrip("0123456789")
            parts.append((1, word, int(part[len(word):])) if part != word else (1, word))
    return parts


def plan(sizes: list[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """The shards' tensor names: huggingface_hub's greedy split of (name, bytes) in state-dict order."""
    shards, current, used = [], [], 0
    for name, n in sizes:
        if n > max_bytes:
            shards.append([name])
            continue
        if used + n > max_bytes:
            shards.append(current)
            current, used = [], 0
        current.append(name)
        used += n
    return shards + [current] if current else shards


class ShardWriter:
    """The planned shards of a model's tensors in a folder: each file is created with its header (every
    offset known) at its first tensor; each tensor is written at its offset whenever it comes."""

    def __init__(self, folder: Path, specs: list[tuple[str, torch.dtype, tuple[int, ...]]], max_bytes: int):
        self.folder = Path(folder)
        ordered = sorted(specs, key=lambda spec: natural_key(spec[0]))
        self.specs = {name: (dtype, tuple(shape)) for name, dtype, shape in ordered}
        sizes = [(name, nbytes(*spec)) for name, spec in self.specs.items()]
        self.shards = plan(sizes, max_bytes)
        n = len(self.shards)
        self.files = [WEIGHTS] if n == 1 else [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
        self.shard_of = {name: k for k, names in enumerate(self.shards) for name in names}
        self.headers = [self.header(k) for k in range(n)]
        self.offset = {}  # name -> where its bytes start in its file
        for k, names in enumerate(self.shards):
            at = len(self.headers[k])
            for name in names:
                self.offset[name], at = at, at + nbytes(*self.specs[name])
        self.left = [len(names) for names in self.shards]
        self.total_size = sum(size for _, size in sizes)
        self.total_parameters = sum(math.prod(shape) for _, shape in self.specs.values())
        self.written, self.open = set(), {}

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if name not in self.specs or name in self.written or (tensor.dtype, tuple(tensor.shape)) != self.specs[name]:
            raise RuntimeError(f"shard writer: {name} {tensor.dtype} {tuple(tensor.shape)} is not a planned tensor "
                               f"still to write ({self.specs.get(name)})")
        k = self.shard_of[name]
        if k not in self.open:
            self.open[k] = open(self.folder / self.files[k], "xb")  # created here, never through a link
            self.open[k].write(self.headers[k])
        f = self.open[k]
        f.seek(self.offset[name])
        f.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        self.written.add(name)
        self.left[k] -= 1
        if not self.left[k]:
            f.flush()
            os.fsync(f.fileno())
            f.close()
            del self.open[k]

    def header(self, k: int) -> bytes:
        entries, offset = {}, 0
        for name in self.shards[k]:
            dtype, shape = self.specs[name]
            n = nbytes(dtype, shape)
            entries[name] = {"dtype": DTYPE_CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
            offset += n
        text = json.dumps({"__metadata__": {"format": "pt"}, **entries}, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        return len(text).to_bytes(8, "little") + text

    def finish(self) -> list[str]:
        """Check every tensor came; write the index where there are several shards. Returns the file names."""
        if missing := [name for name in self.specs if name not in self.written]:
            raise RuntimeError(f"shard writer: {len(missing)} planned tensors never came, the first {missing[0]}")
        if len(self.files) > 1:
            index = {"metadata": {"total_parameters": self.total_parameters, "total_size": self.total_size},
                     "weight_map": {name: self.files[k] for name, k in self.shard_of.items()}}
            (self.folder / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        return self.files


def nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()
