"""`run_sweep`: a run with several adapters (RunConfig.adapters, --sweep), what phantom.run does for them.

Each adapter is the run of it alone (phantom.train.runconfig.adapter_runs) in OUT/NAME, a normal run
folder: claimed, config.yaml (which repeats that adapter alone), adapter, checkpoint, metrics.jsonl, run
card, its own trackers' run. The model is loaded once without a LoRA; phantom.train.sweep trains the
adapters on it together. OUT holds config.yaml (the whole sweep: `--config OUT/config.yaml` repeats it)
and sweep.md, the table of the adapters' final train and held-out losses, which is also printed.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from pathlib import Path

import yaml
from tqdm.contrib.logging import logging_redirect_tqdm

from phantom.base import fileio
from phantom.files import runfolder
from phantom.files.store import BlockStore
from phantom.plan.tune import resolve_prefetch, tuned_chunk
from phantom.stream import placement as P
from phantom.train import runconfig as rc
from phantom.train import runner, trackers
from phantom.train.checkpoint import checkpoint_activations, resume_point, tracker_runs
from phantom.train.load import load as load_phantom
from phantom.train.records import read_metrics
from phantom.train.sweep import Job, train_adapters

SWEEP_TABLE = "sweep.md"


def run_sweep(given: rc.RunConfig, machine, path: Path, store: BlockStore) -> dict:
    """Train every adapter of `given` (its adapters list) in one pass over the weights per step.

    Returns:
        {"status": "done" or "interrupted", "adapters": {name: that adapter's summary}, "report": the
        lines the script prints (the table of OUT/sweep.md)}.
    """
    if machine.ddp.enabled:
        raise ValueError("several adapters train in one process; run the sweep without torchrun")
    if given.train.mode == "full":
        raise ValueError("several adapters train LoRAs (--mode lora or dpo); full finetuning updates the weights "
                         "they would share")
    if given.output.export != "none":
        raise ValueError("--export writes one model; export an adapter of a sweep with merge_lora.py")
    members = [(name, g, runner.decided(g, store)) for name, g in rc.adapter_runs(given)]
    top = runner.decided(given, store)
    out, t = Path(given.train.out), given.train
    with contextlib.ExitStack() as held:
        held.enter_context(runfolder.claimed(out, t.resume, given.output.overwrite, t.mode))
        for _, _, c in members:  # each adapter's folder is a run folder of its own
            held.enter_context(runfolder.claimed(Path(c.train.out), t.resume, given.output.overwrite, t.mode))
        summaries = claimed_sweep(top, members, machine, path, store, held)
    status = "interrupted" if any(s["status"] == "interrupted" for s in summaries) else "done"
    table = write_table(out, given.adapters, summaries)
    return {"status": status, "adapters": {s["name"]: s for s in summaries}, "report": table}


def claimed_sweep(top: rc.RunConfig, members: list, machine, path: Path, store: BlockStore, held) -> list[dict]:
    """The sweep inside its claimed folders: files, model, trackers, training, run cards."""
    first, chunk_set = {}, "mlp_chunk" in top.given  # else --prefetch auto's plan sets it
    if top.train.resume:  # activations as the first adapter's checkpoint recorded them
        flags = {k: v for k, v in rc.to_args(top).items() if k in P.Activations.__dataclass_fields__}
        for name, _, c in members:
            activations, first[name] = resume_point(Path(c.train.out), top.activations, flags)
            chunk_set = chunk_set or "mlp_chunk" in checkpoint_activations(Path(c.train.out))
        top = dataclasses.replace(top, activations=activations)
    top = dataclasses.replace(top, model=dataclasses.replace(top.model, dtype=machine.dtype))
    write_sweep_file(top, store, members)
    rows = runner.micro_rows(top) * top.train.grad_accum * len(members)
    best, placement = resolve_prefetch(top.prefetch, path, machine.device, machine.dtype, top.placement, rows,
                                       top.train.seq_len)
    top = dataclasses.replace(top, activations=tuned_chunk(best, top.activations, chunk_set))
    names = trackers.parse_names(top.output.report_to)
    jobs = []
    for name, _, c in members:
        settings = runner.write_run_file(c, store, Path(c.train.out))
        c = dataclasses.replace(c, activations=top.activations, model=top.model)
        runs = tracker_runs(Path(c.train.out)) if top.train.resume else {}
        sweep = Path(top.train.out).resolve().name
        reporter = held.enter_context(trackers.Reporter(names, Path(c.train.out), settings, f"{sweep}/{name}",
                                                        first.get(name, 1), runs, group=sweep))
        tok, _, train_data, val_data = runner.load_data(c, path, store)
        train_cfg = dataclasses.replace(c.train, sample_every=0)  # no greedy samples: they would read the weights
        jobs.append(Job(name, c.lora, train_cfg, train_data, val_data, tok, (reporter.log,),
                        {"trackers": reporter.runs()}))
    model = load_phantom(path, device=machine.device, dtype=machine.dtype, placement=placement,
                         activations=dataclasses.replace(top.activations, micro_batch=runner.micro_rows(top)),
                         lora=None, trace=top.train.trace)
    with model, logging_redirect_tqdm():
        summaries = train_adapters(model, jobs)
    for (name, g, c), s in zip(members, summaries):
        runner.write_card(dataclasses.replace(c, model=top.model), g, s, store, machine)
    return summaries


def write_sweep_file(top: rc.RunConfig, store: BlockStore, members: list) -> None:
    """OUT/config.yaml: the shared run as OUT's run file, and its adapters: `--config` repeats the sweep."""
    out = Path(top.train.out)
    shared = dataclasses.replace(top, adapters=())
    runner.write_run_file(shared, store, out)
    text = (out / "config.yaml").read_text()
    listed = yaml.safe_dump({"adapters": [dict(a) for a in top.adapters]}, sort_keys=False,
                            default_flow_style=None, width=100)
    fileio.atomic_write_text(out / "config.yaml", text + "# the adapters, each in its own folder OUT/NAME\n" + listed)


def write_table(out: Path, adapters: tuple, summaries: list[dict]) -> str:
    """OUT/sweep.md: each adapter's settings, status and final train and held-out losses; returns its text."""
    lines = ["| adapter | settings | status | steps | final train loss | final held-out loss | best held-out loss |",
             "|---|---|---|---|---|---|---|"]
    for adapter, s in zip(adapters, summaries):
        name = adapter["name"]
        settings = ", ".join(f"{k} {v}" for k, v in adapter.items() if k != "name") or "-"
        recs = read_metrics(Path(s["out"]) / "metrics.jsonl", s["steps"])
        held = [r["val_loss"] for r in recs if r.get("val_loss") is not None]
        lines.append(f"| {name} | {settings} | {s['status']} | {s['steps']} | {_loss(s['final_loss'])} | "
                     f"{_loss(held[-1] if held else None)} | {_loss(s['best_val_loss'])} |")
    text = f"# Sweep: {out.name}\n\n" + "\n".join(lines) + "\n\n" + \
        f"Each adapter's folder is a run of its own (`{out}/NAME`); plot them together: " \
        f"`python scripts/plot.py --out {out}`.\n"
    fileio.atomic_write_text(out / SWEEP_TABLE, text)
    return text


def _loss(v: float | None) -> str:
    return "-" if v is None or not math.isfinite(v) else f"{v:.4f}"
