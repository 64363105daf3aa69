"""GGUF export against llama.cpp's own converter and transformers' GGUF loader.

For tiny models of each family GGUF export covers (built with transformers, through prepare_model.py, with a
random LoRA adapter merged): `merge_lora.py --format gguf` must write the very file (same name, every byte:
metadata keys, values and order, tensor names, shapes, types, order and data) that llama.cpp's
convert_hf_to_gguf.py (pinned: conftest.llama_cpp) writes from `merge_lora.py --format hf` of the same
store and adapter; and transformers' GGUF loader must read it back with the merged HF export's logits
within the type's rounding; the adapter alone as a GGUF LoRA adapter must be the file llama.cpp's
convert_lora_to_gguf.py writes, and on the base GGUF give the merged one. Tokenizers: a sentencepiece model
trained here (Llama-2's settings), and the published Llama-3.1, Qwen3 and DeepSeek-V3 tokenizer.json files
(conftest.real_tokenizer), chat templates included. Every case is built first, then llama.cpp's converters
run on all of them in one process.
"""
from __future__ import annotations

import copy
import functools
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import phantom
from conftest import LLAMA_CPP, llama_cpp, max_rel_err, need, real_tokenizer
from family_check import CASES as FAMILY_CASES
from phantom.export.gguf_export import KEPT_F32
from phantom.data.tokenizer import TINY_TEXT
from test_convert import load_script
from test_export_hf import llama2_style_sentencepiece

transformers = need("transformers")
gguf = need("gguf")

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=64, initializer_range=0.1)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192, "rope_theta": 500000.0}
# Phi-3's LongRoPE (its factors written as extra tensors); short factors 1 and the context at the original one (no
# attention factor), over the whole head, as transformers' GGUF loader reads neither factor nor rope.dimension_count
PHI3_ROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
             "long_factor": [1.0 + i / 2 for i in range(8)], "original_max_position_embeddings": 64}
# latent attention (q and kv through low ranks) and DeepSeekMoE (a dense first layer, a shared expert, routed experts)
MLA = {"vocab_size": 129280, "num_key_value_heads": 4, "kv_lora_rank": 32, "qk_nope_head_dim": 32,
       "qk_rope_head_dim": 16, "v_head_dim": 32, "n_routed_experts": 8, "num_experts_per_tok": 2,
       "moe_intermediate_size": 64, "first_k_dense_replace": 1}
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "mscale": 0.7, "mscale_all_dim": 0.7, "beta_fast": 32.0, "beta_slow": 1.0}  # equal, as published (else refused)
# gpt-oss's YaRN at a context of 16, its ramp rounded out to whole dims as llama.cpp rounds it (the published configs'
# truncate false is exported with a warning: llama.cpp rotates some dims otherwise)
GPT_OSS_YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": True, "original_max_position_embeddings": 16}
LLAMA4_ROPE = {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 1.0,
               "original_max_position_embeddings": 16, "rope_theta": 500000.0}
CASES_LLAMA4 = {"hidden_size": 32, "head_dim": 32, "num_hidden_layers": 4, "vocab_size": 151936, "num_local_experts": 4,
                "num_experts_per_tok": 2, "intermediate_size": 64, "intermediate_size_mlp": 128,
                "interleave_moe_layer_step": 2, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
                "rope_parameters": LLAMA4_ROPE}
# Gated DeltaNet layers before a full-attention one (RoPE over a quarter of each head), 2 q/k heads serving 4 v
# heads, 4 experts and a shared one
NEW_SMALL = {"hidden_size": 32, "head_dim": 32}  # the newer families' cases: narrower, their vocabularies being large
LINEAR = {**NEW_SMALL, "vocab_size": 151936, "linear_key_head_dim": 32, "linear_value_head_dim": 32,
          "linear_num_key_heads": 2, "linear_num_value_heads": 4, "num_experts": 4, "num_experts_per_tok": 2,
          "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64,
          "layer_types": ["linear_attention", "full_attention"]}
# DeepSeek Sparse Attention: tests/family_check.py's tiny DeepSeek-V3.2 and GLM-5 (latent attention, DeepSeekMoE and the
# lightning indexer; GLM-5's layers 1 and 3 reusing the indexer before them), V3.2 with YaRN as published (mscale equal
# to mscale_all_dim), GLM-5 without (llama.cpp's glm-dsa reads no mscale_all_dim); indexer heads 64 wide (llama.cpp
# turns them by a Hadamard matrix of 64 dims or more); attention heads narrower than q8_0's blocks
DSA = {name: {**{k: v for k, v in FAMILY_CASES[name].fields.items() if k != "rope_parameters"}, "index_head_dim": 64}
       for name in ("deepseek_v32", "glm_moe_dsa")}
