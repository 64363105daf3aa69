"""Where a store came from: the manifest's "origin", written when the store is prepared.

A store is phantom's own layout, which no other tool loads. What the ecosystem loads is the model the
store was made from, so an adapter names that (adapter_config.json's base_model_name_or_path, and
revision as peft writes it) and the run card says how to load it: a Hub id at the commit that was
converted, or the Hugging Face folder while it is still there. Meta-format and synthetic stores say
so; they have nothing transformers loads, and an adapter of one names the store itself. Runs record
phantom's VERSION beside torch's.
"""
from __future__ import annotations

from pathlib import Path

VERSION = "0.1.0"  # phantom's, read by setup.cfg
KINDS = ("hub", "hf", "meta", "synthetic")


def hub(repo_id: str, commit: str) -> dict:
    """The origin of a store converted from the Hub cache: the repository id and the commit."""
    return {"kind": "hub", "id": repo_id, "revision": commit}


def folder(src: Path | str, fmt: str) -> dict:
    """The origin of a store converted from a checkpoint folder ("hf" or "meta"), by its absolute path."""
    return {"kind": fmt, "path": str(Path(src).resolve())}


SYNTHETIC = {"kind": "synthetic"}
HUB_REPO = "models--"  # the hub cache's folder of a repository: models--OWNER--NAME/snapshots/COMMIT


def of_checkpoint(src: Path | str, fmt: str, root: Path | str | None = None) -> dict:
    """The origin of a store converted from src: a snapshot under a hub cache root (the root named
    models--OWNER--NAME, src its snapshots/COMMIT) is that hub id at that commit; anything else is
    the folder. The hub forbids "--" in ids, so the folder name gives the id back."""
    src = Path(src)
    if root is not None and fmt == "hf" and Path(root).name.startswith(HUB_REPO) and src.parent.name == "snapshots" \
            and src.parent.parent == Path(root):
        owner_name = Path(root).name[len(HUB_REPO):].split("--")
        if len(owner_name) == 2:
            return hub("/".join(owner_name), src.name)
    return folder(src, fmt)


def origin(manifest: dict) -> dict:
    """The manifest's origin, or {} for stores written before it was recorded (or a malformed one)."""
    o = manifest.get("origin")
    if not isinstance(o, dict) or o.get("kind") not in KINDS:
        return {}
    if o["kind"] == "hub" and not (isinstance(o.get("id"), str) and isinstance(o.get("revision"), str)):
        return {}
    if o["kind"] in ("hf", "meta") and not isinstance(o.get("path"), str):
        return {}
    return o


def base_model(manifest: dict, store: Path | str) -> tuple[str, str | None]:
    """(base_model_name_or_path, revision) for an adapter of the store: the Hub id and its commit, the
    Hugging Face folder when it still holds a config.json, else the store folder itself."""
    o = origin(manifest)
    if o.get("kind") == "hub":
        return o["id"], o["revision"]
    if o.get("kind") == "hf" and (Path(o["path"]) / "config.json").is_file():
        return o["path"], None
    return str(store), None


def describe(manifest: dict) -> str:
    """One phrase for the run card: what the store was prepared from."""
    o = origin(manifest)
    kind = o.get("kind")
    if kind == "hub":
        return f"Hub model `{o['id']}` at revision `{o['revision']}`"
    if kind in ("hf", "meta"):
        return f"{'Hugging Face' if kind == 'hf' else 'Meta-format'} checkpoint `{o['path']}`"
    if kind == "synthetic":
        return "synthetic (random) weights"
    return "not recorded (a store prepared before phantom kept its origin)"
