"""The checks every family passes against its own transformers model, and the table of the families' tiny
models (CASES) that tests/test_families.py runs them over; each family's own tests (tests/test_gemma.py,
test_moe.py, ...) take the same models through conftest's family_models fixture.

A tiny random model of the family is built from its transformers config class, saved with
save_pretrained (with a byte-level BPE tokenizer), converted by scripts/prepare_model.py, and
compared: logits and loss of the streamed model (disk and RAM tiers, prefetch 0 and 2, activations
kept and recomputed) with transformers'; LoRA gradients with peft's; the adapter loaded by peft;
the merged --format hf export loaded by AutoModelForCausalLM and AutoTokenizer; one full-finetuning
step with torch.optim.AdamW on the transformers model.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

import phantom
from phantom.arch.presets import PRESETS
from phantom.arch.quantformat import QuantFormat
from phantom.export.export import export, to_hf
from phantom.arch.ops import rope_rows
from phantom.model.lora import PARAMETER_TARGETS, PROJECTIONS, TARGETS, V4_TARGETS, adapted_modules
from phantom.files.store import BlockStore
from phantom.convert.quantstore import quantize_store
from phantom.convert.synthetic import write_synthetic
from conftest import need
from test_convert import load_script
from test_export_hf import llama3_style_tokenizer_json


transformers = need("transformers")
peft = need("peft")

VOCAB = 400  # the tokenizer's size: ids the tokenizer makes are ids the model has
ALL_TARGETS = PROJECTIONS
EPS = 1e-3  # AdamW's eps in the full-finetuning step (see check_full_step)
STREAMED = list(itertools.product(("disk", "ram"), (0, 2), ("none", "all")))  # offload, prefetch, recompute


@dataclass(frozen=True)
class Case:
    """A tiny random model of one family, and what the shared checks (tests/test_families.py) run on it."""
    config_class: str  # transformers' config class
    fields: dict  # its fields
    hf_class: str  # the class AutoModelForCausalLM loads the export as
    facts: dict  # fields of the converted store's ModelConfig and their values
    adapter_modules: tuple  # adapter_config.json's target_modules of a LoRA on lora_targets
    runs: tuple = tuple(STREAMED)  # (offload, prefetch, recompute) of the base model's logits
    lora_runs: tuple = tuple(STREAMED)  # of the LoRA's logits and gradients
    lora_targets: tuple = ALL_TARGETS


SHAPES = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64)
DENSE = ("down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj")
# Gemma: local sliding-window layers between global ones (window 16 under rows of 40 tokens)
GEMMA = dict(SHAPES, head_dim=32, query_pre_attn_scalar=24, sliding_window=16)
# Phi-3: q, k, v fused in qkv_proj, gate and up in gate_up_proj; Phi3Config's pad id 32000 is past a tiny vocabulary
PHI3, FUSED = dict(SHAPES, pad_token_id=None), ("down_proj", "gate_up_proj", "o_proj", "qkv_proj")
# Mixtures of experts: the shared checks' LoRA on attention (experts: tests/test_moe_lora.py), fewer streamed runs
MOE = dict(runs=(("none", 0, "none"), ("disk", 0, "all"), ("disk", 2, "none"), ("ram", 0, "none"), ("ram", 2, "all")),
           lora_runs=(("disk", 1, "all"), ("ram", 0, "none")), lora_targets=("q", "k", "v", "o"),
           adapter_modules=("k_proj", "o_proj", "q_proj", "v_proj"))
# DeepSeekMoE: a dense first layer, a shared expert, sigmoid scores in groups (V3, GLM-4.5) or softmax (V2)
DEEPSEEK_MOE = dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                    first_k_dense_replace=1, routed_scaling_factor=2.5)
# latent attention: q through a rank-24 bottleneck, keys and values from a rank-16 latent; YaRN with mscale
MLA = dict(SHAPES, num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
           **DEEPSEEK_MOE)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "mscale": 1.0, "mscale_all_dim": 0.7, "beta_fast": 32.0, "beta_slow": 1.0}
# gpt-oss: sinks, a window of 16 on the even layers, biases on attention, the router and the experts, the clamped
# SwiGLU at a limit the tiny model's activations pass, yarn as its config.json has it (truncate false) at a
# context of 16
GPT_OSS = dict(SHAPES, head_dim=24, num_local_experts=8, num_experts_per_tok=2, sliding_window=16, swiglu_limit=1.5,
               rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                                "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16})
DSA = dict(index_topk=16, index_head_dim=16, index_n_heads=4)  # DeepSeek Sparse Attention: a top-16 of rows of 40
MLA_LORA = dict(lora_targets=("q", "kv_a", "kv_b", "o"),
                adapter_modules=("kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "q_b_proj"))
# Gated DeltaNet (Qwen3-Next, Qwen3.5): a linear-attention layer, then a gated full-attention one (RoPE over a quarter
# of each 16-wide head), 2 q/k heads serving 4 v heads, 8 experts and a shared one; 256 positions: past the delta
# rule's chunk of 64 (tests/test_qwen35.py runs 150 tokens, and LoRA on Gated DeltaNet and the experts: the shared
# checks here run fewer streamed cases, the two families between them every tier)
LINEAR = dict(SHAPES, head_dim=16, max_position_embeddings=256, linear_key_head_dim=8, linear_value_head_dim=12,
              linear_num_key_heads=2, linear_num_value_heads=4, num_experts=8, num_experts_per_tok=2,
              moe_intermediate_size=32, shared_expert_intermediate_size=48,
              layer_types=["linear_attention", "full_attention"])
# DeepSeek-V4: four residual streams; a sliding layer (window 16), compressed sparse attention (an entry per 4 tokens,
# the indexer picking 3 of the 10 a row of 40 has), heavily compressed attention (an entry per 8 tokens), then
# compressed sparse attention again; the first two layers' experts hashed by token id (the ids carried to their blocks),
# the others routed by sqrt(softplus) scores with a correction bias; RoPE over the last 8 of each 32-wide head, YaRN on
# the compress base
V4 = dict(hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4, head_dim=32,
          q_lora_rank=24, partial_rotary_factor=0.25, num_experts_per_tok=2, n_routed_experts=8,
          max_position_embeddings=64, sliding_window=16, o_groups=2, o_lora_rank=16, index_n_heads=2,
          index_head_dim=16, index_topk=3, swiglu_limit=1.5,
          layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                       "compressed_sparse_attention"],
          compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
          mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
          rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                           "beta_fast": 32.0, "beta_slow": 1.0})
CASES = {
    # tied embeddings (Llama-3.2 1B/3B, Qwen2.5's small models): one table, both gradients add up in it
    "llama-tied": Case("LlamaConfig", dict(SHAPES, tie_word_embeddings=True, rope_theta=500000.0), "LlamaForCausalLM",
                       {"family": "llama", "tie_embeddings": True}, DENSE),
    # Qwen2 / Qwen2.5: biases on q, k, v
    "qwen2": Case("Qwen2Config", dict(SHAPES, tie_word_embeddings=False), "Qwen2ForCausalLM",
                  {"family": "qwen2", "tie_embeddings": False, "qkv_bias": True}, DENSE),
    "qwen2-tied": Case("Qwen2Config", dict(SHAPES, tie_word_embeddings=True), "Qwen2ForCausalLM",
                       {"family": "qwen2", "tie_embeddings": True}, DENSE),
    # Qwen3 dense: q/k norms, head_dim wider than hidden_size / heads; tied like the small checkpoints
    "qwen3": Case("Qwen3Config", dict(SHAPES, head_dim=32, tie_word_embeddings=True, rope_theta=1000000.0),
                  "Qwen3ForCausalLM", {"family": "qwen3", "head_dim": 32}, DENSE),
    # Mistral: every query past position 15 sees only its last 16 keys
    "mistral": Case("MistralConfig", dict(SHAPES, sliding_window=16), "MistralForCausalLM",
                    {"family": "mistral", "sliding_window": 16}, DENSE),
    # Gemma-2: soft-capped scores and logits
    "gemma2": Case("Gemma2Config", dict(GEMMA, attn_logit_softcapping=3.0, final_logit_softcapping=2.0),
                   "Gemma2ForCausalLM", {"family": "gemma2"}, DENSE),
    # Gemma-3: q/k norms, two RoPE bases (the global one with linear scaling)
    "gemma3": Case("Gemma3TextConfig", dict(GEMMA, layer_types=["sliding_attention", "full_attention"],
                                            rope_parameters={
                                                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                                "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                   "rope_theta": 1e6}}),
                   "Gemma3ForCausalLM", {"family": "gemma3"}, DENSE),
    # Phi-3-mini's shape: as many kv heads as heads, a sliding window (2047 there) shorter than the sequence
    "phi3-mini": Case("Phi3Config", dict(PHI3, num_key_value_heads=4, sliding_window=16), "Phi3ForCausalLM",
                      {"family": "phi3", "rope_dim": 16}, FUSED),
    # Phi-4's: grouped-query attention, rope_theta 250000, no window
    "phi4": Case("Phi3Config", dict(PHI3, rope_parameters={"rope_type": "default", "rope_theta": 250000.0}),
                 "Phi3ForCausalLM", {"family": "phi3", "rope_dim": 16}, FUSED),
    # Phi-4-mini's: RoPE over 3/4 of each head (12 of 16 dims here), longrope past an original context of 16, tied
    "phi4-mini": Case("Phi3Config", dict(PHI3, tie_word_embeddings=True, original_max_position_embeddings=16,
                                         rope_parameters={"rope_type": "longrope", "rope_theta": 1e4,
                                                          "partial_rotary_factor": 0.75,
                                                          "short_factor": [1.0 + 0.1 * i for i in range(6)],
                                                          "long_factor": [1.0 + 0.7 * i for i in range(6)]}),
                      "Phi3ForCausalLM", {"family": "phi3", "rope_dim": 12}, FUSED),
    "qwen3_moe": Case("Qwen3MoeConfig", dict(SHAPES, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                             norm_topk_prob=True, head_dim=24), "Qwen3MoeForCausalLM",
                      {"family": "qwen3_moe", "n_experts": 8}, **MOE),
    # with its shared expert
    "qwen2_moe": Case("Qwen2MoeConfig", dict(SHAPES, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                                             shared_expert_intermediate_size=48), "Qwen2MoeForCausalLM",
                      {"family": "qwen2_moe", "n_experts": 8}, **MOE),
    "mixtral": Case("MixtralConfig", dict(SHAPES, num_local_experts=4, num_experts_per_tok=2, sliding_window=16),
                    "MixtralForCausalLM", {"family": "mixtral", "n_experts": 4}, **MOE),
    # q/k norms over the whole projection; its eos id 50279 is past the vocabulary
    "olmoe": Case("OlmoeConfig", dict(SHAPES, num_experts=8, num_experts_per_tok=2, eos_token_id=2), "OlmoeForCausalLM",
                  {"family": "olmoe", "n_experts": 8}, **MOE),
    "deepseek_v3": Case("DeepseekV3Config", dict(MLA, q_lora_rank=24, n_group=4, topk_group=2, rope_parameters=YARN),
                        "DeepseekV3ForCausalLM", {"family": "deepseek_v3", "n_experts": 8, "router_bias": True},
                        **{**MOE, **MLA_LORA}),
    # DeepSeek-V3.2: DeepSeek-V3 with a lightning indexer in each layer (RoPE in halves); rows of 40 tokens are past
    # its top-16: each query attends to the 16 keys its layer's indexer picks
    "deepseek_v32": Case("DeepseekV32Config", dict(MLA, q_lora_rank=24, n_group=4, topk_group=2, rope_parameters=YARN,
                                                   **DSA),
                         "DeepseekV32ForCausalLM", {"family": "deepseek_v32", "n_experts": 8, "index_topk": 16},
                         **{**MOE, **MLA_LORA}),
    # GLM-5: DeepSeek-V3.2 with RoPE in pairs in its indexer, layers 1 and 3 reusing the top-k of layers 0 and 2
    # (carried between streamed blocks), blocks of three layouts (dense with an indexer, sparse with and without)
    "glm_moe_dsa": Case("GlmMoeDsaConfig", dict(MLA, num_hidden_layers=4, q_lora_rank=24, n_group=4, topk_group=2,
                                                rope_parameters=YARN, **DSA,
                                                indexer_types=["full", "shared", "full", "shared"]),
                        "GlmMoeDsaForCausalLM", {"family": "glm_moe_dsa", "n_experts": 8, "index_shared": (1, 3),
                                                 "index_pairs": True}, **{**MOE, **MLA_LORA}),
    # DeepSeek-V2-Lite's shape: one q projection, softmax routing (greedy), two shared experts
    "deepseek_v2": Case("DeepseekV2Config", dict(MLA, q_lora_rank=None, n_shared_experts=2, routed_scaling_factor=1.5),
                        "DeepseekV2ForCausalLM", {"family": "deepseek_v2", "q_lora_rank": 0},
                        **{**MOE, **MLA_LORA, "adapter_modules": ("kv_a_proj_with_mqa", "kv_b_proj", "o_proj",
                                                                  "q_proj")}),
    "glm4_moe": Case("Glm4MoeConfig", dict(SHAPES, head_dim=24, attention_bias=True, use_qk_norm=True,
                                           **DEEPSEEK_MOE, n_group=2, topk_group=1), "Glm4MoeForCausalLM",
                     {"family": "glm4_moe", "rope_dim": 12, "qk_norm": True}, **MOE),
    "gpt_oss": Case("GptOssConfig", GPT_OSS, "GptOssForCausalLM",
                    {"family": "gpt_oss", "attn_sinks": True, "expert_bias": True, "sliding_window": 16,
                     "layer_types": ("sliding_attention", "full_attention")}, **MOE),
    # MiniMax-M2: q/k norms over the whole projections, RoPE over half of each 24-wide head, sigmoid routing with a
    # correction bias, renormalised; Mixtral's expert names
    "minimax_m2": Case("MiniMaxM2Config", dict(SHAPES, head_dim=24, intermediate_size=32, num_local_experts=8,
                                               num_experts_per_tok=2, rotary_dim=12, bos_token_id=1, eos_token_id=2),
                       "MiniMaxM2ForCausalLM", {"family": "minimax_m2", "n_experts": 8, "router_bias": True,
                                                "rope_dim": 12, "qk_norm_over": "projection"}, **MOE),
    # Llama 4: a RoPE layer attending in chunks of 16 with q/k L2 norms and a dense MLP, then a RoPE-less one with the
    # attention temperature (floor_scale 4: it grows within 40 tokens) and 4 experts (top-2 by sigmoid, scaling their
    # input) beside a shared expert
    "llama4": Case("Llama4TextConfig", dict(SHAPES, head_dim=16, intermediate_size=32, intermediate_size_mlp=96,
                                            num_local_experts=4, num_experts_per_tok=2, no_rope_layer_interval=2,
                                            interleave_moe_layer_step=2, attention_chunk_size=16, floor_scale=4),
                   "Llama4ForCausalLM", {"family": "llama4", "n_experts": 4, "dense_layers": (0,), "attn_chunk": 16,
                                         "layer_types": ("chunked_attention", "full_attention")}, **MOE),
    "deepseek_v4": Case("DeepseekV4Config", V4, "DeepseekV4ForCausalLM",
                        {"family": "deepseek_v4", "n_experts": 8, "hc_mult": 4, "hash_layers": (0, 1), "csa_rate": 4,
                         "hca_rate": 8, "rope_dim": 8, "local_rope_theta": 10000.0},
                        **{**MOE, "lora_targets": V4_TARGETS, "adapter_modules": tuple(sorted(  # o_a: a tensor
                            TARGETS[t][1] for t in V4_TARGETS if t not in PARAMETER_TARGETS))}),
    "qwen3_next": Case("Qwen3NextConfig", LINEAR, "Qwen3NextForCausalLM",
                       {"family": "qwen3_next", "n_experts": 8, "linear_grouped": True, "rope_dim": 4},
                       **{**MOE, "runs": MOE["runs"][:3], "lora_runs": MOE["lora_runs"][:1]}),
    "qwen3_5_moe": Case("Qwen3_5MoeTextConfig", {k: v for k, v in LINEAR.items() if k != "intermediate_size"},
                        "Qwen3_5MoeForCausalLM", {"family": "qwen3_5_moe", "n_experts": 8, "linear_grouped": False,
                                                  "rope_dim": 4},
                        **{**MOE, "runs": MOE["runs"][3:], "lora_runs": MOE["lora_runs"][1:]}),
}


def hf_model(config_class: str, seed: int = 0, **fields):
    """A random model of the family in fp32 (eager attention), with norms and biases that are not 1 and 0."""
    config = getattr(transformers, config_class)(**{"vocab_size": VOCAB, "initializer_range": 0.1, **fields})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape))
            elif name.endswith((".bias", "_bias")):  # gpt-oss's experts' too (gate_up_proj_bias)
                p.copy_(0.1 * torch.randn(p.shape))
            elif config.model_type == "deepseek_v4" and name.endswith(("sinks", "hc.base", "hc_base")):
                p.copy_(0.5 * torch.randn(p.shape))  # DeepSeek-V4's sinks and hyper-connections' biases: zero at init
        for name, b in model.named_buffers():  # DeepSeek-V3's router: a correction bias that moves the choice
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape))
            elif name.endswith("tid2eid"):  # DeepSeek-V4's hashed layers: distinct experts for each token id
                b.copy_(torch.rand(b.shape[0], config.n_routed_experts).argsort(-1)[:, :b.shape[1]])
    return model


def synthetic_preset_loss(name: str, root, **fields) -> torch.Tensor:
    """The loss (after its backward) on random tokens of a --synthetic store of PRESETS[name]'s fields cut to
    tiny widths (and fields), streamed from disk: at random weights it is near ln 97."""
    cfg = dataclasses.replace(PRESETS[name], dim=64, n_heads=4, n_kv_heads=2, explicit_head_dim=16, vocab_size=97,
                              intermediate_size=96, max_seq_len=64, **fields)
    store = write_synthetic(root / name, cfg, torch.float32, progress=False)
    with phantom.load(store, offload="disk", prefetch=1) as pm:
        loss = pm(torch.randint(0, 97, (1, 24)), targets=torch.randint(0, 97, (1, 24)))
        loss.backward()
    return loss.detach()


def check_quantized(store, root, method: str):
    """A quantized copy of store (method "nf4" or "int8", the rest bfloat16) in root / "q": its streamed logits, from
    disk and RAM, equal transformers' on the weights it dequantizes to (its --format hf export) within 1e-5.
    Returns the copy's folder."""
    quantize_store(store, root / "q", QuantFormat(method), dtype=torch.bfloat16, progress=False)
    out = export(root / "q", root / "hf", None, "hf", dtype=torch.float32, progress=False)
    reference = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokens, _ = batch()
    with torch.no_grad():
        ref = reference(tokens).logits
    for offload in ("disk", "ram"):
        with phantom.load(root / "q", offload=offload, prefetch=1, lora=None, dtype=torch.float32) as pm:
            with torch.no_grad():
                assert rel_err(pm(tokens), ref) < 1e-5, offload
    return root / "q"