# name: (transformers config class, its fields, tokenizer, store dtype, outtypes compared with the converter)
CASES = {
    "llama": ("LlamaConfig", {}, "sentencepiece", "fp32", ("f32", "f16", "bf16", "q8_0")),
    "llama3": ("LlamaConfig", {"rope_parameters": LLAMA3_ROPE, "vocab_size": 128256}, "llama3_1", "bf16", ("q8_0",)),
    "mistral": ("MistralConfig", {"sliding_window": None, "head_dim": 32}, "sentencepiece", "fp32", ("f16",)),
    "qwen2": ("Qwen2Config", {}, "sentencepiece", "bf16", ("bf16",)),  # Qwen2Model reads a tokenizer.model first
    "qwen3": ("Qwen3Config", {"vocab_size": 151936, "head_dim": 128, "tie_word_embeddings": True}, "qwen3", "bf16",
              ("q8_0",)),
    "qwen3_moe": ("Qwen3MoeConfig", {"vocab_size": 151936, "head_dim": 128, "num_experts": 4, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 768, "norm_topk_prob": True}, "qwen3", "bf16", ("q8_0",)),
    "qwen2_moe": ("Qwen2MoeConfig", {"vocab_size": 151936, "num_experts": 4, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632},
                  "qwen3", "bf16", ("bf16",)),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None},
                "sentencepiece", "bf16", ("q8_0",)),
    "olmoe": ("OlmoeConfig", {"vocab_size": 151936, "num_experts": 4, "num_experts_per_tok": 2, "num_key_value_heads": 4},
              "qwen3", "bf16", ("bf16",)),  # llama.cpp's olmoe has no grouped-query attention
    "gemma2": ("Gemma2Config", {"sliding_window": 8,
                                "tie_word_embeddings": True}, "sentencepiece", "bf16", ("f16",)),
    # six layers: five sliding (RoPE base 10000), then a full one (base 1e6), llama.cpp's fixed pattern
    "gemma3": ("Gemma3TextConfig", {"sliding_window": 8, "num_hidden_layers": 6,
                                    "tie_word_embeddings": True}, "sentencepiece", "bf16", ("q8_0",)),
    "deepseek_v3": ("DeepseekV3Config", {**MLA, "q_lora_rank": 32, "n_group": 4, "topk_group": 2, "n_shared_experts": 1,
                                         "routed_scaling_factor": 2.5, "rope_parameters": YARN}, "deepseek_v3", "bf16",
                    ("q8_0",)),
    "deepseek_v2": ("DeepseekV2Config", {**MLA, "q_lora_rank": 32, "n_shared_experts": 2, "routed_scaling_factor": 1.5},
                    "deepseek_v3", "bf16", ("bf16",)),
    # DeepSeek-V3.2: 16 indexer heads (with family_check's 4, the ReLU zeroes every head's score of some keys, and keys
    # tied at 0 straddle the top-16 at two queries of the 40-token prompt, where torch.topk and ggml_top_k pick
    # different ones); YaRN with mscale and mscale_all_dim 1, as published (llama.cpp takes mscale as 1 for deepseek32)
    "deepseek_v32": ("DeepseekV32Config", {**DSA["deepseek_v32"], "index_n_heads": 16, "vocab_size": 129280,
                                           "rope_parameters": {**YARN, "mscale": 1.0, "mscale_all_dim": 1.0}},
                     "deepseek_v3", "bf16", ("bf16",)),
    # (no bos_token_id, as GLM-4.5's config class: the converter takes [gMASK] as BOS where config.json names none)
    "glm_moe_dsa": ("GlmMoeDsaConfig", {**DSA["glm_moe_dsa"], "vocab_size": 151936, "bos_token_id": None}, "glm", "bf16",
                    ("f16",)),
    "phi3": ("Phi3Config", {"pad_token_id": None, "bos_token_id": 1, "eos_token_id": 2,
                            "original_max_position_embeddings": 64, "rope_parameters": PHI3_ROPE}, "sentencepiece", "fp32", ("bf16",)),
    # Phi-4: Phi-3's layout with a GPT2Tokenizer's byte-level BPE (Qwen3's here, a cl100k-style one as Phi-4's own);
    # RoPE over 3/4 of each head (Phi-4-mini's rope.dimension_count)
    "phi4": ("Phi3Config", {"hidden_size": 32, "pad_token_id": None, "vocab_size": 151936,
                            "partial_rotary_factor": 0.75}, "phi4", "bf16", ("bf16",)),
    # GLM-4.5: q/k/v biases, q/k norms, RoPE over half of each head, a dense first layer, sigmoid routing with a
    # correction bias, a shared expert
    "glm4_moe": ("Glm4MoeConfig", {**NEW_SMALL, "vocab_size": 151936, "attention_bias": True, "use_qk_norm": True,
                                   "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                   "n_shared_experts": 1, "first_k_dense_replace": 1, "routed_scaling_factor": 2.5},
                 "glm", "bf16", ("q8_0",)),
    # gpt-oss: sinks, a window on the even layers, biases everywhere, experts as (experts, in, out) with gate and up
    # alternating, YaRN
    "gpt_oss": ("GptOssConfig", {**NEW_SMALL, "vocab_size": 201088, "num_local_experts": 4, "num_experts_per_tok": 2,
                                 "sliding_window": 8, "rope_parameters": GPT_OSS_YARN}, "gptoss", "bf16", ("q8_0",)),
    # MiniMax-M2: q/k RMSNorms over the whole projections, RoPE over half of each head (rotary_dim, the Hub's field),
    # sigmoid routing with a correction bias, renormalized; Mixtral's expert names
    "minimax_m2": ("MiniMaxM2Config", {**NEW_SMALL, "vocab_size": 151936, "num_local_experts": 4,
                                       "num_experts_per_tok": 2, "rotary_dim": 16, "bos_token_id": 1, "eos_token_id": 2},
                   "qwen3", "bf16", ("f16",)),
    # Llama 4 as llama.cpp's llama4 fixes it: 3 RoPE layers chunked by 8192 with q/k L2 norms, then a RoPE-less one
    # with the attention temperature (attn_scale 0.1, floor_scale 8192); every 2nd layer sparse (sigmoid of the top-k
    # logits on the experts' input, a shared expert); Llama-3.1's RoPE scaling as Scout's (low and high factors equal)
    "llama4": ("Llama4TextConfig", CASES_LLAMA4, "qwen3", "bf16", ("q8_0",)),
    "llama4_vl": ("Llama4Config", CASES_LLAMA4, "qwen3", "bf16", ("q8_0",)),  # the same text model under a vision tower
    # Kimi-K2.5: the deepseek_v3 case's text model inside Kimi_K25ForConditionalGeneration with a vision tower, under
    # the Hub's names, class name and text_config fields (vision_language_source)
    "kimi_k25": ("Kimi_K25Config", {**MLA, "q_lora_rank": 32, "n_group": 4, "topk_group": 2, "n_shared_experts": 1,
                                    "routed_scaling_factor": 2.5, "rope_parameters": YARN}, "deepseek_v3", "bf16",
                 ("q8_0",)),
    "qwen3_next": ("Qwen3NextConfig", {**LINEAR, "intermediate_size": 128}, "qwen3", "bf16", ("f16",)),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", LINEAR, "qwen3", "bf16", ("bf16",)),
}
# transformers' GGUF loader takes qwen3's head_dim from Qwen3Config's default (128), not the file's key_length,
# so that case has Qwen3's own 128 (qwen3_moe too; and the MoE cases have their config classes' default expert
# widths, which it takes instead of the file's expert_feed_forward_length); it reads no rope_freqs (Llama-3.1's scaling), so the llama3 case is not
# loaded with it (its file, rope_freqs included, is compared byte for byte with the converter's).
LORA_OUTTYPES = {"llama": "f32", "qwen3": "q8_0", "gemma2": "f16"}  # cases whose adapter is also written as a GGUF LoRA adapter
TOLERANCE = {"f32": 1e-5, "f16": 2e-2, "bf16": 1e-1, "q8_0": 1e-1}  # logits against unrounded weights, max |a - b| / max |b|


