"""Finetune a Llama model with LoRA while its blocks stream from disk: `python scripts/finetune.py`.

With no flags it trains the embedded tiny model on the shipped text. Writes config.yaml (the resolved
run), adapter/ (PEFT), checkpoint/ (for --resume), metrics.jsonl, README.md (a run card) and, with
--trace, trace.json into --out. Every flag is checked against the model before anything is measured,
generated or allocated.
"""
import argparse
import contextlib
import dataclasses
import functools
import logging
import sys
from pathlib import Path

from tqdm.contrib.logging import logging_redirect_tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

import phantom  # noqa: E402
import torch  # noqa: E402
from phantom import chat, cli, data, fileio, preference, runcard, runfile, runfolder, trackers, tune  # noqa: E402
from phantom import provenance, showdata  # noqa: E402
from phantom import costmodel as cm  # noqa: E402
from phantom import placement as P  # noqa: E402
from phantom.convert import ensure_tiny, write_synthetic  # noqa: E402
from phantom.dist import init_from_env  # noqa: E402
from phantom.lora import family_targets  # noqa: E402
from phantom.model import MODES  # noqa: E402
from phantom.store import BlockStore  # noqa: E402
from phantom.tokenizer import Tokenizer  # noqa: E402
from phantom.checkpoint import (io_error_line, prepare_work_dir, resume_point, store_fingerprint,  # noqa: E402
                                tracker_runs)
from phantom.train import TrainConfig, read_metrics, train  # noqa: E402

D = TrainConfig()
PC = preference.PreferenceConfig()
SMALL_MODEL = 100_000_000  # parameters: below this a model takes the demo's high rates (a random tiny base)
DEFAULT_LR = {("lora", True): 1e-2, ("lora", False): 2e-4, ("full", True): 1e-3, ("full", False): 1e-5,
              ("dpo", True): 1e-2, ("dpo", False): 5e-6}  # (mode, small)
TRAIN_MODES = MODES + ("dpo",)
TINY_SAMPLE_EVERY = 100  # the tiny demo shows what it learned: a greedy sample at steps 100 and the last
log = logging.getLogger("finetune")
# Run-file sections (--config): where a flag sits in OUT/config.yaml; a flag named SECTION-x (--lora-dropout)
# or in the Placement/Activations groups goes to its section by itself, any other new flag to the top level.
SECTIONS = {
    "model": ("model", "revision", "synthetic", "layers", "device", "dtype", "mode"),
    "placement": ("prefetch", "compile"),
    "lora": (),
    "data": ("data", "val-data", "val-split", "data-dtype", "data-split", "columns", "chat-template", "train-on",
             "show-data", "show-data-ids", "seq-len", "batch-size", "grad-accum", "sequential", "workers"),
    "optim": ("iters", "lr", "min-lr", "warmup", "weight-decay", "grad-clip", "seed", "loss-type", "beta",
              "label-smoothing", "reference"),
    "output": ("out", "resume", "overwrite", "eval-every", "eval-iters", "save-every", "sample-every", "prompt", "trace",
               "report-to", "quiet"),
}
RUN_FILE_HELP = """
run files: every flag is a YAML key of the same name (without --), at the top level or in one of the
sections model, data, lora, optim, placement, output (a key in section S may drop an S- prefix);
flags on the command line override the file. OUT/config.yaml is the resolved run (every value, the
phantom and torch versions, the store's fingerprint): --config OUT/config.yaml repeats it.

    python scripts/finetune.py --model weights/7B --data chat.jsonl --lora-rank 16 --lora-targets q,k,v,o \\
        --iters 1000 --lr 2e-4 --offload auto --report-to tensorboard --out runs/7b
    python scripts/finetune.py --config run.yaml            # the same run, with run.yaml:

    model: {model: weights/7B}
    data: {data: chat.jsonl}
    lora: {rank: 16, targets: [q, k, v, o]}
    optim: {iters: 1000, lr: 2.0e-4}
    placement: {offload: auto}
    output: {out: runs/7b, report-to: tensorboard}

examples/ holds run files for the tiny demo, a 7B LoRA on chat data and a 70B LoRA from RAM and disk.
"""


