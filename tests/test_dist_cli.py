"""`torchrun --nproc-per-node 2 scripts/finetune.py`: two gloo ranks on CPU train the tiny model on
the global batch, rank 0 alone writes, and the adapter matches one process with the same global
batch (AdamW: to 1e-4 of the largest entry, see test_dist.py for why not 1e-5)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import max_rel_err

ROOT = Path(__file__).resolve().parent.parent
COMMON = ["--iters", "4", "--seq-len", "32", "--lr", "1e-2", "--val-split", "0", "--save-every", "0", "-q",
          "--seed", "3", "--offload", "ram"]


def run(cmd, tmp_path):
    env = {**os.environ, "PHANTOM_WEIGHTS": str(tmp_path / "weights"), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def test_torchrun_two_ranks_match_one_process(tmp_path):
    finetune = str(ROOT / "scripts" / "finetune.py")
    run([sys.executable, finetune, "--batch-size", "4", "--out", str(tmp_path / "one")] + COMMON, tmp_path)
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", finetune,
         "--batch-size", "2", "--out", str(tmp_path / "two")] + COMMON, tmp_path)
    one = load_file(str(tmp_path / "one" / "adapter" / "adapter_model.safetensors"))
    two = load_file(str(tmp_path / "two" / "adapter" / "adapter_model.safetensors"))
    assert one.keys() == two.keys()
    for k in one:
        assert max_rel_err(two[k], one[k]) <= 1e-4, k
    assert any(one[k].abs().max() > 0 for k in one if "lora_B" in k)
    lines = (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 4 and json.loads(lines[-1])["tokens"] == 4 * 32  # one writer, global tokens


def test_torchrun_on_a_fresh_clone_makes_things_once_and_speaks_once(tmp_path):
    """No tiny model, no tuning profile yet: both ranks start at once; one makes each thing under a
    lock, the other waits; rank 0 alone prints the summary."""
    finetune = str(ROOT / "scripts" / "finetune.py")
    env = {**os.environ, "PHANTOM_WEIGHTS": str(tmp_path / "weights"), "PHANTOM_CACHE": str(tmp_path / "cache"),
           "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          finetune, "--iters", "2", "--seq-len", "32", "--batch-size", "2", "--val-split", "0",
                          "--eval-every", "0", "--prefetch", "auto", "--offload", "disk", "--device", "cpu",
                          "--out", str(tmp_path / "out")],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("finetune done") == 1, out.stdout
    assert "error" not in out.stderr.lower(), out.stderr[-3000:]


def test_more_local_ranks_than_cuda_devices_is_one_error(monkeypatch):
    from phantom.train import dist as pdist
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    try:
        pdist.init_from_env("cuda")
    except ValueError as e:
        assert "4 ranks" in str(e) and "2 CUDA device(s)" in str(e) and "--device cpu" in str(e)
    else:
        raise AssertionError("no error")


DPO_FIGURES = ("loss", "rewards_chosen", "rewards_rejected", "reward_margin", "reward_accuracy")


def test_torchrun_dpo_two_ranks_match_one_process(tmp_path):
    """--mode dpo on two gloo ranks of 2 pairs each equals one process over the same 4 pairs: the logged
    loss and reward figures (means over the global batch, as one process takes them) and the adapter."""
    finetune = str(ROOT / "scripts" / "finetune.py")
    dpo = [*COMMON, "--mode", "dpo", "--iters", "3"]
    run([sys.executable, finetune, "--batch-size", "4", "--out", str(tmp_path / "one")] + dpo, tmp_path)
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", finetune,
         "--batch-size", "2", "--out", str(tmp_path / "two")] + dpo, tmp_path)
    one, two = ([json.loads(line) for line in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
                for d in ("one", "two"))
    assert [r["step"] for r in one] == [r["step"] for r in two] == [1, 2, 3]
    for a, b in zip(one, two):
        for key in DPO_FIGURES:
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (a["step"], key)
    assert one[-1]["reward_margin"] > 1e-4  # the steps moved the policy off the reference
    adapter = {d: load_file(str(tmp_path / d / "adapter" / "adapter_model.safetensors")) for d in ("one", "two")}
    assert adapter["one"].keys() == adapter["two"].keys()
    for k in adapter["one"]:
        assert max_rel_err(adapter["two"][k], adapter["one"][k]) <= 1e-4, k
