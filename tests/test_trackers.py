"""`finetune.py --report-to`: each tracker holds what metrics.jsonl holds, read back through the tracker's
own reader (TensorBoard's event accumulator, MLflow's client, wandb's offline run folder); trackers never
change the weights; one that is missing, down or raising mid-run is one warning and the run goes on.
"""
from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import need
from phantom.train import trackers
from test_convert import load_script
from test_finetune_cli import metrics


TINY = ["--model", "tiny", "--iters", "4", "--batch-size", "2", "--seq-len", "32", "--eval-every", "2",
        "--eval-iters", "1", "--save-every", "0", "--offload", "ram", "-q"]


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: a second thread only waits on a shared machine
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def tracker_env(monkeypatch, tmp_path):
    """No tracker reaches past tmp_path: no login, no server, mlruns/ in the test's own folder."""
    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_ALLOW_FILE_STORE", "MLFLOW_EXPERIMENT_NAME", "WANDB_API_KEY",
                "WANDB_MODE", "WANDB_PROJECT", "WANDB_DIR"):
        monkeypatch.delenv(var, raising=False)  # restored (and what a run set undone) after the test
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="module")
def cli():
    return load_script("finetune")


def series(out: Path) -> dict[str, list[tuple[int, float]]]:
    """metrics.jsonl as key -> [(step, value)], the scalars a tracker is given."""
    out_: dict[str, list] = {}
    for rec in metrics(out):
        for key, value in trackers.scalars(rec).items():
            out_.setdefault(key, []).append((rec["step"], value))
    return out_


def adapter(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "adapter" / "adapter_model.safetensors"))


def same_weights(a: Path, b: Path) -> bool:
    wa, wb = adapter(a), adapter(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


@pytest.fixture(scope="module")
def plain(cli, tmp_path_factory):
    out = tmp_path_factory.mktemp("plain") / "out"
    assert cli.main([*TINY, "--out", str(out)]) == 0
    return out


def test_scalars_are_the_numbers_of_a_record():
    rec = {"step": 3, "loss": 2.5, "tokens": 64, "sample": "text", "val_loss": 2.0, "flag": True}
    assert trackers.scalars(rec) == {"loss": 2.5, "tokens": 64.0, "val_loss": 2.0}


def test_report_to_names():
    assert trackers.parse_names("none") == () and trackers.parse_names("") == ()
    assert trackers.parse_names("TensorBoard, wandb,tensorboard") == ("tensorboard", "wandb")
    with pytest.raises(ValueError, match="unknown tracker 'comet'"):
        trackers.parse_names("tensorboard,comet")


def test_every_tracker_holds_the_metrics_and_the_weights_do_not_change(cli, plain, tmp_path, capsys):
    event_accumulator = need("tensorboard.backend.event_processing.event_accumulator")
    mlflow = need("mlflow")
    need("wandb")
    out = tmp_path / "tracked"
    assert cli.main([*TINY, "--report-to", "tensorboard,wandb,mlflow", "--out", str(out)]) == 0
    assert "--report-to" not in capsys.readouterr().err  # no tracker failed
    assert [r.get("loss") for r in metrics(out)] == [r.get("loss") for r in metrics(plain)]
    assert same_weights(out, plain)
    want = series(out)
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "stall_frac", "bytes_h2d", "val_loss"} <= want.keys()
    assert want["val_loss"][0][0] == 0 and len(want["loss"]) == 4  # the eval before training, then each step

    acc = event_accumulator.EventAccumulator(str(out / "tensorboard"), size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == want.keys()
    for key, points in want.items():
        assert [(e.step, e.value) for e in acc.Scalars(key)] == [(s, f32(v)) for s, v in points], key
    assert "lora-rank: 8" in acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()

    client = mlflow.tracking.MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("phantom").experiment_id])
    assert run.info.run_name == "tracked" and run.info.status == "FINISHED"
    assert run.data.params["lora-rank"] == "8" and run.data.params["iters"] == "4"
    assert run.data.params["recorded-torch"] == torch.__version__
    assert len(run.data.params["recorded-store-fingerprint"]) == 64
    for key, points in want.items():
        assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)] == points, key

    (folder,) = (out / "wandb").glob("offline-run-*")  # offline: no login in this environment
    (log,) = folder.glob("run-*.wandb")
    raw = log.read_bytes()  # the run's protobuf records; each history item keeps its value as JSON text
    assert all(key.encode() in raw for key in want) and b"lora-rank" in raw
    assert all(json.dumps(v).encode() in raw for v in (want["loss"][-1][1], want["val_loss"][-1][1]))


