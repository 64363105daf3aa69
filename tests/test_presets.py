"""Presets of the models people finetune, each from its config.json (see phantom/arch/config.py).

Each preset goes through the exporter's config.json and back through phantom.arch.family unchanged, and the
family's transformers class built from that config.json (on the meta device: shapes, no memory) has
exactly the parameters phantom counts. `scripts/tune.py --preset qwen2.5-72B` plans like the 70B.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from phantom.plan import costinputs as ci
from phantom.plan import profiles
from phantom.arch.config import ModelConfig
from phantom.arch.presets import PRESETS
from phantom.export.export import hf_config
from phantom.arch.family import FAMILIES, config_from_hf
from family_check import transformers
from test_tune import script

DATA = Path(__file__).parent / "data"
# the published config.json of each (tests/data; where each came from: notes/presets-published.md)
PUBLISHED_FILES = {"deepseek-v3.2": "deepseek-v3.2-671B", "glm-5": "glm-5-744B",
                   "deepseek-v4-flash-base": "deepseek-v4-flash-284B", "deepseek-v4-pro": "deepseek-v4-pro-1.6T",
                   "kimi-k2.5": "kimi-k2.5-1T"}

FAMILY_PRESETS = ["qwen2.5-7B", "qwen2.5-72B", "qwen3-8B", "qwen3-32B", "llama3.1-8B", "llama3.1-70B", "llama3.2-1B",
                  "llama3.2-3B", "gemma2-9B", "gemma2-27B", "gemma3-27B", "mistral-7B", "phi4-14B", "phi3-mini-4k",
                  "qwen3-30B-A3B", "qwen3-235B-A22B", "mixtral-8x7B", "olmoe-1B-7B", "deepseek-v3-671B", "kimi-k2-1T",
                  "glm-4.5-355B", "deepseek-v2-lite-16B", "gpt-oss-20b", "gpt-oss-120b", "minimax-m2-230B",
                  "llama4-scout-109B", "llama4-maverick-400B", "deepseek-v3.2-671B", "glm-5-744B", "deepseek-v4-flash-284B",
                  "deepseek-v4-pro-1.6T", "kimi-k2.5-1T"]
# parameters as the model cards state them (billions)
PUBLISHED = {"qwen2.5-7B": 7.61, "qwen2.5-72B": 72.7, "qwen3-8B": 8.2, "qwen3-32B": 32.8, "llama3.1-8B": 8.03,
             "llama3.1-70B": 70.6, "llama3.2-1B": 1.24, "llama3.2-3B": 3.21, "gemma2-9B": 9.24, "gemma2-27B": 27.2,
             "phi4-14B": 14.7, "phi3-mini-4k": 3.82, "qwen3-30B-A3B": 30.5, "qwen3-235B-A22B": 235, "mixtral-8x7B": 46.7,
             "deepseek-v3-671B": 671, "deepseek-v2-lite-16B": 15.7,  # without DeepSeek-V3's prediction layer
             "deepseek-v3.2-671B": 671, "glm-5-744B": 744,  # without their prediction layers, indexers included
             "gpt-oss-20b": 21, "gpt-oss-120b": 117, "minimax-m2-230B": 229,
             "llama4-scout-109B": 108, "llama4-maverick-400B": 400,
             "deepseek-v4-flash-284B": 284}  # V4-Pro's card rounds 1.57T to 1.6T: its count is the class's alone  # Llama 4: the text model (the cards' 109B, 400B hold the vision tower)


@pytest.mark.parametrize("name", FAMILY_PRESETS)
def test_a_preset_round_trips_through_its_config_json(name):
    cfg = PRESETS[name]
    back = config_from_hf(json.loads(json.dumps(hf_config(cfg, torch.bfloat16))))
    assert [back.window(i) for i in range(cfg.n_layers)] == [cfg.window(i) for i in range(cfg.n_layers)]
    same = dict(layer_types=cfg.layer_types if cfg.hc_mult else None, multiple_of=cfg.multiple_of,  # V4: its kinds too
                ffn_dim_multiplier=cfg.ffn_dim_multiplier)
    assert dataclasses.replace(back, **same) == dataclasses.replace(cfg, intermediate_size=cfg.hidden_dim, **same)


@pytest.mark.parametrize("name", FAMILY_PRESETS)
def test_the_family_class_has_the_parameters_phantom_counts(name):
    cfg = PRESETS[name]
    c = hf_config(cfg, torch.bfloat16)
    config = transformers.AutoConfig.for_model(c.pop("model_type"), **c)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert type(model).__name__ == FAMILIES[cfg.family].hf_class
    persistent = model.state_dict().keys()  # DeepSeek-V3's router correction bias: a buffer, in the checkpoint
    buffers = sum(b.numel() for n, b in model.named_buffers() if n in persistent)
    assert sum(p.numel() for p in model.parameters()) + buffers == cfg.n_params()
    if name in PUBLISHED:
        assert abs(cfg.n_params() / 1e9 - PUBLISHED[name]) < 0.01 * PUBLISHED[name]  # cards round either way


@pytest.mark.parametrize("file,name", PUBLISHED_FILES.items())
def test_the_presets_are_their_published_config_files_read(file, name):
    """Every field phantom reads from the published file (V4: its compress_ratios; Kimi-K2.5: its text_config, the
    vision tower left out, its INT4 quantization_config read as shipped) is the preset's."""
    assert config_from_hf(json.loads((DATA / f"{file}.config.json").read_text())) == PRESETS[name]