TOKENIZER_FILES = {"phi4": "qwen3", "glm": "qwen3"}  # cases' tokenizers made from a real one
GLM_TOKENS = ("[gMASK]", "<|user|>", "<|observation|>")  # GLM's own, beside <|endoftext|>


# Phi-3's added tokens after its sentencepiece pieces (32000 + i there), all special, its vocabulary padded by 64:
# llama.cpp's vocabulary loader looks up <|endoftext|> (with </s>, <unk>, <s>) in a model named Phi-3
PHI3_ADDED = ("<|endoftext|>", "<|assistant|>", "<|placeholder1|>", "<|placeholder2|>", "<|placeholder3|>",
              "<|placeholder4|>", "<|system|>", "<|end|>", "<|placeholder5|>", "<|placeholder6|>", "<|user|>")


def phi3_added_tokens(folder: Path, pieces: int) -> int:
    """tokenizer_config.json with Phi-3's added tokens after tokenizer.model's pieces; the padded vocabulary."""
    decoder = {str(pieces + i): {"content": text, "lstrip": False, "normalized": False, "rstrip": i > 0,
                                 "single_word": False, "special": True} for i, text in enumerate(PHI3_ADDED)}
    config = {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
              "add_bos_token": True, "add_eos_token": False, "added_tokens_decoder": decoder}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return pieces + 64


def source_folder(folder: Path, name: str) -> int:
    """The tokenizer files of a case in folder; its vocabulary size."""
    kind = CASES[name][2]
    if kind == "sentencepiece" and name == "phi3":
        return phi3_added_tokens(folder, llama2_style_sentencepiece(folder))
    if kind == "sentencepiece":
        return llama2_style_sentencepiece(folder)
    real = real_tokenizer(TOKENIZER_FILES.get(kind, kind))
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (real / f).is_file():
            shutil.copy(real / f, folder / f)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    if kind == "phi4":  # Phi-4's tokenizer_config.json names GPT2Tokenizer, which the converter reads as BPE
        config["tokenizer_class"] = "GPT2Tokenizer"
    if kind == "glm":  # the special tokens the converter's GLM vocabulary looks up, after Qwen3's
        spec = json.loads((folder / "tokenizer.json").read_text())
        first = max(t["id"] for t in spec["added_tokens"]) + 1
        added = [{"id": first + i, "content": text, "single_word": False, "lstrip": False, "rstrip": False,
                  "normalized": False, "special": True} for i, text in enumerate(GLM_TOKENS)]
        spec["added_tokens"] += added
        config["added_tokens_decoder"].update({str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in added})
        (folder / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))
    (folder / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False))
    return len(json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"])


# vision-language config class: (its text model's config class, the text_config fields the Hub's files have beyond
# what save_pretrained writes, the Hub's class name, a one-layer vision tower's config, the class's other fields)
KIMI_VISION = dict(num_hidden_layers=1, hidden_size=32, intermediate_size=48, num_attention_heads=2, patch_size=4,
                   pos_emb_height=4, pos_emb_width=4)
LLAMA4_VISION = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=28,
                     patch_size=14, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32)
VISION_LANGUAGE = {"Kimi_K25Config": ("DeepseekV3Config", {"model_type": "kimi_k2", "scoring_func": "sigmoid",
                                                           "topk_method": "noaux_tc"}, "KimiK25ForConditionalGeneration",
                                      KIMI_VISION, {"projection_hidden_size": 32}),
                   "Llama4Config": ("Llama4TextConfig", {}, "Llama4ForConditionalGeneration", LLAMA4_VISION, {})}


def vision_language_source(src: Path, config_class: str, text_fields: dict) -> None:
    """A tiny vision-language checkpoint in src as the Hub ships it (Kimi-K2.5's: its layers named
    language_model.model.layers.N, its published class name and text_config fields), a one-layer vision tower
    beside the text model."""
    from test_deepseek import published_names
    text_class, published, hub_class, vision, other = VISION_LANGUAGE[config_class]
    text = {**getattr(transformers, text_class)(**text_fields).to_dict(), **published}
    config = getattr(transformers, config_class)(text_config=text, vision_config=vision, tie_word_embeddings=False,
                                                 **other)
    transformers.AutoModelForImageTextToText.from_config(config).save_pretrained(src)
    if config_class == "Kimi_K25Config":  # save_pretrained writes Kimi's layers as blocks.N
        published_names(src)
    written = json.loads((src / "config.json").read_text())
    written["architectures"] = [hub_class]
    written["text_config"].update(published)
    (src / "config.json").write_text(json.dumps(written, indent=2))


def text_config(folder: Path) -> dict:
    """A checkpoint's config.json, or its text model's (text_config) where it is a vision-language one."""
    config = json.loads((folder / "config.json").read_text())
    return config.get("text_config", config)


def causal_lm(folder: Path, **kwargs):
    """transformers' model of a checkpoint, its vision-language class where it is one (logits of input_ids alone)."""
    auto = transformers.AutoModelForImageTextToText if "text_config" in json.loads((folder / "config.json").read_text()) \
        else transformers.AutoModelForCausalLM
    return auto.from_pretrained(folder, dtype=torch.float32, **kwargs).eval()


def build(root: Path, name: str) -> tuple[Path, Path, Path]:
    """(store, adapter, merged HF export) of a case: a random tiny model and a random LoRA adapter."""
    config_class, fields, _, dtype, _ = CASES[name]
    src = root / "hf"
    src.mkdir()
    vocab = source_folder(src, name)
    torch.manual_seed(0)
    if config_class in VISION_LANGUAGE:
        vision_language_source(src, config_class, {**SMALL, "vocab_size": vocab, "tie_word_embeddings": False, **fields})
    else:
        config = getattr(transformers, config_class)(**{**SMALL, "vocab_size": vocab, "tie_word_embeddings": False,
                                                        **fields})
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(src)
    store = root / f"tiny-{name}"  # the GGUF's general.name comes from this folder's name, the HF export's from its own
    assert load_script("prepare_model").main(["--src", str(src), "--out", str(store), "--dtype", dtype,
                                              "--quiet"]) == 0
    lora = phantom.LoraConfig(rank=4, alpha=8, targets=("q", "k", "v", "o", "gate", "up", "down"))
    with phantom.load(store, offload="none", lora=lora) as model, torch.no_grad():
        gen = torch.Generator().manual_seed(1)
        for p in model.trainable_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
        model.save_adapter(root / "adapter")
    merged = root / "merged" / store.name
    assert load_script("merge_lora").main(["--model", str(store), "--adapter", str(root / "adapter"), "--out",
                                           str(merged), "--format", "hf", "--quiet"]) == 0
    return store, root / "adapter", merged


