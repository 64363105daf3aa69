"""Which folder a run may write into: its own, and nothing else; which folders --overwrite may replace.

A run's folder (--out) is one of: new or empty; a folder phantom made for this run, continued with
--resume; or another phantom run's folder, replaced only with --overwrite. phantom knows its folders
by a marker, MARKER, written first (under the folder's lock, before any other file): the run's random
id, when it started and the modes of the runs that wrote there. A run that stopped before its first
checkpoint left nothing to keep: its folder may be started again as it is. A folder with anything else
in it is the user's, and is refused with one line listing what it holds: nothing of it is read, written or
deleted. The run folder itself may be a link (the user's choice); a link where phantom writes inside
it is refused, naming it (a planted link would send a write outside the folder).

Stores and exports are replaced whole by --overwrite (prepare_model.py, merge_lora.py) only where the
folder there is one phantom wrote: a store's manifest.json, an export's phantom-export.json, says so.
"""
from __future__ import annotations

import contextlib
import os
import time
import uuid
from pathlib import Path

from phantom.base import fileio, safejson

MARKER = "phantom-run.json"
LOCK = ".lock"
# What phantom writes at the top of a run folder; links are looked for only where it writes.
OWN_FILES = (LOCK, MARKER, "config.yaml", "README.md", "metrics.jsonl", "trace.json", "reference_logps.safetensors",
             "sweep.md")
OWN_FOLDERS = ("adapter", "checkpoint", "checkpoint.tmp", "checkpoint.old", "tensorboard", "store", "optim")
WORK_FOLDERS = ("store", "optim")  # full finetuning's working copy: removed only where a full run made it
SHOWN = 8  # names listed in a refusal
STORE_MANIFEST, STORE_FORMAT = "manifest.json", "phantom-store"  # phantom.files.store's manifest says what it is
EXPORT_MARKER, EXPORT_FORMAT = "phantom-export.json", "phantom-export"  # written into every export


class RunFolderError(ValueError):
    """--out is not this run's to write: the one line says why and what to do."""


def _json(path: Path) -> dict | None:
    if path.is_symlink() or not path.is_file():
        return None
    try:
        found = safejson.load(path)
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def folder_kind(path: Path | str) -> str | None:
    """"store" or "export" where phantom wrote the folder (its manifest says so), else None."""
    path = Path(path)
    if (_json(path / STORE_MANIFEST) or {}).get("format") == STORE_FORMAT:
        return "store"
    if (_json(path / EXPORT_MARKER) or {}).get("format") == EXPORT_FORMAT:
        return "export"
    return None


def check_replaceable(path: Path | str, kind: str) -> None:
    """Before --overwrite replaces `path` whole: refused (RunFolderError) unless it is missing, empty
    or a phantom `kind` ("store" or "export"); a folder that is not phantom's is never removed."""
    path = Path(path)
    if path.is_symlink():
        raise RunFolderError(f"--overwrite: {path} is a symbolic link; give the folder it points to, or another --out")
    if not path.exists() or (path.is_dir() and not any(path.iterdir())):
        return
    if not path.is_dir():
        raise RunFolderError(f"--overwrite: {path} is a file, not a phantom {kind}; move it away or choose "
                             f"another --out")
    if folder_kind(path) != kind:
        raise RunFolderError(f"--overwrite: {path} is not a phantom {kind} (its manifest does not say so) and phantom "
                             f"removes only folders it wrote; it holds {listing(path)}: move it away or choose "
                             f"another --out")


def read_marker(out: Path | str) -> dict | None:
    """The marker of a phantom run folder, or None (no marker, or one phantom did not write)."""
    marker = _json(Path(out) / MARKER)
    return marker if marker and isinstance(marker.get("run"), str) else None


def run_id(out: Path | str) -> str | None:
    """The id of the run that owns `out` (None: no marker, e.g. a run through the library API)."""
    marker = read_marker(out)
    return marker["run"] if marker else None


def made_work_folders(out: Path | str) -> bool:
    """Whether full finetuning's store/ and optim/ in out are phantom's: a full run wrote there."""
    marker = read_marker(out)
    return bool(marker) and "full" in marker.get("modes", [])


