"""Qwen3-Next and Qwen3.5-MoE (text) beyond the shared checks of tests/test_families.py (logits streamed every way,
LoRA on attention against peft, the merged export, the full step against AdamW):

- Gated DeltaNet's chunked delta rule equals transformers' chunked and per-token torch implementations, and the
  models equal transformers over 150 tokens (three chunks), streamed from disk and RAM;
- each feature of the layers changes transformers' logits, so the checks see it;
- LoRA on attention, on every Gated DeltaNet projection and on the experts (peft's target_parameters) equals
  peft, resident and streamed with the experts read routed and whole; the merged export equals peft's
  merge_and_unload; packed rows equal their examples run alone;
- generation (the conv and recurrent states the cache) equals transformers' generate past a chunk;
- a Qwen3.5 vision-language checkpoint is read as its text model, the vision tower left out in one line;
- the presets are the published config.json files read, their parameters transformers' (meta device);
- what phantom does not model is refused in one line.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import phantom

from family_check import CASES, batch, check_logits, cross_entropy, make, peft, peft_step, prepare, rel_err, \
    transformers
from phantom.arch.config import ConfigError
from phantom.arch.deltanet import chunk_gated_delta_rule
from phantom.arch.family import config_from_hf
from phantom.arch.presets import PRESETS
from phantom.export.export import export
from test_moe_lora import RUNS, assert_equals_peft, phantom_step
from test_moe_routed import ram_streams  # noqa: F401  (a fixture: the RAM tier read into slots, as on CUDA)

DATA = Path(__file__).parent / "data"
NAMES = ("qwen3_next", "qwen3_5_moe")
LINEAR_TARGETS = {"qwen3_next": ("in_proj_qkvz", "in_proj_ba", "out_proj"),
                  "qwen3_5_moe": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")}


def delta_rule_inputs(hk: int, hv: int, t: int = 150, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(2, t, hk, 16, generator=gen) for _ in range(2))
    v = torch.randn(2, t, hv, 12, generator=gen)
    g = -torch.rand(2, t, hv, generator=gen) * 2  # log decays as softplus gives them, some steep
    beta = torch.rand(2, t, hv, generator=gen)
    return q, k, v, g, beta


@pytest.mark.parametrize("hk,hv", [(2, 4)])
def test_the_chunked_delta_rule_equals_transformers_chunked_and_per_token(hk, hv):
    """Three chunks of 64 (the last partial), value heads sharing a q/k head: within 1e-5 of transformers'
    chunked form (the same sums: measured equal to the bit) and of its per-token recurrence (other sums: measured
    6e-7, as transformers' two forms differ)."""
    from transformers.models.qwen3_next import modeling_qwen3_next as hf
    q, k, v, g, beta = delta_rule_inputs(hk, hv)
    ours = chunk_gated_delta_rule(q, k, v, g, beta)
    chunked, _ = hf.torch_chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    per_token, _ = hf.torch_recurrent_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    assert rel_err(ours, chunked) < 1e-5 and rel_err(ours, per_token) < 1e-5
    assert rel_err(ours, chunk_gated_delta_rule(q, k, v, torch.zeros_like(g), beta)) > 1e-2  # the decay counts


def test_targets_that_leave_some_blocks_bare_are_said(family_models, caplog):
    """q, v adapt the full-attention layers alone: a warning names the linear-attention blocks they leave bare; the
    delta rule's projections named too, none is."""
    _, store = family_models("qwen3_5_moe")
    with caplog.at_level("WARNING", logger="phantom.model.backends"):
        phantom.load(store, offload="none", lora=phantom.LoraConfig(targets=("q", "v"))).close()
    said = [r.getMessage() for r in caplog.records if "adapt no module" in r.getMessage()]
    assert len(said) == 1 and "of 1 of the 2 blocks (0)" in said[0], said
    caplog.clear()
    with caplog.at_level("WARNING", logger="phantom.model.backends"):
        phantom.load(store, offload="none", lora=phantom.LoraConfig(targets=("q", "v", "in_proj_qkv"))).close()
    assert not [r for r in caplog.records if "adapt no module" in r.getMessage()]


def test_the_delta_rules_backward_is_linear_in_the_chunks():
    """Its backward allocates no sequence-sized zeros per chunk (a slice indexed in the chunk loop would: each
    select's backward zero-fills the whole tensor, quadratic in the length). Counted: fills of tensors the size of a
    whole sequence's per-chunk values during the backward, at 4 and at 16 chunks."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class SequenceFills(TorchDispatchMode):
        def __init__(self, numel):
            super().__init__()
            self.numel, self.count = numel, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            if name in ("zeros", "zeros_like", "fill_", "new_zeros", "select_backward") and \
                    isinstance(out, torch.Tensor) and out.numel() >= self.numel:
                self.count += 1
            return out

    counts = []
    for n in (4, 16):
        q, k, v, g, beta = (t.requires_grad_() for t in delta_rule_inputs(1, 2, t=64 * n))
        out = chunk_gated_delta_rule(q, k, v, g, beta)
        with SequenceFills(v.numel()) as mode:
            out.sum().backward()
        counts.append(mode.count)
    assert counts[1] <= counts[0] + 2, counts


@pytest.mark.parametrize("name,runs", [("qwen3_5_moe", [("disk", 1, "all"), ("ram", 0, "none")]),
                                       ("qwen3_next", [("ram", 1, "all")])])
def test_logits_over_three_chunks_equal_transformers_streamed(family_models, name, runs):
    model, store = family_models(name)
    check_logits(model, store, *batch(2, 150), runs=runs)


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


def scale(suffix: str, factor: float = 0.0, rows: slice = slice(None)):
    def edit(model):
        for n, t in model.named_parameters():
            if n.endswith(suffix):
                t[rows] *= factor
    return edit


def gate_rows(model):  # each head's output gate (the second head_dim rows of its 2 * head_dim in q_proj) to zero
    for n, t in model.named_parameters():
        if n.endswith("self_attn.q_proj.weight"):
            t.view(4, 2, 16, -1)[:, 1] = 0


@pytest.mark.parametrize("name,change,edit", [
    ("qwen3_5_moe", None, scale("linear_attn.A_log", 2.0)),  # the decay rate
    ("qwen3_5_moe", None, scale("linear_attn.dt_bias")),  # the decay's bias
    ("qwen3_5_moe", None, scale("linear_attn.conv1d.weight", 0.0, (slice(None), slice(None), slice(0, 3)))),
    ("qwen3_5_moe", None, scale("linear_attn.in_proj_b.weight")),  # the write strength beta
    ("qwen3_5_moe", None, scale("linear_attn.in_proj_z.weight")),  # the output norm's gate
    ("qwen3_5_moe", None, scale("linear_attn.norm.weight", 2.0)),
    ("qwen3_5_moe", None, gate_rows),  # full attention's output gate
    ("qwen3_5_moe", None, scale("self_attn.q_norm.weight")),  # a (1 + w) norm
    ("qwen3_5_moe", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
     None),
    ("qwen3_5_moe", None, scale("shared_expert_gate.weight")),  # the shared expert's sigmoid gate
    ("qwen3_next", None, scale("linear_attn.in_proj_ba.weight", 0.0, slice(0, 2))),  # a key head's b rows
    ("qwen3_next", dict(norm_topk_prob=False), None),
])
def test_each_feature_changes_transformers_logits(name, change, edit):
    assert differs(name, change, edit) > 1e-3


def test_the_conv_sees_three_tokens_back():
    """The last tap alone is the token itself: zeroing the others changes the logits (above), zeroing it too more."""
    assert differs("qwen3_5_moe", None, scale("linear_attn.conv1d.weight")) > 1e-3


def linear_lora(name: str) -> tuple[str, ...]:
    return ("q", "k", "v", "o", *LINEAR_TARGETS[name], "gate", "up", "down")


@pytest.mark.parametrize("name", NAMES)
def test_the_default_targets_adapt_every_block_as_peft_names_them(family_models, name, caplog, tmp_path):
    """The default targets (auto) are q, v and the Gated DeltaNet's input projection (in_proj_qkv; Qwen3-Next's
    in_proj_qkvz): no block is left bare, the adapter names those modules as peft does, peft loads it onto the
    transformers model with a LoRA in every block, and its logits, loss and gradients equal peft's; an explicit
    q,v still means q and v alone."""
    model, store = family_models(name)
    tokens, targets = batch(2, 3)[0], batch(2, 3, seed=1)[0]
    assert phantom.LoraConfig().targets == ("auto",)
    with caplog.at_level("WARNING", logger="phantom.model.backends"):
        got = phantom_step(store, tokens, targets, tmp_path / "adapter", lora_targets=("auto",), offload="none")
    assert not [r for r in caplog.records if "adapt no module" in r.getMessage()]
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["target_modules"] == sorted(["q_proj", "v_proj", LINEAR_TARGETS[name][0]])
    assert config["target_parameters"] is None
    pmodel = peft.PeftModel.from_pretrained(model, tmp_path / "adapter")
    try:
        adapted = {int(n.split(".layers.")[1].split(".")[0]) for n, _ in pmodel.named_parameters() if "lora_A" in n}
    finally:
        pmodel.unload()
    assert adapted == set(range(model.config.num_hidden_layers))
    assert_equals_peft(got, peft_step(model, tmp_path / "adapter", tokens, targets), "auto")
    explicit = tmp_path / "explicit"
    phantom_step(store, tokens, targets, explicit, lora_targets=("q", "v"), offload="none")
    assert json.loads((explicit / "adapter_config.json").read_text())["target_modules"] == ["q_proj", "v_proj"]


@pytest.fixture(scope="module")
def adapters(family_models, tmp_path_factory):
    """name -> (model, store, tokens, targets, adapter folder, its config): a LoRA on attention, Gated DeltaNet's
    projections and the experts, saved from a resident phantom model."""
    made = {}

    def get(name):
        if name not in made:
            model, store = family_models(name)
            tokens, targets = batch(2, 3)[0], batch(2, 3, seed=1)[0]
            adapter = tmp_path_factory.mktemp(name) / "adapter"
            phantom_step(store, tokens, targets, adapter, lora_targets=linear_lora(name), offload="none")
            config = json.loads((adapter / "adapter_config.json").read_text())
            made[name] = model, store, tokens, targets, adapter, config
        return made[name]
    return get


@pytest.mark.usefixtures("ram_streams")
@pytest.mark.parametrize("name", NAMES)
def test_lora_on_every_projection_and_the_experts_equals_peft(adapters, name):
    """Logits within 1e-5 of peft's, every A and B gradient within 1e-4, streamed from disk and RAM, experts read
    routed and whole (the adapter saved from a resident model); the adapter loads in peft with its module names
    (Qwen3.5's shared expert's linears too: peft adapts them by target_modules there; on Qwen3-Next gate_proj
    names the experts)."""
    model, store, tokens, targets, adapter, config = adapters(name)
    plain = ["down_proj", "gate_proj", "up_proj"] if name == "qwen3_5_moe" else []
    assert config["target_modules"] == sorted([*plain, "k_proj", "o_proj", "q_proj", "v_proj", *LINEAR_TARGETS[name]])
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    ref = peft_step(model, adapter, tokens, targets)
    for offload, prefetch, recompute, reads in (RUNS[2], RUNS[4]) if name == "qwen3_5_moe" else (RUNS[1], RUNS[3]):
        knobs = {} if offload == "none" else dict(expert_reads=reads, micro_batch=1 if reads == "routed" else None)
        got = phantom_step(store, tokens, targets, lora_targets=linear_lora(name), offload=offload, prefetch=prefetch,
                           recompute=recompute, **knobs)
        assert_equals_peft(got, ref, (offload, prefetch, recompute, reads), unhit=True)


@pytest.mark.parametrize("name", NAMES)
def test_the_merged_export_equals_peft_merge_and_unload(adapters, name, tmp_path):
    """Within 1e-5 of peft's merged model. (peft's merged and unmerged models differ by 1e-5 to 3e-5 here: a random
    LoRA on the delta rule's decay and write strength is ill-conditioned, so the merge is compared with the merge.)"""
    model, store, tokens, _, adapter, _ = adapters(name)
    merged_ref = peft.PeftModel.from_pretrained(make(name), adapter).merge_and_unload().eval()
    out = export(store, tmp_path / "hf", adapter, "hf", progress=False)
    merged = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(merged).__name__ == CASES[name].hf_class
    with torch.no_grad():
        want, base = merged_ref(tokens).logits, model(tokens).logits
        assert rel_err(merged(tokens).logits, want) < 1e-5 and rel_err(base, want) > 1e-3


