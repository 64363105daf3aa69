"""`--model Qwen/Qwen2.5-7B-Instruct`: a Hugging Face hub id, found in the local hub cache and converted once.

The cache is the hub's own layout (HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub):
models--OWNER--NAME/refs/REVISION holds a commit, snapshots/COMMIT/ the files. The store is made on
first use with --link (no second copy of the tensors), under a lock, so processes that start at once
convert it once; nothing here touches the network.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from phantom.base.fileio import locked
from phantom.convert.convert import convert_checkpoint

REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
COMMIT = re.compile(r"^[0-9a-f]{40}$")
# a branch or tag name as git allows it (git check-ref-format): no "..", "//", "@{", control characters,
# spaces or ~^:?*[\ ; no part starting with "." or ending with ".lock"; not starting or ending with "/"
REVISION = re.compile(r"^(?!/)(?!.*(?:\.\.|//|@\{|/\.))(?!\.)[^\x00-\x20\x7f~^:?*\[\\]+(?<![/.])(?<!\.lock)$")


def is_hub_id(name: str) -> bool:
    """OWNER/NAME, as the hub spells repository ids, where no folder OWNER is here (weights/7B is a path)."""
    return bool(REPO_ID.match(name)) and ".." not in name and not Path(name.split("/")[0]).exists()


def hub_cache() -> Path:
    if env := os.environ.get("HF_HUB_CACHE"):
        return Path(env)
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "huggingface"
    return Path(home) / "hub"


def how_to_get(repo_id: str, revision: str) -> str:
    rev = "" if revision == "main" else f" --revision {revision}"
    return (f"download it with `huggingface-cli download {repo_id}{rev}` (or `hf download`), or point HF_HUB_CACHE "
            f"/ HF_HOME at the cache that has it")


def snapshot(repo_id: str, revision: str = "main") -> tuple[Path, str]:
    """(snapshot folder, commit) of repo_id at revision (a branch, a tag or a commit) in the hub cache.

    Raises:
        ValueError: revision is not a name git allows for a branch or tag, nor a commit (a path like
            ../../f would read any file as a ref).
        FileNotFoundError: the model or that revision is not in the cache (the message says how to get it).
    """
    if not REVISION.match(revision) or any(p.endswith(".lock") for p in revision.split("/")):
        raise ValueError(f"--revision {revision!r} is not a branch, tag or commit name")
    repo = hub_cache() / f"models--{repo_id.replace('/', '--')}"
    ref = repo / "refs" / revision
    if COMMIT.match(revision):
        commit = revision
    elif ref.is_file() and COMMIT.match(ref.read_text().strip()):
        commit = ref.read_text().strip()
    else:
        raise FileNotFoundError(f"model {repo_id} (revision {revision}) is not in the Hugging Face cache at "
                                f"{hub_cache()}; {how_to_get(repo_id, revision)}")
    folder = repo / "snapshots" / commit
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"model {repo_id} at {commit[:12]} is incomplete in the Hugging Face cache ({folder} "
                                f"has no config.json); {how_to_get(repo_id, revision)}")
    return folder, commit


def ensure_store(repo_id: str, weights: Path, revision: str = "main") -> Path:
    """The store of repo_id at revision under weights/hub/, converted with --link on first use.

    Stores are per commit, so a new revision of the model is a new store and an old one stays valid.
    A lock beside the store makes concurrent first uses convert once; the others wait and open it.
    """
    folder, commit = snapshot(repo_id, revision)
    out = Path(weights) / "hub" / repo_id.replace("/", "--") / commit
    if (out / "manifest.json").is_file():
        return out
    with locked(out.parent / f".{commit}.lock"):
        if not (out / "manifest.json").is_file():  # another process may have made it while we waited
            convert_checkpoint(folder, out, link=True, progress=False, root=folder.parent.parent)
    return out