def parser() -> argparse.ArgumentParser:
    """finetune.py's flags; also the schema of its run files (phantom.runfile)."""
    p = argparse.ArgumentParser(description=__doc__, epilog=RUN_FILE_HELP,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--config", default=None, metavar="RUN.yaml", help="YAML run file: its keys are these flags (see below); "
                                                         "flags given here override it")
    a("--model", default="tiny", help="preset name (prepared under weights/), a store folder, or a Hugging Face "
                                      "hub id in the local hub cache, converted on first use (default: tiny)")
    a("--revision", default="main", help="with a hub id: the branch, tag or commit in the cache (default: main)")
    a("--synthetic", action="store_true", help="random weights with the shapes of the preset --model and the tiny "
                                               "tokenizer: a smoke test of real shapes without downloading them")
    a("--layers", type=int, default=None, help="with --synthetic: this many blocks (default: the preset's)")
    a("--device", default="auto", help="cpu, cuda, cuda:N, mps or auto (default: auto)")
    a("--dtype", default="auto", choices=cli.DTYPES, help="compute dtype (default auto: bf16 on CUDA, else fp32)")
    cli.add_config_flags(p, P.Placement, skip=("prefetch", "shared_ram"))
    a("--prefetch", default=None, dest="prefetch_or_auto", metavar="N|auto", help="blocks read ahead of the one computing (default: 2), or auto: the tuner's "
                                       "tier, prefetch and resident blocks (python scripts/tune.py measures; else a "
                                       "quick profile)")
    cli.add_config_flags(p, P.Activations, skip=("micro_batch",))
    a("--no-compile", dest="compile", action="store_false", help="run blocks eagerly")
    a("--mode", default="lora", choices=TRAIN_MODES,
      help="train a LoRA, all weights, or a LoRA on preference pairs (dpo: --data with prompt/chosen/rejected; "
           "default: lora)")
    a("--loss-type", default=PC.loss, choices=preference.LOSSES,
      help="dpo: sigmoid (DPO) or ipo (default: sigmoid)")
    a("--beta", type=float, default=PC.beta, help=f"dpo: how far the policy may move from the reference "
                                                  f"(default: {PC.beta})")
    a("--label-smoothing", type=float, default=PC.label_smoothing,
      help="dpo: assumed fraction of pairs labelled the wrong way, sigmoid loss only (default: 0)")
    a("--reference", default=PC.reference, choices=preference.REFERENCES,
      help="dpo: together (the reference beside the policy in each loaded block: no extra reads) or precompute "
           "(once before training, cached in --out: one extra read of the weights in all; default: together)")
    a("--lora-rank", type=int, default=8, help="LoRA rank r (default: 8)")
    a("--lora-alpha", type=float, default=16.0, help="LoRA scale is alpha / r (default: 16)")
    a("--lora-targets", default="q,v", help="comma-separated projections: q,k,v,o,gate,up,down (qkv, gate_up: "
                                             "those together), or all-linear (every one, as peft's all-linear); on "
                                             "Phi-3 any of q,k,v is its fused qkv_proj, as peft has it (default: q,v)")
    a("--data", default=None, help="plain text, JSONL (prompt/response, Alpaca, chat messages), or token ids already "
                                   "tokenized (.bin, .npy); default: the shipped tiny text")
    a("--val-data", default=None, help="held-out data file (default: split off --val-split of --data)")
    a("--val-split", type=float, default=0.1, help="fraction of --data held out for evaluation, 0: none (default: 0.1)")
    a("--data-dtype", default=None, choices=sorted(data.TOKEN_DTYPES),
      help="element type of .bin token files (default: uint16 if the vocabulary fits, else uint32)")
    a("--data-split", default=None, help="split of a Hub dataset or datasets folder (default: train)")
    a("--columns", default=None, metavar="KEY=COLUMN,...", help="records keep their data under other names, e.g. "
      "prompt=question,response=answer or messages=dialog")
    a("--chat-template", default=None, metavar="FILE", help="Jinja chat template for chat and instruction records "
      "(default: the model's own, kept in the store from its tokenizer_config.json; none: plain Role: content lines)")
    a("--train-on", default="all", choices=chat.TRAIN_ON, help="what carries loss in a chat: all assistant turns, the "
      "last one, or prompt-too (every token) (default: all)")
    a("--show-data", type=int, default=0, metavar="N", help="print the first N training rows as the model sees them "
      "(every token, special tokens by their text; loss spans in [[ ]], packed examples on their own lines) and exit")
    a("--show-data-ids", action="store_true", help="with --show-data: each token's id beside it, in ⟨ ⟩")
    a("--iters", type=int, default=D.iters, help=f"optimizer steps (default: {D.iters})")
    a("--batch-size", type=int, default=D.batch_size, help=f"rows per micro-batch (default: {D.batch_size})")
    a("--grad-accum", type=int, default=D.grad_accum, help="micro-batches per step, layer-major (default: 1)")
    a("--seq-len", type=int, default=D.seq_len, help=f"tokens per row (default: {D.seq_len})")
    a("--lr", type=float, default=None, help="peak learning rate (default by model size: LoRA 1e-2 under 100M "
                                             "parameters, else 2e-4; full 1e-3 / 1e-5)")
    a("--min-lr", type=float, default=None, help="end of the cosine decay (default: lr / 10)")
    a("--warmup", type=int, default=D.warmup, help=f"linear warmup steps (default: {D.warmup})")
    a("--weight-decay", type=float, default=D.weight_decay, help="AdamW weight decay (default: 0)")
    a("--grad-clip", type=float, default=D.grad_clip, help="max gradient norm, 0: off (default: 1)")
    a("--eval-every", type=int, default=D.eval_every, help="evaluate every N steps, 0: at the end only")
    a("--eval-iters", type=int, default=D.eval_iters, help="batches per evaluation")
    a("--save-every", type=int, default=D.save_every, help="checkpoint every N steps, 0: at the end only")
    a("--sample-every", type=int, default=None, help=f"print a greedy sample every N steps and at the end, 0: off "
                                                     f"(default: {TINY_SAMPLE_EVERY} for the tiny model, else off)")
    a("--prompt", default="The keeper", help="prompt of the samples")
    a("--sequential", action="store_true", help="read the data in order instead of random windows/rows")
    a("--workers", type=int, default=D.workers, help="DataLoader worker processes")
    a("--out", default=D.out, help=f"output folder (default: {D.out})")
    a("--resume", action="store_true", help="continue from --out/checkpoint")
    a("--overwrite", action="store_true", help="start a new run in --out although another phantom run's files are "
                                               "there (only the files phantom writes are replaced)")
    a("--seed", type=int, default=D.seed, help="seed of the LoRA init, batch order and dropout")
    a("--trace", action="store_true", help="write --out/trace.json (Chrome trace of the scheduler)")
    a("--report-to", default="none", metavar="TRACKERS", help="comma-separated experiment trackers fed the "
      "metrics.jsonl scalars and the config: tensorboard, wandb, mlflow, or none (default: none)")
    a("-q", "--quiet", action="store_true", help="no progress bar or log lines")
    return p


