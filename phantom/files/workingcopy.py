"""Working copies: the store full finetuning rewrites, and the rewrite itself. Apart from the reader
because a store is only ever read, except this one way: a copy made of hard links (free until a block
changes), whose files are each replaced whole by rename with the manifest updated after, so the
original is never touched and a crash leaves the old file or the new one, never a mix.

The rewrite is reached through the open store (BlockStore.write_block, write_head, write_embed),
which passes itself here.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from phantom.base import faults, fileio
from phantom.base.fileio import atomic_write_json
from phantom.files.storeformat import MANIFEST, FileEntry, crc_record, read_manifest, safe_join
from phantom.files.tensorfile import StoreError, read_header, write_safetensors


def clone_store(src: Path, dst: Path) -> Path:
    """A working copy of a store for full finetuning: hard links where possible, else copies.

    Safe because files in a store are only ever replaced by rename, never modified in place, so a
    rewrite in the copy never touches the original's data. Something that is not a store (no
    manifest, or not a phantom store's) is refused; opening the copy checks its files.
    """
    src, dst = Path(src), Path(dst)
    read_manifest(src)  # refuse to clone something that is not a store
    return link_tree(src, dst)


def link_tree(src: Path, dst: Path) -> Path:
    """Replace dst by a copy of the folder src made of hard links (copies across filesystems).

    A snapshot for free where files are only ever replaced by rename: later rewrites in either tree
    create new files and leave the other's untouched. Built under a temporary name, then renamed.
    """
    src, dst = Path(src), Path(dst)
    with fileio.replacing_folder(dst) as tmp:
        for f in sorted(src.rglob("*")):
            if f.is_symlink():
                raise StoreError(f"{f}: symbolic links are not allowed in a store")
            if f.name.endswith(".tmp"):
                continue  # an unfinished write of a crashed run
            target = tmp / f.relative_to(src)
            if f.is_dir():
                target.mkdir(exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(f, target)
            except OSError:
                shutil.copyfile(f, target)
    return dst


def rewrite(store, rel: str, tensors: dict[str, torch.Tensor]) -> FileEntry:
    """Replace one file of an open store (a BlockStore) atomically with new values of the same
    tensors, then its manifest; the file's new entry (the caller puts it in place of the old).

    Raises:
        ValueError: a quantized store (its weights are frozen), or tensors not the file's layout.
    """
    if store.quant is not None:
        raise ValueError(f"{store.path}: a quantized store's weights are frozen (not rewritten)")
    old = next(e for e in [store.embed, store.head, *store.blocks] if e.path == safe_join(store.path, rel))
    got = {k: tuple(v.shape) for k, v in tensors.items()}
    if got != {s.name: s.shape for s in old.specs}:
        raise ValueError(f"{rel}: new tensors {got} do not match the file's layout")
    with fileio.replacing(old.path) as tmp:
        info = write_safetensors(tmp, {k: v.to(store.dtype) for k, v in tensors.items()})
    faults.point("store.rewrite")  # crash tests: new file in place, manifest not yet updated
    with store.manifest_lock:
        store.manifest["files"][rel] = info
        store.manifest.get("links", {}).get("files", {}).pop(rel, None)  # was linked, now a file
        atomic_write_json(store.path / MANIFEST, store.manifest)
        store.checks.mark(old.path)
    return FileEntry(old.path, old.specs, read_header(old.path)[1], old.nbytes, info["sha256"],
                     crc=crc_record(store.path / MANIFEST, rel, info, old.nbytes, header=True))
