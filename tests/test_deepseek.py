"""DeepSeek-V3 (Kimi-K2), DeepSeek-V2 and GLM-4.5 beyond the shared checks of tests/test_families.py (logits
streamed every way, LoRA on attention against peft, the merged export, the full step against AdamW):

- each feature of the family changes transformers' logits, so the shared checks see it;
- the variants the tiny models of the shared checks leave out (rotated dims in halves, DeepSeek-V2's groups,
  unnormalised weights, a model without multi-token-prediction layers) equal transformers too;
- LoRA on attention and the experts (peft's target_parameters) equals peft, resident and streamed with the
  experts read routed and whole; the merged export equals peft's merge_and_unload;
- the presets are the published config.json files read (tests/data: the fields of each repository's file,
  quantization_config left out), a Kimi-K2 file read as DeepSeek-V3 without running its code;
- what phantom does not model is refused in one line.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import phantom

from family_check import (CASES, batch, check_logits, check_quantized, make, peft, peft_step, prepare, rel_err,
                          transformers)
from phantom.arch.config import ConfigError
from phantom.arch.family import config_from_hf
from phantom.arch.presets import PRESETS
from phantom.export.export import export
from test_moe_lora import RUNS, assert_equals_peft, expert_adapter, few, phantom_step
from test_convert import load_script
from test_hub import add_to_cache
from test_moe_routed import ram_streams  # noqa: F401  (a fixture: the RAM tier read into slots, as on CUDA)

DATA = Path(__file__).parent / "data"
NAMES = ("deepseek_v3", "deepseek_v2", "glm4_moe")


def differs(name: str, change: dict | None = None, edit=None) -> float:
    """How far the logits of CASES[name]'s model move when a field changes (change) or a tensor is edited."""
    tokens, _ = batch()
    model = make(name)
    other = make(name, **(change or {}))
    other.load_state_dict(model.state_dict())
    if edit is not None:
        with torch.no_grad():
            edit(other)
    with torch.no_grad():
        return rel_err(other(tokens).logits, model(tokens).logits)


def zero(suffix: str):
    def edit(model):
        for n, t in [*model.named_parameters(), *model.named_buffers()]:
            if n.endswith(suffix):
                t.zero_()
    return edit


@pytest.mark.parametrize("name,change,edit", [
    ("deepseek_v3", None, zero("e_score_correction_bias")),  # the correction bias moves the choice
    ("deepseek_v3", dict(topk_group=4), None),  # the choice limited to 2 of 4 groups
    ("deepseek_v3", dict(routed_scaling_factor=1.0), None),
    ("deepseek_v3", dict(norm_topk_prob=False), None),
    ("deepseek_v3", None, zero("shared_experts.down_proj.weight")),  # the shared expert, always on
    ("deepseek_v3", None, zero("layers.0.mlp.down_proj.weight")),  # the dense first layer
    ("deepseek_v3", dict(rope_interleave=False), None),  # the rotated dims' layout
    ("deepseek_v3", dict(rope_parameters={**CASES["deepseek_v3"].fields["rope_parameters"], "mscale_all_dim": 1.3}),
     None),  # YaRN's softmax scale
    ("deepseek_v3", None, zero("q_a_layernorm.weight")),  # the q bottleneck's norm
    ("deepseek_v2", dict(routed_scaling_factor=1.0), None),
    ("deepseek_v2", dict(topk_method="group_limited_greedy", n_group=4, topk_group=1), None),
    ("glm4_moe", dict(partial_rotary_factor=1.0), None),
    ("glm4_moe", None, zero("self_attn.q_norm.weight")),
    ("glm4_moe", None, zero("e_score_correction_bias")),
])
def test_each_feature_changes_transformers_logits(name, change, edit):
    assert differs(name, change, edit) > 1e-3


