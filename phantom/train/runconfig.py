"""The run as one frozen config: `RunConfig`, the flags of scripts/finetune.py and its YAML run file.

RunConfig is composed of the configs the library takes (ModelSource, DataSource, LoraConfig,
TrainConfig with its PreferenceConfig, Placement, Activations, Output). Every field of each is one
flag, its name, help, type and choices read from the field (phantom.stream.placement.knob; a knob with
cli=False says why it has none), and so one key of a run file in the section its knob names
(phantom.train.runfile: the parser is the run file's schema). A field added to one of them is a flag and a
run-file key with no edit here: `LoraConfig.dropout` is `--lora-dropout`, `lora: {dropout: 0.1}`.

What a run decides from its model or its machine sits on RunConfig itself, None meaning "decide":
the learning rate (by the model's size), the sample interval (the tiny demo's) and the prefetch
depth (`auto`: the tuner's). phantom.train.runner.run carries a RunConfig out.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import re
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path

from phantom.data import chat
from phantom.data.tokenfiles import TOKEN_DTYPES
from phantom.model.lora import LoraConfig
from phantom.stream.placement import Activations, Placement, knob, offload_choices
from phantom.train import cli, runfile, trackers
from phantom.train.grpo import GrpoConfig
from phantom.train.preference import PreferenceConfig
from phantom.train.trainconfig import TrainConfig

TRAIN_MODES = ("lora", "full", "dpo", "grpo")
SECTION_ORDER = ("model", "placement", "lora", "data", "optim", "output")  # as OUT/config.yaml shows them
# The flags in the order --help, OUT/config.yaml and the run card's command show them; a flag of a new
# field follows the last flag of its config.
ORDER = ("config", "model", "revision", "synthetic", "layers", "device", "dtype", "offload", "resident",
         "device-budget", "ram-budget", "prefetch", "recompute", "keep-budget", "checkpoint-inner", "compile",
         "loss-chunk", "no-compile", "mode", "loss-type", "beta", "label-smoothing", "reference", "lora-rank",
         "lora-alpha", "lora-targets", "data", "val-data", "val-split", "data-dtype", "data-split", "columns",
         "chat-template", "train-on", "show-data", "show-data-ids", "iters", "batch-size", "grad-accum", "seq-len",
         "lr", "min-lr", "warmup", "weight-decay", "grad-clip", "eval-every", "eval-iters", "eval-tasks",
         "eval-tasks-every", "eval-limit", "save-every",
         "sample-every", "prompt", "sequential", "workers", "out", "resume", "overwrite", "seed", "trace",
         "report-to", "export", "quiet")
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

several adapters in one run (a sweep at the price of one read of the weights per step): a top-level
`adapters:` list, each entry a name and its own values of the per-adapter keys (ADAPTER_KEYS below),
everything else shared; or on the command line --sweep KEY=V1,V2 (repeatable: the grid of all values;
values holding a comma are separated by ;). Each adapter is a run folder OUT/NAME; OUT/sweep.md
compares them.

    adapters:
      - {name: a, lr: 1.0e-3}
      - {name: b, lr: 3.0e-3, lora-rank: 16, data: other.jsonl}
"""
# What each adapter of a sweep sets for itself (as its flags are spelled); everything else is shared.
ADAPTER_KEYS = ("lr", "min-lr", "warmup", "weight-decay", "grad-clip", "lora-rank", "lora-alpha", "lora-targets",
                "lora-dropout", "seed", "data", "val-data", "columns", "train-on")
ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._=+-]{0,99}")