def test_kimi_k2_5_is_the_vision_language_class_s_text_model():
    """Kimi_K25ForConditionalGeneration built on the meta device from the published config.json (its text_config;
    the class's own defaults are DeepSeek-V3's text model, tied): its language model and head hold the preset's
    parameters, and its vision tower and projector the rest."""
    c = json.loads((DATA / "kimi-k2.5.config.json").read_text())
    drop = ("auto_map", "quantization_config", "model_type")
    text = {k: v for k, v in c.pop("text_config").items() if k not in drop}
    config = transformers.Kimi_K25Config(text_config=text, **{k: v for k, v in c.items() if k not in drop})
    with torch.device("meta"):
        model = transformers.Kimi_K25ForConditionalGeneration(config)
    persistent = model.state_dict().keys()  # the router correction bias: a buffer, in the checkpoint
    lm = model.model.language_model
    buffers = sum(b.numel() for n, b in lm.named_buffers() if f"model.language_model.{n}" in persistent)
    counted = sum(p.numel() for p in lm.parameters()) + buffers + model.lm_head.weight.numel()
    assert counted == PRESETS["kimi-k2.5-1T"].n_params()
    assert sum(p.numel() for p in model.parameters()) > counted  # the vision tower, left out


def test_tune_plans_kimi_k2_5_as_shipped(tmp_path, monkeypatch, capsys):
    """scripts/tune.py --preset kimi-k2.5-1T --quantize int4-group plans its 61 blocks as the Hub ships them (the
    routed experts INT4 with a bf16 scale per 32 values, the rest bf16: 0.288x the bf16 store, as Kimi-K2's), on a
    768 GB host; a profile measured on a small shape stands in for this machine's."""
    small = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, multiple_of=16, max_seq_len=64)
    profile = dataclasses.replace(profiles.probe(small, "cpu", ci.Workload(1, 16, "fp32", "bf16"), tmp_path, quick=True),
                                  free_device_bytes=None, free_host_bytes=768 << 30)
    monkeypatch.setattr(profiles, "probe", lambda *a, **k: profile)
    assert script().main(["--preset", "kimi-k2.5-1T", "--quantize", "int4-group", "--device", "cpu", "--json",
                          "--batch-size", "1", "--seq-len", "128", "--disk-budget", "2TB"]) == 0
    plan = json.loads(capsys.readouterr().out)
    cfg = PRESETS["kimi-k2.5-1T"]
    assert plan["fits"] and len(plan["tiers"]) == cfg.n_layers
    ratio = ci.shape_of(cfg, quant="int4-group").block_bytes / ci.shape_of(cfg).block_bytes
    assert 0.2812 < ratio < 0.29, ratio


