"""`--model OWNER/NAME`: a model in the local Hugging Face hub cache, converted on first use with --link.

The cache is built on disk in the hub's own layout (refs/REVISION -> commit, snapshots/COMMIT/* as
links into blobs/); nothing touches the network.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import phantom
from phantom.convert.convert import convert_checkpoint
from phantom.convert.synthetic import write_synthetic
from phantom.files.store import BlockStore
from conftest import randomize_lora
from family_check import batch, hf_model, peft, rel_err
from test_convert import REPO, load_script
from test_export_hf import llama3_style_tokenizer_json

REPO_ID = "acme/tiny-qwen"
FIELDS = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64)


def add_to_cache(cache, model, revision: str, seed: int, repo_id: str = REPO_ID) -> str:
    """Write model's folder into the cache as the hub does: blobs by content, a snapshot of links, a ref."""
    tmp = cache.parent / f"save-{seed}"
    model.save_pretrained(tmp, safe_serialization=True)
    llama3_style_tokenizer_json(tmp)
    commit = hashlib.sha1(f"{repo_id}{seed}".encode()).hexdigest()
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snap = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snap.mkdir(parents=True)
    for f in tmp.iterdir():
        blob = repo / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.move(f, blob)
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / revision).write_text(commit)
    return commit


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("PHANTOM_WEIGHTS", str(tmp_path / "weights"))
    models = {"main": hf_model("Qwen2Config", seed=0, **FIELDS), "v1": hf_model("Qwen2Config", seed=1, **FIELDS)}
    commits = {rev: add_to_cache(tmp_path / "hub", m, rev, seed) for seed, (rev, m) in enumerate(models.items())}
    return tmp_path, models, commits


def test_a_hub_id_is_converted_once_linked_and_equals_transformers(cache):
    root, models, commits = cache
    store = phantom.resolve_model(REPO_ID)
    assert store == root / "weights" / "hub" / "acme--tiny-qwen" / commits["main"]
    manifest = json.loads((store / "manifest.json").read_text())
    assert manifest["links"]["files"]  # the tensors are read from the cache's files, not copied
    mtime = (store / "manifest.json").stat().st_mtime_ns
    assert phantom.resolve_model(REPO_ID) == store and (store / "manifest.json").stat().st_mtime_ns == mtime
    tokens, _ = batch()
    with torch.no_grad():
        ref = models["main"](tokens).logits
    with phantom.load(REPO_ID, offload="disk", lora=None) as pm, torch.no_grad():
        assert rel_err(pm(tokens), ref) < 1e-5


def test_another_revision_is_another_store(cache):
    root, models, commits = cache
    store = phantom.resolve_model(REPO_ID, revision="v1")
    assert store.name == commits["v1"]
    assert phantom.resolve_model(REPO_ID, revision=commits["v1"]) == store  # a commit works as a revision
    tokens, _ = batch()
    with torch.no_grad():
        ref = models["v1"](tokens).logits
    with phantom.load(store, offload="none", lora=None) as pm, torch.no_grad():
        assert rel_err(pm(tokens), ref) < 1e-5


def test_finetune_takes_a_hub_id_a_revision_and_all_linear_targets(cache, capsys):
    """The adapter of a run on every projection loads with peft onto the Qwen2 model as it is, same logits."""
    root, models, commits = cache
    cli = load_script("finetune")
    assert cli.main(["--model", REPO_ID, "--revision", "v1", "--lora-targets", "all-linear", "--iters", "2",
                     "--warmup", "0", "--lr", "1e-2", "--batch-size", "2", "--seq-len", "32", "--eval-every", "0",
                     "--val-split", "0", "-q", "--out", str(root / "out")]) == 0
    store = root / "weights" / "hub" / "acme--tiny-qwen" / commits["v1"]
    assert (store / "manifest.json").is_file() and not store.with_name(commits["main"]).exists()
    adapter = root / "out" / "adapter"
    modules = json.loads((adapter / "adapter_config.json").read_text())["target_modules"]
    assert sorted(modules) == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    tokens, _ = batch()
    with phantom.load(store, offload="none", lora=phantom.LoraConfig(targets=("all-linear",))) as pm, torch.no_grad():
        pm.load_adapter(adapter)
        ours, base = pm(tokens), models["v1"](tokens).logits
    with torch.no_grad():
        theirs = peft.PeftModel.from_pretrained(models["v1"], adapter).eval()(tokens).logits
    assert rel_err(ours, base) > 1e-4  # two steps at lr 1e-2 moved it
    assert rel_err(ours, theirs) < 1e-5
    card = (root / "out" / "README.md").read_text()  # the run card loads what the adapter names
    assert f"| prepared from | Hub model `{REPO_ID}` at revision `{commits['v1']}` |" in card
    assert f"AutoPeftModelForCausalLM.from_pretrained({str(adapter)!r})" in card and "merge_lora" not in card


