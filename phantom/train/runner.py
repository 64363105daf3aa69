"""`run(cfg)`: one finetuning run from a RunConfig, what `scripts/finetune.py` does with its flags.

It resolves what the config leaves to the run (device, dtype, the learning rate by the model's
size, the tiny demo's samples, `prefetch="auto"` through the tuner), claims the output folder
(phantom.files.runfolder) and writes there: config.yaml (the resolved run, phantom.train.runfile), the
adapter or weights, checkpoint/, metrics.jsonl, README.md (phantom.train.runcard) and the trackers'
runs. Every value is checked before anything is measured, generated or allocated; bad input raises
ValueError or FileNotFoundError (the scripts print it as one `error:` line).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import logging
from pathlib import Path

import torch
from tqdm.contrib.logging import logging_redirect_tqdm

from phantom.arch.presets import PRESETS, preset
from phantom.base import fileio, provenance
from phantom.data import batches, chat, recordformats, showdata, tokenfiles
from phantom.data import dataset as data
from phantom.data.tokenizer import Tokenizer
from phantom.files import runfolder
from phantom.files.store import BlockStore
from phantom.export.export import export, gguf_module
from phantom.model.adapterfiles import read_adapter_config
from phantom.model.lora import family_targets
from phantom.convert.synthetic import ensure_tiny, write_synthetic
from phantom.plan import planner
from phantom.plan.tune import resolve_prefetch, tuned_chunk
from phantom.stream import placement as P
from phantom.stream.optim import AdamWConfig
from phantom.train import cli, preference, runcard, runfile, trackers
from phantom.train import runconfig as rc
from phantom.train.checkpoint import checkpoint_activations, io_error_line, prepare_work_dir, resume_point, \
    store_fingerprint, tracker_runs
from phantom.train.dist import init_from_env
from phantom.train.grpoloop import load_prompts, show_rollouts
from phantom.train.load import load as load_phantom
from phantom.train.load import resolve_device, resolve_model, weights_dir
from phantom.train.loop import train
from phantom.train.records import read_metrics

SMALL_MODEL = 100_000_000  # parameters: below this a model takes the demo's high rates (a random tiny base)
DEFAULT_LR = {("lora", True): 1e-2, ("lora", False): 2e-4, ("full", True): 1e-3, ("full", False): 1e-5,
              ("dpo", True): 1e-2, ("dpo", False): 5e-6,
              ("grpo", True): 1e-2, ("grpo", False): 1e-6}  # (mode, small); grpo's large: TRL's default
TINY_SAMPLE_EVERY = 100  # the tiny demo shows what it learned: a greedy sample at steps 100 and the last
EXIT = {"done": 0, "interrupted": 0, "shown": 0}  # a run's status -> the script's exit code (else 1)
log = logging.getLogger("finetune")


@dataclasses.dataclass(frozen=True)
class Machine:
    """Where this process computes: its device, compute dtype and rank in a torchrun job."""

    device: torch.device
    dtype: str
    ddp: object  # phantom.train.dist.DistInfo


def run(cfg: rc.RunConfig, sweep=None) -> dict:
    """Train as `cfg` says; returns the run's summary (status, steps, losses, files; `report`: the
    lines the script prints, None on ranks other than 0). With cfg.adapters, `sweep(cfg, machine, path,
    store)` trains them (phantom.train.launch gives phantom.train.sweeprun.run_sweep) and its summary is
    returned."""
    if cfg.adapters and cfg.train.mode == "grpo":
        raise ValueError("--sweep (several adapters in one run) is not supported with --mode grpo: one adapter a run")
    if cfg.adapters:
        rc.adapter_runs(cfg)  # each adapter's values checked before anything is generated or measured
    machine, asked_quiet = start(cfg), not cfg.train.progress
    quiet = asked_quiet or not machine.ddp.is_main  # one voice per job: rank 0 logs, the others only errors
    logging.basicConfig(level=logging.ERROR if not machine.ddp.is_main else logging.WARNING if quiet else
                        logging.INFO, format="%(message)s", force=True)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, progress=not quiet))
    if cfg.model.synthetic or cfg.model.model == "tiny":  # shapes known before anything is generated
        check_seq_len(cfg, preset(cfg.model.model))
    path = model_path(cfg.model, asked_quiet)
    store = BlockStore(path, verify="none")
    check_seq_len(cfg, store.cfg)
    if cfg.data.show_data and cfg.train.mode == "grpo":
        tok, _, prompts, _ = load_data(cfg, path, store)
        print(show_rollouts(prompts, tok, cfg.train.grpo, cfg.data.show_data, ids=cfg.data.show_data_ids))
        return {"status": "shown", "report": None}
    if cfg.data.show_data:
        tok, _, train_data, _ = load_data(cfg, path, store)
        print(showdata.show_rows(batches.rows(train_data, cfg.train.seq_len, tok.pad_or_eos if tok else 0,
                                              segments=True), tok, cfg.data.show_data, ids=cfg.data.show_data_ids))
        return {"status": "shown", "report": None}
    if cfg.adapters:  # several adapters, one read of the weights a step
        if sweep is None:
            raise ValueError("several adapters are trained by phantom.run (phantom.train.launch.run)")
        return sweep(cfg, machine, path, store)
    given, cfg = cfg, decided(cfg, store)
    out = Path(cfg.train.out)
    main = machine.ddp.is_main
    claim = runfolder.claimed(out, cfg.train.resume, cfg.output.overwrite, cfg.train.mode) if main else \
        contextlib.nullcontext()
    with claim:  # checked, locked and marked as this run's before anything is written there
        s, best = claimed_run(cfg, given, machine, path, store)
    if not main:
        return {**s, "report": None}
    report = summary(s)
    if best is not None and s["median_step_s"] is not None:  # the tuner's plan was logged at the start
        report += "\n" + planner.describe_measured(best, s["median_step_s"])
    return {**s, "report": report}


def start(cfg: rc.RunConfig) -> Machine:
    """The device (under torchrun one per rank, one host copy per machine) and the compute dtype."""
    device = resolve_device(cfg.model.device)
    ddp = init_from_env(device.type)
    if ddp.enabled and device.type == "cuda":
        device = torch.device("cuda", ddp.local_rank)
    dtype = cli.resolve_dtype(cfg.model.dtype, device)
    if (why := cli.emulated_bf16(dtype, device)) is not None:
        log.warning("bf16 is emulated on this CPU (%s): its steps take several times an fp32 step's; "
                    "--dtype fp32 (what --dtype auto chooses on a CPU) is faster", why)
    return Machine(device, dtype, ddp)


def decided(cfg: rc.RunConfig, store: BlockStore) -> rc.RunConfig:
    """cfg with the learning rate (by the model's size) and the sample interval (the tiny demo's) set."""
    lr = cfg.lr if cfg.lr is not None else DEFAULT_LR[cfg.train.mode, store.cfg.n_params() < SMALL_MODEL]
    tiny_sft = cfg.model.model == "tiny" and not cfg.model.synthetic and cfg.train.mode != "dpo"  # (dpo: noise)
    every = cfg.sample_every if cfg.sample_every is not None else TINY_SAMPLE_EVERY if tiny_sft else 0
    return dataclasses.replace(cfg, lr=lr, sample_every=every)


def claimed_run(cfg, given, machine: Machine, path: Path, store: BlockStore):
    """The run inside its claimed folder: (the summary, the tuner's prediction where it chose the placement)."""
    out, main = Path(cfg.train.out), machine.ddp.is_main
    if cfg.output.export == "gguf":  # refused before training, not after
        gguf_module().check_supported(store)
    first = 1  # the first step this run trains (for the trackers)
    chunk_set = "mlp_chunk" in cfg.given  # else --prefetch auto's plan sets it
    if cfg.train.resume:  # compile and recompute as the checkpoint recorded them, unless a flag says otherwise
        flags = {k: v for k, v in rc.to_args(cfg).items() if k in P.Activations.__dataclass_fields__}
        activations, first = resume_point(out, cfg.activations, flags)  # before a killed run's store opens
        cfg = dataclasses.replace(cfg, activations=activations)
        chunk_set = chunk_set or "mlp_chunk" in checkpoint_activations(out)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype=machine.dtype))
    settings = write_run_file(cfg, store, out) if main else {}
    best, placement = resolve_prefetch(cfg.prefetch, path, machine.device, machine.dtype, cfg.placement,
                                       micro_rows(cfg) * cfg.train.grad_accum, cfg.train.seq_len)
    train_cfg = cfg.train if best is None else \
        dataclasses.replace(cfg.train, check_step=functools.partial(planner.check_prediction, best))
    cfg = dataclasses.replace(cfg, placement=placement, train=train_cfg,
                              activations=tuned_chunk(best, cfg.activations, chunk_set))
    try:
        runs = tracker_runs(out) if cfg.train.resume else {}  # the trackers' runs continue too
        with trackers.Reporter(trackers.parse_names(cfg.output.report_to) if main else (), out, settings,
                               out.resolve().name, first, runs) as reporter:
            s = train_run(cfg, machine, path, store, reporter)
        if main:
            write_card(cfg, given, s, store, machine, gguf_at_end(cfg, s, store))
    except OSError as e:
        if (line := io_error_line(e, out, path)) is None:
            raise
        raise ValueError(line) from None
    return s, best