def parse_args(argv=None):
    args = runfile.parse_args(parser(), argv, tuple(SECTIONS))
    if args.sample_every is None:
        tiny_sft = args.model == "tiny" and not args.synthetic and args.mode != "dpo"  # (its random base writes noise)
        args.sample_every = TINY_SAMPLE_EVERY if tiny_sft else D.sample_every
    return args


def train_config(args, lr: float) -> TrainConfig:
    return TrainConfig(iters=args.iters, batch_size=args.batch_size, grad_accum=args.grad_accum, seq_len=args.seq_len,
                       lr=lr, min_lr=args.min_lr, warmup=args.warmup, weight_decay=args.weight_decay,
                       grad_clip=args.grad_clip, eval_every=args.eval_every, eval_iters=args.eval_iters,
                       save_every=args.save_every, sample_every=args.sample_every, prompt=args.prompt, seed=args.seed,
                       shuffle=not args.sequential, out=args.out, resume=args.resume, mode=args.mode,
                       workers=args.workers, trace=args.trace, progress=not args.quiet,
                       preference=preference.PreferenceConfig(args.loss_type, args.beta, args.label_smoothing,
                                                              args.reference))


def check_mode(argv) -> None:
    """--mode given twice with different values (--mode dpo --mode full) is refused, not settled
    silently by the last one."""
    argv = list(sys.argv[1:] if argv is None else argv)
    given = [v for a, v in zip(argv, argv[1:] + [""]) if a == "--mode"] + \
        [a.split("=", 1)[1] for a in argv if a.startswith("--mode=")]
    modes = sorted(set(given), key=lambda m: TRAIN_MODES.index(m) if m in TRAIN_MODES else len(TRAIN_MODES))
    if len(modes) > 1:
        raise ValueError(f"--mode {' and --mode '.join(modes)} cannot be combined: dpo trains a LoRA against the "
                         f"base model with the adapters off; choose one --mode")