def test_a_tracker_raising_mid_run_is_one_warning_and_the_run_ends_the_same(cli, plain, tmp_path, capsys,
                                                                             monkeypatch):
    need("tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    real = SummaryWriter.add_scalar

    def flaky(self, tag, value, step=None, *args, **kw):
        if step == 2:
            raise ConnectionError("disk of the dashboard went away")
        return real(self, tag, value, step, *args, **kw)

    monkeypatch.setattr(SummaryWriter, "add_scalar", flaky)
    out = tmp_path / "flaky"
    assert cli.main([*TINY, "--report-to", "tensorboard", "--out", str(out)]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "--report-to" in line]
    assert warnings == ["--report-to tensorboard: failed (ConnectionError: disk of the dashboard went away); "
                        "training goes on without it"]
    assert [r.get("loss") for r in metrics(out)] == [r.get("loss") for r in metrics(plain)]
    assert same_weights(out, plain) and (out / "README.md").is_file()


def test_a_missing_or_unreachable_tracker_is_one_warning_each(cli, plain, tmp_path, capsys, monkeypatch):
    need("mlflow")
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError: not installed
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    out = tmp_path / "down"
    assert cli.main([*TINY, "--report-to", "wandb,mlflow", "--out", str(out)]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "--report-to" in line]
    assert len(warnings) == 2, warnings
    assert warnings[0].startswith("--report-to wandb: ") and "not installed (pip install wandb)" in warnings[0]
    assert warnings[1].startswith("--report-to mlflow: could not start (") and warnings[1].endswith(
        "training goes on without it")
    assert same_weights(out, plain)


def test_under_torchrun_rank_0_alone_reports(tmp_path):
    """Two gloo ranks, --report-to tensorboard: one event file (rank 0's), holding the losses of metrics.jsonl."""
    event_accumulator = need("tensorboard.backend.event_processing.event_accumulator")
    finetune = Path(__file__).resolve().parent.parent / "scripts" / "finetune.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = tmp_path / "two"
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(finetune), "--iters", "2", "--seq-len", "32", "--batch-size", "2", "--val-split", "0",
                          "--save-every", "0", "--offload", "ram", "-q", "--report-to", "tensorboard",
                          "--out", str(out)], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    (events,) = (out / "tensorboard").glob("events.out.tfevents.*")
    acc = event_accumulator.EventAccumulator(str(events), size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(s, f32(v)) for s, v in series(out)["loss"]]
    assert (out / "config.yaml").is_file() and (out / "README.md").is_file()


def test_a_resumed_run_replaces_what_tensorboard_got_past_the_checkpoint(cli, tmp_path):
    """A run killed after its checkpoint at step 2 had logged steps 3 and 4 (written here with other
    values); --resume trains 3 and 4 again: TensorBoard holds each step once, as metrics.jsonl does."""
    event_accumulator = need("tensorboard.backend.event_processing.event_accumulator")
    from torch.utils.tensorboard import SummaryWriter

    out = tmp_path / "run"
    base = [*TINY, "--report-to", "tensorboard", "--out", str(out)]
    assert cli.main([*base, "--iters", "2"]) == 0
    stale = SummaryWriter(log_dir=str(out / "tensorboard"))
    for step in (3, 4):
        stale.add_scalar("loss", 99.0, step)
    stale.close()
    assert cli.main([*base, "--resume"]) == 0
    acc = event_accumulator.EventAccumulator(str(out / "tensorboard"), size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(s, f32(v)) for s, v in series(out)["loss"]]
    assert [s for s, _ in series(out)["loss"]] == [1, 2, 3, 4]