@pytest.mark.parametrize("name,change", [
    ("deepseek_v3", dict(rope_interleave=False, norm_topk_prob=False)),  # halves; weights not renormalised
    ("deepseek_v3", dict(q_lora_rank=None, n_group=1, topk_group=1, first_k_dense_replace=0)),  # all sparse, no groups
    ("deepseek_v2", dict(topk_method="group_limited_greedy", n_group=4, topk_group=2)),
    ("glm4_moe", dict(partial_rotary_factor=1.0, use_qk_norm=False, attention_bias=False)),
])
def test_the_variants_equal_transformers_streamed(name, change, tmp_path):
    model = make(name, **change)
    store = prepare(model, tmp_path)
    check_logits(model, store, *batch(), runs=[("none", 0, "none"), ("disk", 1, "all"), ("ram", 0, "none")])


def expert_models(tmp_path_factory, cache={}):  # noqa: B006 - one build of each a session
    def get(name):
        if name not in cache:
            model = make(name)
            cache[name] = model, prepare(model, tmp_path_factory.mktemp(name))
        return cache[name]
    return get


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return expert_models(tmp_path_factory)


@pytest.mark.usefixtures("ram_streams")
@pytest.mark.parametrize("name", NAMES)
def test_expert_lora_equals_peft_with_experts_read_routed_and_whole(models, name, tmp_path):
    """LoRA on attention and every expert: logits within 1e-5 of peft's, every A and B gradient within 1e-4,
    resident and streamed from disk and RAM, experts read routed and whole; the adapter loads in peft with
    the names peft gives these modules (q, k, v on latent attention: q_b_proj or q_proj, kv_b_proj)."""
    model, store, tokens, targets, adapter, config = expert_adapter(models, name, tmp_path)
    assert config["target_modules"] == list(CASES[name].adapter_modules) if name == "glm4_moe" else \
        sorted(["kv_b_proj", "o_proj", "q_b_proj" if name == "deepseek_v3" else "q_proj"])
    ref = peft_step(model, adapter, tokens, targets)
    for offload, prefetch, recompute, reads in RUNS:
        knobs = {} if offload == "none" else dict(expert_reads=reads, micro_batch=1 if reads == "routed" else None)
        got = phantom_step(store, tokens, targets, offload=offload, prefetch=prefetch, recompute=recompute, **knobs)
        assert_equals_peft(got, ref, (offload, prefetch, recompute, reads), unhit=True)


def test_the_merged_expert_lora_equals_peft_merge_and_unload(models, tmp_path):
    model, store = models("deepseek_v3")
    tokens, targets = few()
    phantom_step(store, tokens, targets, tmp_path / "adapter", offload="none")
    merged_ref = peft.PeftModel.from_pretrained(make("deepseek_v3"), tmp_path / "adapter").merge_and_unload().eval()
    out = export(store, tmp_path / "hf", tmp_path / "adapter", "hf", progress=False)
    merged = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        want, base = merged_ref(tokens).logits, model(tokens).logits
        assert rel_err(merged(tokens).logits, want) < 1e-5 and rel_err(base, want) > 1e-3


@pytest.mark.parametrize("file,preset", [("deepseek-v3", "deepseek-v3-671B"), ("kimi-k2", "kimi-k2-1T"),
                                         ("glm-4.5", "glm-4.5-355B"), ("deepseek-v2-lite", "deepseek-v2-lite-16B")])
def test_the_presets_are_the_published_config_files_read(file, preset):
    """Kimi-K2's file names its own model_type and code (auto_map): its fields are DeepSeek-V3's, read as such."""
    assert config_from_hf(json.loads((DATA / f"{file}.config.json").read_text())) == PRESETS[preset]


def test_the_prediction_layer_is_left_out_in_one_line(caplog):
    with caplog.at_level("INFO"):
        config_from_hf(json.loads((DATA / "deepseek-v3.config.json").read_text()))
    assert [r.getMessage() for r in caplog.records if "multi-token-prediction" in r.getMessage()] == [
        "config.json: 1 multi-token-prediction layer(s) after the last block are left out, as transformers leaves "
        "them out"]


@pytest.mark.parametrize("change,named", [
    (dict(moe_layer_freq=2), "moe_layer_freq"), (dict(scoring_func="softmax"), "scoring_func"),
    (dict(topk_method="greedy"), "topk_method"), (dict(attention_bias=True), "attention_bias"),
    (dict(quantization_config={"quant_method": "fp8"}), "quantization_config"),
])
def test_what_is_not_modelled_is_refused_naming_the_field(change, named):
    c = {**json.loads((DATA / "deepseek-v3.config.json").read_text()), **change}
    with pytest.raises(ConfigError, match=f"{named}="):
        config_from_hf(c)


