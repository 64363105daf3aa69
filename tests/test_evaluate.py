"""lm-evaluation-harness on a phantom model (scripts/evaluate.py, phantom.train.lmeval's PhantomLM) against lm-eval's
own `hf` model (HFLM) on the same tiny Llama saved by transformers: tasks of every output type from local YAML
files (tests/data/lmeval: multiple choice, one continuation, rolling documents longer than the context, greedy
generation), each document's answers (log-likelihoods within 1e-4, the same greedy matches, the same
generations) and every metric, with and without a LoRA adapter (HFLM's peft=); bad input is one line."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import phantom
from conftest import need, randomize_lora
from test_bad_inputs import check
from test_convert import load_script

lm_eval = need("lm_eval")
peft = need("peft")
from family_check import make, prepare  # noqa: E402 (imports transformers: after the checks above)

DATA = Path(__file__).resolve().parent / "data" / "lmeval"
TASKS = ["phantom_mc", "phantom_ll", "phantom_ppl", "phantom_gen"]


def task_folder(folder: Path, data: Path) -> Path:
    """The tasks' YAML files with their data files' folder filled in."""
    folder.mkdir()
    for yaml in DATA.glob("*.yaml"):
        (folder / yaml.name).write_text(yaml.read_text().replace("DATA_DIR", str(data)))
    return folder


def greedy_targets(models, folder: Path, data: Path) -> None:
    """ll.jsonl with, for each context, also each model's own greedy two tokens as targets: requests whose
    is_greedy is True."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(folder)
    rows = [json.loads(line) for line in (DATA / "ll.jsonl").read_text().splitlines()]
    for model in models:
        for r in rows[:5]:
            ids = tok(r["context"], return_tensors="pt").input_ids
            with torch.no_grad():
                out = model.generate(input_ids=ids, max_new_tokens=2, do_sample=False, pad_token_id=1)
            rows.append({"context": r["context"], "target": tok.decode(out[0, ids.shape[1]:]).strip()})
    (data / "ll.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The tiny Llama (its config's BOS and EOS those of its tokenizer) saved by transformers with its
    tokenizer, its store, a random LoRA adapter, and the task folder."""
    root = tmp_path_factory.mktemp("evaluate")
    hf = make("llama-tied", bos_token_id=0, eos_token_id=1)
    store = prepare(hf, root)
    lora = phantom.LoraConfig(rank=4, alpha=8, targets=("q", "k", "v", "o", "gate", "up", "down"))
    with phantom.load(store, offload="none", lora=lora) as model:
        randomize_lora(model, seed=3)
        model.save_adapter(root / "adapter")
    data = root / "data"
    shutil.copytree(DATA, data)
    base = make("llama-tied", bos_token_id=0, eos_token_id=1)
    greedy_targets([hf, peft.PeftModel.from_pretrained(base, root / "adapter").eval()], root / "hf", data)
    return SimpleNamespace(root=root, hf=root / "hf", store=store, adapter=root / "adapter",
                           tasks=task_folder(root / "tasks", data))


def reference(s, fewshot: int | None, peft: Path | None = None) -> dict:
    """lm-eval's hf model on the transformers folder, as lm-eval's CLI runs it."""
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager
    lm = HFLM(pretrained=str(s.hf), peft=str(peft) if peft else None, device="cpu", dtype="float32", batch_size=1)
    return lm_eval.simple_evaluate(model=lm, tasks=TASKS, num_fewshot=fewshot, log_samples=True,
                                   task_manager=TaskManager(include_path=str(s.tasks), include_defaults=False))


def norm(x):
    """An answer as lm-eval holds it in memory or writes it to samples_*.jsonl (numbers and booleans as text)."""
    if isinstance(x, (list, tuple)):
        return [norm(v) for v in x]
    if isinstance(x, str) and x in ("True", "False"):
        return x == "True"
    if isinstance(x, str):
        try:
            return float(x)
        except ValueError:
            return x
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else x


def same(a, b) -> bool:
    a, b = norm(a), norm(b)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == pytest.approx(b, abs=1e-4) if isinstance(a, float) else a == b


def compare(ref: dict, results: dict, samples: dict) -> None:
    """Every document's answers and every metric of `results` equal the reference's."""
    for task in TASKS:
        want = {s["doc_id"]: s for s in ref["samples"][task]}
        assert sorted(want) == sorted(s["doc_id"] for s in samples[task]), task
        for s in samples[task]:
            assert same(s["filtered_resps"], want[s["doc_id"]]["filtered_resps"]), (task, s["doc_id"])
        for key, value in ref["results"][task].items():
            if isinstance(value, float):
                assert results["results"][task][key] == pytest.approx(value, rel=1e-5, abs=1e-9), (task, key)
            else:
                assert results["results"][task][key] == value, (task, key)
    greedy = [r for s in ref["samples"]["phantom_ll"] for r in s["filtered_resps"] if norm(r)[1]]
    assert greedy, "no request of the reference is greedy: the check of is_greedy would see False alone"
    assert any(norm(s["filtered_resps"])[0] for s in ref["samples"]["phantom_gen"]), "every generation is empty"


def test_the_script_writes_lm_evals_files_with_hflms_answers(setup, tmp_path):
    """scripts/evaluate.py, two examples before each question (contexts past the 64-token context: cut from the
    left as HFLM cuts them), blocks streamed from disk."""
    out = tmp_path / "out"
    args = ["--model", str(setup.store), "--tasks", ",".join(TASKS), "--include-path", str(setup.tasks),
            "--num-fewshot", "2", "--batch-size", "3", "--output-path", str(out), "--log-samples", "--device", "cpu",
            "--dtype", "fp32", "--offload", "disk"]
    assert load_script("evaluate").main(args) == 0
    (folder,) = out.iterdir()
    (results_file,) = folder.glob("results_*.json")
    results = json.loads(results_file.read_text())
    samples = {t: [json.loads(line) for line in next(folder.glob(f"samples_{t}_*.jsonl")).read_text().splitlines()]
               for t in TASKS}
    assert folder.name == str(setup.store).replace("/", "__") and len(list(folder.iterdir())) == 1 + len(TASKS)
    compare(reference(setup, 2), results, samples)


def test_the_python_api_with_an_adapter_answers_as_hflm_with_peft(setup):
    """PhantomLM in lm_eval.simple_evaluate (the registered model "phantom"), a LoRA adapter against HFLM's peft=,
    blocks in the RAM tier, batches by memory."""
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager
    from phantom.train.lmeval import PhantomLM
    assert get_model("phantom") is PhantomLM
    with PhantomLM(str(setup.store), adapter=str(setup.adapter), device="cpu", dtype="fp32", offload="ram",
                   batch_size="auto") as lm:
        got = lm_eval.simple_evaluate(model=lm, tasks=TASKS, log_samples=True,
                                      task_manager=TaskManager(include_path=str(setup.tasks), include_defaults=False))
    compare(reference(setup, None, setup.adapter), got, got["samples"])
    with PhantomLM(str(setup.store), device="cpu", dtype="fp32") as lm:  # the adapter moves every answer
        bare = lm_eval.simple_evaluate(model=lm, tasks=["phantom_ll"], log_samples=True,
                                       task_manager=TaskManager(include_path=str(setup.tasks), include_defaults=False))
    moved = [abs(norm(a["filtered_resps"])[0][0] - norm(b["filtered_resps"])[0][0])
             for a, b in zip(bare["samples"]["phantom_ll"], got["samples"]["phantom_ll"])]
    assert min(moved) > 1e-3, moved


@pytest.mark.parametrize("case", ["unknown task", "missing dataset", "samples nowhere", "no include folder"])
def test_bad_input_is_one_line_and_writes_nothing(setup, tmp_path, capsys, case):
    out, yaml = tmp_path / "out", tmp_path / "gone.yaml"
    yaml.write_text((DATA / "phantom_mc.yaml").read_text().replace("DATA_DIR", str(tmp_path / "nowhere")))
    args, words = {
        "unknown task": (["--tasks", "phantom_mc,no_such_task", "--include-path", str(setup.tasks)], ["no_such_task"]),
        "missing dataset": (["--tasks", str(yaml)], ["could not be read", "nowhere"]),
        "samples nowhere": (["--tasks", "phantom_mc", "--log-samples"], ["--log-samples", "--output-path"]),
        "no include folder": (["--tasks", "phantom_mc", "--include-path", str(tmp_path / "none")], ["--include-path"]),
    }[case]
    if "--log-samples" not in args:
        args += ["--output-path", str(out)]
    check(capsys, load_script("evaluate").main(["--model", str(setup.store), *args]), tmp_path, *words)
    assert not out.exists()


def test_finetune_logs_the_tasks_metrics_of_the_adapter_it_trains(setup, tmp_path):
    """finetune.py --eval-tasks: the tasks' metrics in each step's record beside the loss, the last those of the
    adapter the run writes (evaluated again from its files); the run trains as one without them."""
    from lm_eval.tasks import TaskManager
    from phantom.train.lmeval import PhantomLM
    out, files = tmp_path / "run", [str(setup.tasks / f"{t}.yaml") for t in ("phantom_mc", "phantom_ll")]
    args = ["--model", str(setup.store), "--iters", "2", "--batch-size", "2", "--seq-len", "32", "--eval-every", "0",
            "--val-split", "0", "-q", "--device", "cpu", "--offload", "disk"]
    tasks = ["--eval-tasks", ",".join(files), "--eval-tasks-every", "1", "--eval-limit", "3"]
    assert load_script("finetune").main([*args, *tasks, "--out", str(out)]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert all({"loss", "phantom_mc/acc", "phantom_mc/acc_norm", "phantom_ll/perplexity"} <= r.keys() for r in records)
    assert records[0]["phantom_ll/perplexity"] != records[1]["phantom_ll/perplexity"]  # the adapter as it trains
    with PhantomLM(str(setup.store), adapter=str(out / "adapter"), device="cpu", dtype="fp32") as lm:
        again = lm_eval.simple_evaluate(model=lm, tasks=["phantom_ll"], limit=3, bootstrap_iters=0,
                                        task_manager=TaskManager(include_path=str(setup.tasks), include_defaults=False))
    assert records[1]["phantom_ll/perplexity"] == pytest.approx(again["results"]["phantom_ll"]["perplexity,none"],
                                                                rel=1e-6)
    assert load_script("finetune").main([*args, "--out", str(tmp_path / "plain")]) == 0
    alone = [json.loads(line) for line in (tmp_path / "plain" / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in alone] == [r["loss"] for r in records]
