"""Data already tokenized: flat .bin / .npy files of token ids, as nanoGPT and litgpt write them,
memory-mapped as they are (nothing copied or cached) and checked against the vocabulary once.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

TOKEN_SUFFIXES = (".bin", ".npy")  # pre-tokenized: a flat array of token ids
TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


def token_dtype(path: Path, vocab_size: int, dtype: str | None = None) -> np.dtype:
    """The element type of a .bin of token ids: given (--data-dtype), else uint16 when the vocabulary
    fits (nanoGPT's convention), else uint32."""
    if dtype is not None:
        if dtype not in TOKEN_DTYPES:
            raise ValueError(f"--data-dtype must be one of {', '.join(TOKEN_DTYPES)}, not {dtype!r}")
        return np.dtype(TOKEN_DTYPES[dtype])
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def map_tokens(path: Path | str, vocab_size: int, dtype: str | None = None) -> tuple[np.ndarray, str]:
    """A flat file of token ids, memory-mapped (nothing is copied or cached), and its key (the file's
    path, size, mtime and dtype; phantom.data.dataset.load makes it a TokenData, every token trained).

    `.npy` records its dtype (any unsigned or signed integer type, 1-D); `.bin` is raw
    little-endian ids of `dtype` (see token_dtype). Each id is checked against the vocabulary once,
    in chunks, so a file from another tokenizer fails here and not as an index error mid-run.

    Raises:
        ValueError: not a flat integer array, a size that is not a whole number of ids, or an id
            outside [0, vocab_size) (the error names the file and the id's offset).
    """
    path = Path(path)
    if path.suffix == ".npy":
        try:
            tokens = np.load(path, mmap_mode="r", allow_pickle=False)
        except ValueError as e:
            raise ValueError(f"{path}: not a .npy array of token ids ({e})") from None
        if tokens.ndim != 1 or tokens.dtype.kind not in "ui":
            raise ValueError(f"{path}: expected a 1-D integer array of token ids, found {tokens.dtype} of shape "
                             f"{tokens.shape}")
    else:
        dt = token_dtype(path, vocab_size, dtype)
        size = path.stat().st_size
        if size % dt.itemsize:
            raise ValueError(f"{path}: {size} bytes is not a whole number of {dt.name} token ids; pass the "
                             f"--data-dtype it was written with")
        if size == 0:
            raise ValueError(f"{path} is empty; give a file of token ids")
        tokens = np.memmap(path, dtype=dt.newbyteorder("<"), mode="r")
    check_ids(tokens, vocab_size, path)
    st = path.stat()
    ident = f"tokens|{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{tokens.dtype.str}"
    return tokens, hashlib.sha256(ident.encode()).hexdigest()[:16]


def check_ids(tokens: np.ndarray, vocab_size: int, path: Path, chunk: int = 1 << 24) -> None:
    """Raise ValueError naming the first id outside [0, vocab_size) and its offset (in ids)."""
    for at in range(0, len(tokens), chunk):
        part = np.asarray(tokens[at:at + chunk])
        bad = np.flatnonzero((part >= vocab_size) | (part < 0)) if part.dtype.kind == "i" else \
            np.flatnonzero(part >= vocab_size)
        if len(bad):
            i = at + int(bad[0])
            raise ValueError(f"{path}: token id {int(tokens[i])} at offset {i} (byte {i * tokens.dtype.itemsize}) is "
                             f"outside the model's vocabulary of {vocab_size}; tokenize the data with this model's "
                             f"tokenizer, or pass the --data-dtype the file was written with")