# All conversions run in one process (DRIVER: the converters' imports, torch and transformers, made once).
# The pinned converter is written for transformers 4.57.6 (its requirements), and two of its readings differ under
# transformers 5, which each run emulates where its case needs it (its first element: what it emulates):
# "config": it reads config.json through AutoConfig(...).to_dict(), whose dict in 4.57.6 keeps rope_scaling as
# written; transformers 5's moves it into rope_parameters, where Phi3MiniModel does not look, and LongRoPE's factors
# would be lost. So the phi3 cases' converter reads config.json as it is (what 4.57.6's to_dict gives for these fields).
# "bos": DeepseekV32Model asserts the tokenizer's add_bos_token, which 4.57.6's LlamaTokenizerFast (DeepSeek's
# tokenizer_class) reads from tokenizer_config.json; transformers 5 loads a byte-level tokenizer.json as its
# TokenizersBackend, which drops that key (add_bos_token false), so the assertion is given the file's value (the
# tokenizer encodes as before: its pre-tokenizer is hashed as in the deepseek_v3 case).
DRIVER = """import json, runpy, sys
from pathlib import Path
folder = Path(sys.argv[1])
sys.path[:0] = [str(folder), str(folder / "gguf-py")]
import conversion.base as base
import transformers
by_transformers = base.ModelBase.__dict__["load_hparams"]
as_written = staticmethod(lambda d, is_mistral_format=False: json.loads((Path(d) / "config.json").read_text()))
auto_tokenizer = transformers.AutoTokenizer.from_pretrained

def with_configs_bos(d, *args, **kwargs):
    tokenizer = auto_tokenizer(d, *args, **kwargs)
    add_bos = json.loads((Path(d) / "tokenizer_config.json").read_text()).get("add_bos_token", False)
    object.__setattr__(tokenizer, "_add_bos_token", add_bos)  # the attribute alone (its setter remakes the post-processor)
    return tokenizer

for emulated, script, *args in json.loads(sys.argv[2]):
    base.ModelBase.load_hparams = as_written if "config" in emulated else by_transformers
    transformers.AutoTokenizer.from_pretrained = with_configs_bos if "bos" in emulated else auto_tokenizer
    sys.argv = [str(folder / script), *args]
    print("+", *sys.argv, flush=True)
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as e:
        if e.code:
            raise
"""
# checkpoints without their multi-token-prediction layers (transformers and phantom leave them out), which the
# converter's Qwen3-Next and Qwen3.5 classes count in unless told --no-mtp
NO_MTP = ("qwen3_next", "qwen3_5_moe")
CONFIG_AS_WRITTEN = ("phi3", "phi4")  # (transformers 5's to_dict also moves partial_rotary_factor into rope_parameters)
BOS_AS_WRITTEN = ("deepseek_v32",)


def conversions(name: str, merged: Path, out: Path, adapter: Path) -> dict[str, list]:
    """outtype -> the run of llama.cpp's convert_hf_to_gguf.py that writes merged's GGUF into out/outtype, and
    "lora" -> convert_lora_to_gguf.py's of the adapter (merged as --base) into out/lora, for DRIVER."""
    emulated = ["config"] * (name in CONFIG_AS_WRITTEN) + ["bos"] * (name in BOS_AS_WRITTEN)
    mtp = ["--no-mtp"] if name in NO_MTP else []
    runs = {t: [emulated, "convert_hf_to_gguf.py", str(merged), "--outtype", t, *mtp] for t in CASES[name][4]}
    if lora := LORA_OUTTYPES.get(name):
        runs["lora"] = [[], "convert_lora_to_gguf.py", "--base", str(merged), "--outtype", lora, str(adapter)]
    for key, run in runs.items():
        (out / key).mkdir(parents=True)
        run += ["--outfile", str(out / key)]
    return runs


def convert(runs: list[list]) -> None:
    """The runs (conversions' values), one after another in one process."""
    p = subprocess.run([sys.executable, "-c", DRIVER, str(llama_cpp()), json.dumps(runs)], stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=1200)
    assert p.returncode == 0, f"llama.cpp's converters: exit {p.returncode}\n{p.stdout[-3000:]}"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """case(name) -> (store, adapter, merged HF export, {outtype or "lora": phantom's GGUF}, {the same: the
    converters' GGUF}); every case is built at the first call, and converted by llama.cpp in one process."""
    cases, runs = {}, []

    def case(name: str):
        if not cases:
            for n in CASES:
                root = tmp_path_factory.mktemp(n)
                store, adapter, merged = build(root, n)
                ours = {t: merge(store, adapter, root / "gguf" / t, "gguf", t) for t in CASES[n][4]}
                if lora := LORA_OUTTYPES.get(n):
                    ours["lora"] = merge(store, adapter, root / "gguf" / "lora", "gguf-lora", lora)
                theirs = conversions(n, merged, root / "llama.cpp", adapter)
                runs.extend(theirs.values())
                cases[n] = store, adapter, merged, ours, {key: root / "llama.cpp" / key for key in theirs}
            convert(runs)
        store, adapter, merged, ours, theirs = cases[name]
        return store, adapter, merged, ours, {key: next(folder.glob("*.gguf")) for key, folder in theirs.items()}
    return case


def merge(store: Path, adapter: Path | None, out: Path, fmt: str, outtype: str) -> Path:
    """The file `merge_lora.py --format fmt --outtype outtype` writes into out."""
    args = ["--model", str(store), "--out", str(out), "--format", fmt, "--outtype", outtype, "--quiet"]
    assert load_script("merge_lora").main(args + (["--adapter", str(adapter)] if adapter else [])) == 0
    return next(out.glob("*.gguf"))


@functools.lru_cache(maxsize=None)
def read(path: Path):
    """A GGUF file's reader, made once per file (a 150k-token vocabulary takes seconds to parse)."""
    return gguf.GGUFReader(path)


SCALARS = {"UINT8": "B", "INT8": "b", "UINT16": "H", "INT16": "h", "UINT32": "I", "INT32": "i", "FLOAT32": "f",
           "BOOL": "?", "UINT64": "Q", "INT64": "q", "FLOAT64": "d"}  # gguf's value types, as struct reads them