def checked_adapters(adapters) -> tuple:
    """The adapters of a sweep as ({"name": NAME, KEY: value}, ...) with keys as their flags are spelled;
    names are folder names, each once; only ADAPTER_KEYS may differ (one line otherwise)."""
    if not adapters:
        return ()
    if not isinstance(adapters, (list, tuple)) or not all(isinstance(a, dict) for a in adapters):
        raise ValueError("adapters: a list of mappings, each a name and its own values (e.g. {name: a, lr: 1e-3})")
    out = []
    for a in adapters:
        a = {str(k).replace("_", "-"): v for k, v in a.items()}
        name = a.pop("name", None)
        if not isinstance(name, str) or not ADAPTER_NAME.fullmatch(name) or name in (".", ".."):
            raise ValueError(f"adapters: each needs a name that is a folder name (letters, digits, . _ = + -), "
                             f"got {name!r}")
        if bad := [k for k in a if k not in ADAPTER_KEYS]:
            raise ValueError(f"adapters: {name}: {bad[0]!r} is shared by every adapter of a run; an adapter sets "
                             f"only {', '.join(ADAPTER_KEYS)}")
        out.append({"name": name, **a})
    names = [a["name"] for a in out]
    if len(set(names)) < len(names):
        raise ValueError(f"adapters: the name {next(n for n in names if names.count(n) > 1)!r} is given twice")
    return tuple(out)


@dataclass(frozen=True)
class ModelSource:
    """Which weights a run trains and where it computes."""

    model: str = knob("tiny", "preset name (prepared under weights/), a store folder, or a Hugging Face hub id in "
                              "the local hub cache, converted on first use")
    revision: str = knob("main", "with a hub id: the branch, tag or commit in the cache")
    synthetic: bool = knob(False, "random weights with the shapes of the preset --model and the tiny tokenizer: a "
                                  "smoke test of real shapes without downloading them")
    layers: int | None = knob(None, "with --synthetic: this many blocks (default: the preset's)")
    device: str = knob("auto", "cpu, cuda, cuda:N, mps or auto")
    dtype: str = knob("auto", "compute dtype (default auto: bf16 on CUDA, else fp32)", choices=cli.DTYPES)


@dataclass(frozen=True)
class DataSource:
    """What a run trains on and holds out, and how records become rows."""

    data: str | None = knob(None, "plain text, JSONL (prompt/response, Alpaca, chat messages), or token ids already "
                                  "tokenized (.bin, .npy); default: the shipped tiny text")
    val_data: str | None = knob(None, "held-out data file (default: split off --val-split of --data)")
    val_split: float = knob(0.1, "fraction of --data held out for evaluation, 0: none")
    data_dtype: str | None = knob(None, "element type of .bin token files (default: uint16 if the vocabulary fits, "
                                        "else uint32)", choices=sorted(TOKEN_DTYPES))
    data_split: str | None = knob(None, "split of a Hub dataset or datasets folder (default: train)")
    columns: str | None = knob(None, "records keep their data under other names, e.g. prompt=question,"
                                     "response=answer or messages=dialog", metavar="KEY=COLUMN,...")
    chat_template: str | None = knob(None, "Jinja chat template for chat and instruction records (default: the "
                                           "model's own, kept in the store from its tokenizer_config.json; none: "
                                           "plain Role: content lines)", metavar="FILE")
    train_on: str = knob("all", "what carries loss in a chat: all assistant turns, the last one, or prompt-too "
                                "(every token)", choices=chat.TRAIN_ON)
    show_data: int = knob(0, "print the first N training rows as the model sees them (every token, special tokens "
                             "by their text; loss spans in [[ ]], packed examples on their own lines) and exit",
                          metavar="N")
    show_data_ids: bool = knob(False, "with --show-data: each token's id beside it, in ⟨ ⟩")


@dataclass(frozen=True)
class Output:
    """Where a run's files go besides TrainConfig's folder, and who else is told."""

    overwrite: bool = knob(False, "start a new run in --out although another phantom run's files are there (only "
                                  "the files phantom writes are replaced)")
    report_to: str = knob("none", "comma-separated experiment trackers fed the metrics.jsonl scalars and the "
                                  "config: tensorboard, wandb, mlflow, or none", metavar="TRACKERS")

    export: str = knob("none", "at the end of the run, also write OUT/gguf/: the trained model (the adapter merged) "
                               "as one GGUF file for llama.cpp, Ollama and LM Studio, and an Ollama Modelfile "
                               "(needs phantom[gguf]; merge_lora.py --format gguf --outtype picks another type)",
                       choices=("none", "gguf"))

    def __post_init__(self):
        trackers.parse_names(self.report_to)


