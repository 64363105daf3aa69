"""scripts/finetune.py end to end: outputs, one-line errors, SIGKILL + --resume bit-exact, Ctrl-C, plot."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from phantom.files.store import BlockStore
from test_convert import load_script

ROOT = Path(__file__).resolve().parent.parent
FINETUNE = ROOT / "scripts" / "finetune.py"
SMALL = ["--iters", "8", "--batch-size", "4", "--seq-len", "64", "--eval-every", "4", "--eval-iters", "2"]


@pytest.fixture(scope="module")
def cli():
    return load_script("finetune")


def run(*args, **kw):
    return subprocess.run([sys.executable, str(FINETUNE), *map(str, args)], capture_output=True, text=True,
                          timeout=120, **kw)


def metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_finetune_writes_adapter_metrics_and_summary(tmp_path):
    r = run(*SMALL, "--out", tmp_path, "--sample-every", "8", "--trace")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["r"] == 8
    assert len(load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))) == 4 * 2 * 2  # layers, q/v, A/B
    recs = metrics(tmp_path)
    assert [r_["step"] for r_ in recs] == list(range(9))  # step 0: the eval before training
    assert all(k in recs[1] for k in ("loss", "lr", "tokens_per_s", "stall_frac", "bytes_read"))
    assert "val_loss" in recs[4] and "sample" in recs[8]
    assert json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert "finetune done" in r.stdout and str(tmp_path / "adapter") in r.stdout


@pytest.mark.parametrize("args, match", [
    (["--data", "/nonexistent/data.txt"], "data file /nonexistent/data.txt not found"),
    (["--iters", "0"], "--iters must be >= 1"),
    (["--model", "nosuchmodel"], "unknown model 'nosuchmodel'"),
    (["--seq-len", "4096"], "exceeds the model's max_seq_len 512"),
    (["--val-split", "0.02"], "the held-out data (83 tokens) is shorter than one sequence of 128 + 1"),
    (["--lora-targets", "q,x"], "unknown LoRA targets"),
    (["--resume"], "no checkpoint"),
    (["--mode", "full", "--resume"], "no checkpoint"),
])
def test_user_errors_are_one_line_exit_2(cli, capsys, tmp_path, args, match):
    code = cli.main([*args, "--out", str(tmp_path), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: ") and match in err, err


def test_bad_json_line_through_the_cli(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"prompt": "a", "response": "b"}\n{oops}\n')
    r = run("--data", tmp_path / "d.jsonl", "--out", tmp_path / "o", "-q")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [f"error: {tmp_path / 'd.jsonl'}:2: not valid JSON (Expecting property "
                                             f"name enclosed in double quotes); JSONL needs one JSON object per line"]


def test_full_mode_writes_the_trained_store(tmp_path):
    r = run(*SMALL, "--iters", "3", "--mode", "full", "--offload", "ram", "--lr", "1e-3", "--out", tmp_path, "-q")
    assert r.returncode == 0, r.stderr
    assert f"weights      {tmp_path / 'store'}" in r.stdout and not (tmp_path / "adapter").exists()
    losses = [m["loss"] for m in metrics(tmp_path) if "loss" in m]
    assert len(losses) == 3 and losses[-1] < losses[0]
    BlockStore(tmp_path / "store", verify="full")  # complete and consistent


def test_full_mode_rerun_into_the_same_out_starts_from_the_base_model(tmp_path):
    args = [*SMALL, "--iters", "2", "--mode", "full", "--offload", "disk", "--lr", "1e-3", "--eval-every", "0",
            "--val-split", "0", "-q"]
    for out, again in (("a", []), ("b", []), ("b", ["--overwrite"])):  # b twice: the second run must not
        assert run(*args, *again, "--out", tmp_path / out).returncode == 0  # continue from the first's weights
    a, b = BlockStore(tmp_path / "a" / "store"), BlockStore(tmp_path / "b" / "store")
    assert (a.load_block(0)["attention.wq.weight"] == b.load_block(0)["attention.wq.weight"]).all()


def killed_at(point: str, *args) -> subprocess.CompletedProcess:
    """finetune.py SIGKILLed by itself at a named point (phantom/base/faults.py): the same instant every run."""
    r = run(*args, env={**os.environ, "PHANTOM_FAULT": point})
    assert r.returncode == -signal.SIGKILL, f"{point} was never reached (exit {r.returncode}): {r.stderr[-2000:]}"
    return r


def wait_until(done, proc: subprocess.Popen, what: str, timeout: float = 60) -> None:
    """Poll for an event the process causes (a file, a line); fail if it exits or never does."""
    t0 = time.time()
    while not done():
        assert proc.poll() is None, proc.communicate()
        assert time.time() - t0 < timeout, f"{what} did not happen in {timeout} s"
        time.sleep(0.02)


def test_sigkill_then_resume_ends_bit_identical(tmp_path):
    args = [*SMALL, "--iters", "12", "--save-every", "2", "--lora-targets", "q,k,v,o", "-q"]
    ref = run(*args, "--out", tmp_path / "ref")
    assert ref.returncode == 0, ref.stderr
    out = tmp_path / "run"
    killed_at("metrics.write:5", *args, "--out", out)  # step 5 logged, its checkpoint (step 6) not written
    step = json.loads((out / "checkpoint" / "meta.json").read_text())["step"]
    assert step == 4 and not (out / "adapter").exists()
    assert metrics(out)[-1]["step"] == 5  # a step past the checkpoint: --resume must cut the log back
    r = run(*args, "--out", out, "--resume")
    assert r.returncode == 0, r.stderr
    a, b = (load_file(str(d / "adapter" / "adapter_model.safetensors")) for d in (tmp_path / "ref", out))
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    a, b = (load_file(str(d / "checkpoint" / "trainable.safetensors")) for d in (tmp_path / "ref", out))
    assert all((a[k] == b[k]).all() for k in a)
    losses = [[m["loss"] for m in metrics(d) if "loss" in m] for d in (out, tmp_path / "ref")]
    assert losses[0] == losses[1]


@pytest.mark.parametrize("offload", ["disk", "ram"])
def test_full_mode_sigkill_mid_step_then_resume_ends_bit_identical(tmp_path, offload):
    """A kill after a checkpoint, in the middle of a step whose blocks are being rewritten (the write-back
    worker about to update the second block of step 3; the checkpoint is step 2's): --resume rolls the
    working store back to the checkpoint's snapshot and ends where a run that never stopped ends, bit for
    bit (every block, head and embedding)."""
    args = [*SMALL, "--iters", "8", "--save-every", "2", "--mode", "full", "--offload", offload, "--lr", "1e-3",
            "--eval-every", "0", "--val-split", "0", "-q"]
    ref = run(*args, "--out", tmp_path / "ref")
    assert ref.returncode == 0, ref.stderr
    out = tmp_path / "run"
    killed_at("writeback.item:10", *args, "--out", out)  # 4 block updates a step: step 3's second
    assert json.loads((out / "checkpoint" / "meta.json").read_text())["step"] == 2
    r = run(*args, "--out", out, "--resume")
    assert r.returncode == 0, r.stderr
    a, b = BlockStore(tmp_path / "ref" / "store", verify="full"), BlockStore(out / "store", verify="full")
    for i in range(a.n_blocks):
        x, y = a.load_block(i), b.load_block(i)
        assert all((x[k] == y[k]).all() for k in x), i
    assert all((a.load_head()[k] == b.load_head()[k]).all() for k in a.load_head())
    assert (a.load_embed()["tok_embeddings.weight"] == b.load_embed()["tok_embeddings.weight"]).all()


def test_ctrl_c_saves_a_checkpoint_and_exits_cleanly(tmp_path):
    proc = subprocess.Popen([sys.executable, str(FINETUNE), *SMALL, "--iters", "100000", "--save-every", "0",
                             "--eval-every", "0", "--out", str(tmp_path), "-q"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = tmp_path / "metrics.jsonl"  # the eval of step 0, then a line per step: steps 1 and 2 are done
    wait_until(lambda: log.is_file() and len(log.read_text().splitlines()) >= 3, proc, "step 2")
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    step = json.loads((tmp_path / "checkpoint" / "meta.json").read_text())["step"]
    assert step >= 2 and "finetune interrupted" in out and "Traceback" not in err
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    assert metrics(tmp_path)[-1]["step"] == step


def test_plot_draws_loss_and_timeline(tmp_path):
    pytest.importorskip("matplotlib")
    r = run(*SMALL, "--out", tmp_path, "--trace", "-q")
    assert r.returncode == 0, r.stderr
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "plot.py"), "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    for name in ("loss.png", "timeline.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


FULL_SHORT = ["--iters", "4", "--batch-size", "2", "--seq-len", "32", "--mode", "full", "--offload", "disk",
              "--lr", "1e-3", "--eval-every", "0", "--val-split", "0", "--save-every", "1", "-q"]


def test_preflight_refuses_a_run_that_cannot_fit(cli, tmp_path, capsys, monkeypatch):
    import phantom.train.checkpoint
    monkeypatch.setattr(phantom.train.checkpoint, "free_bytes", lambda path: 5_000_000)  # 5 MB free
    assert cli.main([*FULL_SHORT, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "5.0 MB free but this run will write about" in err[0] and "working store" in err[0], err
    assert not (tmp_path / "out" / "checkpoint").exists() and not (tmp_path / "out" / "metrics.jsonl").exists()


def written_bytes(out: Path, base: set[int]) -> int:
    """Bytes of the distinct files under out that are not the base store's (hard links to it cost nothing)."""
    seen, total = set(), 0
    for root, _, files in os.walk(out):  # os.walk skips a folder renamed away mid-walk; Path.rglob raises
        for name in files:
            try:
                st = os.stat(os.path.join(root, name))
            except FileNotFoundError:  # replaced while we looked
                continue
            if st.st_ino not in base and st.st_ino not in seen:
                seen.add(st.st_ino)
                total += st.st_size
    return total


def test_preflight_estimate_is_within_20_percent_of_a_full_runs_peak(tmp_path):
    """What a short full-mode run holds in --out at its peak against the plan. The peak lasts from the
    writing of a checkpoint to the removal of the one it replaces: the old one's snapshot still holds
    the previous store and optimizer state while the working store has the new ones. The run is killed
    there (between the two renames of its third checkpoint), so the folder is measured as it was at
    that instant, not sampled while it changes."""
    import phantom
    import phantom.train.checkpoint
    import phantom.train.trainconfig
    store_dir = phantom.resolve_model("tiny")
    base = {p.stat().st_ino for p in store_dir.rglob("*") if p.is_file()}
    out = tmp_path / "out"
    killed_at("checkpoint.rename:3", *FULL_SHORT, "--out", out)
    assert (out / "checkpoint.old").is_dir() and (out / "checkpoint.tmp").is_dir()  # both checkpoints held
    peak = written_bytes(out, base)
    with phantom.load(store_dir, device="cpu", offload="disk", mode="full", work_dir=tmp_path / "plan") as model:
        plan = phantom.train.checkpoint.planned_bytes(model, phantom.train.trainconfig.TrainConfig(iters=4, out=str(out)))
    assert abs(sum(plan.values()) - peak) <= 0.2 * peak, (plan, peak, os.environ.get("PHANTOM_WEIGHTS"))


def test_default_lr_follows_the_models_size_not_its_name(cli, tmp_path):
    import phantom
    lrs = []
    for name, model in (("a", "tiny"), ("b", str(phantom.resolve_model("tiny")))):
        assert cli.main(["--model", model, "--iters", "1", "--warmup", "0", "--batch-size", "2", "--seq-len", "32",
                         "--eval-every", "0", "--val-split", "0", "-q", "--out", str(tmp_path / name)]) == 0
        lrs.append(metrics(tmp_path / name)[-1]["lr"])
    assert lrs[0] == lrs[1] == 1e-2, lrs


@pytest.mark.parametrize("batch, accum", [(3, 2), (5, 1), (1, 3)])
def test_odd_batch_and_accumulation_with_the_tuner(cli, tmp_path, batch, accum):
    assert cli.main(["--iters", "2", "--batch-size", str(batch), "--grad-accum", str(accum), "--seq-len", "32",
                     "--prefetch", "auto", "--offload", "disk", "--eval-every", "0", "--val-split", "0", "-q",
                     "--out", str(tmp_path)]) == 0
    assert metrics(tmp_path)[-1]["tokens"] == batch * accum * 32


def test_the_tuners_prediction_is_printed_beside_the_measured_step(cli, tmp_path, capsys):
    """--prefetch auto: the plan is logged at the start, and the summary ends with the measured step
    (the median past the first, as metrics.jsonl has them) beside the prediction."""
    import statistics
    assert cli.main(["--iters", "4", "--batch-size", "2", "--seq-len", "32", "--prefetch", "auto", "--offload", "disk",
                     "--eval-every", "0", "--val-split", "0", "-q", "--out", str(tmp_path)]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    m = re.fullmatch(r"measured\s+([\d.]+) s/step, \S+ tokens/s; predicted ([\d.]+) s \(([+-]\d+)%\)", line)
    assert m, line
    steps = [r["step_s"] for r in metrics(tmp_path)]
    assert float(m[1]) == pytest.approx(statistics.median(steps[1:]), abs=1e-3)
    assert float(m[2]) > 0

def test_a_bug_keeps_its_traceback(cli, tmp_path, capsys, monkeypatch):
    """A ValueError from deep inside a library is a bug, not bad input: a line saying so, then the traceback."""
    import phantom.train.loop

    def broken(*a, **k):
        return json.loads("{")  # a ValueError raised inside a library, not by phantom's checks

    monkeypatch.setattr(phantom.train.loop, "planned_bytes", broken)
    with pytest.raises(ValueError, match="Expecting property name"):
        cli.main(["--iters", "1", "-q", "--out", str(tmp_path)])
    assert "internal error: this is a bug" in capsys.readouterr().err


def test_a_second_run_into_the_same_out_is_refused(cli, tmp_path, capsys):
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; sys.path.insert(0, sys.argv[1]); "
                               "from phantom.base import fileio\nwith fileio.locked(sys.argv[2] + '/.lock'):\n"
                               "    print('held', flush=True); time.sleep(60)", str(ROOT), str(tmp_path)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert cli.main(["--iters", "1", "-q", "--out", str(tmp_path)]) == 2
        assert "is in use by another finetune run" in capsys.readouterr().err
    finally:
        holder.kill()
        holder.wait()
    assert cli.main(["--iters", "1", "-q", "--val-split", "0", "--eval-every", "0", "--seq-len", "32",
                     "--out", str(tmp_path)]) == 0  # the killed holder's lock is gone


def test_a_store_without_tokenizer_trains_from_token_ids(cli, tmp_path, capsys):
    """A synthetic store (no tokenizer) trains from a .bin of uint16 ids with a held-out split; text
    data for it is one error line."""
    import numpy as np
    from phantom.arch.config import ModelConfig
    from phantom.convert.synthetic import write_synthetic
    cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=300, multiple_of=16, max_seq_len=64)
    store = write_synthetic(tmp_path / "syn", cfg, seed=0) or tmp_path / "syn"
    ids = np.random.default_rng(1).integers(0, 300, 4000).astype(np.uint16)
    ids.tofile(tmp_path / "train.bin")
    args = ["--model", str(store), "--data", str(tmp_path / "train.bin"), "--iters", "4", "--batch-size", "2",
            "--seq-len", "32", "--eval-every", "2", "--eval-iters", "1", "--save-every", "2", "--offload", "disk",
            "--prefetch", "1", "-q"]
    assert cli.main([*args, "--out", str(tmp_path / "one")]) == 0
    assert cli.main([*args, "--out", str(tmp_path / "err"), "--data", str(tmp_path / "train.txt")]) == 2
    assert "has no tokenizer" in capsys.readouterr().err
    recs = metrics(tmp_path / "one")
    assert recs[-1]["step"] == 4 and "val_loss" in recs[-1]
    a = load_file(str(tmp_path / "one" / "adapter" / "adapter_model.safetensors"))
    assert a and any(v.abs().max() > 0 for k, v in a.items() if "lora_B" in k)