def test_finetune_trains_a_deepseek_v3_from_the_hub_cache(tmp_path, monkeypatch):
    """finetune.py --model OWNER/NAME on a tiny DeepSeek-V3 in the local hub cache: converted on first use (read in
    place), LoRA on latent attention and the experts streamed from disk with the experts read routed; the
    adapter loads in peft onto the transformers model with phantom's logits."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("PHANTOM_WEIGHTS", str(tmp_path / "weights"))
    model = make("deepseek_v3")
    add_to_cache(tmp_path / "hub", model, "main", 0, repo_id="deepseek-ai/tiny-v3")
    out = tmp_path / "out"
    assert load_script("finetune").main([
        "--model", "deepseek-ai/tiny-v3", "--offload", "disk", "--expert-reads", "routed", "--lora-targets",
        "q,kv_a,kv_b,o,gate,up,down", "--iters", "2", "--warmup", "0", "--lr", "1e-2", "--batch-size", "2",
        "--seq-len", "32", "--eval-every", "0", "--val-split", "0", "-q", "--out", str(out)]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("bytes_experts", 0) > 0 for r in records if "loss" in r)  # the experts were read alone
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert config["target_modules"] == ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "q_b_proj"]
    store = phantom.resolve_model("deepseek-ai/tiny-v3")
    tokens, _ = batch()
    with phantom.load(store, offload="none", lora=phantom.LoraConfig(
            targets=("q", "kv_a", "kv_b", "o", "gate", "up", "down"))) as pm, torch.no_grad():
        pm.load_adapter(out / "adapter")
        ours, base = pm(tokens), model(tokens).logits
        theirs = peft.PeftModel.from_pretrained(model, out / "adapter").eval()(tokens).logits
    assert rel_err(ours, base) > 1e-4 and rel_err(ours, theirs) < 1e-5


@pytest.mark.parametrize("name", ["deepseek_v3", "glm4_moe"])
def test_nf4_experts_stream_as_transformers_computes_their_dequantized_weights(family_models, name, tmp_path):
    """An NF4 copy (routers, norms and the correction bias 16-bit) from disk and RAM equals transformers on the
    weights it dequantizes to (its --format hf export)."""
    _, store = family_models(name)
    check_quantized(store, tmp_path, "nf4")


def test_a_cut_model_keeps_its_experts_and_a_probe_its_expert_shape():
    """A benchmark's or profile's few layers of DeepSeek-V3 (three dense layers first) are sparse; a probe of the
    671B block (46 GB dense in fp32) writes blocks of fewer experts of the same shape, within its byte bound."""
    from phantom.plan import costinputs as ci
    from phantom.plan.profiles import PROBE_BLOCK_BYTES, measurable
    v3 = PRESETS["deepseek-v3-671B"]
    assert v3.first_layers(2).dense_layers == () and v3.first_layers(5).dense_layers == (0, 1, 2)
    small = measurable(v3.first_layers(2))
    assert small.expert_dim == v3.expert_dim and small.n_experts % v3.router_groups == 0
    assert ci.shape_of(small, "fp32").block_bytes <= PROBE_BLOCK_BYTES < ci.shape_of(v3, "fp32").block_bytes
    assert measurable(PRESETS["olmoe-1B-7B"]) == PRESETS["olmoe-1B-7B"]


def test_a_tokenizer_written_in_code_is_said_in_one_line_and_the_weights_convert(tmp_path, caplog):
    """Kimi-K2's folder holds tiktoken.model, whose pattern and special tokens are in tokenization_kimi.py: the
    store is made without a tokenizer (training on token ids works), and one line says why."""
    import base64
    model = make("deepseek_v3")
    model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    (tmp_path / "hf" / "tiktoken.model").write_text("".join(f"{base64.b64encode(bytes([i])).decode()} {i}\n"
                                                            for i in range(256)))
    with caplog.at_level("WARNING"):
        assert load_script("prepare_model").main(["--src", str(tmp_path / "hf"), "--out", str(tmp_path / "store"),
                                                  "--quiet"]) == 0
    said = [r.getMessage() for r in caplog.records if "tiktoken.model" in r.getMessage()]
    assert len(said) == 1 and "train on token ids" in said[0]
    with phantom.load(tmp_path / "store", offload="disk", lora=None) as pm, torch.no_grad():
        tokens, _ = batch()
        assert rel_err(pm(tokens), model(tokens).logits) < 1e-5


def kimi_k25(tie: bool = False):
    """A tiny Kimi_K25ForConditionalGeneration: CASES["deepseek_v3"]'s text model (its weights) beside a
    one-layer vision tower; text_config names Kimi-K2's model_type, as the Hub's file does."""
    text_model = make("deepseek_v3")
    text = {**text_model.config.to_dict(), "model_type": "kimi_k2"}
    vision = dict(num_hidden_layers=1, hidden_size=32, intermediate_size=48, num_attention_heads=2, patch_size=4,
                  pos_emb_height=4, pos_emb_width=4)
    config = transformers.Kimi_K25Config(text_config=text, vision_config=vision, projection_hidden_size=32,
                                         tie_word_embeddings=tie)
    config._attn_implementation = "eager"
    model = transformers.Kimi_K25ForConditionalGeneration(config).float().eval()
    state = text_model.state_dict()
    model.model.language_model.load_state_dict({k.removeprefix("model."): v for k, v in state.items()
                                                if k.startswith("model.")})
    if not tie:
        model.lm_head.load_state_dict({"weight": state["lm_head.weight"]})
    return model, text_model


def published_names(folder):
    """Kimi-K2.5's names as the Hub ships them (language_model.model.layers.N, language_model.lm_head) in place of
    save_pretrained's (language_model.model.blocks.N)."""
    from safetensors.torch import load_file, save_file
    import re
    state = load_file(folder / "model.safetensors")
    assert any(".model.blocks.0." in k for k in state)
    save_file({re.sub(r"^language_model\.model\.blocks\.", "language_model.model.layers.", k): v
               for k, v in state.items()}, folder / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("tie,names", [(False, "save_pretrained"), (True, "published")])
def test_kimi_k25_streams_its_text_model_as_transformers_computes_it(tie, names, tmp_path, caplog):
    """Kimi-K2.5/K2.6: the text model of a Kimi_K25ForConditionalGeneration saved by transformers (or under the Hub's
    names) streams from disk and RAM with the vision-language class's text logits within 1e-5; the vision tower and
    projector are left out, said in one line; the tie follows the outer config, as the class ties."""
    model, text_model = kimi_k25(tie)
    model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    if names == "published":
        published_names(tmp_path / "hf")
    from test_export_hf import llama3_style_tokenizer_json
    llama3_style_tokenizer_json(tmp_path / "hf")
    with caplog.at_level("INFO"):
        assert load_script("prepare_model").main(["--src", str(tmp_path / "hf"), "--out", str(tmp_path / "store"),
                                                  "--quiet"]) == 0
    said = [r.getMessage() for r in caplog.records if "vision tower" in r.getMessage()]
    assert len(said) == 1 and "Kimi_K25ForConditionalGeneration" in said[0]
    store = json.loads((tmp_path / "store" / "manifest.json").read_text())["config"]
    assert store["family"] == "deepseek_v3" and store["tie_embeddings"] == tie
    tokens, targets = batch()
    if not tie:
        with torch.no_grad():
            assert rel_err(model(tokens).logits, text_model(tokens).logits) == 0  # the text model it carries
    check_logits(model, tmp_path / "store", tokens, targets, runs=[("disk", 1, "all"), ("ram", 0, "none")])


def test_kimi_k25_config_read_as_deepseek_v3():
    model, _ = kimi_k25()
    c = {**json.loads(model.config.to_json_string()), "architectures": ["Kimi_K25ForConditionalGeneration"]}
    assert config_from_hf(c) == config_from_hf(json.loads(make("deepseek_v3").config.to_json_string()))