def wandb_steps(log: Path) -> list[int]:
    """The `_step` of each history record in an offline run's .wandb file (the value's JSON follows the key)."""
    raw, key, steps = log.read_bytes(), b"\x12\x05_step\x82\x01", []
    at = raw.find(key)
    while at >= 0:
        n = raw[at + len(key)]
        steps.append(int(raw[at + len(key) + 1:at + len(key) + 1 + n]))
        at = raw.find(key, at + 1)
    return sorted(set(steps))


def test_a_resumed_run_continues_its_wandb_and_mlflow_runs(cli, tmp_path):
    """--resume logs into the tracker runs the checkpoint kept: MLflow holds one run whose steps run on
    1..4, each once, as metrics.jsonl (a step the interrupted run had logged past its checkpoint, here
    3, is skipped: MLflow keeps every point); wandb (offline) continues the same run id with steps 3, 4."""
    mlflow = need("mlflow")
    need("wandb")
    out = tmp_path / "run"
    base = [*TINY, "--report-to", "wandb,mlflow", "--out", str(out)]
    assert cli.main([*base, "--iters", "2"]) == 0
    meta = json.loads((out / "checkpoint" / "meta.json").read_text())
    assert meta["trackers"].keys() == {"wandb", "mlflow"}
    client = mlflow.tracking.MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    from mlflow.entities import Metric
    stale = [Metric(key, 99.0, 0, 3) for key in ("loss", "lr")]  # step 3 logged, then killed before its checkpoint
    client.log_batch(meta["trackers"]["mlflow"], metrics=stale)
    assert cli.main([*base, "--resume"]) == 0
    assert json.loads((out / "checkpoint" / "meta.json").read_text())["trackers"] == meta["trackers"]
    (run,) = client.search_runs([client.get_experiment_by_name("phantom").experiment_id])
    assert run.info.run_id == meta["trackers"]["mlflow"] and run.info.status == "FINISHED"
    want = series(out)
    for key in ("loss", "lr"):
        got = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
        assert got == [*want[key][:2], (3, 99.0), want[key][3]], key
    folders = sorted((out / "wandb").glob("offline-run-*"), key=lambda f: f.name)
    # wandb names a run's folder offline-run-<time>-<id>, with -1 added where two start in the same second
    named = re.compile(rf"offline-run-\d{{8}}_\d{{6}}-{re.escape(meta['trackers']['wandb'])}(-\d+)?")
    assert len(folders) == 2 and all(named.fullmatch(f.name) for f in folders), [f.name for f in folders]
    assert [wandb_steps(next(f.glob("run-*.wandb"))) for f in folders] == [[0, 1, 2], [3, 4]]


def test_a_sweep_s_adapter_runs_are_grouped_by_the_sweep(tmp_path, monkeypatch):
    """Each adapter of a sweep is its own tracker run, in the sweep's group: wandb's run group (read back from
    its offline run), MLflow's tag `phantom.sweep` (read back through MLflow's client)."""
    need("wandb")
    need("mlflow")
    monkeypatch.setenv("WANDB_MODE", "offline")
    with trackers.Reporter(("wandb", "mlflow"), tmp_path / "a", {"lr": 1e-3}, "sw/a", group="sw") as reporter:
        assert reporter.trackers.keys() == {"wandb", "mlflow"}
        assert reporter.trackers["wandb"].run.group == "sw"
        mlflow = reporter.trackers["mlflow"]
        run = mlflow.client.get_run(mlflow.run_id)
        assert run.data.tags[trackers.GROUP_TAG] == "sw" and run.info.run_name == "sw/a"
