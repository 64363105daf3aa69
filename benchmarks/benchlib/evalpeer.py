"""`bench.py --modes evaluate`: the same lm-eval tasks on the same weights, side by side: phantom's model
(phantom.train.lmeval.PhantomLM: log-likelihoods layer-major, generations batched, blocks streamed from the disk
tier) against lm-eval's own `hf` model with accelerate's offload (`parallelize=True`, `max_cpu_memory` below the
model's size: the blocks that do not fit go to an offload folder and are loaded at each forward), which is how
lm-eval runs a model that does not fit its device. The weights: a synthetic store of --dim/--layers/--heads with
the tiny sentencepiece tokenizer, exported by phantom's Hugging Face export for transformers to load. The tasks:
a multiple choice over --eval-docs documents (four choices each) and a greedy generate_until of 16 tokens over a
quarter of them, written as local task YAMLs over lines of phantom/assets/tiny.txt. Each row: wall seconds, the
block reads; the two tools' metrics agree (the same weights in fp32). phantom's disk tier reads with O_DIRECT (no
page cache, as for a model larger than host memory); lm-eval's hf model is run twice: its offload folder read
through the page cache (the whole model fits host memory here), then evicted from it before each forward (a model
that does not: each forward reads its offloaded blocks from the disk).
"""
from __future__ import annotations

import json
import random
import time
from pathlib import Path

import torch

import phantom
from phantom.arch.config import ModelConfig
from phantom.data.tokenizer import TINY_TEXT, train_tiny_tokenizer
from phantom.export.export import export
from phantom.convert.synthetic import write_synthetic
from phantom.plan.profiles import evict
from benchlib.common import machine

MC = """task: bench_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/mc.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
GEN = """task: bench_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/gen.jsonl
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 16
  do_sample: false
metric_list:
  - metric: exact_match