def check_seq_len(cfg: rc.RunConfig, model_cfg) -> None:
    if cfg.train.seq_len > model_cfg.max_seq_len and cfg.train.mode != "grpo":  # grpo: prompt + completion
        raise ValueError(f"--seq-len {cfg.train.seq_len} exceeds the model's max_seq_len {model_cfg.max_seq_len}")


def micro_rows(cfg: rc.RunConfig) -> int:
    """Rows per micro-batch: dpo's batch_size is pairs, two rows each (chosen and rejected)."""
    return cfg.train.batch_size * (2 if cfg.train.mode == "dpo" else 1)


def model_path(src: rc.ModelSource, quiet: bool) -> Path:
    """The store to train: a folder, a preset (tiny is generated), or a synthetic store of a preset's
    shapes. Generation takes a machine-wide lock, so ranks and concurrent runs make it once."""
    if not src.synthetic:
        if src.model not in PRESETS:
            return resolve_model(src.model, src.revision)
        with fileio.locked(weights_dir() / ".generate.lock"):
            return resolve_model(src.model)
    if src.model not in PRESETS:
        raise ValueError(f"--synthetic needs a preset --model ({', '.join(PRESETS)}), not {src.model!r}")
    if src.layers is not None and src.layers < 1:
        raise ValueError(f"--layers must be >= 1, got {src.layers}")
    cfg = preset(src.model, **({"n_layers": src.layers} if src.layers else {}))
    out = weights_dir() / f"{src.model}-synthetic-{cfg.n_layers}L"
    with fileio.locked(weights_dir() / ".generate.lock"):
        tiny = ensure_tiny(weights_dir() / "tiny")
        if not (out / "manifest.json").is_file():
            log.info("writing random %s-shaped weights (%d blocks) to %s", src.model, cfg.n_layers, out)
            write_synthetic(out, cfg, tokenizer=tiny / "tokenizer.model", progress=not quiet)
    return out