def save_fused(model, root):
    """transformers 5's own layout: the modules' state_dict (3-D gate_up_proj and down_proj per sparse layer)."""
    root.mkdir(parents=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") and v.dim() == 3 for k, v in state.items())
    save_file(state, root / "model.safetensors", metadata={"format": "pt"})
    model.config.save_pretrained(root)


def check_converts_to(src, store, out, link: bool = False):
    """scripts/prepare_model.py from src to out (read in place with link) gives store's blocks, tensor for tensor."""
    args = ["--src", str(src), "--out", str(out), "--quiet"] + (["--link"] if link else [])
    assert load_script("prepare_model").main(args) == 0
    ours, theirs = BlockStore(out), BlockStore(store)
    for i in range(ours.n_blocks):
        a, b = ours.load_block(i), theirs.load_block(i)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def check_linked_in_place(copy, link, tokens, runs=(("disk", 1), ("ram", 1)), **knobs):
    """A store made with --link holds no tensor bytes of its own (no safetensors file: its manifest, which
    indexes the checkpoint's tensors where they lie, and the tokenizer files, under 64 KiB in all; no q/k
    rows copied), and its logits equal the copied store's bit for bit (fp32, every tier of runs)."""
    files = [p for p in link.rglob("*") if p.is_file()]
    assert not [p.name for p in files if p.suffix == ".safetensors"]
    tokenizer = set(BlockStore(link).manifest.get("tokenizer_files", {})) | {BlockStore(link).manifest["tokenizer"]}
    own = sum(p.stat().st_size for p in files if p.name not in tokenizer)
    assert own < 64 << 10, own
    manifest = json.loads((link / "manifest.json").read_text())
    assert manifest["config"]["rope_interleave"] == BlockStore(copy).cfg.rope_interleave
    for offload, prefetch in runs:
        out = []
        for store in (copy, link):
            with phantom.load(store, offload=offload, prefetch=prefetch, lora=None, dtype=torch.float32,
                              **knobs) as pm, torch.no_grad():
                out.append(pm(tokens))
        assert torch.equal(out[0], out[1]), (offload, prefetch)
    return own


def make(name: str, **changes):
    """The transformers model of CASES[name] (fields changed by changes), as built each time (seed 0)."""
    case = CASES[name]
    return hf_model(case.config_class, **{**case.fields, **changes})


def prepare(model, root, link: bool = False):
    """save_pretrained (+ a tokenizer) -> scripts/prepare_model.py -> the store's folder."""
    model.save_pretrained(root / "hf", safe_serialization=True)
    llama3_style_tokenizer_json(root / "hf")
    args = ["--src", str(root / "hf"), "--out", str(root / "store"), "--quiet"] + (["--link"] if link else [])
    assert load_script("prepare_model").main(args) == 0
    return root / "store"


def model_stores(tmp_path_factory, make):
    """get(name, link=False) -> (the transformers model make(name) builds, its store), each made once (a
    module-scoped fixture's body)."""
    built = {}

    def get(name: str, link: bool = False):
        if (name, link) not in built:
            model = make(name)
            built[(name, link)] = model, prepare(model, tmp_path_factory.mktemp(name), link=link)
        return built[(name, link)]
    return get


def batch(b: int = 2, t: int = 40, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (b, t), generator=gen)
    targets = torch.randint(0, VOCAB, (b, t), generator=gen)
    targets[:, :5] = -100
    return tokens, targets


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).abs().max() / b.abs().max()).item()


