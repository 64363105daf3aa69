"""`phantom.run(RunConfig(...))` is scripts/finetune.py with the same flags: the same metrics.jsonl,
config.yaml and adapter; every field of the run's configs is a flag (`--lora-dropout` included)."""
from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path

import pytest
import yaml

import phantom
from phantom.train import runconfig as rc
from test_convert import load_script

FLAGS = ["--model", "tiny", "--iters", "3", "--batch-size", "2", "--seq-len", "32", "--eval-every", "2",
         "--val-split", "0.1", "--offload", "ram", "--prefetch", "1", "--lora-rank", "4", "--lora-dropout", "0.1",
         "--lora-targets", "q,k,v", "--warmup", "1", "--lr", "5e-3", "--sample-every", "0", "-q"]


def same_run(out: Path) -> phantom.RunConfig:
    return phantom.RunConfig(
        model=phantom.ModelSource(model="tiny"), placement=phantom.Placement(offload="ram"), prefetch=1,
        lora=phantom.LoraConfig(rank=4, dropout=0.1, targets=("q", "k", "v")), lr=5e-3, sample_every=0,
        data=phantom.DataSource(val_split=0.1),
        train=phantom.TrainConfig(iters=3, batch_size=2, seq_len=32, eval_every=2, warmup=1, prompt="The keeper",
                                  out=str(out), progress=False))


def records(out: Path) -> list[dict]:
    """metrics.jsonl without what measures time (durations, rates, stalls)."""
    timed = ("_s", "tok_s", "stall_frac")
    return [{k: v for k, v in json.loads(line).items() if not k.endswith(timed)}
            for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_run_from_python_equals_the_cli(tmp_path):
    cli_out, api_out = tmp_path / "cli", tmp_path / "api"
    assert load_script("finetune").main([*FLAGS, "--out", str(cli_out)]) == 0
    s = phantom.run(same_run(api_out))
    assert s["status"] == "done" and s["steps"] == 3
    mine, theirs = records(api_out), records(cli_out)
    assert [r["step"] for r in mine] == [0, 1, 2, 3] and all("loss" in r for r in mine[1:])
    assert mine == theirs
    written = [yaml.safe_load((o / "config.yaml").read_text()) for o in (api_out, cli_out)]
    for w in written:
        assert w["output"].pop("out") and w.pop("recorded")
    assert written[0] == written[1] and written[0]["lora"]["dropout"] == 0.1
    adapter = json.loads((api_out / "adapter" / "adapter_config.json").read_text())
    assert adapter["lora_dropout"] == 0.1 and adapter["r"] == 4


def test_a_flag_for_every_field():
    """Each field of the run's configs is a flag, unless its knob says cli=False; the run file's sections
    place each flag once."""
    names = {f.name for f in rc.flags()}
    assert {"lora-dropout", "lora-rank", "loss-type", "sequential", "quiet", "offload", "prefetch"} <= names
    parts = {"model": rc.ModelSource, "data": rc.DataSource, "lora": phantom.LoraConfig,
             "train": phantom.TrainConfig, "output": rc.Output, "activations": phantom.Activations}
    for part, cls in parts.items():
        for f in dataclasses.fields(cls):
            flagged = [x for x in rc.flags() if x.path[:2] == (part, f.name)]
            wanted = f.metadata.get("cli", True) and f.name != "micro_batch"
            assert bool(flagged) == wanted, (part, f.name)
    sections = [n for names_ in rc.SECTIONS.values() for n in names_]
    assert len(sections) == len(set(sections)) and set(sections) == names - {"config"}


def test_bad_values_are_refused_from_python_as_from_the_cli():
    with pytest.raises(ValueError, match="unknown tracker 'nope'"):
        rc.Output(report_to="nope")
    with pytest.raises(ValueError, match="prefetch must be >= 0"):
        phantom.RunConfig(prefetch=-1)
    with pytest.raises(ValueError, match="--prefetch must be >= 0 or auto, not '-1'"):
        rc.from_argv(["--prefetch", "-1"])


def test_the_config_round_trips_through_its_flags():
    cfg = rc.from_argv(FLAGS)
    assert cfg.lora == phantom.LoraConfig(rank=4, dropout=0.1, targets=("q", "k", "v"))
    assert cfg.placement.prefetch == 1 and cfg.train.lr == 5e-3 and not cfg.train.progress
    back = rc.from_args(__import__("argparse").Namespace(**{**rc.to_args(cfg), "config": None}))
    assert back == cfg
    assert typing.get_type_hints(rc.RunConfig)["lora"] is phantom.LoraConfig