# a 2-core CPU's quick profile (scripts/tune.py's probe on a dim-64 shape, a quiet machine)
MEASURED_CPU = dict(disk_gbps=0.18, h2d_gbps=62.5, dequant_gbps=4.0, fwd_flops=6.07e9, fwd_grad_ratio=1.95,
                    bwd_ratio=1.89, head_flops=1.91e9, keep_scale=1.13, disk_jitter=0.03, busy_compute_slowdown=4.38,
                    busy_read_slowdown=1.0)


def test_tune_plans_qwen2_5_72b_like_the_70b(tmp_path, monkeypatch, capsys):
    """One machine profile (measured on a small shape, its speeds then set to one such measurement's: the plans'
    ratio is the models', not the load of the machine the test runs on; 256 GiB of host memory free) for both: the
    72B is planned as the 70B is, each block a little larger."""
    small = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, multiple_of=16, max_seq_len=64)
    profile = dataclasses.replace(profiles.probe(small, "cpu", ci.Workload(1, 16, "fp32", "bf16"), tmp_path, quick=True),
                                  free_device_bytes=None, free_host_bytes=256 << 30, **MEASURED_CPU)
    monkeypatch.setattr(profiles, "probe", lambda *a, **k: profile)  # no 70B-shaped blocks written to measure
    plans = {}
    for name in ("qwen2.5-72B", "llama3.1-70B"):
        argv = ["--preset", name, "--device", "cpu", "--batch-size", "1", "--seq-len", "1024", "--json",
                "--ram-budget", "64GiB", "--disk-budget", "1TB"]
        assert script().main(argv) == 0
        plans[name] = json.loads(capsys.readouterr().out)
    qwen, llama = plans["qwen2.5-72B"], plans["llama3.1-70B"]
    assert qwen["fits"] and len(qwen["tiers"]) == len(llama["tiers"]) == 80
    placement = lambda plan: {k: v for k, v in plan["placement"].items() if k != "ram_budget"}  # noqa: E731
    # the same policy; what is kept is budgeted from the host memory the (larger) RAM tier leaves
    policy = lambda plan: {k: v for k, v in plan["activations"].items() if k != "keep_budget"}  # noqa: E731
    assert placement(qwen) == placement(llama) and policy(qwen) == policy(llama)
    if qwen["activations"]["recompute"] == "auto":  # "all" and "none" (as the measured speeds choose) carry no budget
        assert abs(qwen["activations"]["keep_budget"] / llama["activations"]["keep_budget"] - 1) < 0.05
    else:
        assert qwen["activations"]["keep_budget"] is llama["activations"]["keep_budget"] is None
    assert abs(qwen["split"]["ram"] - llama["split"]["ram"]) <= 1  # the same RAM budget, blocks 2.5% larger
    ratio = PRESETS["qwen2.5-72B"].block_params() / PRESETS["llama3.1-70B"].block_params()
    assert 0.9 * ratio < qwen["step_s"] / llama["step_s"] < 1.1 * ratio


def test_tune_plans_gpt_oss_120b(tmp_path, monkeypatch, capsys):
    """scripts/tune.py --preset gpt-oss-120b plans its 36 blocks (a profile measured on a small shape, 256 GiB of
    host memory free): it fits, each block counted with its 128 experts' biases, the sinks and the router's bias."""
    small = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, multiple_of=16, max_seq_len=64)
    profile = dataclasses.replace(profiles.probe(small, "cpu", ci.Workload(1, 16, "fp32", "bf16"), tmp_path, quick=True),
                                  free_device_bytes=None, free_host_bytes=256 << 30)
    monkeypatch.setattr(profiles, "probe", lambda *a, **k: profile)  # no 120B-shaped blocks written to measure
    assert script().main(["--preset", "gpt-oss-120b", "--device", "cpu", "--batch-size", "1", "--seq-len", "1024",
                          "--json", "--ram-budget", "64GiB", "--disk-budget", "1TB"]) == 0
    plan = json.loads(capsys.readouterr().out)
    cfg = PRESETS["gpt-oss-120b"]
    assert plan["fits"] and len(plan["tiers"]) == cfg.n_layers
    assert ci.shape_of(cfg, "bf16").block_bytes == 2 * cfg.block_params()
