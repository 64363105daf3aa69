"""finetune.py with several adapters: --sweep's grid and a run file's adapters: list, each adapter a run
folder of its own and OUT/sweep.md; SIGKILL between two adapters' checkpoints, then --resume, ends as the
run that never stopped; bad adapter lists are one error line."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

FINETUNE = Path(__file__).resolve().parent.parent / "scripts" / "finetune.py"
SMALL = ["--iters", "6", "--batch-size", "2", "--seq-len", "32", "--eval-every", "3", "--eval-iters", "2",
         "--offload", "disk", "-q"]
RUN_FILE = """
adapters:
  - {name: a, lr: 1.0e-2, lora-dropout: 0.1}
  - {name: b, lr: 3.0e-2, lora-rank: 4, lora-targets: [q, k, v, o], seed: 5}
"""


def run(*args, env=None):
    env = {**(env or os.environ), "OMP_NUM_THREADS": "1"}  # tiny steps: one thread is fastest on a busy machine
    return subprocess.run([sys.executable, str(FINETUNE), *map(str, args)], capture_output=True, text=True,
                          timeout=300, env=env)


def metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_sweep_grid_trains_each_adapter_in_its_own_folder(tmp_path):
    r = run(*SMALL, "--iters", "2", "--sweep", "lr=1e-2,3e-2", "--sweep", "lora-rank=4,8", "--out", tmp_path)
    assert r.returncode == 0, r.stderr
    names = ["lr=1e-2_lora-rank=4", "lr=1e-2_lora-rank=8", "lr=3e-2_lora-rank=4", "lr=3e-2_lora-rank=8"]
    for name in names:
        d = tmp_path / name
        assert json.loads((d / "adapter" / "adapter_config.json").read_text())["r"] == int(name[-1])
        assert [m["step"] for m in metrics(d)] == [0, 1, 2] and (d / "README.md").is_file()
        assert "--lr" in (d / "README.md").read_text() and (d / "config.yaml").is_file()
        assert name in r.stdout
    table = (tmp_path / "sweep.md").read_text()
    assert all(f"| {n} |" in table for n in names) and table.strip() in r.stdout
    assert "adapters:" in (tmp_path / "config.yaml").read_text()


def test_sigkill_between_adapters_then_resume_ends_as_the_run_that_never_stopped(tmp_path):
    (tmp_path / "run.yaml").write_text(RUN_FILE)
    args = [*SMALL, "--config", tmp_path / "run.yaml", "--save-every", "2"]
    ref = run(*args, "--out", tmp_path / "ref")
    assert ref.returncode == 0, ref.stderr
    out = tmp_path / "run"
    # records: step 1 a b, step 2 a b (checkpoints), 3 a b, 4 a (a's checkpoint of step 4) b: killed there
    r = run(*args, "--out", out, env={**os.environ, "PHANTOM_FAULT": "metrics.write:8"})
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    steps = {n: json.loads((out / n / "checkpoint" / "meta.json").read_text())["step"] for n in "ab"}
    assert steps == {"a": 4, "b": 2}
    r = run(*args, "--out", out, "--resume")
    assert r.returncode == 0, r.stderr
    for n in "ab":
        for f in ("adapter/adapter_model.safetensors", "checkpoint/trainable.safetensors"):
            got, want = (load_file(str(d / n / f)) for d in (out, tmp_path / "ref"))
            assert got.keys() == want.keys() and all((got[k] == want[k]).all() for k in want)
        strip = lambda recs: [(m["step"], m.get("loss"), m.get("val_loss")) for m in recs]  # noqa: E731
        assert strip(metrics(out / n)) == strip(metrics(tmp_path / "ref" / n))


@pytest.mark.parametrize("text, match", [
    ("adapters: [{name: a, iters: 3}]", "adapters: a: 'iters' is shared by every adapter"),
    ("adapters: [{lr: 1.0e-3}]", "adapters: each needs a name"),
    ("adapters: [{name: a}, {name: a}]", "the name 'a' is given twice"),
    ("adapters: [{name: a, lora-rank: x}]", "adapters: a: lora-rank: expected an integer"),
])
def test_bad_adapters_are_one_error_line(tmp_path, text, match):
    (tmp_path / "run.yaml").write_text(text)
    r = run("--config", tmp_path / "run.yaml", "--out", tmp_path / "out")
    assert r.returncode == 2 and r.stderr.startswith("error: ") and match in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()
