"""Where people keep datasets: Parquet files, folders written by the `datasets` library's `save_to_disk`,
and Hub datasets found in the local Hugging Face cache (read offline, never downloaded). Tables are read
with pyarrow (`pip install phantom[datasets]`). Imports phantom.base.safejson alone (the folders' JSON is the user's).
"""
from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

from phantom.base import safejson

TABLE_SUFFIXES = (".parquet", ".arrow")
DATA_SUFFIXES = TABLE_SUFFIXES + (".jsonl", ".json")
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_dataset(path: Path) -> bool:
    """A Parquet/Arrow file or a `save_to_disk` folder (a Dataset's state.json or a DatasetDict's dataset_dict.json)."""
    return path.suffix in TABLE_SUFFIXES and path.is_file() or path.is_dir() and (
        (path / "state.json").is_file() or (path / "dataset_dict.json").is_file())


def hub_cache() -> Path:
    """The Hugging Face hub cache: $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub."""
    if env := os.environ.get("HF_HUB_CACHE"):
        return Path(env)
    return Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")) / "hub"


def hub_snapshot(repo_id: str) -> Path | None:
    """The cached snapshot of a Hub dataset ("org/name"): the one refs/main names, else the newest; None
    when it is not a dataset id or not in the cache."""
    if not HUB_ID.match(repo_id):
        return None
    repo = hub_cache() / f"datasets--{repo_id.replace('/', '--')}"
    ref = repo / "refs" / "main"
    if ref.is_file() and (repo / "snapshots" / ref.read_text().strip()).is_dir():
        return repo / "snapshots" / ref.read_text().strip()
    snapshots = sorted((repo / "snapshots").glob("*"), key=lambda p: p.stat().st_mtime) if repo.is_dir() else []
    return snapshots[-1] if snapshots else None


def split_files(folder: Path, split: str) -> list[Path]:
    """The data files of `split` in a Hub snapshot: under a folder named for it, or named "<split>-...",
    "<split>.jsonl", ...; a snapshot with no split in its names is all "train"."""
    files = sorted(p for p in folder.rglob("*") if p.suffix in DATA_SUFFIXES and p.is_file()
                   and not any(part.startswith(".") for part in p.relative_to(folder).parts)
                   and p.name not in ("dataset_info.json", "state.json", "dataset_dict.json"))

    def split_of(p: Path) -> str | None:
        parts = p.relative_to(folder).parts
        name = re.split(r"[-_.]", p.name, maxsplit=1)[0]
        return next((s for s in (*parts[:-1], name) if s in ("train", "test", "validation", "valid", "dev")), None)

    named = [p for p in files if split_of(p) == split]
    if named or any(split_of(p) for p in files):
        return named
    return files if split == "train" else []


def disk_folder_files(folder: Path, split: str) -> list[Path]:
    """The Arrow files of a `save_to_disk` folder (a DatasetDict: those of its `split`)."""
    if (folder / "dataset_dict.json").is_file():
        splits = safejson.load(folder / "dataset_dict.json").get("splits", [])
        if split not in splits:
            raise ValueError(f"{folder} has no split {split!r}; it has {', '.join(splits)} (--data-split)")
        folder = folder / split
    state = safejson.load(folder / "state.json")
    return [folder / Path(f["filename"]).name for f in state.get("_data_files", [])]


def data_files(path: Path, split: str | None) -> list[Path]:
    """The files that hold a dataset's records: the file itself, a `save_to_disk` folder's Arrow files,
    or a cached Hub snapshot's files of `split` (default train)."""
    split = split or "train"
    if path.is_file():
        return [path]
    if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():
        return disk_folder_files(path, split)
    files = split_files(path, split)
    if not files:
        raise ValueError(f"{path} holds no {split!r} split in .parquet, .arrow, .jsonl or .json files; choose "
                         f"another with --data-split")
    return files


def resolve(spec: str) -> Path | None:
    """A path that exists, or the cached snapshot of a Hub dataset id; None when neither."""
    path = Path(spec)
    if path.exists():
        return path
    return hub_snapshot(spec)


def table_records(path: Path) -> Iterator[dict]:
    """The rows of a Parquet file or an Arrow stream (as save_to_disk writes them), as dicts, a batch at a time."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"{path} is a Parquet/Arrow table; pip install pyarrow (or phantom[datasets]) to read "
                         f"it") from None
    try:
        if path.suffix == ".parquet":
            batches = pq.ParquetFile(path).iter_batches(batch_size=1024)
        else:
            with open(path, "rb") as f:
                try:
                    reader = pa.ipc.open_stream(f)
                except pa.ArrowInvalid:
                    f.seek(0)
                    reader = pa.ipc.open_file(f)
                    batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
                else:
                    batches = list(reader)
        for batch in batches:
            yield from batch.to_pylist()
    except (pa.ArrowInvalid, OSError) as e:
        raise ValueError(f"{path}: not a readable {path.suffix[1:]} table ({e})") from None
