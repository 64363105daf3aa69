"""lm-evaluation-harness tasks run on a phantom model (phantom.train.lmeval's PhantomLM) with lm-eval's own
evaluator: what scripts/evaluate.py and evaluation during training share.

Task names are resolved before any model work: an --include-path's own tasks (or YAML files given by path)
without indexing lm-eval's thousands of tasks (seconds per index), else with them; an unknown name is one
line. Datasets are read offline, from the local cache (HF_DATASETS_OFFLINE and HF_HUB_OFFLINE are set
unless the environment says otherwise): a task whose data is not there is one line too. Output files are
lm-eval's EvaluationTracker's (OUT/MODEL/results_DATE.json, with --log-samples samples_TASK_DATE.jsonl),
written into a temporary folder beside OUT and each put in place whole (phantom.base.fileio).
"""
from __future__ import annotations

import os

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # before datasets is imported: the local cache only
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import random  # noqa: E402
import shutil  # noqa: E402
from pathlib import Path  # noqa: E402

import lm_eval  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from lm_eval.loggers import EvaluationTracker  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402
from lm_eval.utils import make_table  # noqa: E402

from phantom.base import fileio  # noqa: E402
from phantom.train.lmeval import PhantomLM  # noqa: E402

__all__ = ["DuringTraining", "EvaluationTracker", "PhantomLM", "evaluate", "load_tasks", "metrics_record", "prepare",
           "save", "table", "task_manager"]


def task_manager(names: list[str], include_path: str | None = None) -> TaskManager:
    """A TaskManager that knows every name: the include path's tasks (and YAML paths) alone where that is
    enough, else lm-eval's own as well.

    Raises:
        ValueError: a name no task, group or tag has, and no YAML file is.
    """
    if include_path is not None and not Path(include_path).is_dir():
        raise FileNotFoundError(f"--include-path {include_path}: no such folder")
    local = TaskManager(include_path=include_path, include_defaults=False)
    if all(_known(local, n) for n in names):
        return local
    every = TaskManager(include_path=include_path)
    if unknown := [n for n in names if not _known(every, n)]:
        where = f" nor in {include_path}" if include_path else ""
        raise ValueError(f"unknown task {unknown[0]!r}: not one of lm-eval's tasks, groups or tags{where}, nor a YAML "
                         f"file; `lm-eval ls tasks` lists them")
    return every


def _known(tm: TaskManager, name: str) -> bool:
    return name in tm.all_tasks or (Path(name).suffix in (".yaml", ".yml") and Path(name).is_file())


def load_tasks(tm: TaskManager, names: list[str]) -> list:
    """The tasks and groups the names stand for, built (their documents read) now, so a dataset that is not
    in the local cache stops the run before the model does any work.

    Raises:
        ValueError: a task's dataset could not be read (named, with the library's reason).
    """
    built = []
    for name in names:
        try:
            loaded = tm.load([name])
        except (FileNotFoundError, ConnectionError) as e:
            raise ValueError(f"task {name}: its dataset could not be read ({' '.join(str(e).split())[:300]}); datasets "
                             f"are read offline, from local files and the local cache: load a Hub dataset once where "
                             f"the Hub is reachable") from None
        inner = {c for kids in loaded["group_map"].values() for c in kids}
        built += [g for n, g in loaded["groups"].items() if n not in inner]
        grouped = {t.task_name for g in loaded["groups"].values() for t in g.get_all_tasks()}
        built += [t for n, t in loaded["tasks"].items() if n not in grouped]
    return built


def prepare(names: list[str], include_path: str | None = None) -> tuple[TaskManager, list]:
    """(the TaskManager, the tasks of these names built): everything that can fail on a name or a dataset,
    done before a model is loaded (task_manager, then load_tasks)."""
    tm = task_manager(names, include_path)
    return tm, load_tasks(tm, names)


def evaluate(lm: PhantomLM, prepared: tuple[TaskManager, list], name: str | None = None, **options) -> dict:
    """lm-eval's simple_evaluate of the prepared tasks on lm (options: its num_fewshot, limit, log_samples,
    evaluation_tracker, bootstrap_iters...): its results dict. `name`: the model's name in the output files'
    folder (default: its store's path). The tasks' own TaskManager goes with them: without one lm-eval indexes
    all of its tasks again."""
    tm, tasks = prepared
    model_args = {"pretrained": name or str(lm.model.store.path)}
    return lm_eval.simple_evaluate(model=lm, model_args=model_args, tasks=tasks, task_manager=tm, **options)


class DuringTraining:
    """The tasks a training run evaluates the model it trains on (finetune.py --eval-tasks): checked when made
    (names and datasets, before any step), run with lm-eval's seeds and without stderr bootstrapping, the
    run's random states left as they were (a run with evaluations trains as one without)."""

    def __init__(self, names: tuple[str, ...], tokenizer, limit: int | None = None, batch_size: int | None = None):
        if tokenizer is None:
            raise ValueError("--eval-tasks needs the model's tokenizer; prepare the store with one")
        self.names, self.tokenizer, self.limit, self.batch_size = list(names), tokenizer, limit, batch_size
        prepare(self.names)

    def __call__(self, model) -> dict:
        """The tasks' metrics on the model as it is now (metrics_record)."""
        states = random.getstate(), np.random.get_state()
        devices = [model.device] if model.device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=devices):
                lm = PhantomLM(model, tokenizer=self.tokenizer, batch_size=self.batch_size or "auto")
                results = evaluate(lm, prepare(self.names), limit=self.limit, bootstrap_iters=0)
        finally:
            random.setstate(states[0])
            np.random.set_state(states[1])
        return metrics_record(results)


def save(results: dict, out: Path, tracker: EvaluationTracker) -> list[Path]:
    """lm-eval's output files of a run (the tracker's layout under `out`), each put in place whole: written
    by the tracker into a temporary folder beside out, then moved file by file (samples first, the results
    last). Returns the files written."""
    out = Path(out).absolute()
    tmp = fileio.temp_folder(out)
    try:
        tracker.output_path = str(tmp / out.name)
        samples = results.pop("samples", None)
        tracker.save_results_aggregated(results=results, samples=samples)
        for task in results["configs"] if samples is not None else ():
            tracker.save_results_samples(task_name=task, samples=samples[task])
        written = sorted((p for p in tmp.rglob("*") if p.is_file()), key=lambda p: p.name.startswith("results"))
        placed = []
        for path in written:
            dest = out.parent / path.relative_to(tmp)
            dest.parent.mkdir(parents=True, exist_ok=True)
            placed.append(fileio.atomic_write(dest, path.read_bytes()))
        return placed
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def table(results: dict) -> str:
    """lm-eval's tables of the results (tasks, and groups where there are some)."""
    return make_table(results) + ("\n" + make_table(results, "groups") if results.get("groups") else "")


def metrics_record(results: dict) -> dict:
    """The results' metrics as metrics.jsonl keys: TASK/METRIC (TASK/METRIC/FILTER for a filter other than
    lm-eval's "none"), numbers only (stderr left out)."""
    out = {}
    for task, metrics in results["results"].items():
        for key, value in metrics.items():
            metric, _, filt = key.partition(",")
            if filt and "_stderr" not in metric and isinstance(value, (int, float)) and not isinstance(value, bool):
                out[f"{task}/{metric}" + (f"/{filt}" if filt != "none" else "")] = float(value)
    return out