def check_seq_len(cfg: TrainConfig, model_cfg) -> None:
    if cfg.seq_len > model_cfg.max_seq_len:
        raise ValueError(f"--seq-len {cfg.seq_len} exceeds the model's max_seq_len {model_cfg.max_seq_len}")


def parse_prefetch(text: str | None) -> int | str | None:
    if text is None or text == "auto":
        return text
    if not text.lstrip("-").isdigit() or int(text) < 0:
        raise ValueError(f"--prefetch must be >= 0 or auto, not {text!r}")
    return int(text)


def model_path(args) -> Path:
    """The store to train: a folder, a preset (tiny is generated), or a synthetic store of a preset's
    shapes. Generation takes a machine-wide lock, so ranks and concurrent runs make it once."""
    if not args.synthetic:
        if args.model not in phantom.PRESETS:
            return phantom.resolve_model(args.model, args.revision)
        with fileio.locked(phantom.weights_dir() / ".generate.lock"):
            return phantom.resolve_model(args.model)
    if args.model not in phantom.PRESETS:
        raise ValueError(f"--synthetic needs a preset --model ({', '.join(phantom.PRESETS)}), not {args.model!r}")
    if args.layers is not None and args.layers < 1:
        raise ValueError(f"--layers must be >= 1, got {args.layers}")
    cfg = phantom.preset(args.model, **({"n_layers": args.layers} if args.layers else {}))
    out = phantom.weights_dir() / f"{args.model}-synthetic-{cfg.n_layers}L"
    with fileio.locked(phantom.weights_dir() / ".generate.lock"):
        tiny = ensure_tiny(phantom.weights_dir() / "tiny")
        if not (out / "manifest.json").is_file():
            log.info("writing random %s-shaped weights (%d blocks) to %s", args.model, cfg.n_layers, out)
            write_synthetic(out, cfg, tokenizer=tiny / "tokenizer.model", progress=not args.quiet)
    return out


def tuned(args, path: Path, device, dtype: str, placement: P.Placement):
    """`--prefetch auto`: the tuner's tier, prefetch and resident blocks (what cannot change the
    numbers; the micro-batch and recompute stay as given). One rank or run measures at a time."""
    rows = args.batch_size * args.grad_accum * (2 if args.mode == "dpo" else 1)
    return tune.tuned_placement(path, device, dtype, placement, rows, args.seq_len)


