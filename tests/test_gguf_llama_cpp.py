"""phantom's GGUF files run by llama.cpp itself (its library, built from the pinned llama-cpp-python sdist): the logits
of a few prompts equal transformers' on the merged HF export within the file type's rounding (for Gemma, within
the rounding of llama.cpp's CPU GELU, an f16 table), and the GGUF LoRA adapter
applied by llama.cpp to the base model's GGUF gives the merged model's logits. Skipped where llama.cpp is not built
(conftest.llama_cpp_runtime says how to build it)."""
from __future__ import annotations

import copy
import shutil

import pytest
import torch

from conftest import llama_cpp_runtime, max_rel_err, need
from test_export_gguf import TOLERANCE, build, causal_lm, merge, rounded_through

transformers = need("transformers")
need("gguf")

PROMPTS = [[1, 5, 9, 2, 17, 33, 4, 8], [3, 3, 40, 12, 7, 1, 60, 25, 11, 2, 9, 14]]
# name -> the file types run: every case of test_export_gguf; f32 logits agree to llama.cpp's own sums (its matmuls
# add in another order; its delta rule, Qwen3-Next's and Qwen3.5's, in its own chunks: 6e-5)
CASES = {"llama": ("f32", "q8_0"), "llama3": ("f32",), "mistral": ("f32",), "qwen2": ("f32",), "qwen3": ("f32",),
         "qwen3_moe": ("q8_0",), "glm4_moe": ("f32",), "gpt_oss": ("f32",), "qwen3_next": ("f32",),
         "qwen3_5_moe": ("f32",), "phi3": ("f32",), "phi4": ("f32",), "mixtral": ("f32",), "qwen2_moe": ("f32",),
         "olmoe": ("f32",), "deepseek_v2": ("f32",), "deepseek_v3": ("f32",), "gemma2": ("f32",), "gemma3": ("f32",),
         "deepseek_v32": ("f32",), "glm_moe_dsa": ("f32",), "minimax_m2": ("f32",), "llama4": ("f32",),
         "llama4_vl": ("f32",), "kimi_k25": ("f32",)}
F32 = 1e-4
# llama.cpp pads its context to a multiple of 256 (llama-context.cpp) and takes Phi-3's LongRoPE long factors
# whenever that context exceeds the original one (llama_model::get_rope_factors), 64 in the tiny case, where
# transformers takes them for a sequence past it: phi3 runs on a prompt past 64 tokens, its long factors in both
LONG_PROMPT = [(7 * i + 3) % 500 for i in range(80)]
# DeepSeek-V3.2's and GLM-5's indexers pick 16 keys: a prompt of 40 tokens, past them, beside the short ones (GLM-5's
# layers 1 and 3 reuse the picks of layers 0 and 2)
PROMPTS_OF = {"phi3": [LONG_PROMPT], "glm_moe_dsa": PROMPTS + [LONG_PROMPT[:40]],
              "deepseek_v32": PROMPTS + [LONG_PROMPT[:40]], "llama4": PROMPTS + [LONG_PROMPT]}
# llama.cpp's CPU GELU (ggml-cpu/vec.h defines GGML_GELU_FP16) rounds its input to f16 and reads the tanh GELU from
# an f16 table, which puts Gemma-2/3's logits 3e-4 to 1.3e-3 off transformers' f32 GELU. They are compared with
# transformers' model computing that GELU (ggml_cpu_gelu); the table's steps turn float noise before it into f16
# steps after it (a relative 1e-6 before it moves the 6-layer Gemma-3 case's logits by up to 5e-4 in transformers
# alone), so their bound is the table's, not float noise's
F16_TABLE = 1e-3
F32_CACHE = 0  # GGML_TYPE_F32: llama.cpp's KV cache is f16 unless asked


@pytest.fixture(scope="module")
def llama_cpp():
    return llama_cpp_runtime()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for name, types in CASES.items():
        root = tmp_path_factory.mktemp(name)
        store, adapter, merged = build(root, name)
        out[name] = store, adapter, merged, {t: merge(store, adapter, root / "gguf" / t, "gguf", t) for t in types}
    return out