def cross_entropy(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)


def check_logits(model, store, tokens, targets, runs=STREAMED):
    """The base model, streamed every way: logits and loss equal transformers' within 1e-5."""
    with torch.no_grad():
        ref = model(tokens).logits
    ref_loss = cross_entropy(ref, targets)
    for offload, prefetch, recompute in runs:
        with phantom.load(store, offload=offload, prefetch=prefetch, recompute=recompute, lora=None) as pm:
            with torch.no_grad():
                assert rel_err(pm(tokens), ref) < 1e-5, (offload, prefetch, recompute)
                torch.testing.assert_close(pm(tokens, targets=targets), ref_loss, rtol=1e-5, atol=0)
    return ref


def lora_step(store, tokens, targets, adapter_dir=None, lora_targets=ALL_TARGETS, **knobs):
    """A LoRA on every projection (or lora_targets), B random (so A gets gradients): logits, loss,
    {(layer, target): grads}."""
    lora = phantom.LoraConfig(rank=4, alpha=8, targets=lora_targets)
    with phantom.load(store, lora=lora, loss_chunk=7, **knobs) as pm:
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in pm.trainable_parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            logits = pm(tokens)
        if adapter_dir is not None:
            pm.save_adapter(adapter_dir)
        loss = pm(tokens, targets=targets)
        loss.backward()
        grads = lora_grads(pm)
    return logits, loss.detach(), grads


