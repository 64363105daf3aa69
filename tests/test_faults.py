"""Crash tests: `python scripts/finetune.py` SIGKILLed at named points (phantom/base/faults.py, PHANTOM_FAULT=name:N),
then resumed: each run ends bit-identical to one that never stopped and every store verifies clean. Also an
I/O error in the prefetch thread through the CLI (the scheduler-level "within a second" test is in
test_scheduler.py) and a full disk during a checkpoint (in test_bad_inputs.py).
"""
from __future__ import annotations

import errno
import fnmatch
import threading
import time
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from phantom.base import faults
from phantom.convert.synthetic import ensure_tiny
from phantom.files.store import BlockStore
from phantom.data.tokenizer import TINY_TEXT
from phantom.train.checkpoint import find_checkpoint
from test_convert import load_script

REPO = Path(__file__).resolve().parent.parent
COMMON = ["--iters", "8", "--save-every", "2", "--batch-size", "2", "--seq-len", "32", "-q", "--prefetch", "2",
          "--offload", "disk"]  # fixed placement: fault counts depend on it
LORA = [*COMMON, "--eval-every", "4", "--eval-iters", "1"]
FULL = [*COMMON, "--mode", "full", "--offload", "disk", "--lr", "1e-3", "--eval-every", "0", "--val-split", "0"]

# Counts on the tiny model (4 blocks; 8 steps, a checkpoint every 2). The run writes its marker
# (phantom-run.json), config.yaml and metrics.jsonl whole at its start (file.write 1 to 3); a LoRA
# checkpoint writes 6 files (adapter weights + config, trainable.safetensors, state.pt, meta.json and
# last the seal, manifest.json), so file.write 10..15 are the second checkpoint's and 28 is the final
# adapter, written after the last checkpoint.
LORA_POINTS = [
    "optimizer.step:3",  # mid-run, weights updated in memory only
    "optimizer.step:8",  # the last step, before its checkpoint
    "metrics.write:4",  # step 4 logged, its checkpoint not written: the log must be cut back on resume
    "prefetch.load:13",  # the prefetch thread, in step 3
    "checkpoint.rename:2",  # between the two renames: only checkpoint.old exists
    "checkpoint.rename:4",  # the same for the last checkpoint
    "file.write:11",  # adapter_config.json of checkpoint 2, written, not renamed
    "file.write:12",  # trainable.safetensors with its header and no data
    "file.write:13",  # state.pt written, not renamed
    "file.write:14",  # meta.json
    "file.write:15",  # the seal (manifest.json), the last file before the renames
    "file.write:28",  # the final adapter, after the last checkpoint
]
FULL_POINTS = [
    "writeback.item:14",  # the write-back worker, about to update a block (step 4)
    "store.rewrite:11",  # a block file replaced, the manifest not yet updated (step 3)
]


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    root = tmp_path_factory.mktemp("weights")
    ensure_tiny(root / "tiny")
    return root


@pytest.fixture
def env(weights, monkeypatch):
    monkeypatch.setenv("PHANTOM_WEIGHTS", str(weights))
    return weights


def finetune(*args) -> int:
    return load_script("finetune").main([*map(str, args)])


def killed(point: str, weights: Path, *args) -> subprocess.CompletedProcess:
    env = {**os.environ, "PHANTOM_WEIGHTS": str(weights), "PHANTOM_FAULT": point}
    return subprocess.run([sys.executable, str(REPO / "scripts" / "finetune.py"), *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=300)


def disk_full(where: str, weights: Path, *args) -> subprocess.CompletedProcess:
    env = {**os.environ, "PHANTOM_WEIGHTS": str(weights), "PHANTOM_IO_FAULT": where}
    return subprocess.run([sys.executable, str(REPO / "scripts" / "finetune.py"), *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=300)


def steps_and_losses(out: Path) -> list[tuple[int, float | None]]:
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r.get("loss")) for r in recs]


def leftovers(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.endswith((".tmp", ".old")) or ".tmp." in p.name]