@functools.lru_cache(maxsize=None)
def header(path: Path) -> tuple[dict, list[tuple[str, list[int], str]]]:
    """A GGUF file's metadata ({key: value; an array: its length}) and tensor infos ([(name, shape, type)]),
    read by walking the header (GGUF v3) without building gguf's reader fields: its GGUFReader takes 8 s on a
    Qwen3 vocabulary, 16 s on o200k's (a field part per token and merge); this walk about a tenth of a second."""
    import struct
    data = memoryview(path.read_bytes())
    types = {t.value: t.name for t in gguf.GGUFValueType}
    magic, version, n_tensors, n_kv = struct.unpack_from("<4sIQQ", data, 0)
    assert (magic, version) == (b"GGUF", 3), (magic, version)
    at = 24

    def take(fmt: str):
        nonlocal at
        (value,) = struct.unpack_from("<" + fmt, data, at)
        at += struct.calcsize(fmt)
        return value

    def string() -> str:
        nonlocal at
        n = take("Q")
        at += n
        return bytes(data[at - n:at]).decode("utf-8")

    def value(kind: str):
        nonlocal at
        if kind == "STRING":
            return string()
        if kind != "ARRAY":
            return take(SCALARS[kind])
        item, count = types[take("I")], take("Q")
        if item in SCALARS:
            at += count * struct.calcsize(SCALARS[item])
        else:
            for _ in range(count):
                value(item)
        return count
    fields = {}
    for _ in range(n_kv):
        key = string()
        fields[key] = value(types[take("I")])
    tensors = []
    for _ in range(n_tensors):
        name = string()
        shape = [take("Q") for _ in range(take("I"))]
        tensors.append((name, shape, gguf.GGMLQuantizationType(take("I")).name))
        take("Q")  # the data's offset
    return fields, tensors


def differences(a: Path, b: Path) -> list[str]:
    """What differs between two GGUF files, key by key and tensor by tensor (for an assertion's message)."""
    ra, rb = gguf.GGUFReader(a), gguf.GGUFReader(b)
    out = []
    if list(ra.fields) != list(rb.fields):
        out.append(f"keys only in {a.name}: {set(ra.fields) - set(rb.fields)}, only in the other: "
                   f"{set(rb.fields) - set(ra.fields)}, order: {list(ra.fields) == list(rb.fields)}")
    out += [f"{k}: {str(f.contents())[:120]} != {str(rb.fields[k].contents())[:120]}"
            for k, f in ra.fields.items() if k in rb.fields and (f.types, f.contents()) != (rb.fields[k].types,
                                                                                         rb.fields[k].contents())]
    ta = [(t.name, t.shape.tolist(), t.tensor_type.name) for t in ra.tensors]
    tb = [(t.name, t.shape.tolist(), t.tensor_type.name) for t in rb.tensors]
    if ta != tb:
        out.append(f"tensors: {ta} != {tb}")
    out += [f"{x.name}: other bytes" for x, y in zip(ra.tensors, rb.tensors) if bytes(x.data.data) != bytes(y.data.data)]
    return out or ["the same keys and tensors, other bytes (padding or alignment)"]


@pytest.mark.parametrize("name", list(CASES))
def test_gguf_equals_llama_cpp_converter_output(built, name):
    _, _, _, ours, theirs = built(name)
    for t in CASES[name][4]:
        assert ours[t].name == theirs[t].name, (name, t)
        assert ours[t].read_bytes() == theirs[t].read_bytes(), (name, t, differences(ours[t], theirs[t])[:8])
        fields, tensors = header(ours[t])
        assert fields["general.file_type"] == {"f32": 0, "f16": 1, "q8_0": 7, "bf16": 32}[t]
        if t != "f32":  # the matrices (experts' stacks included) are in the file's type; routers and convolutions f32
            assert {kind.lower() for tname, shape, kind in tensors if len(shape) >= 2 and tname.endswith(".weight")
                    and not tname.endswith(KEPT_F32)} == {t}
            assert {kind for tname, _, kind in tensors if tname.endswith(KEPT_F32)} <= {"F32"}


def test_gguf_written_a_few_rows_at_a_time_is_the_same_file(built, tmp_path, monkeypatch):
    """Tensors are converted in slices of rows (a large embedding is never copied whole): the same bytes."""
    from phantom.export import gguf_export
    store, adapter, _, _, theirs = built("llama")
    monkeypatch.setattr(gguf_export, "CHUNK_BYTES", 1000)  # 3 rows of 64 (attention) or 128 (down) columns
    for t in ("q8_0", "bf16"):
        assert merge(store, adapter, tmp_path / t, "gguf", t).read_bytes() == theirs[t].read_bytes(), t


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # gguf's own f16 cast of huge floats: inf
def test_float_bytes_are_gguf_quantizers_on_every_kind_of_value():
    """encode (torch's bf16 rounding where there is no NaN, a tensor of the file's type as it is) gives gguf's
    quantizers' bytes from float32, as the converter makes them: ties to even, ties that carry into the exponent,
    the largest floats rounding to inf, subnormals, infinities, signed zeros, NaNs of any payload."""
    from phantom.export.gguf_export import T, encode
    gen = torch.Generator().manual_seed(0)
    bits = torch.randint(-2**31, 2**31 - 1, (4096,), generator=gen, dtype=torch.int64).to(torch.int32)
    special = torch.tensor([0x3F808000, 0x3F818000, 0x3F80FFFF, 0x7F7FFFFF, 0x7F7F8000, 0x00000001, 0x80008000,
                            0x7F800000, 0xFF800000, 0x00000000, 0x80000000], dtype=torch.int64).to(torch.int32)
    for values in (torch.cat([bits, special]).view(torch.float32), torch.randn(64, 32, generator=gen)):
        for block in (values, values[~torch.isnan(values)]):  # with NaNs (gguf's path) and without (torch's)
            for source in (torch.float32, torch.bfloat16, torch.float16):  # as the merged weights may be
                x = block.to(source)
                for qtype in (T.BF16, T.F16, T.F32):
                    want = gguf.quants.quantize(x.to(torch.float32).numpy(), qtype).tobytes()
                    assert encode(x, qtype) == want, (source, qtype)