def lora_grads(pm) -> dict:
    """{(layer, HF module): (A's gradient, B's in HF's rows)}, as peft has them: a fused module's (Phi-3's
    qkv_proj) is one A, shared by its parts, and its parts' B rows stacked."""
    rows = rope_rows(pm.cfg)  # q's and k's heads, where their rows are permuted (not latent attention's)
    heads = {t: rows[f"{TARGETS[t][0]}.weight"] for t in ("q", "k") if f"{TARGETS[t][0]}.weight" in rows}
    out = {}
    for i, module, parts in adapted_modules(pm.layers, pm.cfg):
        bs = [to_hf_rows(m.lora_B.grad, heads[t], pm.cfg.rope_dim) if t in heads else m.lora_B.grad for t, m in parts]
        out[(i, module)] = (parts[0][1].lora_A.grad.clone(), torch.cat(bs))
    return out


def peft_grads(pmodel) -> dict:
    """{(layer, HF module): (A's gradient, B's)} of every LoRA in a peft model."""
    params = dict(pmodel.named_parameters())
    out = {}
    for name, p in params.items():
        if name.endswith(".lora_A.default.weight"):
            base = name.removesuffix(".lora_A.default.weight")
            layer, module = base.split(".layers.", 1)[1].split(".", 1)
            out[(int(layer), module)] = (p.grad, params[f"{base}.lora_B.default.weight"].grad)
    return out


