"""Hugging Face's layout of a phantom model: its config.json and its tensors' names and q/k row order.

What the HF export writes and the GGUF export converts from (llama.cpp's converter reads that layout): one
place says how phantom's ModelConfig and Meta-named tensors look to transformers. May import phantom.arch.
"""
from __future__ import annotations

import torch

from phantom.arch.config import ModelConfig
from phantom.arch.family import family
from phantom.arch.family_moe import FUSED_EXPERTS, MOE_FIELDS
from phantom.arch.ops import permute_for_hf, rope_rows
from phantom.files.tensorfile import dtype_name


def hf_config(cfg: ModelConfig, dtype: torch.dtype) -> dict:
    """config.json for the family's own transformers class (the fields phantom.arch.family reads back)."""
    fam = family(cfg)
    c = {"architectures": [fam.hf_class], "model_type": fam.model_type, "hidden_size": cfg.dim,
         "intermediate_size": cfg.hidden_dim, "num_hidden_layers": cfg.n_layers,
         "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
         "vocab_size": cfg.vocab_size, "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
         "max_position_embeddings": cfg.max_seq_len, "hidden_act": cfg.activation,
         "tie_word_embeddings": cfg.tie_embeddings, "torch_dtype": dtype_name(dtype),
         "pad_token_id": None}  # the tokenizer's files say it; a class default (Phi-3's 32000) may exceed the vocab
    if "attention_bias" in fam.readers:
        c["attention_bias"] = cfg.qkv_bias
    if "mlp_bias" in fam.readers:
        c["mlp_bias"] = cfg.mlp_bias
    if "qkv_bias" in fam.readers:  # Qwen2-MoE
        c["qkv_bias"] = cfg.qkv_bias
    if "use_sliding_window" in fam.readers:  # Qwen: the window and the layers it applies to
        c.update(use_sliding_window=cfg.sliding_window is not None, sliding_window=cfg.sliding_window,
                 max_window_layers=cfg.n_layers)
        if cfg.sliding_window is not None:
            c["layer_types"] = ["sliding_attention" if cfg.window(i) else "full_attention"
                                for i in range(cfg.n_layers)]
    elif "sliding_window" in fam.readers:
        c["sliding_window"] = cfg.sliding_window
    if "hidden_activation" in fam.readers:  # Gemma
        c.update(hidden_activation=cfg.activation, query_pre_attn_scalar=cfg.query_pre_attn_scalar,
                 attn_logit_softcapping=cfg.attn_softcap, final_logit_softcapping=cfg.final_softcap,
                 sliding_window=cfg.sliding_window, attention_bias=cfg.qkv_bias,
                 layer_types=["sliding_attention" if cfg.window(i) else "full_attention" for i in range(cfg.n_layers)])
    if cfg.local_rope_theta is not None:  # a RoPE per layer type (Gemma-3)
        del c["rope_theta"]
        c["rope_parameters"] = {"full_attention": {**rope_scaling_json(cfg), "rope_theta": cfg.rope_theta},
                                "sliding_attention": {"rope_type": "default", "rope_theta": cfg.local_rope_theta}}
    elif cfg.rope_scaling is not None:
        c["rope_scaling"] = rope_scaling_json(cfg)
    if fam.moe is not None:  # the experts' fields, as the family's config class names them
        c.update({f: getattr(cfg, MOE_FIELDS[f]) for f in fam.moe.fields})
    if "mlp_only_layers" in fam.readers:  # Qwen-MoE: its dense layers among sparse ones
        c.update(mlp_only_layers=list(cfg.dense_layers), decoder_sparse_step=1)
    if cfg.rotary_dim is not None and not cfg.kv_lora_rank:  # Phi-4-mini (latent attention: its own fields)
        c["partial_rotary_factor"] = cfg.rotary_dim / cfg.head_dim
    if fam.hf_fields is not None:
        c.update(fam.hf_fields(cfg))
    if "original_max_position_embeddings" in fam.readers:  # Phi-3: read before rope_scaling's own
        c["original_max_position_embeddings"] = rope_scaling_json(cfg).get("original_max_position_embeddings",
                                                                           cfg.max_seq_len)
    return c


