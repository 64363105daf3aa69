"""Presets: the shapes of published models, each citing the config it came from (a size registry, as
gpt-fast's). Imports only phantom.arch.config.
"""
from __future__ import annotations

import dataclasses
import math

from phantom.arch.config import ModelConfig, RopeScaling

GEMMA2 = dict(family="gemma2", activation="gelu_pytorch_tanh", tie_embeddings=True, norm_offset=1.0, embed_scale=True,
              post_norms=True, attn_softcap=50.0, final_softcap=30.0, sliding_window=4096,
              layer_types=("sliding_attention", "full_attention"))

# latent attention as DeepSeek-V2 and V3 have it: 192-wide q/k heads (128 plain, 64 rotated), 128-wide v heads
LATENT = dict(kv_lora_rank=512, qk_nope_head_dim=128, v_head_dim=128, explicit_head_dim=192, rotary_dim=64)
DEEPSEEK_ROUTER = dict(router_score="sigmoid", router_fp32=True, router_bias=True, router_group_score="top2",
                       shared_expert_gate=False)
DEEPSEEK_V3 = dict(intermediate_size=18432, norm_eps=1e-6, max_seq_len=163840, family="deepseek_v3", q_lora_rank=1536,
                   **LATENT, n_experts=256, experts_per_token=8, expert_dim=2048, norm_topk_prob=True,
                   shared_expert_dim=2048, dense_layers=(0, 1, 2), router_groups=8, router_topk_groups=4,
                   routed_scale=2.5, **DEEPSEEK_ROUTER,
                   rope_scaling=RopeScaling(rope_type="yarn", factor=40, original_max_seq_len=4096, mscale_all_dim=1.0))
# moonshotai/Kimi-K2-Instruct and K2.5's text model: DeepSeek-V3's architecture, 64 heads, 384 experts, one group, one
# dense layer
KIMI_K2 = {**DEEPSEEK_V3, "rope_theta": 50000.0, "n_experts": 384, "routed_scale": 2.827, "router_groups": 1,
           "router_topk_groups": 1, "dense_layers": (0,)}
GPT_OSS = dict(intermediate_size=2880, max_seq_len=131072, rope_theta=150000, family="gpt_oss", explicit_head_dim=64,
               qkv_bias=True, o_bias=True, sliding_window=128, experts_per_token=4, expert_dim=2880,
               router_aux_coef=0.9, router_score="topk_softmax", attn_sinks=True, router_logit_bias=True,
               expert_bias=True, swiglu_limit=7.0, interleaved_experts=True,
               rope_scaling=RopeScaling(rope_type="yarn", factor=32.0, original_max_seq_len=4096, truncate=False,
                                        attention_factor=1 + 0.1 * math.log(32)))


LLAMA4 = dict(dim=5120, n_layers=48, n_heads=40, n_kv_heads=8, vocab_size=202048, intermediate_size=16384,
              rope_theta=500000.0, family="llama4", experts_per_token=1, expert_dim=8192,
              shared_expert_dim=8192, shared_expert_gate=False, router_score="topk_sigmoid", attn_chunk=8192,
              nope_full=True, attn_scale=0.1, floor_scale=8192.0,
              layer_types=("chunked_attention",) * 3 + ("full_attention",))


