"""config.json fields: each is modelled, refused when set, or irrelevant to the maths (with why).

Every field of each supported family's transformers config class must be in one of the three lists,
so a field a new transformers release adds fails here until someone decides what it means. Fields
phantom used to ignore (Llama's attention_bias, mlp_bias, hidden_act; Mistral's sliding_window) are
now modelled; what is not (another rope type, an MoE, dropout on attention) is one `error:` line
naming the field, exit 2, and no store.
"""
from __future__ import annotations

import json
import math

import pytest
import torch

from phantom.arch.family import FAMILIES, IRRELEVANT, REFUSED_WHEN_SET, ConfigError, config_from_hf
from family_check import CASES, SHAPES, hf_model, prepare, synthetic_preset_loss, transformers
from test_convert import load_script

CONFIG_CLASSES = {case.facts["family"]: case.config_class for case in CASES.values()}  # family -> config class
CONFIG_CLASSES_TO_ARCH = {case.config_class: case.hf_class for case in CASES.values()}


def test_every_family_has_its_config_class_listed():
    """...and a tiny model in the shared checks against transformers (family_check.CASES, tests/test_families.py)."""
    assert set(CONFIG_CLASSES) == set(FAMILIES)


@pytest.mark.parametrize("name", list(CONFIG_CLASSES))
def test_a_fused_tensor_is_one_lora_module_named_as_peft_names_it(name):
    """Each module peft_modules derives from the family's table is a LoRA target or group phantom knows."""
    from phantom.arch.config import ModelConfig
    from phantom.model.lora import GROUPS, PROJECTIONS, peft_modules
    modules = peft_modules(ModelConfig(dim=64, n_layers=1, n_heads=4, vocab_size=10, family=name))
    assert sorted(t for _, parts in modules.values() for t in parts) == sorted(PROJECTIONS)  # each target once
    for short, (module, parts) in modules.items():
        assert parts == GROUPS.get(short, (short,)) and module.endswith(f"{short}_proj")


@pytest.mark.parametrize("name", list(CONFIG_CLASSES))
def test_every_config_field_is_modelled_refused_or_irrelevant(name):
    fam = FAMILIES[name]
    fields = set(getattr(transformers, CONFIG_CLASSES[name])().to_dict())
    known = fam.modelled() | set(REFUSED_WHEN_SET) | set(IRRELEVANT) | set(fam.irrelevant)
    assert not fields - known, f"{name}: fields nobody decided about: {sorted(fields - known)}"


@pytest.mark.parametrize("name", list(CONFIG_CLASSES))
def test_defaults_are_the_config_class_defaults(name):
    """A config.json that leaves a field out means transformers' default: phantom's must be the same."""
    default = getattr(transformers, CONFIG_CLASSES[name])().to_dict()
    for key, value in FAMILIES[name].defaults.items():
        assert default[key] == value, (name, key)


def small(config_class: str, **fields) -> dict:
    c = getattr(transformers, config_class)(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, vocab_size=100, **fields)
    d = c.to_dict()
    d["architectures"] = [CONFIG_CLASSES_TO_ARCH[config_class]]
    return d