def rope_scaling_json(cfg: ModelConfig) -> dict:
    s = cfg.rope_scaling
    if s is None:
        return {"rope_type": "default"}
    if s.rope_type == "linear":
        return {"rope_type": "linear", "factor": s.factor}
    if s.rope_type == "longrope":  # factor: max_position_embeddings over the original context, as it was read
        return {"rope_type": "longrope", "short_factor": list(s.short_factor), "long_factor": list(s.long_factor),
                "attention_factor": s.attention_factor, "original_max_position_embeddings": s.original_max_seq_len}
    if s.rope_type == "yarn":
        return {"rope_type": "yarn", "factor": s.factor, "original_max_position_embeddings": s.original_max_seq_len,
                "beta_fast": s.beta_fast, "beta_slow": s.beta_slow, "attention_factor": s.attention_factor,
                "truncate": s.truncate, **({"mscale_all_dim": s.mscale_all_dim} if s.mscale_all_dim else {})}
    return {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor, "original_max_position_embeddings": s.original_max_seq_len}


def to_hf(cfg: ModelConfig, part: str | int, tensors: dict[str, torch.Tensor],
          fused_experts: bool = False) -> dict[str, torch.Tensor]:
    """Store names and q/k layout -> the family's Hugging Face names and layout (its conversion script's
    permute); the parts of a fused tensor (Phi-3's qkv_proj) stacked by rows, in the family's order.
    Experts one tensor each (what save_pretrained writes), or transformers 5's 3-D tensors."""
    fam, permuted = family(cfg), rope_rows(cfg)
    halves = fam.moe is not None and fam.moe.turned == "halves"  # Llama 4's (experts, in, out): gate then up
    fused_experts = fused_experts or cfg.interleaved_experts or halves  # gpt-oss's, Llama 4's have no other layout
    hf = {name: permute_for_hf(t, permuted[name], cfg.rope_dim) if name in permuted else
          (t[..., 0].long() * 256 + t[..., 1].long()) if name.endswith(".tid2eid") else t  # its digits (config.py)
          for name, t in tensors.items()}
    out = {}
    hf_names, fused = fam.layout(cfg, fused_experts)
    for key, names in fused.items() if isinstance(part, int) else ():
        if present := [n for n in names if n in hf]:
            if len(present) != len(names):
                raise ValueError(f"{key.format(part)} fuses {', '.join(names)}: {', '.join(present)} alone given")
            if (cfg.interleaved_experts or halves) and key in fam.moe.fused:
                out[key.format(part)] = interleave_experts([hf.pop(n) for n in names], cfg.n_experts, halves)
                continue
            out[key.format(part)] = torch.cat([hf.pop(n) for n in names])
            if fused_experts and key in FUSED_EXPERTS:  # (experts, rows of each, columns)
                out[key.format(part)] = out[key.format(part)].unflatten(0, (cfg.n_experts, -1))
    return out | {hf_names[(isinstance(part, int), name)].format(part): t.contiguous() for name, t in hf.items()}


def interleave_experts(tensors: list[torch.Tensor], n_experts: int, halves: bool = False) -> torch.Tensor:
    """Each expert's parts (gate and up, or down; expert after expert, each (out, in) or (out,)) as gpt-oss's
    3-D tensor: (experts, in, parts * out), the parts alternating on the last dim (phantom.files.fusedrows
    reads them back); with halves (Llama 4's), one part after the other on the last dim."""
    parts = len(tensors) // n_experts
    turned = [t.T if t.dim() == 2 else t for t in tensors]
    if halves:
        return torch.stack([torch.cat(turned[e * parts:(e + 1) * parts], dim=-1) for e in range(n_experts)])
    return torch.stack([torch.stack(turned[e * parts:(e + 1) * parts], dim=-1).flatten(-2)
                        for e in range(n_experts)])
