"""Adapters mean what peft means: an adapter trained with peft's use_rslora, rank_pattern, alpha_pattern
or layers_to_transform gives phantom the logits peft gives on the same transformers model, and phantom's
adapter of such a config loads in peft to the same logits; fields phantom does not model are refused,
named. A tiny random Llama is built with transformers, converted by prepare_model.py once per module.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import shutil

import pytest
import torch

import phantom
from family_check import hf_model, need, prepare, rel_err, transformers
from phantom.export.export import export
from phantom.model.adapterfiles import read_adapter_config
from phantom.files.store import StoreError

peft = need("peft")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TOKENS = torch.randint(0, 400, (2, 12), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    model = hf_model("LlamaConfig", hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=128)
    return model, prepare(model, tmp_path_factory.mktemp("llama"))


def peft_adapter(model, folder, **fields):
    """A peft LoRA on every projection with A and B random (B not zero), saved; its logits on TOKENS."""
    pmodel = peft.get_peft_model(copy.deepcopy(model), peft.LoraConfig(r=4, lora_alpha=8, target_modules=ALL,
                                                                        **fields))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in pmodel.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        logits = pmodel(TOKENS).logits
    pmodel.save_pretrained(folder)
    return logits


def phantom_logits(store, adapter):
    with phantom.load(store, lora=read_adapter_config(adapter), offload="none") as pm:
        pm.load_adapter(adapter)
        with torch.no_grad():
            return pm(TOKENS)


CASES = {
    "rslora": dict(use_rslora=True),
    "rank_pattern": dict(rank_pattern={"q_proj": 2, "layers.1.self_attn.v_proj": 6}),
    "alpha_pattern": dict(alpha_pattern={"v_proj": 3.0, "layers.2.mlp.down_proj": 1.5}),
    "layers_list": dict(layers_to_transform=[0, 2]),
    "layers_int": dict(layers_to_transform=1),
    "all_four": dict(use_rslora=True, rank_pattern={"o_proj": 8}, alpha_pattern={"layers.2.mlp.down_proj": 1.5},
                     layers_to_transform=[1, 2]),
}


@pytest.mark.parametrize("case", CASES)
def test_peft_adapter_gives_peft_logits(llama, tmp_path, case):
    model, store = llama
    ref = peft_adapter(model, tmp_path / "adapter", **CASES[case])
    assert rel_err(phantom_logits(store, tmp_path / "adapter"), ref) < 1e-5


def test_merged_export_of_such_an_adapter_gives_peft_logits(llama, tmp_path):
    """merge_lora's --format hf with use_rslora, both patterns and layers_to_transform: transformers loads
    the merged model to the logits peft gives with the adapter."""
    model, store = llama
    ref = peft_adapter(model, tmp_path / "adapter", **CASES["all_four"])
    out = export(store, tmp_path / "merged", tmp_path / "adapter", "hf", progress=False)
    merged = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        assert rel_err(merged(TOKENS).logits, ref) < 1e-5


def test_phantom_adapter_of_such_a_config_loads_in_peft(llama, tmp_path):
    """save_adapter writes use_rslora, the patterns and the layers; peft reads them to phantom's logits."""
    model, store = llama
    peft_adapter(model, tmp_path / "a", **CASES["all_four"])
    lora = read_adapter_config(tmp_path / "a")
    with phantom.load(store, lora=lora, offload="none") as pm:
        pm.load_adapter(tmp_path / "a")
        with torch.no_grad():
            for p in pm.trainable_parameters():
                p.mul_(-1.5)  # phantom's own values, not peft's
            ours = pm(TOKENS)
        pm.save_adapter(tmp_path / "b")
    again = read_adapter_config(tmp_path / "b")
    assert again == dataclasses.replace(lora, targets=again.targets) and set(again.targets) == set(lora.targets)
    pmodel = peft.PeftModel.from_pretrained(copy.deepcopy(model), tmp_path / "b").eval()
    with torch.no_grad():
        assert rel_err(ours, pmodel(TOKENS).logits) < 1e-5


REFUSED = {
    "use_dora": (True, "use_dora"),
    "bias": ("all", "bias"),
    "modules_to_save": (["lm_head"], "modules_to_save"),
    "fan_in_fan_out": (True, "fan_in_fan_out"),
    "layers_pattern": ("h", "layers_pattern"),
    "target_modules": (".*proj", "target_modules"),
    "rank_pattern": ({"(": 2}, "is not a regular expression"),
    "alpha_pattern": ({"(.*)*x": 2}, "repeats a group that repeats"),
    "lora_alpha": ("sixteen", "LoRA alpha must be a finite number"),
    "peft_type": ("IA3", "peft_type"),
}


@pytest.fixture(scope="module")
def saved(llama, tmp_path_factory):
    """One peft adapter (rank 2 on q_proj) for the tests that damage a copy of it."""
    folder = tmp_path_factory.mktemp("saved")
    peft_adapter(llama[0], folder, rank_pattern={"q_proj": 2})
    return folder


@pytest.mark.parametrize("field", REFUSED)
def test_unmodelled_fields_are_refused_by_name(saved, tmp_path, field):
    shutil.copytree(saved, tmp_path, dirs_exist_ok=True)
    value, words = REFUSED[field]
    c = json.loads((tmp_path / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps({**c, field: value}))
    with pytest.raises(StoreError, match=words):
        read_adapter_config(tmp_path)


def test_a_rank_the_weights_do_not_have_is_refused_from_the_header(saved, tmp_path):
    shutil.copytree(saved, tmp_path, dirs_exist_ok=True)
    c = json.loads((tmp_path / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps({**c, "rank_pattern": {"k_proj": 2}}))
    with pytest.raises(StoreError, match=r"_proj\.lora_A\.weight has rank \d, but adapter_config\.json gives its "
                                         r"module rank \d"):
        read_adapter_config(tmp_path)