def llama_cpp_logits(llama_cpp, path, tokens: list[int], lora=None) -> torch.Tensor:
    """Logits of every position of one prompt, as llama.cpp computes them on the CPU."""
    kwargs = {"lora_path": str(lora)} if lora is not None else {}
    n = max(64, len(tokens))
    model = llama_cpp.Llama(model_path=str(path), n_ctx=n, n_batch=n, logits_all=True, n_threads=2, seed=0,
                            type_k=F32_CACHE, type_v=F32_CACHE, verbose=False, **kwargs)  # keys, values unrounded
    try:
        model.eval(tokens)
        return torch.from_numpy(model.scores[: len(tokens)].copy())
    finally:
        model.close()


def ggml_cpu_gelu(x: torch.Tensor) -> torch.Tensor:
    """ggml's CPU GELU of f32 values (ggml_vec_gelu_f32 under GGML_GELU_FP16): 0 at or below -10, x at or above
    10, else the tanh GELU of x rounded to f16, from its table of f16 values."""
    h = x.to(torch.float16).float()
    table = (0.5 * h * (1 + torch.tanh(0.7978845608028654 * h * (1 + 0.044715 * h * h)))).to(torch.float16).float()
    return torch.where(x <= -10, torch.zeros_like(x), torch.where(x >= 10, x, table))


class GgmlCpuGelu(torch.nn.Module):
    def forward(self, x):
        return ggml_cpu_gelu(x)


def with_ggml_cpu_gelu(model):
    """model (Gemma-2/3) with its feed-forward's GELU computed as llama.cpp's CPU backend computes it."""
    for layer in model.model.layers:
        layer.mlp.act_fn = GgmlCpuGelu()
    return model


def transformers_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


@pytest.mark.parametrize("name", list(CASES))
def test_llama_cpp_computes_the_gguf_as_transformers_computes_the_merged_export(llama_cpp, models, name):
    _, _, merged, files = models[name]
    reference = causal_lm(merged)
    gelu = name in ("gemma2", "gemma3")
    if gelu:
        as_llama_cpp = with_ggml_cpu_gelu(copy.deepcopy(reference))
    for t, path in files.items():
        rounded = rounded_through(copy.deepcopy(reference), t)
        for tokens in PROMPTS_OF.get(name, PROMPTS):
            got = llama_cpp_logits(llama_cpp, path, tokens)
            exact, weights_rounded = (transformers_logits(m, tokens) for m in (reference, rounded))
            print(f"{name} {t} {len(tokens)} tokens: {max_rel_err(got, exact):.2e} from the merged export, "
                  f"{max_rel_err(got, weights_rounded):.2e} from it with the file's weights")
            if gelu:
                table = max_rel_err(got, transformers_logits(as_llama_cpp, tokens))
                print(f"{name} {t} {len(tokens)} tokens: {table:.2e} from it with ggml's CPU GELU")
                assert table < F16_TABLE, name
            elif t == "f32":
                assert max_rel_err(got, exact) < F32, name
            else:  # llama.cpp's q8_0 dot products round the activations to q8_0 too: within the type's rounding
                assert max_rel_err(got, exact) < TOLERANCE[t] * (3 if "moe" in name else 1), (name, t)


def test_llama_cpps_lora_on_the_base_gguf_gives_the_merged_models_logits(llama_cpp, models, tmp_path):
    store, adapter, merged, _ = models["llama"]
    base = merge(store, None, tmp_path / "base", "gguf", "f32")
    lora = merge(store, adapter, tmp_path / "lora", "gguf-lora", "f32")
    reference = transformers.AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    for tokens in PROMPTS:
        with_lora = llama_cpp_logits(llama_cpp, base, tokens, lora=lora)
        assert max_rel_err(with_lora, transformers_logits(reference, tokens)) < F32
        assert max_rel_err(llama_cpp_logits(llama_cpp, base, tokens), with_lora) > 1e-2  # the adapter counts


def test_llama_cpp_does_not_load_a_phi3_named_file_without_the_tokens_it_looks_up(llama_cpp, models, tmp_path,
                                                                                     monkeypatch):
    """What GGUF export refuses (gguf_vocab.phi3_name_refusal), written anyway: the llama case's vocabulary, which
    llama.cpp loads under its own name, under a Phi-3 name (the store's folder) stops llama.cpp's loader."""
    from phantom.export import gguf_export
    store = shutil.copytree(models["llama"][0], tmp_path / "tiny-phi3-llama")
    monkeypatch.setattr(gguf_export, "phi3_name_refusal", lambda name, tokens: None)
    path = merge(store, None, tmp_path / "gguf", "gguf", "f32")
    with pytest.raises(ValueError, match="Failed to load model"):
        llama_cpp_logits(llama_cpp, path, PROMPTS[0])

