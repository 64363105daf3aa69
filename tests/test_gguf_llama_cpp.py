"""phantom's GGUF files run by llama.cpp itself (its library, built from the pinned llama-cpp-python sdist): the logits
of a few prompts equal transformers' on the merged HF export within the file type's rounding, and the GGUF LoRA adapter
applied by llama.cpp to the base model's GGUF gives the merged model's logits. Skipped where llama.cpp is not built
(conftest.llama_cpp_runtime says how to build it)."""
from __future__ import annotations

import copy

import pytest
import torch

from conftest import llama_cpp_runtime, max_rel_err, need
from test_export_gguf import TOLERANCE, build, merge, rounded_through

transformers = need("transformers")
need("gguf")

PROMPTS = [[1, 5, 9, 2, 17, 33, 4, 8], [3, 3, 40, 12, 7, 1, 60, 25, 11, 2, 9, 14]]
# name -> the file types run (test_export_gguf's cases); f32 logits agree to llama.cpp's own sums (its matmuls add
# in another order; its delta rule, Qwen3-Next's and Qwen3.5's, in its own chunks: 6e-5)
CASES = {"llama": ("f32", "q8_0"), "qwen3_moe": ("q8_0",), "glm4_moe": ("f32",), "gpt_oss": ("f32",),
         "qwen3_next": ("f32",), "qwen3_5_moe": ("f32",), "phi4": ("f32",), "mixtral": ("f32",), "qwen2_moe": ("f32",),
         "olmoe": ("f32",), "deepseek_v2": ("f32",), "deepseek_v3": ("f32",)}
# not run: gemma2
# (2.2e-4), gemma3 (its tiny file stops llama.cpp at GGML_ASSERT(buffer)), phi3 (the tiny sentencepiece vocabulary
# lacks the special tokens llama.cpp's phi3 vocabulary looks up), qwen2, mistral, llama3 (not tried)
F32 = 1e-4
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
    model = llama_cpp.Llama(model_path=str(path), n_ctx=64, n_batch=64, logits_all=True, n_threads=2, seed=0,
                            type_k=F32_CACHE, type_v=F32_CACHE, verbose=False, **kwargs)  # keys, values unrounded
    try:
        model.eval(tokens)
        return torch.from_numpy(model.scores[: len(tokens)].copy())
    finally:
        model.close()


def transformers_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


@pytest.mark.parametrize("name", list(CASES))
def test_llama_cpp_computes_the_gguf_as_transformers_computes_the_merged_export(llama_cpp, models, name):
    _, _, merged, files = models[name]
    reference = transformers.AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    for t, path in files.items():
        rounded = rounded_through(copy.deepcopy(reference), t)
        for tokens in PROMPTS:
            got = llama_cpp_logits(llama_cpp, path, tokens)
            exact, weights_rounded = (transformers_logits(m, tokens) for m in (reference, rounded))
            print(f"{name} {t} {len(tokens)} tokens: {max_rel_err(got, exact):.2e} from the merged export, "
                  f"{max_rel_err(got, weights_rounded):.2e} from it with the file's weights")
            if t == "f32":
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
