"""YAML run files for scripts/finetune.py: a run from a file equals the same run from flags, a finished
run's OUT/config.yaml repeats it bit for bit, command-line flags win, the examples validate, the run
card says how the run ended, and bad run files are one `error:` line (exit 2) with nothing written.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from phantom.train import runfile
from test_convert import load_script
from test_finetune_cli import metrics

REPO = Path(__file__).resolve().parent.parent
TINY = ["--model", "tiny", "--iters", "3", "--batch-size", "2", "--seq-len", "32", "--eval-every", "2",
        "--eval-iters", "1", "--save-every", "0", "--offload", "ram", "-q"]
# The same run as TINY with a few more flags, as a sectioned run file.
RUN_YAML = """\
model: {model: tiny}
placement: {offload: ram}
lora: {rank: 4, alpha: 8, targets: [q, k, v]}
data: {seq-len: 32, batch-size: 2}
optim:
  iters: 3
  lr: 5e-3          # YAML 1.1 reads this as a string; the flag's own type makes it a number
  warmup: 1
output: {eval-every: 2, eval-iters: 1, save-every: 0, quiet: true}
"""
RUN_FLAGS = [*TINY, "--lora-rank", "4", "--lora-alpha", "8", "--lora-targets", "q,k,v", "--lr", "5e-3",
             "--warmup", "1"]


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: a second thread only waits on a shared machine
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def cli():
    return load_script("finetune")


def losses(out: Path) -> list:
    return [(m["step"], m.get("loss"), m.get("val_loss")) for m in metrics(out)]


def adapter(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "adapter" / "adapter_model.safetensors"))


def same_weights(a: Path, b: Path) -> bool:
    wa, wb = adapter(a), adapter(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.fixture(scope="module")
def flag_run(cli, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "flags"
    assert cli.main([*RUN_FLAGS, "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def yaml_run(cli, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("runs")
    (tmp / "run.yaml").write_text(RUN_YAML)
    assert cli.main(["--config", str(tmp / "run.yaml"), "--out", str(tmp / "yaml")]) == 0
    return tmp / "yaml"


# -- runs --------------------------------------------------------------------------------------

def test_a_run_file_equals_the_same_run_from_flags(flag_run, yaml_run):
    assert losses(yaml_run) == losses(flag_run)
    assert len(losses(flag_run)) == 4 and all(loss is not None for _, loss, _ in losses(flag_run)[1:])
    assert same_weights(yaml_run, flag_run)
    assert json.loads((yaml_run / "adapter" / "adapter_config.json").read_text())["r"] == 4


def test_config_yaml_holds_every_flag_and_repeats_the_run_bit_for_bit(cli, flag_run, tmp_path):
    written = yaml.safe_load((flag_run / "config.yaml").read_text())
    flat = {k: v for section in written.values() for k, v in section.items()}
    assert written["lora"] == {"rank": 4, "alpha": 8.0, "targets": "q,k,v", "dropout": 0.0}  # every LoraConfig flag
    assert written["optim"]["lr"] == 5e-3 and written["model"]["dtype"] == "fp32"  # resolved: auto is fp32 on CPU
    assert written["placement"]["offload"] == "ram" and written["placement"]["recompute"] == "auto"  # a default
    assert written["output"]["resume"] is False and "config" not in flat
    rec = written["recorded"]
    assert rec["torch"] == torch.__version__ and len(rec["store-fingerprint"]) == 64
    keys = runfile.schema(cli.parser())
    assert {runfile.resolve_key(keys, s, k) for s in written if s != "recorded" for k in written[s]} == \
        {k for k, a in keys.items() if a.dest != "compile" or k == "compile"}  # one key per flag

    again = tmp_path / "again"
    assert cli.main(["--config", str(flag_run / "config.yaml"), "--out", str(again)]) == 0
    assert losses(again) == losses(flag_run) and same_weights(again, flag_run)
    mine = yaml.safe_load((again / "config.yaml").read_text())
    assert mine["output"].pop("out") == str(again) and written["output"].pop("out") == str(flag_run)
    assert mine == written  # the repeat resolved to the very same run


def test_command_line_flags_override_the_file(cli, tmp_path):
    (tmp_path / "run.yaml").write_text(RUN_YAML)
    out = tmp_path / "o"
    assert cli.main(["--config", str(tmp_path / "run.yaml"), "--iters", "2", "--lora-rank", "2",
                     "--out", str(out)]) == 0
    assert [m["step"] for m in metrics(out)] == [0, 1, 2]
    assert json.loads((out / "adapter" / "adapter_config.json").read_text())["r"] == 2
    written = yaml.safe_load((out / "config.yaml").read_text())
    assert written["optim"]["iters"] == 2 and written["lora"]["rank"] == 2 and written["lora"]["alpha"] == 8.0


def test_run_card(cli, flag_run):
    card = (flag_run / "README.md").read_text()
    recs = metrics(flag_run)
    assert "`tiny`" in card and written_fingerprint(flag_run)[:16] in card
    assert f"| final train loss | {recs[-1]['loss']:.4f} |" in card
    assert f"| final eval loss | {recs[-1]['val_loss']:.4f} (step 3) |" in card
    assert f"| best eval loss | {min(r['val_loss'] for r in recs if 'val_loss' in r):.4f} |" in card
    assert "--lora-rank 4 --lora-alpha 8.0 --lora-targets q,k,v" in card and "--warmup 1" in card
    assert "--model tiny" not in card and "--offload ram" in card  # given, and differs from the default
    assert "PeftModel.from_pretrained" in card and f"read_adapter_config({str(flag_run / 'adapter')!r})" in card
    assert "| peak memory | host " in card and "| tokens/s |" in card


def written_fingerprint(out: Path) -> str:
    return yaml.safe_load((out / "config.yaml").read_text())["recorded"]["store-fingerprint"]


def test_a_changed_store_or_torch_is_a_warning(cli, flag_run, tmp_path, capsys):
    text = (flag_run / "config.yaml").read_text().replace(f"torch: {torch.__version__}", "torch: 1.0.0")
    (tmp_path / "old.yaml").write_text(text)
    assert cli.main(["--config", str(tmp_path / "old.yaml"), "--iters", "1", "--out", str(tmp_path / "o")]) == 0
    assert "was recorded with torch 1.0.0; this run has" in capsys.readouterr().err


# -- the schema is the parser ------------------------------------------------------------------

def test_a_new_flag_is_a_run_file_key_with_no_edit(cli, tmp_path):
    """A flag added to finetune.py (its type, choices, boolean, SECTION- prefix) works in run files as it is."""
    p = cli.parser()
    p.add_argument("--probe-text", default=None, help="a string")
    p.add_argument("--probe-mode", default="one", choices=["one", "all"])
    p.add_argument("--probe-flag", action="store_true")
    p.add_argument("--lora-probe", type=float, default=0.0)
    (tmp_path / "r.yaml").write_text("data: {probe-text: t.jinja, probe_mode: all}\nprobe-flag: true\n"
                                     "lora: {probe: 0.1}\n")
    args = runfile.parse_args(p, ["--config", str(tmp_path / "r.yaml")], ("data", "lora"))
    assert (args.probe_text, args.probe_mode, args.probe_flag, args.lora_probe) == ("t.jinja", "all", True, 0.1)
    text = runfile.dump(p, runfile.settings(p, args), {"data": ("probe-text", "probe-mode"), "lora": ()})
    back = yaml.safe_load(text)
    assert back["data"] == {"data": None, "dtype": None, "split": None, "probe-text": "t.jinja", "probe-mode": "all"}
    assert back["probe-flag"] is True  # in no section: at the top level
    assert back["lora"]["probe"] == 0.1  # by its SECTION- prefix
    (tmp_path / "bad.yaml").write_text("probe-mode: some\n")
    with pytest.raises(ValueError, match="probe-mode: expected one of one, all, got 'some'"):
        runfile.parse_args(p, ["--config", str(tmp_path / "bad.yaml")])


def test_every_flag_round_trips_through_a_written_run_file(cli, tmp_path):
    """Non-default values for every kind of flag, written and read back, parse to the same namespace."""
    p = cli.parser()
    argv = ["--model", "7B", "--synthetic", "--layers", "2", "--dtype", "bf16", "--offload", "disk",
            "--resident", "1", "--ram-budget", "3G", "--prefetch", "auto", "--recompute", "none",
            "--checkpoint-inner", "--compile", "off", "--loss-chunk", "64", "--no-compile", "--mode", "full",
            "--lora-targets", "q,o", "--lr", "1e-05", "--min-lr", "0", "--val-split", "0", "--data-dtype", "uint32",
            "--sequential", "--trace", "--prompt", "a: b # c", "--report-to", "tensorboard,mlflow", "--out", "x y",
            "--data-split", "validation", "--columns", "prompt=q,response=a", "--chat-template", "none",
            "--train-on", "last", "--show-data", "3", "--revision", "v2", "--loss-type", "ipo", "--beta", "0.25",
            "--label-smoothing", "0.1", "--reference", "precompute"]
    args = runfile.parse_args(p, argv)
    path = tmp_path / "all.yaml"
    path.write_text(runfile.dump(p, runfile.settings(p, args), cli.run_file_sections(p), {"torch": "x"}))
    assert vars(runfile.parse_args(cli.parser(), ["--config", str(path)], tuple(cli.SECTIONS))) == \
        {**vars(args), "config": str(path)}
    defaults = runfile.parse_args(p, [])
    path.write_text(runfile.dump(p, runfile.settings(p, defaults), cli.run_file_sections(p)))
    assert vars(runfile.parse_args(cli.parser(), ["--config", str(path)], tuple(cli.SECTIONS))) == \
        {**vars(defaults), "config": str(path)}


@pytest.mark.parametrize("example", sorted((REPO / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_examples_validate(cli, example):
    args = cli.parse_args(["--config", str(example)])
    keys = runfile.schema(cli.parser())
    doc = runfile.read(example)
    set_ = runfile.values(doc, cli.parser(), example, tuple(cli.SECTIONS))
    assert set_ and all(getattr(args, dest) == value for dest, value in set_.items())
    assert all(isinstance(v, dict) for v in doc.values()), "examples use the sections"
    assert all(runfile.resolve_key(keys, s, k) for s in doc for k in doc[s])


def test_examples_are_the_three_runs():
    names = sorted(p.name for p in (REPO / "examples").glob("*.yaml"))
    assert names == ["70b-lora-ram-disk.yaml", "7b-lora-chat.yaml", "tiny.yaml"]
    big = runfile.read(REPO / "examples" / "70b-lora-ram-disk.yaml")
    assert big["model"]["dtype"] == "bf16" and big["placement"]["offload"] == "auto"
    assert "ram-budget" in big["placement"]


def test_the_tiny_example_runs(cli, tmp_path):
    out = tmp_path / "tiny"
    assert cli.main(["--config", str(REPO / "examples" / "tiny.yaml"), "--iters", "2", "--seq-len", "32",
                     "--eval-every", "0", "--sample-every", "0", "-q", "--out", str(out)]) == 0
    assert [m["step"] for m in metrics(out)] == [0, 1, 2] and (out / "README.md").is_file()


def test_help_shows_the_yaml_form(cli, capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(["--help"])
    text = capsys.readouterr().out
    assert "--config RUN.yaml" in text and "lora: {rank: 16, targets: [q, k, v, o]}" in text
    assert "--report-to TRACKERS" in text


# -- bad run files -----------------------------------------------------------------------------

@pytest.mark.parametrize("text, match", [
    ("iters: [3\n", "malformed YAML"),
    ("model: tiny\n\tseq-len: 3\n", "malformed YAML"),
    ("- iters\n- 3\n", "a run file is a mapping of flag names to values, not a list"),
    ("itres: 3\n", "unknown key 'itres' (did you mean 'iters'?)"),
    ("lora: {rnak: 4}\n", "unknown key 'lora.rnak' (did you mean 'lora.rank'?)"),
    ("iters: ten\n", "iters: expected an integer, got 'ten'"),
    ("lora: {rank: 2.5}\n", "lora.rank: expected an integer, got 2.5 (a number)"),
    ("lr: fast\n", "lr: expected a number, got 'fast'"),
    ("trace: 'yes'\n", "trace: expected true or false, got 'yes' (a string)"),
    ("offload: tape\n", "offload: expected one of auto, none, ram, disk, got 'tape'"),
    ("device: on\n", "device: expected a string, got True (a boolean) (quote it)"),
    ("iters: null\n", "iters: expected an integer, got null"),
    ("ram-budget: lots\n", "ram-budget: expected SIZE|auto, got 'lots'"),
    ("data: {seq-len: {a: 1}}\n", "data.seq-len: expected an integer, got a mapping"),
    ("iters: 3\niters: 4\n", "key 'iters' given twice"),
    ("lora-rank: 4\nlora: {rank: 8}\n", "'lora.rank' and 'lora-rank' both set --lora-rank"),
    ("report-to: tensorboard,neptune\n", "--report-to: unknown tracker 'neptune'"),
])
def test_bad_run_files_are_one_line_exit_2(cli, capsys, tmp_path, text, match):
    (tmp_path / "bad.yaml").write_text(text)
    out = tmp_path / "out"
    code = cli.main(["--config", str(tmp_path / "bad.yaml"), "--out", str(out), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: ") and match in err, err
    assert not out.exists()  # refused before anything was written


def test_a_missing_run_file(cli, capsys, tmp_path):
    assert cli.main(["--config", str(tmp_path / "none.yaml"), "--quiet"]) == 2
    assert capsys.readouterr().err == f"error: --config: run file {tmp_path / 'none.yaml'} not found\n"
    assert cli.main(["--config", str(tmp_path), "--quiet"]) == 2
    assert capsys.readouterr().err == f"error: --config: {tmp_path} is a folder, not a run file\n"


def test_string_flags_take_numbers_as_written(cli, tmp_path):
    (tmp_path / "r.yaml").write_text("placement: {prefetch: 3}\noutput: {prompt: 2024}\nmodel: {model: 7B}\n")
    args = cli.parse_args(["--config", str(tmp_path / "r.yaml")])
    assert (args.prefetch_or_auto, args.prompt, args.model) == ("3", "2024", "7B")


def test_convert_follows_the_action():
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, nargs="+")
    p.add_argument("--x", action="store_false", dest="y")
    p.add_argument("--flag", action=argparse.BooleanOptionalAction, default=True)
    keys = runfile.schema(p)
    assert set(keys) == {"n", "x", "flag"}
    assert runfile.convert(keys["n"], [1, "2"]) == [1, 2] and runfile.convert(keys["n"], 3) == [3]
    assert runfile.convert(keys["x"], True) is False and runfile.convert(keys["x"], False) is runfile._UNSET
    assert runfile.convert(keys["flag"], False) is False
    with pytest.raises(TypeError, match="expected an integer"):
        runfile.convert(keys["n"], [1, True])


def test_run_card_of_a_full_finetune(cli, tmp_path):
    out = tmp_path / "full"
    assert cli.main([*TINY, "--iters", "1", "--eval-every", "0", "--val-split", "0", "--mode", "full", "--lr", "1e-3",
                     "--out", str(out)]) == 0
    card = (out / "README.md").read_text()
    assert "| training | full, fp32 on cpu |" in card and "| final eval loss | - |" in card
    assert f"phantom.load({str(out / 'store')!r})" in card and "PeftModel" not in card
    assert "--offload ram --mode full --val-split 0.0 --iters 1" in card and "--lr 0.001" in card
    assert "| status | done after 1 step |" in card


def yaml_beside_flags(text: str) -> tuple[list[str], str]:
    """(the flags of the first finetune.py command in `text`, the run file shown beside it)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if "finetune.py --model" in line)
    command = lines[start].split("finetune.py", 1)[1]
    while command.rstrip().endswith("\\"):
        start += 1
        command = command.rstrip()[:-1] + lines[start]
    shown = [m.split("#   ", 1)[1] if "#   " in m else m.strip() for m in lines[start + 2:]]
    body = [m for m in shown[:next(i for i, m in enumerate(shown[1:], 1) if not m or m.startswith("A key")
                                   or m.startswith("examples/"))] if ":" in m and "finetune.py" not in m]
    return command.split(), "\n".join(body) + "\n"


@pytest.mark.parametrize("where", ["docs/training.md", "--help"])
def test_the_yaml_form_shown_is_the_same_run_as_the_flags_beside_it(cli, tmp_path, where):
    text = (REPO / where).read_text().split("## Run files", 1)[1] if where != "--help" else cli.RUN_FILE_HELP
    flags, shown = yaml_beside_flags(text)
    assert len(flags) >= 14 and shown.count("\n") >= 5, (flags, shown)
    (tmp_path / "run.yaml").write_text(shown)
    from_file = vars(cli.parse_args(["--config", str(tmp_path / "run.yaml")]))
    assert {**from_file, "config": None} == vars(cli.parse_args(flags))