def peft_step(model, adapter_dir, tokens, targets):
    """The adapter on the transformers model through peft: logits, loss, gradients (HF's q/k row order)."""
    pmodel = peft.PeftModel.from_pretrained(model, adapter_dir, is_trainable=True).eval()
    try:
        logits = pmodel(tokens).logits
        loss = cross_entropy(logits, targets)
        loss.backward()
        grads = peft_grads(pmodel)
    finally:  # the model is shared by every test of the session (conftest's family_models): leave it as it was
        pmodel.unload()
        for p in model.parameters():
            p.grad = None
    return logits.detach(), loss.detach(), grads


def check_lora(model, store, tmp_path, tokens, targets, runs=STREAMED, lora_targets=ALL_TARGETS):
    """LoRA logits, loss and every A/B gradient equal peft's, streamed every way; the adapter loads in peft."""
    adapter = tmp_path / "adapter"
    lora_step(store, tokens, targets, adapter, lora_targets, offload="none")
    ref_logits, ref_loss, ref_grads = peft_step(model, adapter, tokens, targets)
    for offload, prefetch, recompute in runs:
        logits, loss, grads = lora_step(store, tokens, targets, lora_targets=lora_targets, offload=offload,
                                        prefetch=prefetch, recompute=recompute)
        assert rel_err(logits, ref_logits) < 1e-5, (offload, prefetch, recompute)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
        assert grads.keys() == ref_grads.keys()
        for (i, t), (ga, gb) in grads.items():
            ra, rb = ref_grads[(i, t)]
            assert rel_err(ga, ra) < 1e-4, (offload, prefetch, recompute, i, t, "A")
            assert rel_err(gb, rb) < 1e-4, (offload, prefetch, recompute, i, t, "B")
    return adapter, ref_logits