@pytest.fixture(scope="module")
def reference(weights, tmp_path_factory):
    """The uninterrupted LoRA run (in this process, as the resumed runs finish)."""
    out = tmp_path_factory.mktemp("ref") / "out"
    with pytest.MonkeyPatch.context() as mp:  # restores the suite's PHANTOM_WEIGHTS: deleting it would make
        mp.setenv("PHANTOM_WEIGHTS", str(weights))  # a later in-process run resolve "tiny" in the repo's weights/
        assert finetune(*LORA, "--out", out) == 0
    return out


@pytest.fixture(scope="module")
def kills(weights, tmp_path_factory) -> dict:
    """Every killed run, three processes at a time (each dies at its own point whatever the timing)."""
    root = tmp_path_factory.mktemp("kills")
    jobs = {p: (root / p.replace(":", "-"), LORA if p in LORA_POINTS else FULL) for p in LORA_POINTS + FULL_POINTS}
    with ThreadPoolExecutor(3) as pool:
        runs = {p: pool.submit(killed, p, weights, *args, "--out", out) for p, (out, args) in jobs.items()}
    return {p: (jobs[p][0], runs[p].result()) for p in jobs}


def resume_after_kill(point: str, kills: dict, args: list[str]) -> Path:
    out, r = kills[point]
    assert r.returncode == -9, f"{point} was never reached (exit {r.returncode}): {r.stderr[-2000:]}"
    assert find_checkpoint(out) is not None, f"{point}: no checkpoint to resume from"
    assert finetune(*args, "--out", out, "--resume") == 0
    return out


@pytest.mark.parametrize("point", LORA_POINTS)
def test_lora_sigkill_then_resume_is_bit_identical(env, reference, kills, point):
    out = resume_after_kill(point, kills, LORA)
    for f in ("adapter/adapter_model.safetensors", "checkpoint/trainable.safetensors"):
        ref, got = load_file(str(reference / f)), load_file(str(out / f))
        assert ref.keys() == got.keys()
        for k in ref:
            assert bits(ref[k]).equal(bits(got[k])), (f, k)  # bit for bit
    assert steps_and_losses(out) == steps_and_losses(reference)  # every step once, the same losses
    assert not leftovers(out), leftovers(out)
    BlockStore(env / "tiny", verify="full")  # the base store was only ever read


@pytest.fixture(scope="module")
def full_reference(weights, tmp_path_factory):
    out = tmp_path_factory.mktemp("full_ref") / "out"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PHANTOM_WEIGHTS", str(weights))
        assert finetune(*FULL, "--out", out) == 0
    return out


def parts(store: BlockStore) -> dict:
    return {"embed": store.load_embed(), "head": store.load_head(), **{i: store.load_block(i) for i in range(store.n_blocks)}}


def same_store(a: Path, b: Path) -> None:
    """Both stores verify clean (every sha256) and hold the same bytes in every tensor."""
    x, y = parts(BlockStore(a, verify="full")), parts(BlockStore(b, verify="full"))
    assert x.keys() == y.keys()
    for part in x:
        assert x[part].keys() == y[part].keys() and all(bits(x[part][k]).equal(bits(y[part][k])) for k in x[part]), part


def bits(t):
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("point", FULL_POINTS)
def test_full_sigkill_during_write_back_then_resume_is_bit_identical(env, full_reference, kills, point):
    out = resume_after_kill(point, kills, FULL)
    same_store(full_reference / "store", out / "store")
    same_store(full_reference / "checkpoint" / "store", out / "checkpoint" / "store")
    assert steps_and_losses(out) == steps_and_losses(full_reference)
    BlockStore(env / "tiny", verify="full")  # the original is never written


def test_prefetch_io_error_ends_the_cli_with_one_line(env, tmp_path, capsys, monkeypatch):
    """The disk fails under a loader thread on the 5th block read: exit 2, `error: ...`, no traceback,
    and no read starts after the failure (a read already in flight on another loader may finish)."""
    real, calls, failed_at = BlockStore.read_block_into, [], []
    lock = threading.Lock()

    def failing(self, i, buf, **kw):
        with lock:
            calls.append((i, time.monotonic()))
            fail = len(calls) == 5
            if fail:
                failed_at.append(time.monotonic())
        if fail:
            time.sleep(0.2)  # let the other loaders run: none may start a read after this one failed
            raise OSError(errno.EIO, "Input/output error (injected)", str(self.blocks[i].path))
        return real(self, i, buf, **kw)

    monkeypatch.setattr(BlockStore, "read_block_into", failing)
    code = finetune(*LORA, "--out", tmp_path / "out")
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and len(calls) >= 5, err
    assert all(t < failed_at[0] + 0.2 for _, t in calls[5:]), calls
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: I/O error reading "), err
    assert str(env / "tiny" / "blocks") in lines[0] and "a file of the store" in lines[0], err
    assert "check the disk" in lines[0], err


