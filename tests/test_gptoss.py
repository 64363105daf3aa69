"""gpt-oss beyond the shared checks of tests/test_families.py (logits streamed every way, LoRA on attention
against peft, the merged export, the full step against AdamW: sinks, router bias and expert biases train):

- each feature (sinks, the window, the biases, the clamp, gate and up interleaved, yarn) changes transformers'
  logits, so the shared checks see it;
- the experts as the Hub's 16-bit copies ship them (sharded, the published config.json's fields, legacy
  rope_scaling) convert to the store save_pretrained's files make, copied or read in place;
- LoRA on attention and the experts (peft's target_parameters on GptOssExperts' (experts, in, out) tensors, gate
  and up alternating in lora_B's rows) equals peft, resident and streamed, experts read routed and whole; the
  merged export equals peft's merge_and_unload;
- the presets are the published config.json files read, and count transformers' parameters;
- what phantom does not model is refused in one line.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from family_check import (CASES, batch, check_converts_to, check_logits, check_quantized, make, peft, peft_step,
                          rel_err, synthetic_preset_loss, transformers)
from phantom.arch.config import ConfigError
from phantom.arch.family import config_from_hf
from phantom.arch.presets import PRESETS
from phantom.export.export import export
from test_deepseek import differs, expert_models, zero
from test_moe_lora import assert_runs_equal_peft, expert_adapter, few, phantom_step
from test_moe_routed import ram_streams  # noqa: F401  (a fixture: the RAM tier read into slots, as on CUDA)

DATA = Path(__file__).parent / "data"


def swap_gate_and_up(model):
    """gate_up_proj's (and its bias's) even and odd columns exchanged: read the other way round, as a reader
    that took gate and up for halves (or swapped) would."""
    for n, p in model.named_parameters():
        if "gate_up_proj" in n:
            p.copy_(p.unflatten(-1, (-1, 2)).flip(-1).flatten(-2))


def scale_sinks(model):
    for n, p in model.named_parameters():
        if n.endswith("sinks"):
            p.mul_(20)


@pytest.mark.parametrize("change,edit", [
    (None, zero("self_attn.sinks")),  # a sink logit in each softmax's denominator
    (None, scale_sinks),
    (dict(layer_types=["full_attention"] * 2), None),  # the window of 16 on layer 0 (rows of 40 tokens)
    (dict(sliding_window=8), None),
    (None, zero("self_attn.q_proj.bias")), (None, zero("self_attn.k_proj.bias")),  # biases on q, k, v, o
    (None, zero("self_attn.v_proj.bias")), (None, zero("self_attn.o_proj.bias")),
    (None, zero("mlp.router.bias")),  # the router's bias moves the choice and the weights
    (None, zero("experts.gate_up_proj_bias")), (None, zero("experts.down_proj_bias")),  # the experts' biases
    (dict(swiglu_limit=1e4), None),  # the clamp bites at 1.5
    (dict(swiglu_alpha=1.0), None),
    (None, swap_gate_and_up),  # gate and up alternate on gate_up_proj's last dim
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 150000.0}), None),  # yarn
    (dict(rope_parameters={**CASES["gpt_oss"].fields["rope_parameters"], "factor": 8.0}), None),
])
def test_each_feature_changes_transformers_logits(change, edit):
    assert differs("gpt_oss", change, edit) > 1e-3


def test_the_tiny_model_has_activations_past_the_clamp():
    """Some gate and up pre-activations of transformers' experts pass swiglu_limit on the batch: the clamp is
    exercised by the shared checks, not only present."""
    model, seen = make("gpt_oss"), []
    for layer in model.model.layers:
        experts = layer.mlp.experts
        experts._apply_gate = (lambda gate, f=experts._apply_gate: seen.append(gate.detach().abs().max()) or f(gate))
    with torch.no_grad():
        model(batch()[0])
    assert seen and max(seen) > CASES["gpt_oss"].fields["swiglu_limit"]


def shipped_layout(model, root: Path) -> Path:
    """model's weights as the Hub's 16-bit gpt-oss copies ship them: two shards and their index, the published
    config.json's fields (legacy rope_scaling and rope_theta, OpenAI's experts_per_token and
    initial_context_length, layer_types written out) at the tiny model's shapes."""
    root.mkdir(parents=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    names = sorted(state)
    shards = {"model-00000-of-00001.safetensors": names[::2], "model-00001-of-00001.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: state[k] for k in keys}, root / file, metadata={"format": "pt"})
    (root / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}))
    published = json.loads((DATA / "gpt-oss-20b.config.json").read_text())
    c, rope = model.config, CASES["gpt_oss"].fields["rope_parameters"]
    fields = {k: getattr(c, k) for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "head_dim",
                                          "num_attention_heads", "num_key_value_heads", "num_local_experts",
                                          "num_experts_per_tok", "sliding_window", "swiglu_limit", "vocab_size",
                                          "max_position_embeddings", "layer_types")}
    (root / "config.json").write_text(json.dumps({
        **published, **fields, "experts_per_token": c.num_experts_per_tok, "rope_theta": rope["rope_theta"],
        "rope_scaling": {k: v for k, v in rope.items() if k != "rope_theta"}, "eos_token_id": 2, "pad_token_id": 1}))
    return root