@pytest.mark.parametrize("name", list(CASES))
def test_gguf_carries_the_tokenizer_and_chat_template(built, name):
    _, _, merged, ours, _ = built(name)
    fields = header(ours[CASES[name][4][0]])[0]
    assert fields["tokenizer.ggml.tokens"] == text_config(merged)["vocab_size"]
    kind = CASES[name][2]
    assert fields["tokenizer.ggml.model"] == ("llama" if kind == "sentencepiece" else "gpt2")
    # DeepSeek-V3's tokenizer hashes as JoyAI-LLM's (its probe ids with the BOS its post-processor adds), as in the
    # converter; llama.cpp splits "joyai-llm" with DeepSeek-V3's regex (llama-vocab.cpp)
    assert fields["tokenizer.ggml.pre"] == {"sentencepiece": "default", "llama3_1": "llama-bpe", "qwen3": "qwen2",
                                            "glm": "qwen2", "deepseek_v3": "joyai-llm", "gptoss": "gpt-4o",
                                            "phi4": "qwen2"}[kind]
    template = json.loads((merged / "tokenizer_config.json").read_text()).get("chat_template")
    if (merged / "chat_template.jinja").is_file():
        template = (merged / "chat_template.jinja").read_text()
    assert fields.get("tokenizer.chat_template") == template
    if kind != "sentencepiece":
        assert template and "tokenizer.ggml.merges" in fields
    if kind == "glm":  # GLM's special ids, from its added tokens
        added = {t["content"]: t["id"] for t in json.loads((merged / "tokenizer.json").read_text())["added_tokens"]}
        assert [fields[f"tokenizer.ggml.{k}_token_id"] for k in ("bos", "eot", "unknown", "eom")] == \
            [added[t] for t in ("[gMASK]", "<|user|>", "<|endoftext|>", "<|observation|>")]


def rounded_through(model, outtype: str):
    """model with each matrix rounded through the GGUF type (gguf's quantize, then dequantize), as the file
    holds it; vectors (norms, biases) and routers stay f32, as in the file."""
    qtype = gguf.GGMLQuantizationType[outtype.upper()]
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2 and not name.endswith("mlp.gate.weight"):  # experts' stacks too; routers stay f32
                q = gguf.quants.quantize(p.numpy(), qtype)
                p.copy_(torch.from_numpy(gguf.quants.dequantize(q, qtype).reshape(p.shape)))
    return model


# Files transformers' GGUF loader cannot read as the model: llama3 (it reads no rope_freqs), qwen2_moe (it makes the
# shared expert's gate (1, 1, dim), not (1, dim)), mixtral (a `llama` file with experts: it builds a dense Llama),
# olmoe, deepseek_v2/v3/v32, glm4_moe, glm_moe_dsa, qwen3_next, qwen3_5_moe, llama4 (llama4_vl too) and kimi_k25's deepseek2 (none of
# those among its architectures),
# gpt_oss (its reader fails on the file: float() of an array); phi4's tensors are the phi3 case's kind, its 201k-token
# vocabulary alone differs (compared byte for byte), not loaded for the time it takes
NOT_LOADED = ("llama3", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3", "deepseek_v2", "deepseek_v32", "glm4_moe",
              "glm_moe_dsa", "gpt_oss", "qwen3_next", "qwen3_5_moe", "phi4", "llama4", "llama4_vl", "kimi_k25")