"""


def tasks(folder: Path, docs: int, words: int = 0) -> Path:
    """Two local tasks over lines of the tiny text (their first `words` words; 0: whole): which of four lines
    follows a line; a line's continuation."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = [line.strip() for line in TINY_TEXT.read_text().splitlines() if len(line.split()) >= 6]
    lines = [" ".join(line.split()[:words]) if words else line for line in lines]
    rng = random.Random(0)
    with open(folder / "mc.jsonl", "w") as f:
        for n in range(docs):
            a = rng.randrange(len(lines) - 1)
            choices = [lines[a + 1]] + rng.sample(lines, 3)
            rng.shuffle(choices)
            f.write(json.dumps({"question": lines[a], "choices": [" " + c for c in choices],
                                "answer": choices.index(lines[a + 1])}) + "\n")
    with open(folder / "gen.jsonl", "w") as f:
        for n in range(max(1, docs // 4)):
            text = lines[rng.randrange(len(lines))].split()
            f.write(json.dumps({"prompt": " ".join(text[:4]), "answer": " " + " ".join(text[4:])}) + "\n")
    (folder / "bench_mc.yaml").write_text(MC.format(data=folder))
    (folder / "bench_gen.yaml").write_text(GEN.format(data=folder))
    return folder


def evaluate_bench(args, folder: Path) -> str:
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager
    from phantom.train.lmeval import PhantomLM
    cfg = ModelConfig(dim=args.dim, n_layers=args.layers, n_heads=args.heads, n_kv_heads=args.kv_heads,
                      vocab_size=512, max_seq_len=256)
    tok = train_tiny_tokenizer(folder / "tokenizer.model", vocab_size=cfg.vocab_size)
    store = write_synthetic(folder / "store", cfg, torch.float32, seed=0, tokenizer=tok, progress=False)
    export(store, folder / "hf", progress=False)
    tm = TaskManager(include_path=str(tasks(folder / "tasks", args.eval_docs, args.eval_words)), include_defaults=False)
    names = ["bench_mc", "bench_gen"]
    model_bytes = sum(f.stat().st_size for f in (folder / "hf").glob("*.safetensors"))
    rows, results = [], {}

    def run(name: str, lm, batch, reads=None):
        t0 = time.perf_counter()
        out = lm_eval.simple_evaluate(model=lm, tasks=names, task_manager=tm, batch_size=batch)
        seconds = time.perf_counter() - t0
        results[name] = {t: {k: v for k, v in r.items() if isinstance(v, float)} for t, r in out["results"].items()}
        requests = sum(len(v) for v in out["samples"].values()) if "samples" in out else None
        rows.append((name, seconds, reads() if reads else "-"))
        print(name, f"{seconds:.1f} s", results[name], flush=True)
        return requests

    placement = phantom.Placement(offload="disk", prefetch=2)
    with phantom.PhantomModel(phantom.BlockStore(store), "cpu", torch.float32, placement, lora=None) as model:
        for batch in (args.eval_batch, "auto"):  # lm-eval's batch size, then phantom's own from memory
            lm = PhantomLM(model, batch_size=batch)
            model.scheduler.take_metrics()
            run(f"phantom (disk tier), batch size {batch}", lm, batch,
                lambda: f"{model.scheduler.take_metrics()['loads']} block loads")
    hf = HFLM(pretrained=str(folder / "hf"), device="cpu", dtype="float32", batch_size=args.eval_batch, parallelize=True,
              max_cpu_memory=model_bytes // 2, offload_folder=str(folder / "offload"))
    where = getattr(hf.model, "hf_device_map", {})
    blocks = [d for name, d in where.items() if ".layers." in name or name.endswith(".layers")]
    on_disk = sum(str(d) == "disk" for d in blocks)
    run(f"lm-eval hf, accelerate offload ({on_disk} of {cfg.n_layers} blocks in its offload folder, read through "
        f"the page cache)", hf, args.eval_batch)
    # a model larger than host memory: its offload folder is not in the page cache when a forward reads it
    files = [f for d in ("offload", "hf") for f in (folder / d).rglob("*") if f.is_file()]  # where it reads from
    def cold(*_):  # a pre-hook's None leaves the inputs as they are
        for f in files:
            evict(f)
    hook = hf.model.register_forward_pre_hook(cold)
    run(f"lm-eval hf, accelerate offload ({on_disk} of {cfg.n_layers} blocks), the folder evicted from the page "
        f"cache before each forward", hf, args.eval_batch)
    hook.remove()
    return table(args, cfg, model_bytes, rows, results)


def table(args, cfg, model_bytes: int, rows: list, results: dict) -> str:
    base = rows[0][1]
    lines = [f"\n## lm-eval tasks, phantom against lm-eval's hf model with accelerate's offload, "
             f"{time.strftime('%Y-%m-%d %H:%M')}\n",
             f"Machine: {machine()}; cpu, float32. Model: dim {cfg.dim}, {cfg.n_layers} blocks, {cfg.n_heads} heads, "
             f"vocabulary {cfg.vocab_size}, {model_bytes / 2**20:.0f} MiB of weights; hf given max_cpu_memory of "
             f"half of them. Tasks over {f'the first {args.eval_words} words of ' if args.eval_words else ''}lines of "
             f"tiny.txt: bench_mc ({args.eval_docs} documents x 4 choices: loglikelihood), bench_gen "
             f"({max(1, args.eval_docs // 4)} documents, greedy, 16 tokens at most); lm-eval's batch size "
             f"{args.eval_batch} (hf; phantom with it and with its own, auto).\n",
             "| model | seconds | x phantom | reads | bench_mc acc | bench_gen exact_match |", "|---|---|---|---|---|---|"]
    for name, seconds, reads in rows:
        r = results[name]
        lines.append(f"| {name} | {seconds:.1f} | {seconds / base:.2f} | {reads} | "
                     f"{r['bench_mc'].get('acc,none', float('nan')):.4f} | "
                     f"{r['bench_gen'].get('exact_match,none', float('nan')):.4f} |")
    return "\n".join(lines)