def test_packed_rows_equal_their_examples_alone(family_models):
    """A row packing two examples (segment ids): the linear-attention state and the conv start afresh at the
    second, as transformers computes that example alone."""
    model, store = family_models("qwen3_5_moe")
    tokens = batch(1, 90)[0]
    segments = torch.tensor([[0] * 70 + [1] * 20])
    with phantom.load(store, offload="disk", prefetch=1, lora=None) as pm, torch.no_grad():
        packed = pm(tokens, segments=segments)
        first, second = model(tokens[:, :70]).logits, model(tokens[:, 70:]).logits
    assert rel_err(packed[:, :70], first) < 1e-5 and rel_err(packed[:, 70:], second) < 1e-5


def vlm_checkpoint(root: Path):
    """A tiny Qwen3_5MoeForConditionalGeneration (qwen35_vl), saved by transformers as its checkpoints are: text
    under model.language_model, the tower under model.visual."""
    model = qwen35_vl()
    model.save_pretrained(root / "hf", safe_serialization=True)
    return model


def qwen35_vl():
    """A tiny Qwen3_5MoeForConditionalGeneration: a two-block vision tower beside CASES' text model."""
    text = {k: v for k, v in CASES["qwen3_5_moe"].fields.items()}
    config = transformers.Qwen3_5MoeConfig(
        text_config={**text, "vocab_size": 400, "initializer_range": 0.1},
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                           patch_size=4, temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16))
    torch.manual_seed(0)
    return transformers.Qwen3_5MoeForConditionalGeneration(config).float().eval()