def load_model(args, path: Path, device, dtype: str, ddp, placement, activations, lr: float):
    lora = phantom.LoraConfig(rank=args.lora_rank, alpha=args.lora_alpha, seed=args.seed,
                              targets=tuple(t.strip() for t in args.lora_targets.split(",") if t.strip()))
    full = {}
    if args.mode == "full":  # blocks are updated inside backward; the working copy of the store is --out/store
        work_dir = args.out if not ddp.enabled else f"{args.out}/rank{ddp.rank}"  # one working store per rank
        prepare_work_dir(Path(args.out), Path(work_dir), args.resume and placement.offload != "none", path)
        full = dict(mode="full", work_dir=work_dir, optim=phantom.AdamWConfig(
            lr=lr, betas=D.betas, weight_decay=args.weight_decay, max_grad_norm=args.grad_clip or None))
    shared = ddp.local_world_size > 1 and placement.offload == "ram" and args.mode != "full"
    rows = args.batch_size * (2 if args.mode == "dpo" else 1)  # dpo: --batch-size pairs of two rows
    return phantom.load(path, device=device, dtype=dtype, placement=dataclasses.replace(placement, shared_ram=shared),
                        activations=dataclasses.replace(activations, micro_batch=rows), lora=lora,
                        trace=args.trace, **full)


def run(argv=None) -> int:
    args = parse_args(argv)
    check_mode(argv)
    report_to = trackers.parse_names(args.report_to)
    placement, activations = cli.configs_from_args(args, P.Placement(), P.Activations())
    prefetch = parse_prefetch(args.prefetch_or_auto)
    if isinstance(prefetch, int):
        placement = dataclasses.replace(placement, prefetch=prefetch)
    cfg = train_config(args, args.lr if args.lr is not None else 1.0)  # checks the flags; lr is set below
    device = phantom.resolve_device(args.device)
    ddp = init_from_env(device.type)  # under torchrun: one rank per device, one host copy per machine
    if ddp.enabled and device.type == "cuda":
        device = torch.device("cuda", ddp.local_rank)
    quiet = args.quiet or not ddp.is_main  # one voice per job: rank 0 logs, the others print only errors
    logging.basicConfig(level=logging.ERROR if not ddp.is_main else logging.WARNING if quiet else logging.INFO,
                        format="%(message)s", force=True)
    cfg = dataclasses.replace(cfg, progress=not quiet)
    if args.synthetic or args.model == "tiny":  # shapes known before anything is generated
        check_seq_len(cfg, phantom.preset(args.model))
    path = model_path(args)
    store = BlockStore(path, verify="none")
    check_seq_len(cfg, store.cfg)
    if args.show_data:
        tok, _, train_data, _ = load_data(args, path, store)
        print(showdata.show_rows(data.rows(train_data, cfg.seq_len, tok.pad_or_eos if tok else 0, segments=True),
                                 tok, args.show_data, ids=args.show_data_ids))
        return 0
    if args.lr is None:
        cfg = dataclasses.replace(cfg, lr=DEFAULT_LR[args.mode, store.cfg.n_params() < SMALL_MODEL])
    out = Path(args.out)
    claim = runfolder.claimed(out, args.resume, args.overwrite, args.mode) if ddp.is_main else contextlib.nullcontext()
    with claim:  # checked, locked and marked as this run's before anything is written there
        first = 1  # the first step this run trains (for the trackers)
        if args.resume:  # compile and recompute as the checkpoint recorded them, unless a flag says otherwise
            activations, first = resume_point(out, activations, vars(args))  # before a killed run's store opens
        dtype = cli.resolve_dtype(args.dtype, device)
        knobs = resolved_knobs(args, placement, activations)
        settings = write_run_file(args, store, out, lr=cfg.lr, dtype=dtype, **knobs) if ddp.is_main else {}
        best = None  # the tuner's prediction, where it chose the placement
        if prefetch == "auto" and placement.offload != "none":
            best, placement = tuned(args, path, device, dtype, placement)
            cfg = dataclasses.replace(cfg, check_step=functools.partial(cm.check_prediction, best))
        try:
            runs = tracker_runs(out) if args.resume else {}  # the trackers' runs continue too
            with trackers.Reporter(report_to if ddp.is_main else (), out, settings, out.resolve().name,
                                   first, runs) as reporter:
                s = train_run(args, cfg, path, store, device, dtype, ddp, placement, activations, reporter)
            if ddp.is_main:
                write_card(args, argv, s, store, dtype, device)
        except OSError as e:
            if (line := io_error_line(e, out, path)) is None:
                raise
            raise ValueError(line) from None
    if ddp.is_main:
        print_summary(s)
        if best is not None and s["median_step_s"] is not None:  # the tuner's plan was logged at the start
            print(cm.describe_measured(best, s["median_step_s"]))
    return {"done": 0, "interrupted": 0}.get(s["status"], 1)


