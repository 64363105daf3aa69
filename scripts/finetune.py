"""Finetune a Llama model with LoRA while its blocks stream from disk: `python scripts/finetune.py`.

With no flags it trains the embedded tiny model on the shipped text. Writes config.yaml (the resolved
run), adapter/ (PEFT), checkpoint/ (for --resume), metrics.jsonl, README.md (a run card) and, with
--trace, trace.json into --out. Every flag is checked against the model before anything is measured,
generated or allocated. The flags are the fields of phantom.RunConfig; the run is phantom.run.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from phantom.train import cli, launch, runconfig
from phantom.train.runconfig import RUN_FILE_HELP, SECTIONS, run_file_sections, train_config  # noqa: E402,F401 (tests)


def parser():
    """finetune.py's flags (phantom.train.runconfig: one per RunConfig field); also the schema of its run files."""
    return runconfig.parser(__doc__)


def parse_args(argv=None):
    return runconfig.parse_args(argv, parser())


def run(argv=None) -> int:
    """parse -> RunConfig -> run: the summary printed, exit 0 for a run done or stopped by Ctrl-C."""
    s = launch.run(runconfig.from_argv(argv, parser()))
    if s["report"]:
        print(s["report"])
    return launch.EXIT.get(s["status"], 1)


def main(argv=None) -> int:
    return cli.guarded(run, argv)


if __name__ == "__main__":
    sys.exit(main())