def load_model(cfg: rc.RunConfig, machine: Machine, path: Path):
    """The model as cfg places it: full finetuning writes its working store under --out (one per rank);
    local ranks share one RAM copy of a LoRA run's weights."""
    t, ddp, full = cfg.train, machine.ddp, {}
    if t.mode == "full":  # blocks are updated inside backward; the working copy of the store is --out/store
        work_dir = t.out if not ddp.enabled else f"{t.out}/rank{ddp.rank}"
        prepare_work_dir(Path(t.out), Path(work_dir), t.resume and cfg.placement.offload != "none", path)
        full = dict(mode="full", work_dir=work_dir, optim=AdamWConfig(
            lr=t.lr, betas=t.betas, weight_decay=t.weight_decay, max_grad_norm=t.grad_clip or None,
            optim=t.optim))
    shared = ddp.local_world_size > 1 and cfg.placement.offload == "ram" and t.mode != "full"
    lora = cfg.lora
    if t.init_adapter:  # its rank, alpha and targets; its weights after the model is built
        if t.mode == "full":
            raise ValueError("--init-adapter starts a LoRA; --mode full trains every weight")
        lora = dataclasses.replace(read_adapter_config(Path(t.init_adapter)), seed=cfg.lora.seed)
    model = load_phantom(path, device=machine.device, dtype=machine.dtype,
                         placement=dataclasses.replace(cfg.placement, shared_ram=shared),
                         activations=dataclasses.replace(cfg.activations, micro_batch=micro_rows(cfg)),
                         lora=lora, trace=t.trace, **full)
    if t.init_adapter:
        try:
            model.load_adapter(Path(t.init_adapter))
        except BaseException:
            model.close()
            raise
    return model