def part(default, section: str | None, **meta):
    """A RunConfig field holding one config, whose flags go to `section` (unless a field says otherwise)."""
    return field(default=default, metadata=dict(section=section, **meta))


@dataclass(frozen=True)
class RunConfig:
    """Everything one finetuning run is: `phantom.run(RunConfig(...))` is `scripts/finetune.py` with flags.

    lr, sample_every and prefetch are the run's own choices, None: decided at the start (lr by the
    model's size, a sample every 100 steps for the tiny demo, prefetch from `placement`; "auto" asks
    the tuner). train.lr and train.sample_every are replaced by them, lora.seed by train.seed.
    `given`: the placement and activation fields set by a flag or run file even where they equal the
    default (--resume keeps them over the checkpoint's; from Python any field that differs counts too).
    Not flags, as the run sets them: Placement.prefetch (the `prefetch` here takes N or auto),
    shared_ram (local ranks of a RAM-offloaded LoRA run share one copy) and Activations.micro_batch
    (train.batch_size rows, two per pair for dpo). RunConfig() is finetune.py with no flags (its
    samples start from "The keeper").
    """

    config: str | None = knob(None, "YAML run file: its keys are these flags (see below); flags given here "
                                    "override it", metavar="RUN.yaml")
    model: ModelSource = part(ModelSource(), "model")
    placement: Placement = part(Placement(), "placement", knobs=True, skip=("prefetch", "shared_ram"))
    prefetch: int | str | None = knob(None, "blocks read ahead of the one computing (default: 2), or auto: the "
                                            "tuner's tier, prefetch and resident blocks (python scripts/tune.py "
                                            "measures; else a quick profile)", section="placement",
                                      dest="prefetch_or_auto", metavar="N|auto", type="text")
    activations: Activations = part(Activations(), "placement", knobs=True, skip=("micro_batch",))
    lora: LoraConfig = part(LoraConfig(), "lora", prefix="lora-")
    data: DataSource = part(DataSource(), "data")
    train: TrainConfig = part(TrainConfig(prompt="The keeper"), "optim")
    lr: float | None = knob(None, "peak learning rate (default by model size: LoRA 1e-2 under 100M parameters, "
                                  "else 2e-4; full 1e-3 / 1e-5)", section="optim")
    sample_every: int | None = knob(None, "print a greedy sample every N steps and at the end, 0: off (default: "
                                          "100 for the tiny model, else off)", section="output")
    output: Output = part(Output(), "output")
    adapters: tuple = knob((), "", cli=False)  # a sweep: ({"name": ..., ADAPTER_KEYS...}, ...); see adapter_runs
    given: frozenset = knob(frozenset(), "", cli=False)

    def __post_init__(self):
        if not (self.prefetch in (None, "auto") or type(self.prefetch) is int):
            raise ValueError(f"prefetch must be a number of blocks, auto or None, not {self.prefetch!r}")
        if self.prefetch is not None and self.prefetch != "auto":
            object.__setattr__(self, "placement", dataclasses.replace(self.placement, prefetch=self.prefetch))
        if self.lr is not None:
            object.__setattr__(self, "train", dataclasses.replace(self.train, lr=self.lr))
        if self.sample_every is not None:
            object.__setattr__(self, "train", dataclasses.replace(self.train, sample_every=self.sample_every))
        object.__setattr__(self, "lora", dataclasses.replace(self.lora, seed=self.train.seed))
        object.__setattr__(self, "adapters", checked_adapters(self.adapters))


# -- flags -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Flag:
    """One flag: the RunConfig field it sets (its attribute path), its run-file section, argparse's keywords."""

    path: tuple[str, ...]
    name: str
    section: str | None
    kwargs: dict
    group: str | None = None  # the --help group (Placement, Activations)
    meta: dict = field(default_factory=dict)

    @property
    def dest(self) -> str:
        return self.kwargs.get("dest", self.name.replace("-", "_"))


