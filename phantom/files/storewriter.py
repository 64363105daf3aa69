"""Writing a new block store: one safetensors file per transformer block, plus embed, head and a
manifest, into a temporary sibling folder renamed into place once complete (every file fsynced), so a
crash or a failed conversion leaves no half-written store. Its blocks may be quantized on the way in,
or linked from a checkpoint's files (phantom.files.storelinks) instead of copied.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from phantom.arch import quant
from phantom.arch.config import ModelConfig, block_tensor_shapes, embed_tensor_shapes, head_tensor_shapes
from phantom.arch.moe import expert_ranges
from phantom.arch.ops import permute_for_hf, rope_rows
from phantom.arch.quantformat import QuantFormat, block_layout
from phantom.base import fileio
from phantom.base.fileio import atomic_write_json
from phantom.files import runfolder, storelinks
from phantom.files.storeformat import FORMAT, MANIFEST, VERSION, block_file, expert_record, quant_record
from phantom.files.tensorfile import dtype_name, parse_stored, read_header, write_copied, write_safetensors


class StoreWriter:
    """Writes a store into a temporary sibling folder; `finish()` renames it into place.

    Used as a context manager: an exception inside the `with` removes the temporary folder, so a
    failed conversion leaves nothing behind.
    """

    def __init__(self, out: Path, cfg: ModelConfig, dtype: torch.dtype, overwrite: bool = False,
                 quant: QuantFormat | None = None):
        self.out, self.cfg, self.dtype, self.overwrite, self.quant = Path(out), cfg, dtype, overwrite, quant
        if quant is not None and dtype.itemsize != 2:
            raise ValueError(f"a quantized store keeps norms, embedding and head in 16 bits: use --dtype bf16 or fp16, "
                             f"not {dtype_name(dtype)}")
        if self.out.exists() and not overwrite:
            raise FileExistsError(f"{self.out} already exists; remove it or choose another --out")
        runfolder.check_replaceable(self.out, "store")  # overwrite: only a store phantom wrote goes
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = fileio.temp_folder(self.out)
        (self.tmp / "blocks").mkdir()
        self.files: dict[str, dict] = {}
        self.tokenizer: str | None = None
        self.links: dict[str, dict] = {"sources": {}, "files": {}}  # see link_file

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
        return False

    def _stored(self, rel: str, expected: dict[str, tuple[int, ...]]) -> dict[str, tuple[tuple[int, ...], str]]:
        """rel's tensors as given to the writer (name -> shape, dtype): a shipped format's blocks come as
        their stored parts (a checkpoint's FP8 bytes), every other file as dense tensors."""
        if self.quant is not None and self.quant.shipped and rel.startswith("blocks/"):
            return block_layout(self.quant, expected, dtype_name(self.dtype))
        return {n: (s, dtype_name(self.dtype)) for n, s in expected.items()}

    def _write(self, rel: str, tensors: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]]):
        stored = self._stored(rel, expected)
        got = {k: tuple(v.shape) for k, v in tensors.items()}
        if got != expected and got != {n: s for n, (s, _) in stored.items()}:
            raise ValueError(f"{rel}: tensors {got} do not match the config's {expected}")
        if got != expected:  # a shipped format's parts (a checkpoint's FP8 bytes), kept as they are
            tensors = {k: v.to(parse_stored(stored[k][1])) for k, v in tensors.items()}
        elif self.quant is not None and rel.startswith("blocks/"):
            if self.quant.shipped:  # stored as a checkpoint ships them: q/k rows in Hugging Face's order
                tensors = {k: permute_for_hf(v, rope_rows(self.cfg)[k], self.cfg.rope_dim)
                           if k in rope_rows(self.cfg) and self.quant.quantizes(k, tuple(v.shape)) else v
                           for k, v in tensors.items()}
            tensors = quant.quantize_block(self.quant, tensors, self.dtype)
        else:
            tensors = {k: v.to(self.dtype) for k, v in tensors.items()}
        self.files[rel] = write_safetensors(self.tmp / rel, tensors)
        if self._experts(rel):  # each expert's byte range
            try:
                specs, start = read_header(self.tmp / rel)
                self.files[rel].update(expert_record(expert_ranges(specs, self.cfg.n_experts),
                                                     lambda a, b: read_bytes(self.tmp / rel, start + a, b - a),
                                                     self.files[rel]["size"] - start))
            except ValueError:  # quantized experts whose bytes are no whole number of their scales' (see
                if self.quant is None:  # tensorfile.experts_together): read whole blocks, as before
                    raise

    def _experts(self, rel: str) -> int:
        """The experts of rel's block (0: embed, head, a dense block or a dense model)."""
        if not rel.startswith("blocks/") or not self.cfg.sparse(int(Path(rel).name.split(".")[0])):
            return 0
        return self.cfg.n_experts

    def write_embed(self, tensors: dict[str, torch.Tensor]) -> None:
        self._write("embed.safetensors", tensors, embed_tensor_shapes(self.cfg))

    def write_block(self, i: int, tensors: dict[str, torch.Tensor]) -> None:
        self._write(block_file(i), tensors, block_tensor_shapes(self.cfg, i))

    def write_head(self, tensors: dict[str, torch.Tensor]) -> None:
        self._write("head.safetensors", tensors, head_tensor_shapes(self.cfg))

    def link_file(self, rel: str, expected: dict[str, tuple[int, ...]], located: dict[str, tuple],
                  copied: dict[str, torch.Tensor]) -> None:
        """Record rel as a linked file instead of writing it (see phantom.files.storelinks).

        Args:
            rel: the store file it stands for, e.g. "blocks/000.safetensors".
            expected: its tensor names and shapes.
            located: name -> (safetensors file (absolute Path), byte offset, dtype, shape): tensors read in place.
            copied: name -> tensor: the rest (e.g. rows that needed a permutation), written into the store
                as rel's ".local.safetensors" and linked from there.
        """
        if self.quant is not None and not self.quant.shipped:
            raise ValueError(f"{rel}: a quantized store is a copy; it cannot link the checkpoint's files")
        stored = self._stored(rel, expected)
        got = {**{k: tuple(v[3]) for k, v in located.items()}, **{k: tuple(v.shape) for k, v in copied.items()}}
        if got != {n: s for n, (s, _) in stored.items()} or len(got) != len(located) + len(copied):
            raise ValueError(f"{rel}: tensors {got} do not match the config's {expected}")
        if any(dtype_name(v[2]) != stored[k][1] for k, v in located.items()):
            raise ValueError(f"{rel}: linked tensors must be stored as the store keeps them ({dtype_name(self.dtype)})")
        located = {k: (str(Path(v[0]).resolve()), *v[1:]) for k, v in located.items()}
        if copied:
            local = rel.removesuffix(".safetensors") + ".local.safetensors"
            self.files[local] = write_safetensors(self.tmp / local, {k: v.to(parse_stored(stored[k][1]))
                                                                     for k, v in copied.items()})
            specs, start = read_header(self.tmp / local)
            located.update({t.name: (local, start + t.start, t.dtype, t.shape) for t in specs})
        storelinks.add_sources(self.links["sources"], located, self.tmp)
        self.links["files"][rel] = storelinks.file_record(located, self.tmp, self._experts(rel))

    def keep_file(self, rel: str, located: dict[str, tuple], link: bool) -> None:
        """A file beside the model's parts whose tensors stay as a checkpoint ships them, any dtype, bytes as they
        are (a vision-language checkpoint's vision tower: phantom.convert.visionlanguage): copied, or with link
        recorded as a linked file. located: name -> (safetensors file, byte offset, dtype, shape)."""
        located = {k: (str(Path(v[0]).resolve()), *v[1:]) for k, v in located.items()}
        if not link:
            self.files[rel] = write_copied(self.tmp / rel, located)
            return
        storelinks.add_sources(self.links["sources"], located, self.tmp)
        self.links["files"][rel] = storelinks.file_record(located, self.tmp)

    def write_kept(self, rel: str, tensors: dict[str, torch.Tensor]) -> None:
        """keep_file's file from tensors in memory (a copy of another store's), each written as it is."""
        self.files[rel] = write_safetensors(self.tmp / rel, tensors)

    def add_tokenizer(self, src: Path) -> None:
        name = "tokenizer.json" if Path(src).suffix == ".json" else "tokenizer.model"
        shutil.copyfile(src, self.tmp / name)
        with open(self.tmp / name, "rb") as f:
            os.fsync(f.fileno())
        self.tokenizer = name

    def finish(self, extra: dict | None = None) -> Path:
        needed = ["embed.safetensors", "head.safetensors"] + [block_file(i) for i in range(self.cfg.n_layers)]
        missing = [f for f in needed if f not in self.files and f not in self.links["files"]]
        if missing:
            raise ValueError(f"store incomplete: {missing[:3]} not written")
        manifest = {"format": FORMAT, "version": VERSION, "config": self.cfg.to_dict(),
                    "dtype": dtype_name(self.dtype), "tokenizer": self.tokenizer, "files": self.files,
                    **({"links": self.links} if self.links["files"] else {}),
                    **({"quantization": quant_record(self.quant, self.cfg, self.dtype)} if self.quant else {}),
                    **(extra or {})}
        atomic_write_json(self.tmp / MANIFEST, manifest)
        return fileio.swap_folder(self.tmp, self.out)  # overwrite: the old store goes only once this one is complete



def read_bytes(path: Path, offset: int, n: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(n)
