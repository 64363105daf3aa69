"""Experiment trackers (TensorBoard, Weights & Biases, MLflow) fed the records of metrics.jsonl.

Each tracker goes through its own library, imported only when asked for (optional extras). A tracker
that cannot start or fails mid-run is one warning and is dropped: training never dies for its
dashboard, and nothing here touches the training's numbers. A run's wandb and MLflow run ids are kept
in its checkpoint (Reporter.runs), so `--resume` continues the same tracker runs: one curve per run.
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path

log = logging.getLogger(__name__)

TRACKERS = ("tensorboard", "wandb", "mlflow")
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow-skinny"}


def parse_names(text: str | None) -> tuple[str, ...]:
    """`--report-to tensorboard,wandb` -> ("tensorboard", "wandb"); none/empty: ()."""
    names = tuple(dict.fromkeys(n.strip().lower() for n in (text or "").split(",") if n.strip()))
    if names in ((), ("none",)):
        return ()
    if unknown := [n for n in names if n not in TRACKERS]:
        raise ValueError(f"--report-to: unknown tracker {unknown[0]!r}; choose from {', '.join(TRACKERS)} "
                         f"(comma-separated) or none")
    return names


def scalars(rec: dict) -> dict[str, float]:
    """The numbers of a metrics.jsonl record (not its step or its sample text)."""
    return {k: float(v) for k, v in rec.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


class TensorBoard:
    """Event files in OUT/tensorboard, one scalar tag per metrics.jsonl key; the config as text. A resumed
    run purges what an interrupted one logged past its checkpoint, as metrics.jsonl is cut back."""

    run_id = None  # the event files are the run (OUT/tensorboard)

    def __init__(self, out: Path, config: dict, name: str, first_step: int = 1, run_id: str | None = None,
                 group: str | None = None):  # a sweep's adapters: OUT/<name>/tensorboard, one logdir (OUT) shows them
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.writer = SummaryWriter(log_dir=str(out / "tensorboard"), purge_step=first_step if first_step > 1 else None)
        self.writer.add_text("config", "\n".join(f"    {k}: {v}" for k, v in config.items()))

    def log(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandB:
    """A wandb run in OUT/wandb: online when logged in (or WANDB_MODE says), else offline (`wandb sync`).
    Resumed (run_id): the same run, resume="allow"; steps it already holds (an interrupted run's past
    its checkpoint) are skipped, as wandb cannot replace a logged step."""

    def __init__(self, out: Path, config: dict, name: str, first_step: int = 1, run_id: str | None = None,
                 group: str | None = None):
        import wandb

        mode = os.environ.get("WANDB_MODE") or ("online" if wandb.login(prompt=False, verify=False) else "offline")
        quiet = not logging.getLogger().isEnabledFor(logging.INFO)  # finetune.py -q: no wandb banners either
        resume = {"id": run_id, "resume": "allow"} if run_id else {}
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "phantom"), name=name, dir=str(out),
                              group=group, config=config, mode=mode, reinit="create_new", settings=wandb.Settings(silent=quiet),
                              **resume)
        self.run_id, self.next_step = self.run.id, self.run.step  # a resumed online run: past its last step

    def log(self, step: int, values: dict[str, float]) -> None:
        if step >= self.next_step:
            self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class MLflow:
    """An MLflow run in experiment MLFLOW_EXPERIMENT_NAME (default phantom) at MLFLOW_TRACKING_URI,
    default a file store in ./mlruns (mlflow 3 asks MLFLOW_ALLOW_FILE_STORE=true for it, set here).
    Resumed (run_id, where that run exists): the same run, running again; steps up to the last it holds
    are skipped (MLflow keeps every point logged, so a step logged twice would be two points)."""

    def __init__(self, out: Path, config: dict, name: str, first_step: int = 1, run_id: str | None = None,
                 group: str | None = None):
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            uri = Path("mlruns").resolve().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # mlflow 3 asks for it for ./mlruns
        self.client = MlflowClient(tracking_uri=uri)
        experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME", "phantom")
        self.run_id, self.last_step = run_id, -1  # step 0: the eval before training
        if run_id is not None and self.exists(run_id):
            self.client.update_run(run_id, status="RUNNING")  # its params are the run's already
            self.last_step = max((m.step for m in self.client.get_metric_history(run_id, "loss")), default=-1)
            return
        tags = {GROUP_TAG: group} if group else None
        self.run_id = self.client.create_run(self.experiment_id(experiment), run_name=name, tags=tags).info.run_id
        self.client.log_batch(self.run_id, params=[_param(k, v) for k, v in config.items()])

    def exists(self, run_id: str) -> bool:
        try:
            self.client.get_run(run_id)
            return True
        except Exception:  # noqa: BLE001 - mlflow raises MlflowException for a run it does not hold
            log.warning("--report-to mlflow: run %s of the checkpoint is not at %s; starting a new one", run_id,
                        self.client.tracking_uri)
            return False

    def experiment_id(self, name: str) -> str:
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        try:
            return self.client.create_experiment(name)
        except Exception:  # noqa: BLE001 - another run created it first
            return self.client.get_experiment_by_name(name).experiment_id

    def log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        if step <= self.last_step:
            return
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _param(key: str, value):
    from mlflow.entities import Param

    return Param(key, str(value)[:6000])


CLASSES = {"tensorboard": TensorBoard, "wandb": WandB, "mlflow": MLflow}
GROUP_TAG = "phantom.sweep"  # MLflow's tag holding a sweep's name on each adapter's run (wandb: the run's group)


class Reporter:
    """The trackers of a run (`first_step` > 1: a resumed run's first new step; `runs`: the tracker run
    ids its checkpoint kept, as `runs()` gives them; `group`: the sweep an adapter's run belongs to). `log(rec)` takes each metrics.jsonl record; a
    tracker that raises is warned about once and dropped, so the run goes on as it would without it."""

    def __init__(self, names: tuple[str, ...], out: Path, config: dict, name: str, first_step: int = 1,
                 runs: dict | None = None, group: str | None = None):
        self.trackers = {}
        for tracker in names:
            try:
                run_id = (runs or {}).get(tracker)
                self.trackers[tracker] = CLASSES[tracker](Path(out), config, name, first_step, run_id, group)
            except ImportError as e:
                self.warn(tracker, f"{e.name or e} is not installed (pip install {PACKAGES[tracker]})")
            except Exception as e:  # noqa: BLE001 - a tracker never stops training
                self.warn(tracker, f"could not start ({type(e).__name__}: {' '.join(str(e).split())[:300]})")

    def runs(self) -> dict[str, str]:
        """{tracker: run id} of the trackers that have one (wandb, MLflow): what a checkpoint keeps."""
        return {name: t.run_id for name, t in self.trackers.items() if t.run_id}

    @staticmethod
    def warn(tracker: str, what: str) -> None:
        log.warning("--report-to %s: %s; training goes on without it", tracker, what)

    def log(self, rec: dict) -> None:
        values = scalars(rec)
        for tracker in list(self.trackers):
            self._call(tracker, "log", rec["step"], values)

    def close(self) -> None:
        for tracker in list(self.trackers):
            self._call(tracker, "close")
        self.trackers.clear()

    def _call(self, tracker: str, method: str, *args) -> None:
        try:
            getattr(self.trackers[tracker], method)(*args)
        except Exception as e:  # noqa: BLE001 - a tracker never stops training
            self.trackers.pop(tracker)
            self.warn(tracker, f"failed ({type(e).__name__}: {' '.join(str(e).split())[:300]})")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