def test_a_vision_language_checkpoint_is_read_as_its_text_model(tmp_path, caplog):
    from test_export_hf import llama3_style_tokenizer_json
    from test_convert import load_script
    model = vlm_checkpoint(tmp_path)
    keys = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert keys["architectures"] == ["Qwen3_5MoeForConditionalGeneration"] and "text_config" in keys
    llama3_style_tokenizer_json(tmp_path / "hf")
    with caplog.at_level("INFO"):
        assert load_script("prepare_model").main(["--src", str(tmp_path / "hf"), "--out", str(tmp_path / "store"),
                                                  "--quiet"]) == 0
    assert any("vision tower is left out" in r.getMessage() for r in caplog.records)
    tokens, _ = batch()
    with phantom.load(tmp_path / "store", offload="disk", prefetch=1, lora=None) as pm, torch.no_grad():
        assert rel_err(pm(tokens), model(input_ids=tokens).logits) < 1e-5


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5_moe"])
def test_generation_past_a_chunk_equals_transformers_generate(family_models, name):
    """The conv and recurrent states are the cache of a Gated DeltaNet layer: a 70-token prompt (its prefill
    past the delta rule's chunk of 64) and a 3-token one, left-padded in one batch, then token by token."""
    from phantom.model.generate import Request, generate_many
    model, store = family_models(name)
    gen = torch.Generator().manual_seed(5)
    ps = [torch.randint(0, 400, (n,), generator=gen).tolist() for n in (70, 3)]
    with torch.no_grad():
        want = [model.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(p):].tolist() for p in ps]
    with phantom.load(store, offload="disk", prefetch=1, lora=None) as pm:
        assert [c.ids for c in generate_many(pm, [Request(p, 8) for p in ps])] == want