def load_data(cfg: rc.RunConfig, path: Path, store: BlockStore):
    """(tokenizer, recipe, training data, held-out data) as cfg.data says."""
    d = cfg.data
    tok = Tokenizer(store.tokenizer_path) if store.tokenizer_path is not None else None
    if tok is None and (d.data is None or Path(d.data).suffix not in tokenfiles.TOKEN_SUFFIXES):
        raise FileNotFoundError(f"{path} has no tokenizer; train it on token ids already tokenized (--data FILE.bin "
                                f"or FILE.npy), or prepare the store with a tokenizer")
    template = chat.read_template(path, tok, d.chat_template) if tok is not None else None
    recipe = recordformats.Recipe(template, d.train_on, recordformats.parse_columns(d.columns), d.data_split)
    load = functools.partial(data.load, tok=tok, vocab_size=store.cfg.vocab_size, dtype=d.data_dtype, recipe=recipe)
    split = data.split
    if cfg.train.mode == "grpo":  # prompts (or rollouts made elsewhere), nothing held out
        if tok is None:
            raise FileNotFoundError(f"{path} has no tokenizer: --mode grpo samples text for its reward functions")
        prompts = load_prompts(d.data or "", tok, template, cfg.train.grpo, store.cfg.max_seq_len)
        return tok, recipe, prompts, None
    if cfg.train.mode == "dpo":  # pairs; chat messages through the model's template where it has one
        load = functools.partial(preference.load_pairs, tok=tok, encode=preference.pair_encoder(template))
        split = preference.split_pairs
    train_data, val_data = split(load(d.data), 0 if d.val_data else d.val_split)
    val_data = load(d.val_data) if d.val_data else val_data
    if template is None and train_data.fmt in recordformats.CHAT_FORMATS:
        log.info("%s has no chat template: chat records are rendered as plain Role: content lines", path)
    return tok, recipe, train_data, val_data


def train_run(cfg: rc.RunConfig, machine: Machine, path: Path, store: BlockStore, reporter) -> dict:
    tok, recipe, train_data, val_data = load_data(cfg, path, store)
    prompt = recordformats.render_prompt(cfg.train.prompt, train_data.fmt, recipe.template)
    t = dataclasses.replace(cfg.train, prompt=prompt)
    with load_model(cfg, machine, path) as model, logging_redirect_tqdm():
        return train(model, train_data, val_data, t, tok, (reporter.log,), {"trackers": reporter.runs()})


def write_run_file(cfg: rc.RunConfig, store: BlockStore, out: Path) -> dict:
    """OUT/config.yaml: every flag as this run resolved it, the phantom and torch versions and the
    store's fingerprint, so `--config OUT/config.yaml` repeats the run. Returns all of it as one flat
    mapping (the config the trackers are given)."""
    p = rc.parser()
    resolved = rc.to_args(cfg, resolved=True)
    resolved["prefetch_or_auto"] = "auto" if cfg.prefetch == "auto" else str(cfg.placement.prefetch)
    flat = runfile.settings(p, argparse.Namespace(**resolved), resume=False, overwrite=False)  # a file starts a run
    record = {"phantom": provenance.VERSION, "torch": torch.__version__, "store": str(store.path),
              "store-fingerprint": store_fingerprint(store)}
    for key, was in runfile.recorded(cfg.config).items():
        if key in ("phantom", "torch", "store-fingerprint") and was != record[key]:
            log.warning("%s was recorded with %s %s; this run has %s: its numbers may differ", cfg.config, key,
                        was, record[key])
    header = f"# phantom run file, resolved at the start of the run in {out}.\n" \
             f"# Repeat it: python scripts/finetune.py --config {out / 'config.yaml'} (flags given there win).\n"
    runfile.write(out / "config.yaml", runfile.dump(p, flat, rc.run_file_sections(p), record, header))
    return {**flat, **{f"recorded-{k}": v for k, v in record.items()}}


