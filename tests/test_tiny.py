"""The tiny model and the README's first command: `python scripts/finetune.py` learns visibly."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from phantom.arch.presets import preset
from phantom.convert.synthetic import TINY_RECIPE, ensure_tiny
from phantom.files.store import BlockStore

ROOT = Path(__file__).resolve().parent.parent


def test_tiny_store_is_made_again_when_its_recipe_changed(tmp_path):
    path = ensure_tiny(tmp_path / "tiny")
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["tiny_recipe"] == TINY_RECIPE and manifest["init"] == "fan_in"
    assert BlockStore(path).cfg == preset("tiny")
    assert BlockStore(path).cfg.vocab_size == 64
    del manifest["tiny_recipe"]  # a store made by an older recipe
    (path / "manifest.json").write_text(json.dumps(manifest))
    assert ensure_tiny(path) == path
    assert json.loads((path / "manifest.json").read_text())["tiny_recipe"] == TINY_RECIPE
    BlockStore(path, verify="full")
    (path / "manifest.json").write_text("{not json")  # damaged: left for the store's checks to report
    assert ensure_tiny(path) == path and (path / "manifest.json").read_text() == "{not json"


def test_first_command_learns_visibly(tmp_path):
    """The README's first command, as a fresh checkout runs it: the held-out loss falls at every
    evaluation to at most 0.85 of step 0's, nothing is warned about, and the run ends with a sample."""
    env = {**os.environ, "PHANTOM_WEIGHTS": str(tmp_path / "weights"), "PHANTOM_CACHE": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "finetune.py"), "--out", str(tmp_path / "out")],
                       capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "warn" not in r.stderr.lower(), r.stderr[-3000:]
    recs = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    vals = [(rec["step"], rec["val_loss"]) for rec in recs if "val_loss" in rec]
    assert [s for s, _ in vals] == [0, 50, 100, 150, 200]
    assert all(b < a for (_, a), (_, b) in zip(vals, vals[1:])), vals
    assert vals[-1][1] <= 0.85 * vals[0][1], vals
    assert recs[-1]["step"] == 200 and recs[-1]["sample"]