def load_data(args, path, store):
    """(tokenizer, recipe, training data, held-out data) as the flags say."""
    tok = Tokenizer(store.tokenizer_path) if store.tokenizer_path is not None else None
    if tok is None and (args.data is None or Path(args.data).suffix not in data.TOKEN_SUFFIXES):
        raise FileNotFoundError(f"{path} has no tokenizer; train it on token ids already tokenized (--data FILE.bin "
                                f"or FILE.npy), or prepare the store with a tokenizer")
    template = chat.read_template(path, tok, args.chat_template) if tok is not None else None
    recipe = data.Recipe(template, args.train_on, data.parse_columns(args.columns), args.data_split)
    load = functools.partial(data.load, tok=tok, vocab_size=store.cfg.vocab_size, dtype=args.data_dtype,
                             recipe=recipe)
    split = data.split
    if args.mode == "dpo":  # pairs; chat messages through the model's template where it has one
        load = functools.partial(preference.load_pairs, tok=tok, encode=preference.pair_encoder(template))
        split = preference.split_pairs
    train_data, val_data = split(load(args.data), 0 if args.val_data else args.val_split)
    val_data = load(args.val_data) if args.val_data else val_data
    if template is None and train_data.fmt in data.CHAT_FORMATS:
        log.info("%s has no chat template: chat records are rendered as plain Role: content lines", path)
    return tok, recipe, train_data, val_data


def train_run(args, cfg, path, store, device, dtype, ddp, placement, activations, reporter) -> dict:
    tok, recipe, train_data, val_data = load_data(args, path, store)
    cfg = dataclasses.replace(cfg, prompt=data.render_prompt(args.prompt, train_data.fmt, recipe.template))
    with load_model(args, path, device, dtype, ddp, placement, activations, cfg.lr) as model, logging_redirect_tqdm():
        return train(model, train_data, val_data, cfg, tok, (reporter.log,), {"trackers": reporter.runs()})


def resolved_knobs(args, placement: P.Placement, activations: P.Activations) -> dict:
    """dest -> value of the placement and activation flags left to their config's default (None: auto)."""
    knobs = {f.name: getattr(cfg, f.name) for cfg in (placement, activations) for f in dataclasses.fields(cfg)
             if f.name in vars(args) and getattr(args, f.name) is None}
    return {**knobs, "prefetch_or_auto": args.prefetch_or_auto or str(placement.prefetch)}


def write_run_file(args, store: BlockStore, out: Path, **resolved) -> dict:
    """OUT/config.yaml: every flag as this run resolved it (`resolved`, by dest: lr, dtype, placement), the
    phantom and torch versions and the store's fingerprint, so `--config OUT/config.yaml` repeats the run.
    Returns all of it as one flat mapping (the config the trackers are given)."""
    p = parser()
    flat = runfile.settings(p, args, **resolved, resume=False, overwrite=False)  # a run file starts a run
    record = {"phantom": phantom.__version__, "torch": torch.__version__, "store": str(store.path),
              "store-fingerprint": store_fingerprint(store)}
    for key, was in runfile.recorded(args.config).items():
        if key in ("phantom", "torch", "store-fingerprint") and was != record[key]:
            log.warning("%s was recorded with %s %s; this run has %s: its numbers may differ", args.config, key,
                        was, record[key])
    header = f"# phantom run file, resolved at the start of the run in {out}.\n" \
             f"# Repeat it: python scripts/finetune.py --config {out / 'config.yaml'} (flags given there win).\n"
    runfile.write(out / "config.yaml", runfile.dump(p, flat, run_file_sections(p), record, header))
    return {**flat, **{f"recorded-{k}": v for k, v in record.items()}}