def listing(out: Path) -> str:
    """'a, b/, c and 3 more': what a folder holds, for a refusal."""
    names = sorted(p.name + ("/" if p.is_dir() and not p.is_symlink() else "") for p in out.iterdir())
    more = f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
    return ", ".join(names[:SHOWN]) + more


def find_link(out: Path) -> Path | None:
    """The first symbolic link where phantom writes inside out: its own names, everything below its
    folders (a distributed full run's rankN/ included)."""
    names = OWN_FILES + OWN_FOLDERS + tuple(sorted(p.name for p in out.glob("rank*")))
    for name in names:
        path = out / name
        if path.is_symlink():
            return path
        if name in OWN_FILES or not path.is_dir():
            continue
        for folder, dirs, files in os.walk(path):
            for entry in sorted(dirs + files):
                if os.path.islink(os.path.join(folder, entry)):
                    return Path(folder) / entry
    return None


def has_results(out: Path) -> bool:
    """Whether a run in out got anywhere: a checkpoint or its outputs. One that stopped before its first
    checkpoint (a full disk, a bad flag found late) may be started again without --overwrite."""
    return any((out / name).exists() for name in ("checkpoint", "checkpoint.old", "adapter", "README.md"))


def check(out: Path | str, resume: bool, overwrite: bool, mode: str) -> dict | None:
    """Refuse a folder that is not this run's (RunFolderError); reads only. Returns the marker of the
    phantom run there (None: a new or empty folder)."""
    out = Path(out)
    if resume and overwrite:
        raise RunFolderError("--resume continues the run in --out and --overwrite starts a new one there: choose one")
    if out.exists() and not out.is_dir():
        raise RunFolderError(f"--out {out} is not a folder")
    if (link := find_link(out) if out.is_dir() else None) is not None:
        raise RunFolderError(f"{link} is a symbolic link: phantom writes only files it creates, never through a "
                             f"link; remove it or choose another --out")
    if not out.is_dir() or all(p.name == LOCK for p in out.iterdir()):
        return None
    marker = read_marker(out)
    if marker is None:
        old = f" (a run of an older phantom, without {MARKER}, cannot be resumed: start it again)" \
            if (out / "checkpoint" / "meta.json").is_file() else ""
        raise RunFolderError(f"--out {out} is not empty and is not a phantom run folder: it holds {listing(out)}"
                             f"{old}; choose an empty or new folder")
    if not resume and not overwrite and has_results(out):
        raise RunFolderError(f"--out {out} holds another phantom run (started {marker.get('started', '?')}, "
                             f"--mode {marker.get('mode', '?')}): pass --resume to continue it, --overwrite to "
                             f"replace its files, or choose another --out")
    if mode == "full" and "full" not in marker.get("modes", []):
        if work := [name for name in WORK_FOLDERS if (out / name).exists()]:
            raise RunFolderError(f"{out / work[0]} was not written by a full finetune run of phantom; move it "
                                 f"away or choose another --out")
    return marker


def new_marker(previous: dict | None, mode: str) -> dict:
    """The marker of a run starting now, keeping the modes of the runs that wrote there before."""
    modes = sorted(set((previous or {}).get("modes", [])) | {mode})
    return {"run": uuid.uuid4().hex, "started": time.strftime("%Y-%m-%d %H:%M:%S"), "mode": mode, "modes": modes}


@contextlib.contextmanager
def claimed(out: Path | str, resume: bool = False, overwrite: bool = False, mode: str = "lora"):
    """Hold `out` for one run: checked (before anything is written, so a refused folder is left as it
    was), locked, checked again under the lock (another run may have claimed it meanwhile), and marked
    as this run's (MARKER, the first file written; a resumed run keeps its marker). Yields the marker."""
    out = Path(out)
    check(out, resume, overwrite, mode)
    with fileio.locked(out / LOCK, wait=False, what=f"{out} is in use by another finetune run; wait for it to "
                                                    f"end or choose another --out"):
        previous = check(out, resume, overwrite, mode)
        marker = previous if resume else new_marker(previous, mode)  # resume: None if there is nothing to resume
        if not resume:
            fileio.atomic_write_json(out / MARKER, marker)
        yield marker