PRESET_FILES = [("qwen3.5-35b-a3b", "qwen3.5-35B-A3B"), ("qwen3.5-122b-a10b", "qwen3.5-122B-A10B"),
                ("qwen3.5-397b-a17b", "qwen3.5-397B-A17B"), ("qwen3-next-80b-a3b", "qwen3-next-80B-A3B")]


@pytest.mark.parametrize("file,preset", PRESET_FILES)
def test_the_presets_are_the_config_files_read_with_transformers_parameter_counts(file, preset):
    """The preset is config.json read; its parameters are transformers' text model's, built on the meta device
    (a vision-language file's text_config: the vision tower is not phantom's)."""
    c = json.loads((DATA / f"{file}.config.json").read_text())
    assert config_from_hf(c) == PRESETS[preset]
    if "text_config" in c:
        hf_config, cls = transformers.Qwen3_5MoeTextConfig(**c["text_config"]), transformers.Qwen3_5MoeForCausalLM
    else:
        hf_config, cls = transformers.Qwen3NextConfig(**c), transformers.Qwen3NextForCausalLM
    with torch.device("meta"):
        count = sum(p.numel() for p in cls(hf_config).parameters())
    assert PRESETS[preset].n_params() == count


@pytest.mark.parametrize("change,named", [
    (dict(mlp_only_layers=[1]), "linear_attention layers need"), (dict(attn_output_gate=False), "attn_output_gate="),
    (dict(layer_types=["linear_attention"]), "layer_types="), (dict(attention_dropout=0.1), "attention_dropout="),
    (dict(hidden_act="gelu_new"), "hidden_act="),
])
def test_what_is_not_modelled_is_refused_naming_the_field(change, named):
    c = {**json.loads((DATA / "qwen3-next-80b-a3b.config.json").read_text()), **change}
    with pytest.raises(ConfigError, match=named):
        config_from_hf(c)