@pytest.mark.parametrize("name", [n for n in CASES if n not in NOT_LOADED])
def test_transformers_loads_the_gguf_with_the_merged_logits(built, name):
    """The GGUF's logits are the merged HF export's with its matrices rounded through the file's type (to
    float noise), and near the unrounded ones."""
    _, _, merged, ours, _ = built(name)
    reference = causal_lm(merged)
    tokens = torch.randint(0, reference.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        exact = reference(tokens).logits
        for t in CASES[name][4]:
            path = ours[t]
            model = transformers.AutoModelForCausalLM.from_pretrained(  # Phi3Config's pad id 32000 is past the vocab
                path.parent, gguf_file=path.name, dtype=torch.float32, pad_token_id=None).eval()
            got = model(tokens).logits
            assert max_rel_err(got, rounded_through(copy.deepcopy(reference), t)(tokens).logits) < 1e-5, (name, t)
            moe = 3 if "moe" in name else 1  # rounding moves a router's top-k choice now and then
            assert max_rel_err(got, exact) < TOLERANCE[t] * moe, (name, t)


@pytest.mark.parametrize("name", list(LORA_OUTTYPES))
def test_gguf_lora_equals_llama_cpp_converter_output(built, name):
    _, _, _, ours, theirs = built(name)
    assert ours["lora"].name == theirs["lora"].name
    assert ours["lora"].read_bytes() == theirs["lora"].read_bytes(), differences(ours["lora"], theirs["lora"])[:8]
    fields = read(ours["lora"]).fields
    assert (fields["general.type"].contents(), fields["adapter.type"].contents()) == ("adapter", "lora")


def test_gguf_lora_over_the_base_gguf_is_the_merged_gguf(built, tmp_path):
    """llama.cpp's LoRA maths (W + alpha / r * B @ A, per GGUF tensor) on the base model's GGUF and the adapter's
    gives the merged GGUF's matrices: the adapter's names and q/k rows fit the base file's."""
    store, _, _, ours, _ = built("llama")  # f32 files: the merged model's and the adapter's
    base = {t.name: t.data for t in gguf.GGUFReader(merge(store, None, tmp_path / "base", "gguf", "f32")).tensors}
    merged = {t.name: t.data for t in read(ours["f32"]).tensors}
    lora = read(ours["lora"])
    pairs = {t.name: torch.from_numpy(t.data.copy()) for t in lora.tensors}
    scale = lora.fields["adapter.lora.alpha"].contents() / next(iter(pairs.values())).shape[0]
    assert len(pairs) == 2 * 7 * SMALL["num_hidden_layers"]  # every projection of every block
    for a_name in [n for n in pairs if n.endswith(".lora_a")]:
        w = a_name.removesuffix(".lora_a")
        expected = torch.from_numpy(base[w].copy()) + scale * pairs[w + ".lora_b"] @ pairs[a_name]
        assert max_rel_err(torch.from_numpy(merged[w].copy()), expected) < 1e-5, w


def test_finetune_export_gguf_writes_the_merged_file_and_says_how_to_run_it(built, tmp_path):
    """finetune.py --export gguf: OUT/gguf/ holds merge_lora.py --format gguf's file of the run's adapter (the
    default type: f16 for this fp32 store) and a Modelfile naming it; the run card says how to run both."""
    store = built("llama")[0]
    run = tmp_path / "run"
    assert load_script("finetune").main(["--model", str(store), "--data", str(TINY_TEXT), "--iters", "2", "--seq-len",
                                         "32", "--batch-size", "2", "--out", str(run), "--device", "cpu", "--export",
                                         "gguf", "--quiet"]) == 0
    (path,) = (run / "gguf").glob("*.gguf")
    assert (run / "gguf" / "Modelfile").read_text() == f"FROM ./{path.name}\n"
    assert path.read_bytes() == merge(store, run / "adapter", tmp_path / "merged", "gguf", "f16").read_bytes()
    card = (run / "README.md").read_text()
    assert f"llama-cli -m {path}" in card and "ollama create" in card and "-f Modelfile" in card


def edited(store: Path, folder: Path, **fields) -> Path:
    """A copy of store whose manifest's config has fields changed (a model llama.cpp would compute otherwise)."""
    shutil.copytree(store, folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["config"].update(fields)
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def text_config_edited(store: Path, folder: Path, **fields) -> Path:
    """A copy of a vision-language store whose checkpoint config (kept as shipped) has fields in its text_config
    (None: left out)."""
    folder = shutil.copytree(store, folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    text = manifest["vision_language"]["config"]["text_config"]
    for key, value in fields.items():
        if value is None:
            del text[key]
        else:
            text[key] = value
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def without_bos(merged: Path, folder: Path) -> Path:
    """A store prepared from a copy of the HF export merged whose tokenizer_config.json says add_bos_token false."""
    src = shutil.copytree(merged, folder / "hf")
    config = json.loads((src / "tokenizer_config.json").read_text())
    (src / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": False}))
    assert load_script("prepare_model").main(["--src", str(src), "--out", str(folder / "store"), "--quiet"]) == 0
    return folder / "store"


def test_bad_gguf_requests_are_one_line_and_leave_nothing(built, tmp_path, capsys, monkeypatch):
    from phantom.export import gguf_arch
    store, moe, gemma2, glm = built("llama")[0], built("qwen3_moe"), built("gemma2")[0], built("glm4_moe")
    merge_lora = load_script("merge_lora").main
    cases = [(["--model", str(store), "--format", "gguf-lora"], "give --adapter"),
             (["--model", str(store), "--format", "hf", "--outtype", "f16"], "--outtype is for"),
             (["--model", str(moe[0]), "--adapter", str(moe[1]), "--format", "gguf-lora"], "covers dense models"),
             (["--model", str(glm[0]), "--adapter", str(glm[1]), "--format", "gguf-lora"], "stacks a mixture's"),
             (["--model", str(edited(gemma2, tmp_path / "g1", query_pre_attn_scalar=32.0)), "--format", "gguf"],
              "llama.cpp scales this Gemma-2's queries by 256^-1/2"),
             (["--model", str(edited(gemma2, tmp_path / "g2", rope_theta=20000.0)), "--format", "gguf"],
              "llama.cpp reads Gemma-2's RoPE base as 10000"),
             (["--model", str(edited(moe[0], tmp_path / "q", norm_topk_prob=False)), "--format", "gguf"],
              "llama.cpp's qwen3moe fixes norm_topk_prob"),
             (["--model", str(without_bos(built("deepseek_v32")[2], tmp_path / "v32")), "--format", "gguf"],
              "DeepSeek-V3.2's vocabulary only where tokenizer_config.json says add_bos_token true"),
             # a Kimi-K2.5 checkpoint whose text_config names no scoring function (llama.cpp would route with softmax)
             (["--model", str(text_config_edited(built("kimi_k25")[0], tmp_path / "k", scoring_func=None)),
               "--format", "gguf"], "llama.cpp's deepseek2 routes with softmax unless config.json says scoring_func"),
             # a Llama 4 checkpoint whose config says every layer is sparse beside moe_layers of every 2nd
             (["--model", str(text_config_edited(built("llama4_vl")[0], tmp_path / "l4", interleave_moe_layer_step=1)),
               "--format", "gguf"], "this checkpoint's config.json says 1 where its moe_layers make it 2"),
             # a Phi-3 name (the folder's) on a vocabulary without <|endoftext|>: llama.cpp's loader stops on it
             (["--model", str(shutil.copytree(store, tmp_path / "tiny-phi3-llama")), "--format", "gguf"],
              "this vocabulary lacks <|endoftext|>; name the store's folder without phi3")]
    for args, words in cases:
        capsys.readouterr()
        assert merge_lora([*args, "--out", str(tmp_path / "out"), "--quiet"]) == 2, args
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and words in err[0], err
        assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))
    monkeypatch.delitem(gguf_arch.ARCHES, "llama")  # a family GGUF export does not cover
    assert merge_lora(["--model", str(store), "--format", "gguf", "--out", str(tmp_path / "out"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "GGUF export covers mistral, " in err[0] and "this is a llama model" in err[0], err


def test_newer_families_refuse_what_llama_cpp_computes_otherwise(built):
    """gpt-oss: llama.cpp clamps the experts' SwiGLU at 7 (alpha 1.702), slides the even layers, scales YaRN's
    attention by 0.1 ln(factor) + 1 (and ramps YaRN between whole dims: warned); Qwen3-Next / Qwen3.5: it lays full-attention
    layers out by a period and has no attention output bias; DeepSeek-V3.2 / GLM-5: it reads the indexer's queries from
    the query latent and turns them by a Hadamard matrix of 64 dims or more, and its glm-dsa reads no YaRN log multiplier."""
    import dataclasses
    from phantom.files.store import BlockStore
    from phantom.export.gguf_arch import refusal
    oss, nxt, q35 = (BlockStore(built(n)[0]).cfg for n in ("gpt_oss", "qwen3_next", "qwen3_5_moe"))
    assert refusal(oss) is None and refusal(nxt) is None and refusal(q35) is None
    yarn = dataclasses.replace(oss.rope_scaling, attention_factor=1.0)
    for cfg, words in [(dataclasses.replace(oss, swiglu_limit=1.5), "SwiGLU at limit 7 with alpha 1.702"),
                       (dataclasses.replace(oss, qkv_bias=False, o_bias=False), "loads attention biases"),
                       (dataclasses.replace(oss, layer_types=("full_attention", "sliding_attention")),
                        "slides the even layers"),
                       (dataclasses.replace(oss, rope_scaling=yarn), "0.1 ln(factor) + 1 = 1.13863"),
                       (dataclasses.replace(nxt, layer_types=("full_attention", "linear_attention")),
                        "qwen3next makes every full_attention_interval-th layer full attention"),
                       (dataclasses.replace(q35, layer_types=("full_attention", "linear_attention")),
                        "qwen35moe makes every"),
                       (dataclasses.replace(nxt, qkv_bias=True, o_bias=True), "qwen3next has no attention output bias")]:
        assert words in refusal(cfg), (words, refusal(cfg))
    olmoe, dsv2 = (BlockStore(built(n)[0]).cfg for n in ("olmoe", "deepseek_v2"))
    assert refusal(olmoe) is None and refusal(dsv2) is None
    assert "no grouped-query attention" in refusal(dataclasses.replace(olmoe, n_kv_heads=2))
    assert "only at DeepSeek-V2-Lite's depths" in refusal(dataclasses.replace(dsv2, q_lora_rank=0))
    assert refusal(dataclasses.replace(dsv2, q_lora_rank=0, n_layers=27)) is None
    dsv3 = BlockStore(built("deepseek_v3")[0]).cfg
    assert refusal(dsv3) is None and "differs from its mscale_all_dim" in refusal(
        dataclasses.replace(dsv3, rope_scaling=dataclasses.replace(dsv3.rope_scaling, attention_factor=1.038)))
    # DeepSeek Sparse Attention: the indexer's queries from the query latent, its heads turned by a Hadamard matrix of
    # 64 dims or more; glm-dsa reads no YaRN log multiplier
    v32, glm5 = (BlockStore(built(n)[0]).cfg for n in ("deepseek_v32", "glm_moe_dsa"))
    assert refusal(v32) is None and refusal(glm5) is None
    for cfg, words in [(dataclasses.replace(glm5, q_lora_rank=0), "glm-dsa reads the indexer's queries from the query latent"),
                       (dataclasses.replace(v32, index_head_dim=96), "deepseek32 turns the indexer's queries and keys"),
                       (dataclasses.replace(glm5, rope_scaling=v32.rope_scaling), "glm-dsa reads no YaRN log multiplier"),
                       (dataclasses.replace(v32, rope_scaling=dataclasses.replace(v32.rope_scaling, attention_factor=1.038)),
                        "llama.cpp's deepseek32 scales YaRN's attention by mscale_all_dim alone"),
                       (dataclasses.replace(v32, rope_scaling=dataclasses.replace(v32.rope_scaling, mscale_all_dim=0.7)),
                        "llama.cpp's deepseek32 takes YaRN's mscale as 1")]:
        assert words in refusal(cfg), (words, refusal(cfg))
    # Llama 4: llama.cpp's llama4 fixes the layers' layout (every 4th RoPE-less and unchunked), the chunk (8192), the
    # temperature's constants, q/k norms unless there are 128 experts, the sparse layers' period; no attention biases
    l4 = BlockStore(built("llama4")[0]).cfg
    assert refusal(l4) is None
    for cfg, words in [(dataclasses.replace(l4, layer_types=("chunked_attention", "full_attention")),
                        "chunked attention on every layer but each 4th"),
                       (dataclasses.replace(l4, attn_chunk=16), "attends in chunks of 8192 positions"),
                       (dataclasses.replace(l4, attn_scale=0.0, floor_scale=0.0), "and this model has none"),
                       (dataclasses.replace(l4, qk_l2=False), "this model with 4 sets use_qk_norm false"),
                       (dataclasses.replace(l4, dense_layers=(1, 3)), "moe_layers follow no such period"),
                       (dataclasses.replace(l4, qkv_bias=True), "loads no attention output bias")]:
        assert words in refusal(cfg), (words, refusal(cfg))
    # the published configs' YaRN (truncate false), which llama.cpp ramps between whole dims: said, not refused
    from phantom.export.gguf_arch import yarn_difference
    untruncated = dataclasses.replace(oss, rope_scaling=dataclasses.replace(oss.rope_scaling, truncate=False))
    assert refusal(untruncated) is None and yarn_difference(oss) is None
    assert "llama.cpp ramps YaRN between whole dims (0 and 2)" in yarn_difference(untruncated)


# -- memory: one block at a time ---------------------------------------------------------------------
CHILD = r"""
import json, sys
import torch
torch.set_num_threads(1)
sys.path.insert(0, sys.argv[1] + "/scripts")
import merge_lora
assert merge_lora.main(["--model", sys.argv[2], "--out", sys.argv[3], "--format", "gguf", "--outtype", "q8_0",
                        "--quiet"]) == 0
with open("/proc/self/status") as f:  # this process image's own peak (see tests/test_memory.py)
    print(json.dumps({"peak": next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))}))
"""


def test_gguf_export_peak_memory_grows_with_one_block_not_with_depth(tmp_path):
    """Peak RSS of merge_lora.py --format gguf on fp32 stores of 4 and 16 blocks of ~13 MiB each (one child
    process each, side by side): 12 more blocks add less than half of what holding the model would (12 blocks):
    allocator noise, seen from 0.2 to 3.1 blocks (the larger beside the rest of the suite)."""
    import os
    from phantom.files.store import BlockStore
    repo, stores = Path(__file__).resolve().parent.parent, {}
    for n in (4, 16):
        src = tmp_path / f"hf{n}"
        src.mkdir()
        config = transformers.LlamaConfig(vocab_size=llama2_style_sentencepiece(src), hidden_size=512,
                                          intermediate_size=1536, num_hidden_layers=n, num_attention_heads=4,
                                          max_position_embeddings=64, tie_word_embeddings=False)
        transformers.LlamaForCausalLM(config).save_pretrained(src)
        stores[n] = tmp_path / f"store{n}"
        assert load_script("prepare_model").main(["--src", str(src), "--out", str(stores[n]), "--quiet"]) == 0
    block = BlockStore(stores[4]).block_nbytes
    assert block > 10 * 2**20
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(repo), str(stores[n]), str(tmp_path / f"out{n}")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for n in (4, 16)]
    peaks = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        peaks.append(json.loads(out.strip().splitlines()[-1])["peak"])
    mib = [round(x / 2**20, 1) for x in (block, *peaks)]
    print(f"block, peak RSS of 4 and 16 blocks: {mib} MiB")
    assert peaks[1] - peaks[0] < 6 * block, f"peak RSS grows with depth: block, 4 blocks, 16 blocks = {mib} MiB"


def test_the_docs_name_the_pinned_converter():
    """The reference converter's release is pinned once (tests/conftest.py's LLAMA_CPP); docs/models.md names it."""
    release = LLAMA_CPP[0].replace("==", " ")
    assert release in " ".join((Path(__file__).parent.parent / "docs" / "models.md").read_text().split())