# A full disk at each write site in turn (faults.io_point: the Nth write of a matching path fails with
# ENOSPC): the run ends in one line naming the file, and --resume, once there is space, ends where an
# uninterrupted run ends, bit for bit.
DISK_FULL = [
    ("lora", "*/metrics.jsonl:5"),  # the 4th step's record
    ("lora", "*/checkpoint.tmp/state.pt:2"),  # the second checkpoint
    ("lora", "*/checkpoint.tmp/trainable.safetensors:3"),
    ("lora", "*/checkpoint.tmp/adapter/.adapter_model*:2"),
    ("lora", "*/out/adapter/.adapter_model*:1"),  # the final adapter, after the last checkpoint
    ("full", "*/out/store/blocks/.*:9"),  # a block's write-back in step 3
    ("full", "*/out/optim/*:10"),  # a block's optimizer state in step 3
    ("full", "*/checkpoint.tmp/state.pt:2"),
]


@pytest.mark.parametrize("mode, where", DISK_FULL)
def test_disk_full_at_each_write_site_then_resume_is_bit_identical(env, request, tmp_path, mode, where):
    args, ref = (LORA, "reference") if mode == "lora" else (FULL, "full_reference")
    ref = request.getfixturevalue(ref)
    glob = where.rsplit(":", 1)[0]
    out = tmp_path / "out"
    r = disk_full(where, env, *args, "--out", out)  # its own process, as a run that stops would be
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-3000:]
    assert lines[0].startswith("error: no space left on device writing "), lines
    named = lines[0].removeprefix("error: no space left on device writing ").split(";")[0]
    assert fnmatch.fnmatch(named, glob), (named, glob)
    assert "is intact: free space and rerun with --resume" in lines[0], lines
    assert finetune(*args, "--out", out, "--resume") == 0
    if mode == "lora":
        for f in ("adapter/adapter_model.safetensors", "checkpoint/trainable.safetensors"):
            a, b = load_file(str(ref / f)), load_file(str(out / f))
            assert a.keys() == b.keys() and all(bits(a[k]).equal(bits(b[k])) for k in a), f
    else:
        same_store(ref / "store", out / "store")
    assert steps_and_losses(out) == steps_and_losses(ref)  # every step once, the same losses
    assert not leftovers(out), leftovers(out)


def test_disk_full_writing_the_token_cache(env, tmp_path, capsys, monkeypatch):
    """No checkpoint yet: the line says so, and the next run (space again) tokenizes and trains."""
    text = tmp_path / "data.txt"
    text.write_text(TINY_TEXT.read_text())
    monkeypatch.setattr(faults, "IO_TARGET", ("*/.phantom-cache/*", 1))
    monkeypatch.setattr(faults, "io_hits", 0)
    code = finetune(*LORA, "--data", text, "--out", tmp_path / "out")
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and ".phantom-cache" in lines[0], lines
    assert lines[0].startswith("error: no space left on device writing ") and "no checkpoint was written yet" in lines[0]
    assert not leftovers(tmp_path), leftovers(tmp_path)
    monkeypatch.setattr(faults, "IO_TARGET", None)
    assert finetune(*LORA, "--data", text, "--out", tmp_path / "out") == 0


def test_a_torn_metrics_tail_is_cut_on_resume(env, reference, tmp_path):
    """A run stopped mid-append (here: a full disk, then half a record as a power cut would leave):
    --resume drops the torn tail and ends with every step once."""
    out = tmp_path / "out"
    assert disk_full("*/metrics.jsonl:5", env, *LORA, "--out", out).returncode == 2
    with open(out / "metrics.jsonl", "ab") as f:
        f.write(b'{"step": 4, "loss": 3.1, "lr": 0.0')  # no newline: the write broke off
    assert finetune(*LORA, "--out", out, "--resume") == 0
    assert steps_and_losses(out) == steps_and_losses(reference)