def run_file_sections(p: argparse.ArgumentParser) -> dict[str, tuple[str, ...]]:
    """SECTIONS, with every flag of the Placement and Activations groups in placement."""
    grouped = [o[2:] for g in p._action_groups if g.title in ("Placement", "Activations")
               for a in g._group_actions for o in a.option_strings if o.startswith("--")]
    return {**SECTIONS, "placement": SECTIONS["placement"] + tuple(grouped)}


def write_card(args, argv, s: dict, store: BlockStore, dtype: str, device) -> None:
    """OUT/README.md: the run card (model, data, flags that differ from the defaults, how it ended)."""
    p, recs = parser(), read_metrics(Path(s["out"]) / "metrics.jsonl", s["steps"])
    given = runfile.given(p, argv) | set(runfile.values(runfile.read(args.config), p, Path(args.config),
                                                         tuple(SECTIONS)) if args.config else {})
    defaults = vars(p.parse_args([]))
    changed = {d: getattr(args, d) for d in given if d in defaults and getattr(args, d) != defaults[d]}
    evals = [(r["step"], r["val_loss"]) for r in recs if r.get("val_loss") is not None]
    host, dev = runcard.peak_memory(device)
    given_targets = tuple(t.strip() for t in args.lora_targets.split(",") if t.strip())
    targets = ",".join(family_targets(phantom.LoraConfig(targets=given_targets).targets, store.cfg))
    lora = f"rank {args.lora_rank}, alpha {args.lora_alpha:g}, targets {targets}" + (
        f" (given {args.lora_targets})" if targets != args.lora_targets else "")
    card = runcard.RunCard(
        out=s["out"], model=args.model, store=str(store.path), fingerprint=store_fingerprint(store),
        n_params=store.cfg.n_params(), dtype=dtype, device=str(device), mode=args.mode, lora=lora,
        data=describe_data(args), flags=tuple(runfile.as_argv(p, changed)), status=s["status"], steps=s["steps"],
        final_loss=s["final_loss"], final_eval=evals[-1] if evals else None, best_eval=s["best_val_loss"],
        tokens_per_s=s["tokens"] / max(s["time_s"], 1e-9), peak_host_bytes=host, peak_device_bytes=dev,
        adapter=s["adapter"], weights=s["weights"],
        versions=f"phantom {phantom.__version__}, torch {torch.__version__}",
        origin=provenance.describe(store.manifest), **loadable_base(store))
    runcard.write(Path(s["out"]) / "README.md", card)


def loadable_base(store: BlockStore) -> dict:
    """The run card's base model for peft: what the adapter names when transformers can load it."""
    base, revision = provenance.base_model(store.manifest, store.path)
    return {} if base == str(store.path) else {"base_model": base, "base_revision": revision}


def describe_data(args) -> str:
    train_ = f"`{args.data}`" if args.data else "the shipped tiny text"
    held = f"held-out `{args.val_data}`" if args.val_data else \
        f"{args.val_split:g} held out" if args.val_split else "no held-out data"
    return f"{train_}, {held}, {args.seq_len} tokens per row, {args.batch_size * args.grad_accum} rows per step"


def main(argv=None) -> int:
    return cli.guarded(run, argv)


def print_summary(s: dict) -> None:
    best = f"{s['best_val_loss']:.4f}" if s["best_val_loss"] is not None else "-"
    print(f"\n{'finetune ' + s['status']:-^60}\n"
          f"steps        {s['steps']}\n"
          f"tokens       {s['tokens']:,} in {s['time_s']:.1f} s ({s['tokens'] / max(s['time_s'], 1e-9):,.0f} tok/s)\n"
          f"loss         final {s['final_loss']:.4f}, best eval {best}\n"
          f"{'weights' if s['weights'] else 'adapter':<13}{s['weights'] or s['adapter'] or '(not written)'}\n"
          f"checkpoint   {s['checkpoint'] + '  (continue with --resume)' if s['checkpoint'] else '-'}\n"
          f"metrics      {s['metrics']}  (plot: python scripts/plot.py --out {s['out']})\n"
          f"run card     {Path(s['out']) / 'README.md'}, the run in {Path(s['out']) / 'config.yaml'}")


if __name__ == "__main__":
    sys.exit(main())
