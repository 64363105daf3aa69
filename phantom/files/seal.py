"""A folder sealed as one unit: a manifest of its files (size and sha256) and the id of the run that
wrote it, written last, so a reader can tell the folder it finds from the one that was written.

A checkpoint is sealed (phantom.train.checkpoint): --resume refuses, naming the file, a checkpoint in which
any file was replaced (a state.pt copied from another run), damaged or truncated, one file missing or
added, or the whole folder of another run. The check walks the folder and compares what it finds with
the manifest; no path read from the manifest is ever opened.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

from phantom.base import fileio, safejson

SEAL = "manifest.json"
FORMAT = 1
CHUNK = 1 << 20


class SealError(ValueError):
    """A sealed folder is not the one that was written: the one line names the file."""


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _files(folder: Path) -> dict[str, Path]:
    """rel -> path of every file under folder but the seal, in order; a link is refused (LinkError)."""
    found = {}
    for root, dirs, files in os.walk(folder):
        for name in sorted(dirs + files):
            path = Path(root) / name
            if path.is_symlink():
                fileio.refuse_link(path)
            if name in files and path != folder / SEAL:
                found[path.relative_to(folder).as_posix()] = path
    return dict(sorted(found.items()))


def write_seal(folder: Path | str, run: str | None, **fields) -> dict:
    """Seal a complete folder: its files' sizes and sha256, the run id and `fields`, in SEAL (written
    last: a folder without it was never finished)."""
    folder = Path(folder)
    listed = {rel: {"size": path.stat().st_size, "sha256": file_sha256(path)} for rel, path in _files(folder).items()}
    seal = {"format": FORMAT, "run": run, **fields, "files": listed}
    fileio.atomic_write_json(folder / SEAL, seal)
    return seal


_checked: dict[str, tuple] = {}  # folder -> what it held when last found sealed (checked once per resume)


def _signature(folder: Path, files: dict[str, Path]) -> tuple:
    return tuple((rel, st.st_size, st.st_mtime_ns, st.st_ino) for rel, path in [(SEAL, folder / SEAL), *files.items()]
                 for st in [path.stat()])


def read_seal(folder: Path) -> dict:
    path = folder / SEAL
    if path.is_symlink() or not path.is_file():
        raise SealError(f"{folder} has no {SEAL} (it was written by an older phantom, or not by phantom): it "
                        f"cannot be checked; start the run again in a new --out")
    try:
        seal = safejson.load(path)
    except (OSError, ValueError):
        seal = None
    if not isinstance(seal, dict) or seal.get("format") != FORMAT or not isinstance(seal.get("files"), dict):
        raise SealError(f"{path} is damaged (not the manifest phantom wrote): the checkpoint cannot be checked; "
                        f"start the run again in a new --out")
    return seal


def check_seal(folder: Path | str, run: str | None) -> dict:
    """The seal of `folder`, after checking that the folder is the one it lists, written by run `run`
    (None: any run, for folders no run marker owns). Raises SealError naming the first difference."""
    folder = Path(folder)
    seal = read_seal(folder)
    if run is not None and seal.get("run") != run:
        raise SealError(f"{folder} was written by another run ({seal.get('run')}; this folder's run is {run}): "
                        f"a checkpoint resumes only the run that wrote it")
    files = _files(folder)
    if _checked.get(str(folder)) == (sig := _signature(folder, files)):
        return seal
    listed = seal["files"]
    for rel in listed.keys() - files.keys():
        raise SealError(f"{folder / rel} is missing ({SEAL} lists it): the checkpoint is incomplete")
    for rel, path in files.items():
        want = listed.get(rel)
        if not isinstance(want, dict):
            raise SealError(f"{path} is not part of the checkpoint this run wrote ({SEAL} does not list it)")
        why = "size" if want.get("size") != path.stat().st_size else \
            "sha256" if want.get("sha256") != file_sha256(path) else None
        if why:
            raise SealError(f"{path} is not the file this run wrote (its {why} differs from {SEAL}'s): it was "
                            f"replaced or damaged; restore it, or start the run again in a new --out")
    _checked[str(folder)] = sig
    return seal