def deepseek_v4(dim: int, n_layers: int, n_heads: int, n_experts: int, expert_dim: int, first: str,
                **fields) -> ModelConfig:
    """DeepSeek-V4's shape: its config.json's values (V4-Flash's where `fields` leave them). compress_ratios as
    published: two `first` layers (V4-Flash: sliding window alone, V4-Pro: heavily compressed), then compressed sparse
    and heavily compressed ones in turn, compressed sparse first; three hashed layers; YaRN 16x from 65536 positions on
    the compressed layers (compress_rope_theta)."""
    kinds = [first] * 2 + ["heavily_compressed_attention" if i % 2 else "compressed_sparse_attention"
                           for i in range(n_layers - 2)]
    return ModelConfig(**{**dict(
        dim=dim, n_layers=n_layers, n_heads=n_heads, vocab_size=129280, family="deepseek_v4", n_kv_heads=1,
        explicit_head_dim=512, rotary_dim=64, norm_eps=1e-6, max_seq_len=1048576, rope_theta=160000.0,
        rope_scaling=RopeScaling(rope_type="yarn", factor=16.0, original_max_seq_len=65536),
        local_rope_theta=10000.0, q_lora_rank=1024, o_groups=8, o_lora_rank=1024, attn_sinks=True, index_heads=64,
        index_head_dim=128, index_topk=512, hc_mult=4, hc_iters=20, hc_eps=1e-6, csa_rate=4, hca_rate=128,
        sliding_window=128, layer_types=tuple(kinds), hash_layers=(0, 1, 2), n_experts=n_experts, experts_per_token=6,
        expert_dim=expert_dim, shared_expert_dim=expert_dim, intermediate_size=expert_dim, shared_expert_gate=False,
        router_score="sqrtsoftplus", router_bias=True, norm_topk_prob=True, routed_scale=1.5, swiglu_limit=10.0,
        swiglu_clamped=True, router_aux_coef=0.001), **fields})