def test_the_checkpoint_layouts(family_models, tmp_path):
    """save_pretrained writes GptOssExperts' parameters as they are ((experts, hidden, 2 * width) gate_up_proj,
    gate and up alternating, and its bias; (experts, width, hidden) down_proj and its bias), as the Hub's bf16
    copies hold them; those files, sharded with the published config.json's fields, convert to the same store,
    copied or read in place (the experts' parts are copied: every other column, turned)."""
    model, store = family_models("gpt_oss")
    from safetensors import safe_open
    with safe_open(store.parent / "hf" / "model.safetensors", "pt") as f:
        shapes = {k.removeprefix("model.layers.0.mlp.experts."): tuple(f.get_slice(k).get_shape())
                  for k in f.keys() if k.startswith("model.layers.0.mlp.experts.")}
    c = model.config
    E, H, W = c.num_local_experts, c.hidden_size, c.intermediate_size
    assert shapes == {"gate_up_proj": (E, H, 2 * W), "gate_up_proj_bias": (E, 2 * W), "down_proj": (E, W, H),
                      "down_proj_bias": (E, H)}
    src = shipped_layout(model, tmp_path / "shipped")
    check_converts_to(src, store, tmp_path / "copied")
    check_converts_to(src, store, tmp_path / "linked", link=True)
    check_logits(model, tmp_path / "linked", *batch(), runs=[("disk", 1, "none")])


def test_each_expert_reads_its_own_columns(family_models):
    """Expert e's gate, up and down in the store are gate_up_proj[e]'s even and odd columns and down_proj[e],
    turned, and their biases (written here by index, apart from phantom's reader)."""
    from phantom.files.store import BlockStore
    model, store = family_models("gpt_oss")
    block, experts = BlockStore(store).load_block(1), model.model.layers[1].mlp.experts
    for e in (0, 5):
        gu, b = experts.gate_up_proj[e].detach(), experts.gate_up_proj_bias[e].detach()
        want = {"w1.weight": gu[:, 0::2].T, "w3.weight": gu[:, 1::2].T, "w2.weight": experts.down_proj[e].detach().T,
                "w1.bias": b[0::2], "w3.bias": b[1::2], "w2.bias": experts.down_proj_bias[e].detach()}
        for name, t in want.items():
            assert torch.equal(block[f"feed_forward.experts.{e}.{name}"], t), (e, name)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return expert_models(tmp_path_factory)


@pytest.mark.usefixtures("ram_streams")
def test_expert_lora_equals_peft_with_experts_read_routed_and_whole(models, tmp_path):
    """LoRA on attention and every expert: logits within 1e-5 of peft's, every A and B gradient within 1e-4,
    resident and streamed from disk and RAM, experts read routed and whole; unhit experts' gradients zero in
    both. peft adapts GptOssExperts' (experts, in, out) tensors without swapping in and out: gate_up_proj's
    lora_B rows alternate gate and up as its columns do."""
    model, store, tokens, targets, adapter, config = expert_adapter(models, "gpt_oss", tmp_path)
    assert config["target_modules"] == ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert_runs_equal_peft(store, tokens, targets, peft_step(model, adapter, tokens, targets))


def test_the_merged_expert_lora_equals_peft_merge_and_unload(models, tmp_path):
    model, store = models("gpt_oss")
    tokens, targets = few()
    phantom_step(store, tokens, targets, tmp_path / "adapter", offload="none")
    merged_ref = peft.PeftModel.from_pretrained(make("gpt_oss"), tmp_path / "adapter").merge_and_unload().eval()
    out = export(store, tmp_path / "hf", tmp_path / "adapter", "hf", progress=False)
    merged = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        want, base = merged_ref(tokens).logits, model(tokens).logits
        assert rel_err(merged(tokens).logits, want) < 1e-5 and rel_err(base, want) > 1e-3