def to_hf_rows(w: torch.Tensor, n_heads: int, rotary: int) -> torch.Tensor:
    """Meta's interleaved RoPE rows -> HF's half split, over the leading `rotary` rows of each head (the rest
    stay): rows 0, 2, 4, .. then 1, 3, 5, .. of each head, as transformers' convert_llama_weights_to_hf.py
    orders them (written here by index, apart from phantom's permute)."""
    head = w.shape[0] // n_heads
    order = torch.cat([torch.arange(0, rotary, 2), torch.arange(1, rotary, 2), torch.arange(rotary, head)])
    return w[(torch.arange(n_heads)[:, None] * head + order).flatten()]


def check_merged_export(store, adapter, tmp_path, tokens, expected_logits, hf_class: str):
    """merge_lora's --format hf: loads with AutoModelForCausalLM as the family's class, equal logits; AutoTokenizer."""
    out = export(store, tmp_path / "merged", adapter, "hf", progress=False)
    merged = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(merged).__name__ == hf_class
    generation = json.loads((out / "generation_config.json").read_text())  # the tokenizer's ids, in config.json too
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(merged.config, key) == generation.get(key), key
    with torch.no_grad():
        assert rel_err(merged(tokens).logits, expected_logits) < 1e-5
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok("Once upon a time")["input_ids"]  # the tokenizer the model came with