def flags() -> list[Flag]:
    """Every flag of a run, in ORDER (`--no-compile`: the on/off `--compile`'s short form)."""
    found = list(_walk(RunConfig(), (), None, "", {}))
    found.append(Flag(("activations", "compile"), "no-compile", "placement",
                      dict(dest="compile", action="store_false", help="run blocks eagerly")))
    rank = {name: i for i, name in enumerate(ORDER)}
    last: dict[str, int] = {}  # config -> the place of its last flag in ORDER
    for f in found:
        if f.name in rank:
            last[f.path[0]] = max(last.get(f.path[0], -1), rank[f.name])
    return sorted(found, key=lambda f: (rank[f.name], 0) if f.name in rank else (last.get(f.path[0], len(ORDER)), 1))


def _walk(config, path: tuple[str, ...], section: str | None, prefix: str, outer: dict):
    hints = typing.get_type_hints(type(config))
    for f in dataclasses.fields(config):
        meta, value = dict(f.metadata), getattr(config, f.name)
        if meta.get("by_mode"):  # its default depends on --mode: not given is None (the mode's config decides)
            value = None
        if not meta.get("cli", True) or f.name in outer.get("skip", ()):
            continue
        where = meta.get("section", section)
        if dataclasses.is_dataclass(value):
            yield from _walk(value, path + (f.name,), where, meta.get("prefix", prefix), meta)
            continue
        name = meta.get("flag", prefix + f.name.replace("_", "-"))
        if outer.get("knobs"):  # Placement, Activations: None is "not given", the config decides
            kw = cli.knob_flag(f, hints[f.name], f.default)
            yield Flag(path + (f.name,), name, where, kw, type(config).__name__, meta)
        else:
            yield Flag(path + (f.name,), name, where, _plain_flag(name, hints[f.name], meta, value), None, meta)


def _plain_flag(name: str, kind, meta: dict, default) -> dict:
    """argparse keywords of a flag whose default is the field's own (a boolean flag turns it on or off)."""
    help_ = meta.get("help", "")
    kw = dict(dest=meta.get("dest", name.replace("-", "_")), help=help_)
    if kind in (bool, bool | None):
        return {**kw, "action": "store_true"}  # on: the field's opposite of its default
    if meta.get("action") == "append":  # repeated: each one more value (None: none given)
        return {**kw, "action": "append", "default": None, "metavar": meta.get("metavar")}
    if "nargs" in meta:
        return {**kw, "nargs": meta["nargs"], "type": meta.get("item", str), "default": default,
                "metavar": meta.get("metavar")}
    if default is not None and "default" not in help_:
        kw["help"] = f"{help_} (default: {','.join(default) if isinstance(default, tuple) else default})"
    kw["default"] = ",".join(default) if meta.get("type") == "csv" else default
    if "choices" in meta:
        kw["choices"] = meta["choices"]
    elif kind in (int, int | None):
        kw["type"] = int
    elif kind in (float, float | None):
        kw["type"] = float
    if "metavar" in meta:
        kw["metavar"] = meta["metavar"]
    return kw