def gated_deltanet(n_layers: int, **fields) -> dict:
    """Qwen3-Next's and Qwen3.5's layers: three Gated DeltaNet layers (16 q/k heads of 128) then one gated full
    attention (2 kv heads of 256, RoPE over a quarter of each head, base 1e7), experts with a shared one."""
    return dict(n_layers=n_layers, n_kv_heads=2, norm_eps=1e-6, rope_theta=1e7, max_seq_len=262144,
                explicit_head_dim=256, qk_norm=True, norm_offset=1.0, rotary_dim=64, rope_interleave=False,
                attn_output_gate=True, norm_topk_prob=True, router_aux_coef=0.001, linear_k_heads=16, linear_k_dim=128,
                linear_v_dim=128, linear_conv=4,
                layer_types=(("linear_attention",) * 3 + ("full_attention",)) * (n_layers // 4),
                **fields)


def qwen35(n_layers: int, dim: int, n_heads: int, v_heads: int, n_experts: int, k: int, width: int) -> ModelConfig:
    """A Qwen3.5 mixture of experts' text model (its config.json's text_config; intermediate_size: its shared
    expert's, as no layer is dense)."""
    return ModelConfig(dim=dim, n_heads=n_heads, vocab_size=248320, family="qwen3_5_moe", intermediate_size=width,
                       **gated_deltanet(n_layers, linear_v_heads=v_heads, n_experts=n_experts, experts_per_token=k,
                                        expert_dim=width, shared_expert_dim=width))


# Shapes from Meta's params.json files (llama-2, codellama, llama-3 repos) and Mistral's config.json.
PRESETS: dict[str, ModelConfig] = {
    # Generated on first use (synthetic.ensure_tiny); small enough to train in a minute on 2 CPU cores.
    # 64 tokens: the shipped text's characters and their commonest pairs (see ensure_tiny for why).
    "tiny": ModelConfig(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=32,
                        max_seq_len=512),
    # Llama-2 (meta-llama/Llama-2-*b params.json)
    "7B": ModelConfig(dim=4096, n_layers=32, n_heads=32, vocab_size=32000),
    "13B": ModelConfig(dim=5120, n_layers=40, n_heads=40, vocab_size=32000),
    # CodeLlama-34b params.json: GQA, rope_theta 1e6, 16k context
    "34B": ModelConfig(dim=8192, n_layers=48, n_heads=64, n_kv_heads=8, vocab_size=32000,
                       ffn_dim_multiplier=1.0, rope_theta=1e6, max_seq_len=16384),
    "70B": ModelConfig(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=32000,
                       multiple_of=4096, ffn_dim_multiplier=1.3),
    # CodeLlama-7b params.json
    "codellama-7B": ModelConfig(dim=4096, n_layers=32, n_heads=32, vocab_size=32016, rope_theta=1e6,
                                max_seq_len=16384),
    # Meta-Llama-3-8B / 70B params.json
    "llama3-8B": ModelConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256,
                             multiple_of=1024, ffn_dim_multiplier=1.3, rope_theta=500000.0, max_seq_len=8192),
    "llama3-70B": ModelConfig(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256,
                              multiple_of=4096, ffn_dim_multiplier=1.3, rope_theta=500000.0, max_seq_len=8192),
    # mistralai/Mistral-7B-v0.1 config.json (max_position_embeddings 32768; planned at 4096 tokens)
    "mistral-7B": ModelConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=32000,
                              intermediate_size=14336, max_seq_len=4096, family="mistral", sliding_window=4096),
    # Each from the config.json of the Hugging Face repo named (for the Gemma-3 and multimodal repos,
    # its text_config); max_seq_len is max_position_embeddings.
    # Qwen/Qwen2.5-7B, Qwen/Qwen2.5-72B (use_sliding_window false: no window)
    "qwen2.5-7B": ModelConfig(dim=3584, n_layers=28, n_heads=28, n_kv_heads=4, vocab_size=152064,
                              intermediate_size=18944, norm_eps=1e-6, rope_theta=1e6, max_seq_len=131072,
                              family="qwen2", qkv_bias=True),
    "qwen2.5-72B": ModelConfig(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=152064,
                               intermediate_size=29568, norm_eps=1e-5, rope_theta=1e6, max_seq_len=131072,
                               family="qwen2", qkv_bias=True),
    # Qwen/Qwen3-8B, Qwen/Qwen3-32B (head_dim 128)
    "qwen3-8B": ModelConfig(dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, vocab_size=151936,
                            intermediate_size=12288, norm_eps=1e-6, rope_theta=1e6, max_seq_len=40960,
                            family="qwen3", qk_norm=True),
    "qwen3-32B": ModelConfig(dim=5120, n_layers=64, n_heads=64, n_kv_heads=8, vocab_size=151936,
                             intermediate_size=25600, norm_eps=1e-6, rope_theta=1e6, max_seq_len=40960,
                             family="qwen3", qk_norm=True, explicit_head_dim=128),
    # meta-llama/Llama-3.1-8B, meta-llama/Llama-3.1-70B (rope_scaling llama3, factor 8)
    "llama3.1-8B": ModelConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256,
                               intermediate_size=14336, rope_theta=500000.0, rope_scaling=RopeScaling(),
                               max_seq_len=131072),
    "llama3.1-70B": ModelConfig(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256,
                                intermediate_size=28672, rope_theta=500000.0, rope_scaling=RopeScaling(),
                                max_seq_len=131072),
    # meta-llama/Llama-3.2-1B, meta-llama/Llama-3.2-3B (tied embeddings, rope_scaling llama3, factor 32)
    "llama3.2-1B": ModelConfig(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256,
                               intermediate_size=8192, rope_theta=500000.0, rope_scaling=RopeScaling(factor=32.0),
                               max_seq_len=131072, tie_embeddings=True),
    "llama3.2-3B": ModelConfig(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, vocab_size=128256,
                               intermediate_size=8192, rope_theta=500000.0, rope_scaling=RopeScaling(factor=32.0),
                               max_seq_len=131072, tie_embeddings=True),
    # google/gemma-2-9b, google/gemma-2-27b (sliding 4096 on every other layer, soft-caps 50 and 30)
    "gemma2-9B": ModelConfig(dim=3584, n_layers=42, n_heads=16, n_kv_heads=8, vocab_size=256000,
                             intermediate_size=14336, norm_eps=1e-6, max_seq_len=8192, explicit_head_dim=256,
                             **GEMMA2, query_pre_attn_scalar=256),
    "gemma2-27B": ModelConfig(dim=4608, n_layers=46, n_heads=32, n_kv_heads=16, vocab_size=256000,
                              intermediate_size=36864, norm_eps=1e-6, max_seq_len=8192, explicit_head_dim=128,
                              **GEMMA2, query_pre_attn_scalar=144),
    # google/gemma-3-27b-pt text_config (sliding 1024 on five layers of six; RoPE 1e6 linear x8 / local 1e4)
    "gemma3-27B": ModelConfig(dim=5376, n_layers=62, n_heads=32, n_kv_heads=16, vocab_size=262208,
                              intermediate_size=21504, norm_eps=1e-6, max_seq_len=131072, explicit_head_dim=128,
                              family="gemma3", activation="gelu_pytorch_tanh", tie_embeddings=True, norm_offset=1.0,
                              embed_scale=True, post_norms=True, qk_norm=True, query_pre_attn_scalar=168,
                              rope_theta=1e6, rope_scaling=RopeScaling(rope_type="linear", factor=8.0),
                              local_rope_theta=1e4, sliding_window=1024,
                              layer_types=("sliding_attention",) * 5 + ("full_attention",)),
    # microsoft/phi-4, microsoft/Phi-3-mini-4k-instruct (Phi3ForCausalLM: qkv_proj and gate_up_proj fused
    # in the checkpoint; Phi-3-mini's window of 2047 keys)
    "phi4-14B": ModelConfig(dim=5120, n_layers=40, n_heads=40, n_kv_heads=10, vocab_size=100352,
                            intermediate_size=17920, norm_eps=1e-5, rope_theta=250000.0, max_seq_len=16384,
                            family="phi3"),
    "phi3-mini-4k": ModelConfig(dim=3072, n_layers=32, n_heads=32, n_kv_heads=32, vocab_size=32064,
                                intermediate_size=8192, norm_eps=1e-5, max_seq_len=4096, family="phi3",
                                sliding_window=2047),
    # Mixtures of experts: Qwen/Qwen3-30B-A3B, Qwen/Qwen3-235B-A22B (128 experts, 8 per token, head_dim 128),
    # mistralai/Mixtral-8x7B-v0.1 (8 experts, 2 per token), allenai/OLMoE-1B-7B-0924 (64 experts, 8 per
    # token, q/k norms over the whole projection)
    "qwen3-30B-A3B": ModelConfig(dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, vocab_size=151936,
                                 intermediate_size=6144, norm_eps=1e-6, rope_theta=1e6, max_seq_len=40960,
                                 family="qwen3_moe", qk_norm=True, explicit_head_dim=128, n_experts=128,
                                 experts_per_token=8, expert_dim=768, norm_topk_prob=True, router_aux_coef=0.001),
    "qwen3-235B-A22B": ModelConfig(dim=4096, n_layers=94, n_heads=64, n_kv_heads=4, vocab_size=151936,
                                   intermediate_size=12288, norm_eps=1e-6, rope_theta=1e6, max_seq_len=40960,
                                   family="qwen3_moe", qk_norm=True, explicit_head_dim=128, n_experts=128,
                                   experts_per_token=8, expert_dim=1536, norm_topk_prob=True, router_aux_coef=0.001),
    "mixtral-8x7B": ModelConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=32000,
                                intermediate_size=14336, rope_theta=1e6, max_seq_len=32768, family="mixtral",
                                n_experts=8, experts_per_token=2, expert_dim=14336, norm_topk_prob=True,
                                router_aux_coef=0.02),
    "olmoe-1B-7B": ModelConfig(dim=2048, n_layers=16, n_heads=16, n_kv_heads=16, vocab_size=50304,
                               intermediate_size=1024, max_seq_len=4096, family="olmoe", qk_norm=True,
                               qk_norm_over="projection", n_experts=64, experts_per_token=8, expert_dim=1024,
                               router_aux_coef=0.01),
    # DeepSeekMoE (sigmoid scores in groups, a correction bias, ungated shared experts, dense first layers):
    # deepseek-ai/DeepSeek-V3 (latent attention, YaRN 40x with mscale; its multi-token-prediction layer left out,
    # as transformers leaves it), moonshotai/Kimi-K2-Instruct (DeepSeek-V3's architecture, 384 experts, 64 heads),
    # zai-org/GLM-4.5 (grouped-query attention with q/k norms and biases, RoPE over half of each head),
    # deepseek-ai/DeepSeek-V2-Lite (no q bottleneck, softmax scores chosen greedily)
    "deepseek-v3-671B": ModelConfig(dim=7168, n_layers=61, n_heads=128, vocab_size=129280, **DEEPSEEK_V3),
    "kimi-k2-1T": ModelConfig(dim=7168, n_layers=61, n_heads=64, vocab_size=163840, **{
        **KIMI_K2, "max_seq_len": 131072, "rope_scaling": RopeScaling(
            rope_type="yarn", factor=32.0, original_max_seq_len=4096, beta_fast=1.0, beta_slow=1.0,
            mscale_all_dim=1.0)}),
    # moonshotai/Kimi-K2.5 (Kimi_K25ForConditionalGeneration: its text_config, the vision tower left out): Kimi-K2's
    # shapes with 262144 positions (YaRN 64x, beta_fast 32) and norm eps 1e-5; untied. Its routed experts ship as
    # compressed-tensors INT4 in groups of 32 with bf16 scales, the rest bf16: plan it with --quantize int4-group
    "kimi-k2.5-1T": ModelConfig(dim=7168, n_layers=61, n_heads=64, vocab_size=163840, **{
        **KIMI_K2, "max_seq_len": 262144, "norm_eps": 1e-5, "rope_scaling": RopeScaling(
            rope_type="yarn", factor=64.0, original_max_seq_len=4096, mscale_all_dim=1.0)}),
    "glm-4.5-355B": ModelConfig(dim=5120, n_layers=92, n_heads=96, n_kv_heads=8, vocab_size=151552,
                                intermediate_size=12288, rope_theta=1e6, max_seq_len=131072, family="glm4_moe",
                                explicit_head_dim=128, qkv_bias=True, qk_norm=True, rotary_dim=64, n_experts=160,
                                experts_per_token=8, expert_dim=1536, norm_topk_prob=True, shared_expert_dim=1536,
                                dense_layers=(0, 1, 2), routed_scale=2.5, **DEEPSEEK_ROUTER),
    # DeepSeek Sparse Attention: deepseek-ai/DeepSeek-V3.2 (DeepSeek-V3's shapes, a 64-head indexer picking 2048
    # keys in every layer); zai-org/GLM-5 (its config.json: 64 heads of 192 + 64 q/k and 256 v dims, a 32-head
    # indexer in every layer, RoPE in pairs in both, base 1e6)
    "deepseek-v3.2-671B": ModelConfig(dim=7168, n_layers=61, n_heads=128, vocab_size=129280, **{
        **DEEPSEEK_V3, "family": "deepseek_v32"}, index_heads=64, index_head_dim=128, index_topk=2048),
    "glm-5-744B": ModelConfig(dim=6144, n_layers=78, n_heads=64, vocab_size=154880, intermediate_size=12288,
                              max_seq_len=202752, rope_theta=1e6, family="glm_moe_dsa", q_lora_rank=2048,
                              kv_lora_rank=512, qk_nope_head_dim=192, v_head_dim=256, explicit_head_dim=256,
                              rotary_dim=64, n_experts=256, experts_per_token=8, expert_dim=2048, norm_topk_prob=True,
                              shared_expert_dim=2048, dense_layers=(0, 1, 2), routed_scale=2.5, **DEEPSEEK_ROUTER,
                              index_heads=32, index_head_dim=128, index_topk=2048, index_pairs=True),
    "deepseek-v2-lite-16B": ModelConfig(dim=2048, n_layers=27, n_heads=16, vocab_size=102400, intermediate_size=10944,
                                        norm_eps=1e-6, max_seq_len=163840, family="deepseek_v2", n_experts=64,
                                        experts_per_token=6, expert_dim=1408, shared_expert_dim=2816, dense_layers=(0,),
                                        router_fp32=True, shared_expert_gate=False, **LATENT,
                                        rope_scaling=RopeScaling(rope_type="yarn", factor=40, original_max_seq_len=4096,
                                                                 mscale_all_dim=0.707)),
    # openai/gpt-oss-20b, openai/gpt-oss-120b (sinks, a window of 128 on every other layer, biases on attention, the
    # router and the experts, the clamped SwiGLU, yarn 32x; read from 16-bit experts, the Hub's MXFP4 ones refused)
    "gpt-oss-20b": ModelConfig(dim=2880, n_layers=24, n_heads=64, n_kv_heads=8, vocab_size=201088, **GPT_OSS,
                               layer_types=("sliding_attention", "full_attention") * 12, n_experts=32),
    "gpt-oss-120b": ModelConfig(dim=2880, n_layers=36, n_heads=64, n_kv_heads=8, vocab_size=201088, **GPT_OSS,
                                layer_types=("sliding_attention", "full_attention") * 18, n_experts=128),
    # MiniMaxAI/MiniMax-M2 (MiniMaxM2Config's defaults, which are its config.json's; rotary_dim 64 of each 128-wide
    # head, as the file says): q/k norms over the whole projections, sigmoid routing with a correction bias
    "minimax-m2-230B": ModelConfig(dim=3072, n_layers=62, n_heads=48, n_kv_heads=8, vocab_size=200064,
                                   intermediate_size=1536, norm_eps=1e-6, rope_theta=5e6, max_seq_len=196608,
                                   family="minimax_m2", explicit_head_dim=128, rotary_dim=64, qk_norm=True,
                                   qk_norm_over="projection", n_experts=256, experts_per_token=8, expert_dim=1536,
                                   norm_topk_prob=True, router_aux_coef=0.001, router_score="sigmoid",
                                   router_bias=True),
    # meta-llama/Llama-4-Scout-17B-16E and -Maverick-17B-128E (their config.json's text_config; the vision tower is
    # left out): RoPE (llama3 x16 on Scout, none on Maverick) with chunks of 8192 on three layers of four, the fourth
    # without RoPE and with the attention temperature (floor_scale 8192, attn_scale 0.1); top-1 sigmoid routing
    "llama4-scout-109B": ModelConfig(**LLAMA4, n_experts=16, qk_l2=True, rope_scaling=RopeScaling(
        factor=16.0, low_freq_factor=1.0, high_freq_factor=1.0, original_max_seq_len=8192), max_seq_len=10485760),
    "llama4-maverick-400B": ModelConfig(**LLAMA4, n_experts=128, dense_layers=tuple(range(0, 48, 2)),
                                        max_seq_len=1048576),
    # deepseek-ai/DeepSeek-V4-Flash(-Base) and -Pro: their config.json files (tests/data; notes/presets-published.md),
    # compress_ratios included (transformers' default layer_types differ from both). MTP layers left out.
    "deepseek-v4-flash-284B": deepseek_v4(4096, 43, 64, 256, 2048, "sliding_attention"),
    "deepseek-v4-pro-1.6T": deepseek_v4(7168, 61, 128, 384, 3072, "heavily_compressed_attention", q_lora_rank=1536,
                                        o_groups=16, index_topk=1024, routed_scale=2.5),
    # Gated DeltaNet among gated attention: Qwen/Qwen3.5-35B-A3B, Qwen/Qwen3.5-122B-A10B, Qwen/Qwen3.5-397B-A17B
    # (vision-language checkpoints: their text_config; the vision tower is left out), Qwen/Qwen3-Next-80B-A3B-Instruct
    "qwen3.5-35B-A3B": qwen35(40, 2048, 16, 32, 256, 8, 512),
    "qwen3.5-122B-A10B": qwen35(48, 3072, 32, 64, 256, 8, 1024),
    "qwen3.5-397B-A17B": qwen35(60, 4096, 32, 64, 512, 10, 1024),
    "qwen3-next-80B-A3B": ModelConfig(dim=2048, n_heads=16, vocab_size=151936, family="qwen3_next",
                                      intermediate_size=5120, **gated_deltanet(48, linear_v_heads=32, n_experts=512,
                                                                                experts_per_token=10, expert_dim=512,
                                                                                shared_expert_dim=512,
                                                                                linear_grouped=True)),
}


def preset(name: str, **overrides) -> ModelConfig:
    """A preset by name, with fields replaced (e.g. n_layers for a cut-down benchmark model)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    cfg = PRESETS[name]
    if "n_layers" in overrides:
        cfg = cfg.first_layers(overrides.pop("n_layers"))
    return dataclasses.replace(cfg, **overrides)