def test_a_full_step_of_a_long_row_trains_the_decay_as_transformers_does(family_models):
    """The gradients of A_log, dt_bias and the conv (full finetuning's) over 150 tokens equal transformers' within
    3e-4 (measured 0.5e-4 to 1.3e-4; the full-attention layer's o_proj above it differs by 2e-4 too: rounding in
    the gradient reaching the layers, not the delta rule, whose chunked and per-token forms in transformers
    differ by 2e-5 on these)."""
    model, store = family_models("qwen3_next")
    tokens, targets = batch(1, 150)
    ref = make("qwen3_next")
    cross_entropy(ref(tokens).logits, targets).backward()
    want = {n: p.grad for n, p in ref.named_parameters() if "linear_attn" in n and "proj" not in n}
    with phantom.load(store, mode="full", offload="none") as pm:
        pm(tokens, targets=targets).backward()
        got = {n: p.grad for n, p in pm.layers[0].named_parameters()}
    for name, g in want.items():
        ours = got["attention." + name.split("linear_attn.")[1]]
        assert rel_err(ours, g) < 3e-4, name


def test_tune_plans_the_presets(tmp_path, monkeypatch, capsys):
    """scripts/tune.py --preset plans Qwen3.5-35B-A3B and Qwen3-Next-80B-A3B (one small measured profile, 256 GiB of
    host memory): every block placed, the step's compute counting the delta rule's FLOPs beside attention's."""
    import dataclasses
    from phantom.arch.config import ModelConfig
    from phantom.arch.deltanet import mixer_flops
    from phantom.plan import costinputs as ci
    from phantom.plan import profiles
    from test_tune import script
    small = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, multiple_of=16, max_seq_len=64)
    probed = profiles.probe(small, "cpu", ci.Workload(1, 16, "fp32", "bf16"), tmp_path, quick=True)
    profile = dataclasses.replace(probed, free_device_bytes=None, free_host_bytes=256 << 30)
    monkeypatch.setattr(profiles, "probe", lambda *a, **k: profile)  # no 35B-shaped blocks written to measure
    for name in ("qwen3.5-35B-A3B", "qwen3-next-80B-A3B"):
        argv = ["--preset", name, "--device", "cpu", "--batch-size", "1", "--seq-len", "1024", "--json",
                "--ram-budget", "64GiB", "--disk-budget", "1TB"]
        assert script().main(argv) == 0
        plan = json.loads(capsys.readouterr().out)
        assert len(plan["tiers"]) == PRESETS[name].n_layers and plan["step_s"] > 0
    cfg = PRESETS["qwen3.5-35B-A3B"]  # a quarter of the layers pay T^2: three quarters a constant per token
    assert mixer_flops(cfg, 8192) - mixer_flops(cfg, 1024) == pytest.approx(0.25 * 2 * (8192 - 1024) * cfg.q_dim)


@pytest.mark.parametrize("method", ["nf4", "int8"])
def test_quantized_stores_stream_as_transformers_computes_their_dequantized_weights(family_models, method, tmp_path):
    """NF4 and int8 copies (Gated DeltaNet's projections quantized; its conv, decay and norms, the routers 16-bit)
    from disk and RAM equal transformers on the weights they dequantize to (their --format hf export)."""
    from family_check import check_quantized
    _, store = family_models("qwen3_5_moe" if method == "nf4" else "qwen3_next")
    check_quantized(store, tmp_path, method)
