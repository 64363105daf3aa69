"""The token cache beside a data file (.phantom-cache/<file>.<key>/: tokens.npy, labels.npy, starts.npy,
meta.json): written whole, then renamed into place; read back as files anyone could have put there
(arrays without pickles, their dtypes, shapes and ranges checked), so a damaged or planted cache is one
error naming it, not a crash mid-run. Imports fileio and safejson only.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from phantom.base import fileio, safejson
from phantom.data.special_tokens import IGNORE_INDEX

ARRAYS = ("tokens", "labels", "starts")


class CacheError(ValueError):
    """A token cache that is not what write_cache writes."""


def write_cache(folder: Path, fmt: str, tokens: np.ndarray, labels: np.ndarray, starts: np.ndarray) -> None:
    """All three arrays and meta.json into a temporary folder, renamed into place when complete.

    A failed write (disk full) removes the temporary folder; the caller tokenizes again next time.
    """
    tmp = fileio.temp_folder(folder)
    try:
        for name, a in zip(ARRAYS, (tokens, labels, starts)):
            fileio.atomic_write(tmp / f"{name}.npy", lambda f, a=a: np.save(f, a))
        fileio.atomic_write_json(tmp / "meta.json", {"format": fmt, "tokens": len(tokens), "examples": len(starts)})
        fileio.publish_folder(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # failed, or another process wrote it first


def read_cache(folder: Path, vocab_size: int) -> tuple[str, np.ndarray, np.ndarray, np.ndarray]:
    """(format, tokens, labels, starts) of a cache folder, memory-mapped and checked: 1-D integer
    arrays loaded with allow_pickle=False, labels as long as tokens, starts ascending from 0 inside
    them, every id in [0, vocab_size) and every label an id or IGNORE_INDEX.

    Raises:
        CacheError: naming the folder and what is wrong, and saying to remove it.
    """
    try:
        meta = safejson.load(folder / "meta.json")
    except ValueError as e:
        raise CacheError(f"{e}{_ADVICE.format(folder=folder)}") from None
    arrays = []
    for name in ARRAYS:
        try:
            a = np.load(folder / f"{name}.npy", mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError, EOFError) as e:
            raise CacheError(_damaged(folder, f"{name}.npy is not an array file ({e})")) from None
        if a.ndim != 1 or a.dtype.kind not in "iu":
            raise CacheError(_damaged(folder, f"{name}.npy holds {a.dtype} of shape {a.shape}, not 1-D integers"))
        arrays.append(a)
    tokens, labels, starts = arrays
    problem = _problem(meta, tokens, labels, starts, vocab_size)
    if problem:
        raise CacheError(_damaged(folder, problem))
    return meta["format"], tokens, labels, starts


_ADVICE = "; remove {folder} and phantom tokenizes the data again"


def _damaged(folder: Path, problem: str) -> str:
    return f"{folder}: a damaged token cache ({problem})" + _ADVICE.format(folder=folder)


def _problem(meta, tokens: np.ndarray, labels: np.ndarray, starts: np.ndarray, vocab_size: int) -> str | None:
    """What is wrong with a cache's contents, or None."""
    if not isinstance(meta, dict) or not isinstance(meta.get("format"), str):
        return "meta.json names no format"
    if len(tokens) == 0 or len(labels) != len(tokens):
        return f"{len(tokens)} tokens and {len(labels)} labels"
    if len(starts) == 0 or starts[0] != 0 or np.any(np.diff(starts) <= 0) or starts[-1] >= len(tokens):
        return "example starts that are not ascending inside the tokens"
    chunk = 1 << 24
    for at in range(0, len(tokens), chunk):
        ids, lab = np.asarray(tokens[at:at + chunk]), np.asarray(labels[at:at + chunk])
        if ids.min() < 0 or ids.max() >= vocab_size:
            return f"token ids outside the vocabulary of {vocab_size}"
        if np.any((lab != IGNORE_INDEX) & ((lab < 0) | (lab >= vocab_size))):
            return f"labels outside the vocabulary of {vocab_size}"
    return None