REFUSALS = [  # (config class, fields, the field the error must name)
    ("LlamaConfig", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 8,
                                         "long_factor": [1.0] * 8}}, "rope_type"),
    ("LlamaConfig", {"hidden_act": "relu2"}, "hidden_act"),
    ("LlamaConfig", {"attention_dropout": 0.1}, "attention_dropout"),
    ("MistralConfig", {"num_local_experts": 8}, "num_local_experts"),
    ("Qwen2Config", {"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
    ("MistralConfig", {"mlp_bias": True}, "mlp_bias"),
    ("Qwen2Config", {"attention_bias": True}, "attention_bias"),
    ("Gemma2Config", {"hidden_activation": "relu"}, "hidden_activation"),
    ("Gemma3TextConfig", {"rope_parameters": {"full_attention": {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e6},
                                              "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
     "rope_type"),
    ("Gemma3TextConfig", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    # Phi3Config knows default and longrope alone; partial rotary is Phi-3's alone
    ("Phi3Config", {"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_type"),
    ("LlamaConfig", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.75}},
     "partial_rotary_factor"),
    ("Qwen2Config", {"partial_rotary_factor": 0.75}, "partial_rotary_factor"),
    ("Phi3Config", {"resid_pdrop": 0.1}, "resid_pdrop"),
    ("Phi3Config", {"attention_bias": True}, "attention_bias"),
    # mixtures of experts: jitter, clipped q/k/v (dense layers among sparse ones: tests/test_moe_dense.py)
    ("MixtralConfig", {"router_jitter_noise": 0.01}, "router_jitter_noise"),
    ("OlmoeConfig", {"clip_qkv": 8.0}, "clip_qkv"),
    ("OlmoeConfig", {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
]


@pytest.mark.parametrize("config_class,fields,named", REFUSALS, ids=[r[2] for r in REFUSALS])
def test_unmodelled_fields_are_refused_naming_the_field(config_class, fields, named):
    c = small(config_class)
    c.update(fields)
    with pytest.raises(ConfigError, match=named):
        config_from_hf(c)


def test_an_architecture_not_in_the_table_is_refused_with_the_supported_set():
    with pytest.raises(ConfigError, match=r"architectures.*GPT2LMHeadModel.*supported: LlamaForCausalLM"):
        config_from_hf({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})


def test_every_refused_field_is_refused():
    """Each entry of REFUSED_WHEN_SET refuses a value that would change the maths (no dead entries)."""
    bad = {"attention_dropout": 0.1, "is_encoder_decoder": True, "use_bidirectional_attention": True,
           "quantization_config": {"quant_method": "awq"}, "num_experts": 8, "num_local_experts": 8,
           "n_routed_experts": 8, "partial_rotary_factor": 0.5, "resid_pdrop": 0.1, "embd_pdrop": 0.1}
    assert set(bad) == set(REFUSED_WHEN_SET)
    for key, value in bad.items():
        with pytest.raises(ConfigError, match=key):
            config_from_hf({**small("LlamaConfig"), key: value})


def test_llama_fields_once_ignored_are_now_modelled():
    cfg = config_from_hf(small("LlamaConfig", attention_bias=True, mlp_bias=True, hidden_act="gelu", head_dim=32))
    assert (cfg.qkv_bias, cfg.o_bias, cfg.mlp_bias, cfg.activation, cfg.head_dim) == (True, True, True, "gelu", 32)
    cfg = config_from_hf(small("MistralConfig", sliding_window=16))
    assert [cfg.window(i) for i in range(2)] == [16, 16]

    cfg = config_from_hf(small("Phi3Config", sliding_window=2047))
    assert [cfg.window(i) for i in range(2)] == [2047, 2047] and cfg.rope_scaling is None
    # Phi-3-mini-128k's first config.json said "su"; Phi3Config reads it (and "yarn") as longrope, counting
    # from the top-level original_max_position_embeddings
    c = small("Phi3Config", max_position_embeddings=131072, original_max_position_embeddings=4096)
    c["rope_scaling"] = {"type": "su", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    s = config_from_hf(c).rope_scaling
    assert (s.rope_type, s.original_max_seq_len, s.long_factor) == ("longrope", 4096, (2.0,) * 8)
    assert s.attention_factor == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))


def test_refusal_through_prepare_model_is_one_error_line_exit_2(tmp_path, capsys):
    model = hf_model("LlamaConfig", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=2)
    model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 1e4}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    capsys.readouterr()  # save_pretrained's progress bar
    code = load_script("prepare_model").main(["--src", str(tmp_path / "hf"), "--out", str(tmp_path / "s"), "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and "rope_type" in err[0], err
    assert "'default', 'llama3'" in err[0]
    assert not (tmp_path / "s").exists()


# ---------------------------------------------------------------------------------------------
# Llama with the fields it used to ignore: equal to transformers' now

@pytest.fixture(scope="module")
def llama_extras(tmp_path_factory):
    model = hf_model("LlamaConfig", **SHAPES, attention_bias=True, mlp_bias=True, hidden_act="gelu")
    return model, prepare(model, tmp_path_factory.mktemp("llama_extras"))


def test_llama_biases_and_gelu_match_transformers(llama_extras, tmp_path):
    from family_check import batch, check_lora, check_logits
    model, store = llama_extras
    tokens, targets = batch()
    check_logits(model, store, tokens, targets, runs=[("disk", 0, "all"), ("ram", 2, "none")])
    check_lora(model, store, tmp_path, tokens, targets, runs=[("disk", 2, "none"), ("ram", 0, "all")])
    assert any(n.endswith("o_proj.bias") for n, _ in model.named_parameters())


def test_synthetic_stores_of_every_family_preset_shape_run(tmp_path):
    """--synthetic with a family preset's fields (cut to tiny widths): written, loaded, streamed, finite."""
    from phantom.arch.presets import PRESETS
    for name in ("qwen2.5-7B", "qwen3-8B", "llama3.2-1B", "gemma2-9B", "gemma3-27B", "phi4-14B", "phi3-mini-4k"):
        window = 8 if PRESETS[name].sliding_window else None
        loss = synthetic_preset_loss(name, tmp_path, n_layers=3, sliding_window=window)
        assert torch.isfinite(loss) and abs(loss.item() - math.log(97)) < 1.0, name