PEFT_LOAD = """
import sys, torch
from peft import AutoPeftModelForCausalLM
tokens = torch.load(sys.argv[1], weights_only=True)
with torch.no_grad():
    out = {a: AutoPeftModelForCausalLM.from_pretrained(a).eval()(tokens).logits for a in sys.argv[3:]}
torch.save(out, sys.argv[2])
"""


def test_an_adapter_names_its_base_so_peft_loads_it_with_no_other_step(cache):
    """adapter_config.json names what the store came from: the hub id and the commit converted, or
    the Hugging Face folder; peft's AutoPeftModelForCausalLM then loads the adapter alone, offline,
    in a fresh process, and gives phantom's logits."""
    root, models, commits = cache
    folder = root / "hf-folder"
    models["v1"].save_pretrained(folder)
    llama3_style_tokenizer_json(folder)
    stores = {"hub": phantom.resolve_model(REPO_ID),
              "folder": convert_checkpoint(folder, root / "weights" / "from-folder", progress=False)["out"]}
    assert BlockStore(stores["hub"]).manifest["origin"] == {"kind": "hub", "id": REPO_ID, "revision": commits["main"]}
    assert BlockStore(stores["folder"]).manifest["origin"] == {"kind": "hf", "path": str(folder.resolve())}
    tokens, _ = batch()
    ours = {}
    for name, store in stores.items():
        with phantom.load(store, offload="none", lora=phantom.LoraConfig(targets=("q", "v"))) as pm, torch.no_grad():
            randomize_lora(pm)
            pm.save_adapter(root / name)
            ours[name] = pm(tokens)
    config = {n: json.loads((root / n / "adapter_config.json").read_text()) for n in stores}
    assert (config["hub"]["base_model_name_or_path"], config["hub"]["revision"]) == (REPO_ID, commits["main"])
    assert (config["folder"]["base_model_name_or_path"], config["folder"]["revision"]) == (str(folder.resolve()), None)
    torch.save(tokens, root / "tokens.pt")
    env = {**os.environ, "HF_HUB_CACHE": str(root / "hub"), "HF_HOME": str(root / "hf-home"), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", PEFT_LOAD, str(root / "tokens.pt"), str(root / "theirs.pt"),
                          str(root / "hub"), str(root / "folder")], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    theirs = torch.load(root / "theirs.pt", weights_only=True)
    with torch.no_grad():
        assert rel_err(ours["hub"], models["main"](tokens).logits) > 1e-3  # the adapter moved the logits
    assert rel_err(theirs[str(root / "hub")], ours["hub"]) < 1e-5
    assert rel_err(theirs[str(root / "folder")], ours["folder"]) < 1e-5
    shutil.rmtree(folder)  # gone: nothing transformers loads, so the adapter names the store itself
    with phantom.load(stores["folder"], offload="none", lora=phantom.LoraConfig(targets=("q", "v"))) as pm:
        pm.save_adapter(root / "orphan")
    assert json.loads((root / "orphan" / "adapter_config.json").read_text())["base_model_name_or_path"] == \
        str(stores["folder"])


def test_synthetic_stores_say_so(tmp_path):
    cfg = dataclasses.replace(phantom.preset("tiny"), n_layers=1)
    store = write_synthetic(tmp_path / "s", cfg, progress=False)
    assert BlockStore(store).manifest["origin"] == {"kind": "synthetic"}


def test_a_missing_model_is_one_line_saying_how_to_get_it(cache, capsys):
    root, _, _ = cache
    cli = load_script("finetune")
    for argv in (["--model", "acme/absent"], ["--model", REPO_ID, "--revision", "v9"]):
        assert cli.main([*argv, "--iters", "1", "-q", "--out", str(root / "out2")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and "huggingface-cli download" in err[0], err


def test_concurrent_first_uses_convert_once(cache):
    root, _, commits = cache
    code = "import phantom; print(phantom.resolve_model('acme/tiny-qwen'))"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                              text=True) for _ in range(3)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e for _, e in outs]
    paths = {o.strip() for o, _ in outs}
    folder = root / "weights" / "hub" / "acme--tiny-qwen"
    assert paths == {str(folder / commits["main"])}
    assert sorted(p.name for p in folder.iterdir() if not p.name.endswith(".lock")) == [commits["main"]]
    BlockStore(folder / commits["main"], verify="full")


def test_a_path_under_an_existing_folder_is_a_path_not_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "weights").mkdir()
    with pytest.raises(FileNotFoundError, match="no phantom store at weights/7b"):
        phantom.resolve_model("weights/7b")