def parser(description: str | None = None) -> argparse.ArgumentParser:
    """The flags of a run; also the schema of its run files (phantom.train.runfile). The tiers installed
    packages declare are registered first: they are choices of --offload (and of `offload:`).

    Raises:
        ValueError: a tier plugin is broken or conflicts (one line).
    """
    offload_choices()
    p = argparse.ArgumentParser(description=description, epilog=RUN_FILE_HELP,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    groups = {}
    for f in flags():
        if f.group is not None and f.group not in groups:
            groups[f.group] = p.add_argument_group(f.group)
        options = [f"--{f.name}"] + ([f.meta["short"]] if "short" in f.meta else [])
        (groups[f.group] if f.group else p).add_argument(*sorted(options, key=len), **f.kwargs)
    p.add_argument("--sweep", action="append", metavar="KEY=V1,V2,...",
                   help=f"train one adapter per value (repeatable: the grid of all values), all in one pass over the "
                        f"weights, each in OUT/NAME; KEY is one of {', '.join(ADAPTER_KEYS)} (values holding a "
                        f"comma are separated by ;); a run file's `adapters:` list names them itself")
    return p


def _sections() -> dict[str, tuple[str, ...]]:
    by = {s: [] for s in SECTION_ORDER}
    for f in flags():
        if f.section is not None:
            by.setdefault(f.section, []).append(f.name)
    return {s: tuple(names) for s, names in by.items()}


SECTIONS = _sections()  # run-file section -> the flags it holds (OUT/config.yaml)


def run_file_sections(p: argparse.ArgumentParser | None = None) -> dict[str, tuple[str, ...]]:
    """Where each flag sits in OUT/config.yaml (a flag named SECTION-x, or new, by its prefix)."""
    return SECTIONS


def parse_args(argv=None, p: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """The command line (and its --config run file) as argparse's namespace, one dest per flag."""
    return runfile.parse_args(p or parser(), argv, tuple(SECTIONS))


# -- namespace <-> RunConfig -------------------------------------------------------------------

def from_argv(argv=None, p: argparse.ArgumentParser | None = None) -> RunConfig:
    """RunConfig from a command line: flags over the --config file over the defaults, every value checked."""
    args = parse_args(argv, p)
    check_mode(argv)
    return from_args(args)


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


def parse_prefetch(text: str | None) -> int | str | None:
    if text is None or text == "auto":
        return text
    if not text.lstrip("-").isdigit() or int(text) < 0:
        raise ValueError(f"--prefetch must be >= 0 or auto, not {text!r}")
    return int(text)


def from_args(args: argparse.Namespace) -> RunConfig:
    """The RunConfig a namespace of parse_args holds (checked in the order the flags were always checked:
    trackers, placement, prefetch, training, then the rest)."""
    values: dict[tuple[str, ...], object] = {}
    seen = set()  # dests: --no-compile shares --compile's
    for f in flags():
        value = getattr(args, f.dest, None)
        if f.dest in seen or (f.group is not None and value is None):
            continue  # a knob not given: its config decides
        seen.add(f.dest)
        if f.meta.get("invert"):
            value = not value
        elif f.meta.get("type") == "csv":
            value = tuple(t.strip() for t in value.split(",") if t.strip())
        elif f.meta.get("action") == "append" or "nargs" in f.meta:
            value = tuple(value) if value is not None else (() if f.meta.get("action") == "append" else None)
        values[f.path] = value
    output = Output(**_part(values, "output"))
    placement, activations = Placement(**_part(values, "placement")), Activations(**_part(values, "activations"))
    prefetch = parse_prefetch(values.pop(("prefetch",), None))
    train = _train(values, values[("lr",)])
    given = frozenset(p[1] for p in values if p[0] in ("placement", "activations"))
    adapters = sweep_grid(args.sweep) if getattr(args, "sweep", None) else getattr(args, "adapters", None) or ()
    return RunConfig(adapters=adapters, config=values[("config",)], model=ModelSource(**_part(values, "model")), placement=placement,
                     prefetch=prefetch, activations=activations, lora=LoraConfig(**_part(values, "lora")),
                     data=DataSource(**_part(values, "data")), train=train, lr=values[("lr",)],
                     sample_every=values[("sample_every",)], output=output, given=given)


def _part(values: dict, name: str) -> dict:
    return {p[1]: v for p, v in values.items() if p[0] == name and len(p) == 2}


def _train(values: dict, lr: float | None) -> TrainConfig:
    """TrainConfig of the flags; lr 1.0 stands in for one decided later (checked again then). --loss-type and
    --beta are DPO's or GRPO's by --mode (None: the mode's default)."""
    pref = {p[2]: v for p, v in values.items() if p[:2] == ("train", "preference")}
    grpo = {p[2]: v for p, v in values.items() if p[:2] == ("train", "grpo")}
    if values.get(("train", "mode")) == "grpo":
        shared = {"loss_type": pref.pop("loss", None), "beta": pref.pop("beta", None)}
        grpo.update({k: v for k, v in shared.items() if v is not None})
    return TrainConfig(**_part(values, "train"), lr=lr if lr is not None else 1.0, preference=PreferenceConfig(**pref),
                       grpo=GrpoConfig(**grpo))


def train_config(args: argparse.Namespace, lr: float) -> TrainConfig:
    """The TrainConfig of parsed flags, with `lr`."""
    return dataclasses.replace(from_args(args).train, lr=lr)


def to_args(cfg: RunConfig, resolved: bool = False) -> dict[str, object]:
    """dest -> value: the namespace parse_args would give for `cfg` (a knob neither given nor changed is
    None, "not given"), or with `resolved` every knob's value (what OUT/config.yaml records)."""
    out: dict[str, object] = {}
    for f in flags():
        if f.dest in out:
            continue
        value = cfg
        for attr in f.path:
            value = getattr(value, attr)
        if f.meta.get("invert"):
            value = not value
        elif f.meta.get("type") == "csv":
            value = ",".join(value)
        elif f.meta.get("action") == "append" or "nargs" in f.meta:
            value = list(value) if value else None
        elif f.meta.get("by_mode"):  # --loss-type, --beta: the mode's own value; not given where it is the default
            grpo = cfg.train.mode == "grpo"
            name = {"loss": "loss_type" if grpo else "loss", "beta": "beta"}[f.path[2]]
            value = getattr(cfg.train.grpo if grpo else cfg.train.preference, name)
            if not resolved and value == getattr(GrpoConfig() if grpo else PreferenceConfig(), name):
                value = None
        elif f.name == "prefetch":
            value = None if value is None else str(value)
        elif f.group is not None and not resolved and f.path[1] not in cfg.given and \
                value == getattr(type(getattr(cfg, f.path[0]))(), f.path[1]):
            value = None
        out[f.dest] = value
    return out


# -- several adapters ------------------------------------------------------------------------------

def sweep_grid(specs: list[str]) -> tuple[dict, ...]:
    """--sweep KEY=V1,V2 ... as adapters: one per combination of the values, named by them (lr=1e-3_lora-rank=8)."""
    axes = []
    for spec in specs:
        key, eq, text = spec.partition("=")
        key = key.strip()
        if not eq or key not in ADAPTER_KEYS:
            raise ValueError(f"--sweep {spec!r}: expected KEY=V1,V2,... with KEY one of {', '.join(ADAPTER_KEYS)}")
        values = [v.strip() for v in text.split(";" if ";" in text else ",") if v.strip()]
        if not values or any(k == key for k, _ in axes):
            raise ValueError(f"--sweep {spec!r}: give {key} once, with one or more values")
        axes.append((key, values))
    grid = itertools.product(*[[(k, v) for v in values] for k, values in axes])
    return tuple({"name": "_".join(f"{k}={_name_part(v)}" for k, v in combo), **dict(combo)} for combo in grid)


def _name_part(value: str) -> str:
    """A value as part of a folder name: a file by its name, anything else its characters kept where safe."""
    if "/" in value or "\\" in value:
        value = value.replace("\\", "/").rstrip("/").rsplit("/", 1)[-1]
    return re.sub(r"[^A-Za-z0-9._+-]", "+", value)


def adapter_runs(cfg: RunConfig, p: argparse.ArgumentParser | None = None) -> list[tuple[str, RunConfig]]:
    """Each adapter of a sweep as the run of it alone: cfg with the adapter's values, --out OUT/NAME, and
    every value checked as its flag is (one line naming the adapter otherwise)."""
    p = p or parser()
    actions = {k: a for a in p._actions for k in (o[2:] for o in a.option_strings) if k in ADAPTER_KEYS}
    base = to_args(cfg)
    out = []
    for a in cfg.adapters:
        args = dict(base, sweep=None, adapters=None)
        for key, value in a.items():
            if key == "name":
                continue
            try:
                args[actions[key].dest] = runfile.convert(actions[key], value)
            except (TypeError, ValueError, argparse.ArgumentTypeError) as e:
                raise ValueError(f"adapters: {a['name']}: {key}: {e}") from None
        args["out"] = str(Path(cfg.train.out) / a["name"])
        try:
            out.append((a["name"], dataclasses.replace(from_args(argparse.Namespace(**args)), given=cfg.given)))
        except ValueError as e:
            raise ValueError(f"adapters: {a['name']}: {e}") from None
    return out
