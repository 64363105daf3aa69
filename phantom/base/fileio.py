"""Durable files: the one rule every file and folder phantom writes follows, and one line when a
write fails. Every replace in phantom goes through here (tests/test_layout.py checks it).

The rule: a file is either replaced whole (written under a temporary name in its own folder, fsynced,
renamed over the old one, then the folder fsynced: `atomic_write`, `replacing`) or appended by whole
records (one write of a complete line, cut back if it fails part-way; a tail torn by a crash is cut
on the next read: `RecordLog`). A folder is built whole under a temporary name and then swapped in
(`replacing_folder`); a crash between its two renames leaves NAME.old, which `current_folder` finds.
A reader sees the old or the new version, never a mix. Also: an advisory lock for things made once
per machine or per folder.

Nothing is written through a link: temporary files are created exclusively (O_EXCL | O_NOFOLLOW; a
fixed temporary name a killed run left is unlinked first), and a file to be replaced, a lock or a log
that is a symbolic link is refused (LinkError) naming it, since writing there would change a file
outside the folder given (a planted `.lock -> ../file`).
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import shutil
import stat
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

from phantom.base import faults, safejson

log = logging.getLogger(__name__)

# What a failed read or write means to the user (errno -> words); anything else is not the user's to fix.
USER_ERRNOS = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
               errno.EROFS: "read-only file system", errno.EIO: "I/O error", errno.EACCES: "permission denied",
               errno.EPERM: "operation not permitted"}

class LinkError(ValueError):
    """A file phantom would write is a symbolic link (or a hard link, for files written in place)."""


def refuse_link(path: Path | str) -> None:
    """LinkError if path is a symbolic link: phantom writes only files it creates."""
    if os.path.islink(path):
        raise LinkError(f"{path} is a symbolic link: phantom writes only files it creates, never through a link; "
                        f"remove it or choose another folder")


def create_exclusive(path: Path | str) -> int:
    """A new file at path, open for writing: fails if anything (a link included) is there already."""
    try:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        raise _named(e, Path(path)) from None


def open_own(path: Path | str, flags: int) -> int:
    """Open (or create) a file phantom writes in place (a lock, an append-only log): never through a
    symbolic link, and refused where it is not a regular file of its own (a hard link to another file)."""
    try:
        fd = os.open(path, flags | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            refuse_link(path)
        raise _named(e, Path(path)) from None
    st = os.fstat(fd)
    if stat.S_ISCHR(st.st_mode):  # os.devnull: where a rank that does not log writes its records
        return fd
    if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
        os.close(fd)
        raise LinkError(f"{path} is not a file of its own ({'a hard link' if st.st_nlink > 1 else 'not a regular file'}"
                        f"): phantom writes only files it creates; remove it or choose another folder")
    return fd


def _named(e: OSError, path: Path) -> OSError:
    """The error with the file it concerns (a failed write() carries no file name)."""
    if e.filename is None:
        e = OSError(e.errno, e.strerror, str(path))
    return e


def fsync_dir(path: Path | str) -> None:
    """Make a rename or a new file in `path` durable (the folder's entry, not only the data)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path | str, data: bytes | Callable) -> Path:
    """Replace `path` whole: temporary file in the same folder, fsync, rename, fsync the folder.

    Args:
        data: the bytes, or a function that writes into the binary file object it is given (for
            payloads that should not be built in memory first, e.g. np.save).

    Raises:
        OSError: with the file name set (disk full, quota, permissions); nothing is left behind.
    """
    path = Path(path)
    refuse_link(path)
    fd, tmp = -1, None
    try:  # mkstemp: a random name, created O_EXCL | O_NOFOLLOW
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            faults.io_point(path)
            data(f) if callable(data) else f.write(data)
            faults.point("file.write")  # crash tests: written, not yet renamed
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError as e:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        raise _named(e, path) from None
    except BaseException:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        raise
    return path


@contextlib.contextmanager
def new_file(path: Path | str):
    """A binary file created (or cut) to be written in place, never through a symbolic link, flushed and fsynced
    when the block ends: a file inside a temporary folder that is renamed into place whole (a store being written,
    a checkpoint), where a temporary file of its own would be one rename too many."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "wb") as f:
        yield f
        f.flush()
        os.fsync(f.fileno())


@contextlib.contextmanager
def replacing(path: Path | str):
    """For writers that need a file name (safetensors, torch.save): yields a temporary path in path's
    folder; when the block ends, the file is fsynced and renamed over `path`, and the folder fsynced.
    On an error the temporary file is removed (and an OSError names `path`).

    The temporary name is fixed (.NAME.tmp): a file has one writer at a time (the store's rewrites,
    the optimizer's state, the adapter), and what a killed run left there is overwritten by the next
    write of that file instead of staying behind under a name nothing will use again: it is unlinked
    (a link planted there goes, never followed) and the temporary file created exclusively."""
    path = Path(path)
    refuse_link(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        if os.path.islink(tmp) or os.path.isfile(tmp):
            os.unlink(tmp)
        os.close(create_exclusive(tmp))
        yield Path(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise _named(e, path) from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def old_folder(path: Path) -> Path:
    """Where `replacing_folder` keeps the previous version of path between its two renames."""
    return path.with_name(f"{path.name}.old")


def current_folder(path: Path | str) -> Path | None:
    """path, or its previous version where a crash fell between replacing_folder's two renames."""
    path = Path(path)
    return path if path.exists() else old_folder(path) if old_folder(path).exists() else None


def fsync_tree(root: Path) -> None:
    """fsync every file and folder under root (cheap for files their writer already synced)."""
    for folder, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(folder)


def temp_folder(path: Path | str) -> Path:
    """A fresh, empty folder beside path, for building what `swap_folder` will put in its place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))


def swap_folder(tmp: Path | str, path: Path | str, crash_point: str = "folder.rename") -> Path:
    """Put the complete folder tmp in path's place: its contents fsynced, then path -> NAME.old,
    tmp -> path, NAME.old removed. `crash_point` names the moment between the renames (crash tests)."""
    tmp, path = Path(tmp), Path(path)
    fsync_tree(tmp)
    old = old_folder(path)
    shutil.rmtree(old, ignore_errors=True)
    if path.exists():
        os.replace(path, old)  # kept until the new one is in place
    faults.point(crash_point)
    os.replace(tmp, path)
    fsync_dir(path.parent)
    shutil.rmtree(old, ignore_errors=True)
    return path


def publish_folder(tmp: Path | str, path: Path | str) -> bool:
    """Put the complete folder tmp at path unless something is there already (a cache another process
    wrote first: same contents); True if tmp became path."""
    tmp, path = Path(tmp), Path(path)
    fsync_tree(tmp)
    try:
        os.rename(tmp, path)  # fails on an existing non-empty folder: never replaces one
    except OSError:
        return False
    fsync_dir(path.parent)
    return True


@contextlib.contextmanager
def replacing_folder(path: Path | str, tmp: Path | str | None = None, crash_point: str = "folder.rename"):
    """Build a folder that replaces `path` whole: yields a temporary folder beside it (`tmp`, emptied
    first, or a fresh one); when the block ends it is swapped in (`swap_folder`). On an error the
    temporary folder is removed and path stays as it was."""
    path = Path(path)
    if tmp is None:
        tmp = temp_folder(path)
    else:
        tmp = Path(tmp)
        if tmp.is_symlink():  # planted: unlinked, never followed (rmtree refuses links)
            tmp.unlink()
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        swap_folder(tmp, path, crash_point)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def atomic_write_text(path: Path | str, text: str) -> Path:
    return atomic_write(path, text.encode())


def atomic_write_json(path: Path | str, obj) -> Path:
    return atomic_write(path, (json.dumps(obj, indent=1) + "\n").encode())


class RecordLog:
    """An append-only JSONL file written by whole lines.

    Each record is one `write` of a complete line, flushed to the OS; if that write fails (disk full)
    the file is cut back to where the line began, so the file never ends in half a record. `fsync`
    makes what was appended durable (the trainer calls it before each checkpoint).
    """

    def __init__(self, path: Path | str):
        self.path = Path(path)
        self.fd = open_own(self.path, os.O_WRONLY | os.O_APPEND)

    def append(self, line: str) -> None:
        raw = line.encode() if line.endswith("\n") else (line + "\n").encode()
        end = os.lseek(self.fd, 0, os.SEEK_END)
        try:
            faults.io_point(self.path)
            done = os.write(self.fd, raw)
            while done < len(raw):  # a short write: the rest, or an OSError (disk full)
                done += os.write(self.fd, raw[done:])
        except OSError as e:
            with contextlib.suppress(OSError):
                os.ftruncate(self.fd, end)
            raise _named(e, self.path) from None

    def fsync(self) -> None:
        try:
            os.fsync(self.fd)
        except OSError as e:
            raise _named(e, self.path) from None

    def close(self) -> None:
        os.close(self.fd)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def read_records(path: Path | str, repair: bool = False) -> list[dict]:
    """The JSON records of a JSONL file; a torn last line (a crash mid-append) is skipped, and with
    `repair` cut from the file (logged). A bad line elsewhere is an error: it is not a torn append."""
    path = Path(path)
    if not path.is_file():
        return []
    raw = path.read_bytes()
    lines = raw.split(b"\n")
    records, good = [], 0
    for k, line in enumerate(lines):
        if not line.strip():
            good += len(line) + 1
            continue
        try:
            records.append(safejson.loads(line, str(path), line=k + 1, finite=False))
            good += len(line) + 1
        except ValueError:
            if any(rest.strip() for rest in lines[k + 1:]):
                raise ValueError(f"{path}:{k + 1}: not a JSON record; the file is damaged in the middle: "
                                 f"move it away to continue") from None
            log.warning("%s ends in a torn record (%d bytes): %s", path, len(line),
                        "cut" if repair else "ignored")
            if repair:
                with os.fdopen(open_own(path, os.O_RDWR), "r+b") as f:  # cut in place: never through a link
                    f.truncate(min(good, len(raw)))
                    f.flush()
                    os.fsync(f.fileno())
            break
    return records


def describe(e: OSError, doing: str = "writing") -> str | None:
    """'no space left on device writing /x/y' for the errors a user can fix, else None (a bug)."""
    what = USER_ERRNOS.get(e.errno)
    if what is None:
        return None
    return f"{what} {doing} {e.filename}" if e.filename else what


_in_process: dict[str, threading.Lock] = {}  # POSIX locks do not exclude threads of one process
_in_process_guard = threading.Lock()


@contextlib.contextmanager
def locked(path: Path | str, wait: bool = True, what: str = ""):
    """Hold an exclusive lock on the file `path` (created if needed) for the block.

    A POSIX record lock (fcntl.lockf): the kernel drops it when the holder dies, even by SIGKILL, so a
    lock left by a killed run never blocks the next one, and unlike flock it is not inherited by
    forked children (DataLoader workers outliving a killed parent would otherwise keep it). A
    thread lock per path makes it exclusive between threads of one process too. With wait=False a
    held lock raises ValueError with `what` (the caller's words).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _in_process_guard:
        local = _in_process.setdefault(str(path.resolve()), threading.Lock())
    if not local.acquire(blocking=wait):
        raise ValueError(what or f"{path} is locked by another run")
    try:
        fd = open_own(path, os.O_RDWR)
        try:
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except (BlockingIOError, PermissionError):  # EAGAIN or EACCES: held by another process
                raise ValueError(what or f"{path} is locked by another process") from None
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()} {time.time():.0f}\n".encode())  # who holds it, for a curious user
            yield path
        finally:
            os.close(fd)  # releases the lock
    finally:
        local.release()