@pytest.mark.parametrize("file,preset", [("gpt-oss-20b", "gpt-oss-20b"), ("gpt-oss-120b", "gpt-oss-120b")])
def test_the_presets_are_the_published_config_files_read_and_count_transformers_parameters(file, preset):
    """tests/data: the fields of openai/gpt-oss-20b's and -120b's config.json, quantization_config (MXFP4) left
    out; the preset's parameter count is GptOssForCausalLM's, built on the meta device from the same file."""
    c = json.loads((DATA / f"{file}.config.json").read_text())
    assert config_from_hf(c) == PRESETS[preset]
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.GptOssConfig(**c))
    assert PRESETS[preset].n_params() == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("change,named", [
    (dict(swiglu_limit=None), "swiglu_limit"),
    (dict(layer_types=["full_attention"]), "layer_types"),
    (dict(quantization_config={"quant_method": "bitsandbytes"}), "quantization_config"),  # mxfp4 is read
    (dict(attention_dropout=0.1), "attention_dropout"),
])
def test_what_is_not_modelled_is_refused_naming_the_field(change, named):
    c = {**json.loads((DATA / "gpt-oss-20b.config.json").read_text()), **change}
    with pytest.raises(ConfigError, match=f"{named}="):
        config_from_hf(c)


@pytest.mark.parametrize("method", ["nf4", "int8"])
def test_a_quantized_store_streams_its_dequantized_experts(family_models, method, tmp_path):
    """NF4 and int8 linear weights (biases, sinks and the router 16-bit): from disk and RAM, the logits of
    transformers on the weights the store dequantizes to (its --format hf export)."""
    _, store = family_models("gpt_oss")
    quantized = check_quantized(store, tmp_path, method)
    record = json.loads((quantized / "manifest.json").read_text())["quantization"]["tensors"]
    assert record["feed_forward.experts.3.w2.weight"] == record["attention.wq.weight"] == method
    assert record["feed_forward.experts.3.w2.bias"] == record["attention.sinks"] == "bfloat16"


@pytest.mark.parametrize("name", ["gpt-oss-20b", "gpt-oss-120b"])
def test_a_synthetic_store_of_the_preset_shape_streams(name, tmp_path):
    import math
    loss = synthetic_preset_loss(name, tmp_path, n_layers=2, n_experts=6, experts_per_token=2, expert_dim=32,
                                 sliding_window=8)
    assert torch.isfinite(loss) and abs(loss.item() - math.log(97)) < 1.0


def test_a_packed_row_equals_transformers_on_each_example_alone(family_models):
    """Two examples of 22 and 18 tokens in one row (segment ids): each one's logits are transformers' on it alone,
    the sinks in every softmax and the window of 16 counted from each example's own start."""
    import phantom
    model, store = family_models("gpt_oss")
    tokens = batch(1, 40)[0]
    segments = torch.tensor([[0] * 22 + [1] * 18])
    with phantom.load(store, offload="disk", prefetch=1, lora=None) as pm, torch.no_grad():
        packed = pm(tokens, segments=segments)[0]
        for start, end in ((0, 22), (22, 40)):
            assert rel_err(packed[start:end], model(tokens[:, start:end]).logits[0]) < 1e-5


def test_formats_that_cannot_hold_it_are_refused_in_one_line(family_models, tmp_path, capsys):
    """Meta's format (Llama's maths: no sinks, biases or experts) and GGUF of this model (its SwiGLU clamp is not
    the one llama.cpp's gpt-oss fixes): exit 2 and one `error:` line each, nothing written."""
    from test_convert import load_script
    _, store = family_models("gpt_oss")
    capsys.readouterr()  # what building the store printed
    for fmt, said in (("meta", "sets explicit_head_dim, qkv_bias, o_bias, sliding_window, n_experts, attn_sinks"),
                      ("gguf", "llama.cpp's gpt-oss clamps the experts' SwiGLU at limit 7 with alpha 1.702")):
        assert load_script("merge_lora").main(["--model", str(store), "--out", str(tmp_path / fmt), "--format", fmt,
                                               "--quiet"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and said in err[0] and not (tmp_path / fmt).exists()


@pytest.mark.usefixtures("ram_streams")
def test_logits_equal_transformers_with_experts_read_routed_and_whole(family_models):
    """The base model's logits and loss, from disk and RAM, the experts read alone (routed, a micro-batch a row)
    or with their block (whole): within 1e-5 of transformers'; the routed runs read experts alone."""
    import phantom
    from family_check import cross_entropy
    model, store = family_models("gpt_oss")
    tokens, targets = batch()
    with torch.no_grad():
        ref = model(tokens).logits
    for offload in ("disk", "ram"):
        for reads in ("routed", "whole"):
            with phantom.load(store, offload=offload, prefetch=1, lora=None, expert_reads=reads,
                              micro_batch=1 if reads == "routed" else None) as pm, torch.no_grad():
                assert rel_err(pm(tokens), ref) < 1e-5, (offload, reads)
                torch.testing.assert_close(pm(tokens, targets=targets), cross_entropy(ref, targets), rtol=1e-5, atol=0)
                assert (pm.backend.scheduler.take_metrics()["bytes_experts"] > 0) == (reads == "routed")