def gguf_at_end(cfg: rc.RunConfig, s: dict, store: BlockStore) -> str | None:
    """--export gguf: OUT/gguf/ (the GGUF file and its Modelfile) from what the run wrote (the adapter merged
    into the store, or the trained weights); the file's path, None where nothing was asked or written."""
    if cfg.output.export != "gguf" or (s["adapter"] is None and s["weights"] is None):
        return None
    out = Path(s["out"]) / "gguf"
    if s["weights"] is not None:
        export(s["weights"], out, fmt="gguf", overwrite=True, progress=False)
    else:
        export(store.path, out, adapter=s["adapter"], fmt="gguf", overwrite=True, progress=False)
    return str(next(out.glob("*.gguf")))


def write_card(cfg: rc.RunConfig, given: rc.RunConfig, s: dict, store: BlockStore, machine: Machine,
               gguf: str | None = None) -> None:
    """OUT/README.md: the run card (model, data, flags that differ from the defaults, how it ended).
    `given`: the config before the run decided its own values (so only what was asked for is listed);
    gguf: the GGUF file --export wrote."""
    p, recs = rc.parser(), read_metrics(Path(s["out"]) / "metrics.jsonl", s["steps"])
    defaults, asked = vars(p.parse_args([])), rc.to_args(given)
    changed = {d: v for d, v in asked.items() if d in defaults and v != defaults[d]}
    evals = [(r["step"], r["val_loss"]) for r in recs if r.get("val_loss") is not None]
    host, dev = runcard.peak_memory(machine.device)
    lo = cfg.lora
    targets, asked_targets = ",".join(family_targets(lo.targets, store.cfg)), asked["lora_targets"]
    lora = f"rank {lo.rank}, alpha {lo.alpha:g}, targets {targets}" + (
        f" (given {asked_targets})" if targets != asked_targets else "")
    card = runcard.RunCard(
        out=s["out"], model=cfg.model.model, store=str(store.path), fingerprint=store_fingerprint(store),
        n_params=store.cfg.n_params(), dtype=machine.dtype, device=str(machine.device), mode=cfg.train.mode,
        lora=lora, data=describe_data(cfg), flags=tuple(runfile.as_argv(p, changed)), status=s["status"],
        steps=s["steps"], final_loss=s["final_loss"], final_eval=evals[-1] if evals else None,
        best_eval=s["best_val_loss"], tokens_per_s=s["tokens"] / max(s["time_s"], 1e-9), peak_host_bytes=host,
        peak_device_bytes=dev, adapter=s["adapter"], weights=s["weights"],
        versions=f"phantom {provenance.VERSION}, torch {torch.__version__}",
        origin=provenance.describe(store.manifest), gguf=gguf, rollouts=runcard.rollout_line(recs),
        **loadable_base(store))
    runcard.write(Path(s["out"]) / "README.md", card)


def loadable_base(store: BlockStore) -> dict:
    """The run card's base model for peft: what the adapter names when transformers can load it."""
    base, revision = provenance.base_model(store.manifest, store.path)
    return {} if base == str(store.path) else {"base_model": base, "base_revision": revision}


def describe_data(cfg: rc.RunConfig) -> str:
    d, t = cfg.data, cfg.train
    train_ = f"`{d.data}`" if d.data else "the shipped tiny text"
    held = f"held-out `{d.val_data}`" if d.val_data else f"{d.val_split:g} held out" if d.val_split else \
        "no held-out data"
    return f"{train_}, {held}, {t.seq_len} tokens per row, {t.batch_size * t.grad_accum} rows per step"


def summary(s: dict) -> str:
    """The lines a finished run prints: how it ended and where its files are."""
    best = f"{s['best_val_loss']:.4f}" if s["best_val_loss"] is not None else "-"
    return (f"\n{'finetune ' + s['status']:-^60}\n"
            f"steps        {s['steps']}\n"
            f"tokens       {s['tokens']:,} in {s['time_s']:.1f} s ({s['tokens'] / max(s['time_s'], 1e-9):,.0f} "
            f"tok/s)\n"
            f"loss         final {s['final_loss']:.4f}, best eval {best}\n"
            f"{'weights' if s['weights'] else 'adapter':<13}{s['weights'] or s['adapter'] or '(not written)'}\n"
            f"checkpoint   {s['checkpoint'] + '  (continue with --resume)' if s['checkpoint'] else '-'}\n"
            f"metrics      {s['metrics']}  (plot: python scripts/plot.py --out {s['out']})\n"
            f"run card     {Path(s['out']) / 'README.md'}, the run in {Path(s['out']) / 'config.yaml'}")
