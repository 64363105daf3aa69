"""The run card: OUT/README.md at the end of a finetune, as Hugging Face model cards describe a model.

What was trained on what, the flags that differ from the defaults, how it ended (final and best
eval, tokens/s, peak memory) and how to load the result with peft and with phantom.load.
"""
from __future__ import annotations

import dataclasses
import resource
import shlex
import sys
from pathlib import Path

import torch

from phantom.base import fileio


STATUS_NOTE = {"nan": ": the loss or gradient was no longer finite at that step, so the run stopped there (its last "
                      "good checkpoint is kept; lower --lr or check the data, then --resume)"}


@dataclasses.dataclass(frozen=True)
class RunCard:
    """What README.md says; every figure comes from the run (its summary and metrics.jsonl)."""

    out: str
    model: str  # as given: preset name or store folder
    store: str  # the store folder trained on
    fingerprint: str  # sha256 over the store's per-file checksums
    n_params: int
    dtype: str
    device: str
    mode: str  # lora or full
    lora: str  # "rank 8, alpha 16, targets q,v" (LoRA runs)
    data: str
    flags: tuple  # the command-line arguments that differ from the defaults
    status: str
    steps: int
    final_loss: float
    final_eval: tuple | None  # (step, val_loss) of the last evaluation
    best_eval: float | None
    tokens_per_s: float
    peak_host_bytes: int
    peak_device_bytes: int | None
    adapter: str | None  # OUT/adapter (LoRA)
    weights: str | None  # the trained store (full)
    versions: str  # "phantom X, torch Y"
    origin: str = ""  # what the store was prepared from (phantom.base.provenance.describe)
    base_model: str | None = None  # what peft loads the adapter onto (a Hub id or folder), None: none loadable
    base_revision: str | None = None  # the Hub commit of base_model
    gguf: str | None = None  # the GGUF file --export gguf wrote (OUT/gguf/NAME.gguf), its Modelfile beside it
    rollouts: str = ""  # grpo: the reward and a step's time by part (rollout_line)

    def markdown(self) -> str:
        return "\n".join([f"# Run card: {Path(self.out).name}", "", *self.table(), "", *self.flag_lines(), "",
                          *self.loading(), "", *self.gguf_lines()])

    def table(self) -> list[str]:
        evals = f"{self.final_eval[1]:.4f} (step {self.final_eval[0]})" if self.final_eval else "-"
        device = f", device {gib(self.peak_device_bytes)}" if self.peak_device_bytes is not None else ""
        rows = [("model", f"`{self.model}` ({self.n_params / 1e6:,.1f}M parameters, store `{self.store}`, "
                          f"fingerprint `{self.fingerprint[:16]}`)"),
                *([("prepared from", self.origin)] if self.origin else []),
                ("training", f"{self.mode}" + (f": {self.lora}" if self.mode == "lora" else "") +
                 f", {self.dtype} on {self.device}"),
                ("data", self.data), ("status", f"{self.status} after {self.steps} step{'s' * (self.steps != 1)}" + STATUS_NOTE.get(self.status, "")),
                ("final train loss", f"{self.final_loss:.4f}"), ("final eval loss", evals),
                ("best eval loss", f"{self.best_eval:.4f}" if self.best_eval is not None else "-"),
                ("tokens/s", f"{self.tokens_per_s:,.0f}"),
                *([("rollouts", self.rollouts)] if self.rollouts else []),
                ("peak memory", f"host {gib(self.peak_host_bytes)} (max RSS){device}"),
                ("software", self.versions)]
        return ["| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)]

    def flag_lines(self) -> list[str]:
        cmd = " ".join(["python scripts/finetune.py", *map(shlex.quote, self.flags)])
        return ["## Flags that differ from the defaults", "", "    " + cmd, "",
                f"Every value of the run, defaults included, is in `{Path(self.out) / 'config.yaml'}`; "
                f"`python scripts/finetune.py --config {Path(self.out) / 'config.yaml'}` repeats it."]

    def loading(self) -> list[str]:
        if self.adapter is None and self.weights is None:
            return ["## Loading", "", "The run wrote no weights (see status)."]
        if self.adapter is None:
            return ["## Loading", "", "The trained weights are the store in "
                    f"`{self.weights}`:", "", "```python", "import phantom", "",
                    f"model = phantom.load({str(self.weights)!r})", "```", "",
                    "In Hugging Face's layout (transformers, vLLM): "
                    f"`python scripts/merge_lora.py --model {self.weights} --out merged --format hf`."]
        if self.base_model is not None:
            return ["## Loading the adapter", "", *self.peft_auto(), "", *self.phantom_lines()]
        base = f"{self.out}/hf-base"
        return ["## Loading the adapter", "", f"With peft, onto the base model in Hugging Face's layout (the "
                f"checkpoint the store was prepared from, or `python scripts/merge_lora.py --model {self.store} "
                f"--out {base} --format hf`):", "", "```python", "from peft import PeftModel",
                "from transformers import AutoModelForCausalLM", "",
                f"base = AutoModelForCausalLM.from_pretrained({base!r})",
                f"model = PeftModel.from_pretrained(base, {self.adapter!r})", "```", "", *self.phantom_lines()]

    def peft_auto(self) -> list[str]:
        """peft alone: adapter_config.json names the base model (and its Hub commit) the store came from."""
        at = f" at revision `{self.base_revision}`" if self.base_revision else ""
        return [f"With peft, which loads the base model the adapter names (`{self.base_model}`{at}):", "",
                "```python", "from peft import AutoPeftModelForCausalLM", "",
                f"model = AutoPeftModelForCausalLM.from_pretrained({self.adapter!r})", "```"]

    def phantom_lines(self) -> list[str]:
        return ["With phantom:", "", "```python", "import phantom", "from phantom.model.adapterfiles import read_adapter_config", "",
                f"model = phantom.load({self.store!r}, lora=read_adapter_config({self.adapter!r}))",
                f"model.load_adapter({self.adapter!r})", "```"]


    def gguf_lines(self) -> list[str]:
        """How to run the GGUF file with llama.cpp and with Ollama (its Modelfile names the file)."""
        if self.gguf is None:
            return []
        path, name = Path(self.gguf), Path(self.out).resolve().name.lower()
        return ["## llama.cpp and Ollama", "", f"`{path}` is the trained model in one GGUF file (the chat template "
                f"inside); `{path.parent / 'Modelfile'}` names it for Ollama:", "", "```sh",
                f"llama-cli -m {shlex.quote(str(path))} -cnv",
                f"llama-server -m {shlex.quote(str(path))} --port 8080",
                f"cd {shlex.quote(str(path.parent))} && ollama create {name} -f Modelfile && ollama run {name}",
                "```", ""]


def gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def peak_memory(device: torch.device) -> tuple[int, int | None]:
    """(peak resident bytes of this process, peak bytes allocated on the CUDA device or None)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    host = rss if sys.platform == "darwin" else rss * 1024  # macOS reports bytes, Linux KiB
    return host, torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def write(path: Path, card: RunCard) -> None:
    fileio.atomic_write_text(path, card.markdown())


def rollout_line(records: list[dict]) -> str:
    """A GRPO run's mean reward at its first and last steps that sampled, and a step's mean seconds of generation,
    scoring, reference passes and training ("" for other runs)."""
    rewarded = [r for r in records if r.get("reward") is not None]
    if not rewarded:
        return ""
    parts = [(name, [r[f"{name}_s"] for r in records if f"{name}_s" in r])
             for name in ("generation", "scoring", "reference", "train")]
    times = ", ".join(f"{name} {sum(v) / len(v):.2f} s" for name, v in parts if v)
    return f"reward {rewarded[0]['reward']:.4f} at step {rewarded[0]['step']}, {rewarded[-1]['reward']:.4f} at step " \
           f"{rewarded[-1]['step']}; a step's mean: {times}"

