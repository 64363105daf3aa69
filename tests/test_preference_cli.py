"""`scripts/finetune.py --mode dpo` end to end: outputs and metrics, bad inputs, SIGKILL + --resume
bit-exact, the precomputed reference (one more read of the weights in all), and the tiny model
learning from preferences."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import phantom
from phantom.convert.synthetic import ensure_tiny
from phantom.train.preference import PreferenceConfig, load_pairs, split_pairs
from phantom.data.tokenizer import Tokenizer
from phantom.train.loop import train
from phantom.train.records import preference_postfix
from phantom.train.trainconfig import TrainConfig
from test_finetune_cli import FINETUNE, metrics


def run(*args, **kw):
    return subprocess.run([sys.executable, str(FINETUNE), *map(str, args)], capture_output=True, text=True,
                          timeout=600, **kw)

DPO = ["--mode", "dpo", "--iters", "6", "--batch-size", "4", "--seq-len", "80", "--eval-every", "3",
       "--eval-iters", "2", "--sample-every", "0", "--offload", "disk", "--prefetch", "0"]
FIGURES = ("rewards_chosen", "rewards_rejected", "reward_margin", "reward_accuracy")


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    root = tmp_path_factory.mktemp("weights")
    ensure_tiny(root / "tiny")
    return root


def dpo(weights, *args, **kw):
    return run(*args, env={**os.environ, "PHANTOM_WEIGHTS": str(weights), **kw})


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_dpo_writes_a_peft_adapter_and_preference_metrics(weights, tmp_path):
    r = dpo(weights, *DPO, "--out", tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["peft_type"] == "LORA"
    assert len(load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))) == 4 * 2 * 2
    recs = metrics(tmp_path)
    assert [m["step"] for m in recs] == list(range(7))
    assert all(k in recs[1] for k in ("loss", "bytes_read", *FIGURES))
    assert recs[0]["val_loss"] == pytest.approx(0.693147, abs=1e-5)  # adapters at zero: policy == reference
    assert all(f"val_{k}" in recs[3] for k in FIGURES)
    assert recs[1]["bytes_read"] > 0
    assert preference_postfix(recs[2]) == {"acc": f"{recs[2]['reward_accuracy']:.2f}"}  # the bar shows it
    assert preference_postfix({"loss": 1.0}) == {}


@pytest.mark.parametrize("records, match", [
    ([{"prompt": "a", "chosen": "b"}], r"p.jsonl:1: a preference pair needs prompt, chosen, rejected; .* no 'rejected'"),
    ([{"prompt": "a", "chosen": "b", "rejected": "c"}, {"prompt": "a", "chosen": "b", "rejected": ""}],
     "p.jsonl:2: the rejected response is empty"),
])
def test_bad_pairs_are_one_error_line(weights, tmp_path, records, match):
    r = dpo(weights, *DPO, "--data", write_jsonl(tmp_path / "p.jsonl", records), "--out", tmp_path / "o")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert re.search(match, lines[0]), lines[0]
    assert not (tmp_path / "o" / "adapter").exists()


def test_dpo_and_full_together_are_one_error_line(weights, tmp_path):
    for order in (["--mode", "dpo", "--mode", "full"], ["--mode", "full", "--mode", "dpo"]):
        r = dpo(weights, *order, "--iters", "1", "--out", tmp_path)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert r.stderr.startswith("error: --mode full and --mode dpo cannot be combined"), r.stderr
        assert not (tmp_path / "checkpoint").exists()


def test_identical_responses_are_a_warning_with_their_count(weights, tmp_path):
    records = [{"prompt": f"The keeper {i}", "chosen": " lit the lamp", "rejected": " lit the lamp" if i % 3 == 0
                else " the lamp lit"} for i in range(12)]
    r = dpo(weights, *DPO, "--iters", "2", "--data", write_jsonl(tmp_path / "p.jsonl", records), "--out", tmp_path / "o")
    assert r.returncode == 0, r.stderr
    assert "4 of 12 pairs have identical chosen and rejected responses" in r.stderr


def test_dpo_sigkill_then_resume_ends_bit_identical(weights, tmp_path):
    args = [*DPO, "--iters", "8", "--save-every", "2", "-q"]
    ref = dpo(weights, *args, "--out", tmp_path / "ref")
    assert ref.returncode == 0, ref.stderr
    out = tmp_path / "run"
    r = dpo(weights, *args, "--out", out, PHANTOM_FAULT="metrics.write:5")  # step 5 logged, not checkpointed
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    assert json.loads((out / "checkpoint" / "meta.json").read_text())["step"] == 4
    r = dpo(weights, *args, "--out", out, "--resume")
    assert r.returncode == 0, r.stderr
    for name in ("adapter/adapter_model.safetensors", "checkpoint/trainable.safetensors"):
        a, b = (load_file(str(d / name)) for d in (tmp_path / "ref", out))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    strip = lambda recs: [{k: v for k, v in m.items() if k in ("step", "loss", *FIGURES)} for m in recs]  # noqa: E731
    assert strip(metrics(out)) == strip(metrics(tmp_path / "ref"))


def test_precompute_reads_the_weights_once_more_in_all(weights, tmp_path):
    """Per step the precomputed run reads what the together run reads (the policy's blocks); before
    the first step it reads each block once (a forward pass), and a resumed run not at all."""
    together = dpo(weights, *DPO, "-q", "--out", tmp_path / "t")
    pre = dpo(weights, *DPO, "-q", "--reference", "precompute", "--out", tmp_path / "p")
    assert together.returncode == 0 and pre.returncode == 0, together.stderr + pre.stderr
    t, p = metrics(tmp_path / "t"), metrics(tmp_path / "p")
    assert [m["bytes_read"] for m in t[1:]] == [m["bytes_read"] for m in p[1:]]
    assert "reference_bytes_read" not in t[0]
    with phantom.load(weights / "tiny", offload="disk", prefetch=0) as pm, torch.no_grad():
        pm.scheduler.take_metrics()
        pm(torch.zeros(2, 8, dtype=torch.long))
        one_pass = pm.scheduler.take_metrics()
    assert p[0]["reference_bytes_read"] == one_pass["bytes_read"] > 0 and p[0]["reference_loads"] == 4
    assert abs(p[0]["val_loss"] - t[0]["val_loss"]) < 1e-6  # the cached reference is the reference
    cache = tmp_path / "p" / "reference_logps.safetensors"
    assert cache.is_file()
    r = dpo(weights, *DPO, "--iters", "8", "--reference", "precompute", "--out", tmp_path / "p", "--resume")
    assert r.returncode == 0 and "using the reference log-probabilities cached" in r.stderr, r.stderr
    raw = bytearray(cache.read_bytes())
    raw[-3] ^= 0xFF  # a damaged cache is computed again, not trusted
    cache.write_bytes(bytes(raw))
    r = dpo(weights, *DPO, "--iters", "9", "--reference", "precompute", "--out", tmp_path / "p", "--resume")
    assert r.returncode == 0 and "computing them again" in r.stderr, r.stderr


def test_loss_flags_reach_the_config(tmp_path):
    from test_convert import load_script
    cli = load_script("finetune")
    args = cli.parse_args(["--mode", "dpo", "--loss-type", "ipo", "--beta", "0.3", "--label-smoothing", "0.1",
                           "--reference", "precompute", "--out", str(tmp_path)])
    cfg = cli.train_config(args, 1e-3)
    assert cfg.mode == "dpo" and cfg.preference == PreferenceConfig("ipo", 0.3, 0.1, "precompute")
    r = run("--mode", "dpo", "--beta", "0", "--out", tmp_path)
    assert r.returncode == 2 and r.stderr.strip() == "error: --beta must be > 0, got 0.0", r.stderr


def test_the_tiny_model_learns_from_preferences(weights, tmp_path):
    """The generated pairs (chosen: the text's next words, rejected: the same words shuffled): after a
    short run the reward accuracy on held-out pairs is well above chance and their loss below log 2."""
    tok = Tokenizer(weights / "tiny" / "tokenizer.model")
    train_pairs, val_pairs = split_pairs(load_pairs(None, tok), 0.1)
    with phantom.load(weights / "tiny", offload="none", micro_batch=16) as model:
        s = train(model, train_pairs, val_pairs, TrainConfig(iters=60, batch_size=8, seq_len=80, mode="dpo",
                                                             eval_every=0, save_every=0, out=str(tmp_path),
                                                             progress=False), tok)
    recs = metrics(tmp_path)
    assert s["status"] == "done" and recs[0]["val_loss"] == pytest.approx(0.693147, abs=1e-5)
    assert recs[-1]["val_reward_accuracy"] >= 0.7 and recs[-1]["val_loss"] < 0.63, recs[-1]


def test_init_adapter_starts_sft_and_dpo_from_it_and_is_dpo_s_reference(weights, tmp_path):
    """--init-adapter: its rank and targets, its weights as the start (an SFT step at a learning rate of 1e-12 leaves
    it as it was); DPO takes it, frozen, as its reference: at step 0 the policy is the reference (loss log 2).""" 
    import phantom
    from conftest import randomize_lora
    with phantom.load(weights / "tiny", offload="none", lora=phantom.LoraConfig(rank=6, targets=("q", "k", "v"))) as pm:
        randomize_lora(pm, seed=4)
        pm.save_adapter(tmp_path / "init")
    init = load_file(str(tmp_path / "init" / "adapter_model.safetensors"))
    r = dpo(weights, "--iters", "1", "--lr", "1e-12", "--warmup", "0", "--init-adapter", tmp_path / "init",
            "--sample-every", "0", "--eval-every", "0", "--val-split", "0", "--out", tmp_path / "sft", "-q")
    assert r.returncode == 0, r.stderr
    after = load_file(str(tmp_path / "sft" / "adapter" / "adapter_model.safetensors"))
    assert after.keys() == init.keys() and all(torch.allclose(after[k], init[k], atol=1e-6) for k in init)
    assert json.loads((tmp_path / "sft" / "adapter" / "adapter_config.json").read_text())["r"] == 6
    r = dpo(weights, *DPO, "--init-adapter", tmp_path / "init", "--out", tmp_path / "dpo")
    assert r.returncode == 0, r.stderr
    assert metrics(tmp_path / "dpo")[0]["val_loss"] == pytest.approx(0.693147, abs=1e-5)