def check_full_step(model, store, tokens, targets, work_dir=None, lr: float = 1e-3):
    """One full-finetuning step equals torch.optim.AdamW on the transformers model within 1e-5: resident,
    or streamed from disk with work_dir (blocks updated by the block optimizer inside backward).

    AdamW's first update is lr * g / (|g| + eps): at eps 1e-8 that is lr * sign(g), so a gradient of
    1e-7 that rounding moves by 1e-7 may flip; eps 1e-3 (on both sides) keeps the update a smooth
    function of the gradient, which is what the comparison is about. It still scales gradient
    rounding (fp32 gradients agree to a few 1e-6) by lr / eps: lr 1e-3 keeps that under the bound
    while the update (1e-3 a weight) is at least 100 times the tolerance."""
    for p in model.parameters():
        p.requires_grad_(True)
        p.grad = None
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ref_opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, eps=EPS)
    moe = hasattr(model.config, "router_aux_loss_coef")  # its router loss, as transformers adds it
    fused = any(n.endswith("experts.gate_up_proj") for n, _ in model.named_parameters())
    out = model(tokens, output_router_logits=True) if moe else model(tokens)
    aux = getattr(out, "aux_loss", None) if moe else None  # Llama4ForCausalLM's loss has no router term
    (cross_entropy(out.logits, targets) + (0 if aux is None else model.config.router_aux_loss_coef * aux)).backward()
    ref_opt.step()
    unreached = {n for n, p in model.named_parameters() if p.grad is None}  # DeepSeek-V3.2's indexer: no gradient
    knobs = dict(offload="none") if work_dir is None else dict(offload="disk", prefetch=1, work_dir=work_dir)
    with phantom.load(store, mode="full", loss_chunk=7, optim=phantom.AdamWConfig(lr=lr, weight_decay=0.1, eps=EPS),
                      **knobs) as pm:
        opt = torch.optim.AdamW(pm.trainable_parameters(), lr=lr, weight_decay=0.1, eps=EPS)
        pm(tokens, targets=targets).backward()
        opt.step()
        n_trained = len(pm.trainable_parameters())
        if work_dir is not None:
            pm.finish_step()
            pm.save_full()
            trained = BlockStore(work_dir / "store")
            parts = {"embed": trained.load_embed(), "head": trained.load_head(),
                     **{i: trained.load_block(i) for i in range(trained.n_blocks)}}
        else:
            parts = {"embed": {"tok_embeddings.weight": pm.embed_table}, "head": {"norm.weight": pm.norm_weight},
                     **{i: block.state_dict() for i, block in enumerate(pm.layers)}}
            if pm.hc_head is not None:  # DeepSeek-V4's mix of the streams, in the head
                parts["head"] |= {f"hc_head.{k}": v for k, v in pm.hc_head.named_parameters()}
            if not pm.cfg.tie_embeddings:
                parts["head"]["output.weight"] = pm.output_weight
    ours = {}
    for part, tensors in parts.items():
        ours |= to_hf(pm.cfg, part, {k: v.detach() for k, v in tensors.items()}, fused_experts=fused)
    theirs = dict(model.named_parameters())
    buffers = {n: b for n, b in model.named_buffers() if n in ours}  # DeepSeek-V3's correction bias: not trained
    buffers |= {n: before[n] for n in unreached}  # left as they were, in both
    assert set(ours) == set(theirs) | set(buffers), (set(ours) ^ (set(theirs) | set(buffers)))
    theirs = {n: p for n, p in theirs.items() if n not in unreached}
    for name, b in buffers.items():
        assert torch.equal(ours[name], b), name
    if work_dir is None:
        assert n_trained == sum(map(len, parts.values())) - len(buffers)  # a tied table is one parameter in both
    for name, p in theirs.items():
        assert not torch.equal(p, before[name]), name  # the step moved it
        assert rel_err(ours[name], p) < 1e-5, name
