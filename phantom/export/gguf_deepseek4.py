"""DeepSeek-V4 out to one GGUF file (llama.cpp's deepseek4), the file llama.cpp's convert_hf_to_gguf.py writes from
the checkpoint as the Hub ships it.

The converter's DeepseekV4Model reads V4 only in the Hub's layout (DeepSeek's names, FP8 tiles with e8m0 scales,
FP4 experts) and keeps its types whatever --outtype says: the FP8 weights dequantized and written Q8_0, the experts'
FP4 bytes repacked into MXFP4 blocks bit for bit (each layer's experts stacked per projection, written first with
the hashed layers' token-to-expert tables as int32), the rest as shipped (2-D bf16 as BF16, 2-D float32 as F32,
vectors F32). A store of that checkpoint holds those very bytes, so the file is written from it: an expert the
adapter leaves as it is from its stored bytes, one it changes quantized again by transformers' MXFP4 rule
(phantom.arch.quant), every FP8 weight from its merged float32 value. Tensors in the natural order of the Hub's
names, as the converter reads them. May import gguf, phantom.arch, phantom.files and the GGUF export's modules.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

import gguf
import numpy as np
import torch

from phantom.arch import quant
from phantom.files.hfshards import natural_key
from phantom.files.store import BlockStore
from phantom.export.gguf_export import Arch, Planned, add_metadata, file_name, tensor_nbytes, write_layout, \
    write_rows
from phantom.export.gguf_hparams import rewriting, text_hparams

T = gguf.GGMLQuantizationType
FTYPE = gguf.LlamaFileType.MOSTLY_MXFP4_MOE  # the converter's, whatever --outtype says
# store name -> (the Hub's name, which orders the converter's reading; the file's name)
TOP = {"tok_embeddings.weight": ("embed.weight", "token_embd.weight"),
       "hc_head.base": ("hc_head_base", "output_hc_base.weight"), "hc_head.fn": ("hc_head_fn", "output_hc_fn.weight"),
       "hc_head.scale": ("hc_head_scale", "output_hc_scale.weight"), "output.weight": ("head.weight", "output.weight"),
       "norm.weight": ("norm.weight", "output_norm.weight")}
COMPRESSOR = {"ape": "ape", "norm.weight": "norm", "wgate.weight": "gate", "wkv.weight": "kv"}
BLOCK = {"attention.sinks": ("attn.attn_sink", "attn_sinks"),
         "attention.kv_norm.weight": ("attn.kv_norm.weight", "attn_kv_a_norm"),
         "attention.q_a_norm.weight": ("attn.q_norm.weight", "attn_q_a_norm"),
         "attention.wkv.weight": ("attn.wkv.weight", "attn_kv"),
         "attention.wo_a.weight": ("attn.wo_a.weight", "attn_output_a"),
         "attention.wo_b.weight": ("attn.wo_b.weight", "attn_output_b"),
         "attention.wq_a.weight": ("attn.wq_a.weight", "attn_q_a"),
         "attention.wq_b.weight": ("attn.wq_b.weight", "attn_q_b"),
         **{f"attention.compressor.{k}": (f"attn.compressor.{k}", f"attn_compressor_{v}") for k, v in COMPRESSOR.items()},
         **{f"attention.indexer.compressor.{k}": (f"attn.indexer.compressor.{k}", f"indexer_compressor_{v}")
            for k, v in COMPRESSOR.items()},
         "attention.indexer.weights_proj.weight": ("attn.indexer.weights_proj.weight", "indexer.proj"),
         "attention.indexer.wq_b.weight": ("attn.indexer.wq_b.weight", "indexer.attn_q_b"),
         "attention_norm.weight": ("attn_norm.weight", "attn_norm"), "ffn_norm.weight": ("ffn_norm.weight", "ffn_norm"),
         "feed_forward.gate.weight": ("ffn.gate.weight", "ffn_gate_inp"),
         "feed_forward.gate.e_score_correction_bias": ("ffn.gate.bias", "exp_probs_b"),
         **{f"feed_forward.shared_expert.{w}.weight": (f"ffn.shared_experts.{w}.weight", f"ffn_{p}_shexp")
            for w, p in (("w1", "gate"), ("w2", "down"), ("w3", "up"))},
         **{f"hc_{s}.{p}": (f"hc_{s}_{p}", f"hc_{s}_{p}") for s in ("attn", "ffn") for p in ("base", "fn", "scale")}}
# llama.cpp's chat templates for DeepSeek-V4 (its models/templates, MIT: assets/llamacpp/LICENSE), which the
# converter writes before any key but the architecture, and the tokenizer's own template then replaces in place
TEMPLATES = Path(__file__).resolve().parent.parent / "assets" / "llamacpp"
EXPERTS = (("w1", "ffn_gate_exps"), ("w2", "ffn_down_exps"), ("w3", "ffn_up_exps"))  # the converter's order
TID2EID = "feed_forward.gate.tid2eid"


def refusal(store: BlockStore, outtype: str | None) -> str | None:
    """What this file cannot be: the converter writes V4 only from the FP8 and FP4 checkpoint the Hub ships, in its
    own types; llama.cpp's deepseek4 scores experts by sqrt(softplus), mixes 4 streams, and takes a compression rate
    of 4 as compressed sparse attention (its indexer), any other as heavily compressed."""
    cfg = store.cfg
    if store.quant is None or store.quant.experts != "mxfp4" or not store.quant.shipped:
        return ("GGUF export of DeepSeek-V4 writes what llama.cpp's converter writes from the checkpoint as the Hub "
                "ships it (FP8 tiles, FP4 experts), and this store is not of one; prepare the store from it")
    if outtype is not None:
        return ("GGUF export of DeepSeek-V4 keeps the checkpoint's types, as llama.cpp's converter does (FP8 as Q8_0, "
                "FP4 experts as MXFP4, the rest as shipped): drop --outtype")
    if cfg.router_score != "sqrtsoftplus":
        return f"llama.cpp's deepseek4 scores experts by sqrt(softplus), and this model by {cfg.router_score}"
    if cfg.hc_mult != 4:
        return f"llama.cpp's deepseek4 mixes 4 residual streams, and this model {cfg.hc_mult}"
    if cfg.csa_rate != 4 or cfg.hca_rate == 4:
        return (f"llama.cpp's deepseek4 takes a compression rate of 4 as compressed sparse attention and any other as "
                f"heavily compressed, and this model's rates are {cfg.csa_rate} and {cfg.hca_rate}")
    if tuple(cfg.hash_layers) != tuple(range(len(cfg.hash_layers))):
        return "llama.cpp's deepseek4 hashes the first hash_layer_count layers, and this model's hashed layers differ"
    return None


def deepseek4_hparams(w: gguf.GGUFWriter, c: dict, ftype) -> None:
    """DeepseekV4Model's keys, read from the HF export's config.json (transformers' fields) as the converter reads
    the Hub's: TextModel's base keys (the compressed layers' YaRN as the file's scaling, the sliding layers' base
    as its frequency base, no feed-forward length), then V4's own."""
    rope = c["rope_parameters"]
    compress = rope.get("compress", {})
    yarn = {k: compress[k] for k in ("rope_type", "factor", "original_max_position_embeddings", "beta_fast",
                                     "beta_slow")} if compress.get("rope_type") == "yarn" else {}
    base = {k: c[k] for k in ("num_hidden_layers", "max_position_embeddings", "hidden_size", "num_attention_heads",
                              "num_key_value_heads", "rms_norm_eps", "n_routed_experts", "num_experts_per_tok",
                              "head_dim")}
    text_hparams(w, {**base, "scoring_func": c["scoring_func"],
                     "rope_parameters": {**yarn, "rope_theta": rope["main"]["rope_theta"]}}, ftype)
    layers = c["num_hidden_layers"]
    rates = c["compress_rates"]
    w.add_rope_dimension_count(int(c["head_dim"] * c["partial_rotary_factor"]))
    w.add_q_lora_rank(c["q_lora_rank"])
    w.add_sliding_window(c["sliding_window"])
    w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    w.add_expert_shared_count(c["n_shared_experts"])
    w.add_expert_weights_scale(c["routed_scaling_factor"])
    w.add_expert_weights_norm(True)  # DeepseekV4 always renormalizes the chosen experts' weights
    w.add_swiglu_clamp_exp([c["swiglu_limit"]] * layers)
    w.add_swiglu_clamp_shexp([c["swiglu_limit"]] * layers)
    for key, field in (("head_count", "index_n_heads"), ("key_length", "index_head_dim"), ("top_k", "index_topk")):
        w.add_uint32(f"{w.arch}.attention.indexer.{key}", c[field])
    w.add_uint32(f"{w.arch}.attention.output_group_count", c["o_groups"])
    w.add_uint32(f"{w.arch}.attention.output_lora_rank", c["o_lora_rank"])
    w.add_array(f"{w.arch}.attention.compress_ratios", [rates.get(t, 0) for t in c["layer_types"]])
    w.add_float32(f"{w.arch}.attention.compress_rope_freq_base", c["compress_rope_theta"])
    w.add_uint32(f"{w.arch}.hyper_connection.count", c["hc_mult"])
    w.add_uint32(f"{w.arch}.hyper_connection.sinkhorn_iterations", c["hc_sinkhorn_iters"])
    w.add_float32(f"{w.arch}.hyper_connection.epsilon", c["hc_eps"])
    w.add_uint32(f"{w.arch}.hash_layer_count", sum(t == "hash_moe" for t in c["mlp_layer_types"]))
    w.add_uint32(f"{w.arch}.embedding_length_out", c["hidden_size"] * c["hc_mult"])


ARCH = Arch(gguf.MODEL_ARCH.DEEPSEEK2, deepseek4_hparams, vocab="bpe", name="deepseek4")  # arch: a placeholder
# (gguf's package has no deepseek4; the file's architecture is name, its tensors named here)


def repack_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    """A weight's MXFP4 parts (rows, cols/2 bytes: two e2m1 codes a byte, the first low; rows, cols/32 E8M0 scales)
    as ggml's block_mxfp4 rows: per 32 values its scale byte, then 16 bytes holding value j low and j + 16 high
    (the converter's repack_mxfp4_blocks: bits moved, none changed)."""
    rows, n = scales.shape
    src = blocks.reshape(rows, n, 16)
    vals = torch.stack((src & 0x0F, src >> 4), dim=-1).reshape(rows, n, 32)
    codes = vals[:, :, :16] | (vals[:, :, 16:] << 4)
    return torch.cat((scales.unsqueeze(-1), codes), dim=-1).reshape(rows, n * 17).numpy()


def plain_type(shape: tuple[int, ...], dtype: torch.dtype) -> T:
    """A tensor the checkpoint ships unquantized: vectors F32, matrices in their own type (bf16 or float32)."""
    return T.F32 if len(shape) < 2 or dtype == torch.float32 else T.BF16


def plan(store: BlockStore) -> list[Planned]:
    """Every tensor of the file in the converter's order: the hashed layers' tables, each layer's stacked experts,
    then the rest in the natural order of the Hub's names (hf_name: the store's part and name)."""
    cfg, first, rest = store.cfg, [], []
    for i in cfg.hash_layers:
        shape = (cfg.vocab_size, cfg.experts_per_token)
        first.append(Planned(f"{i}:{TID2EID}", f"blk.{i}.ffn_gate_tid2eid.weight", shape, T.I32,
                             tensor_nbytes(shape, T.I32)))
    for i in range(cfg.n_layers):
        specs = {s.name: s for s in store.blocks[i].specs}
        for w, name in EXPERTS:
            stored = tuple(specs[f"feed_forward.experts.0.{w}.weight.blocks"].shape)  # (rows, groups, 16) bytes
            shape = (cfg.n_experts, stored[0], math.prod(stored[1:]) * 2)
            first.append(Planned(f"{i}:{w}", f"blk.{i}.{name}.weight", shape, T.MXFP4,
                                 tensor_nbytes(shape, T.MXFP4)))
        for name, (hub, gg) in BLOCK.items():
            if name in specs or f"{name}.fp8" in specs:
                shape = tuple(specs[f"{name}.fp8"].shape if f"{name}.fp8" in specs else specs[name].shape)
                q = T.Q8_0 if f"{name}.fp8" in specs else plain_type(shape, specs[name].dtype)
                if name == "feed_forward.gate.e_score_correction_bias" and i in cfg.hash_layers:
                    continue  # the converter drops a hashed layer's bias (tid2eid routes it)
                suffix = ".bias" if name.endswith("bias") else ".weight"
                rest.append(Planned(f"{i}:{name}", f"blk.{i}.{gg}{suffix}", shape, q, tensor_nbytes(shape, q),
                                    natural_key(f"layers.{i}.{hub}")))
    for part in ("embed", "head"):
        for s in (store.embed if part == "embed" else store.head).specs:
            hub, gg = TOP[s.name]
            shape = tuple(s.shape)
            q = plain_type(shape, s.dtype)
            rest.append(Planned(f"{part}:{s.name}", gg, shape, q, tensor_nbytes(shape, q), natural_key(hub)))
    return first + sorted(rest, key=lambda p: p.order)


def expert_rows(store: BlockStore, i: int, merged: dict[str, torch.Tensor], w: str) -> np.ndarray:
    """Layer i's experts of projection w as the file's MXFP4 rows: an expert's stored bytes where its merged value is
    the stored one dequantized (the adapter left it), else its merged value quantized by transformers' rule."""
    buf = torch.empty(store.block_size(i), dtype=torch.uint8)
    store.read_block_into(i, buf)
    stored = store.block_views(buf, i)
    out = []
    for e in range(store.cfg.n_experts):
        name = f"feed_forward.experts.{e}.{w}.weight"
        parts = {"blocks": stored[f"{name}.blocks"], "scales": stored[f"{name}.scales"]}
        value = merged[name].to(torch.float32)
        if not torch.equal(quant.dequantize_mxfp4_into(parts, torch.empty_like(value)), value):
            parts = quant.quantize_mxfp4(value)
        out.append(repack_mxfp4(parts["blocks"].reshape(value.shape[0], -1), parts["scales"]))
    return np.stack(out)


def default_template(name: str) -> str:
    """llama.cpp's template the converter writes for a V4 named name: DeepSeek-V4-Flash-0731's where the name says
    0731, else DeepSeek-V4's."""
    template = "deepseek-ai-DeepSeek-V4-Flash-0731.jinja" if "0731" in name else "deepseek-ai-DeepSeek-V4.jinja"
    return (TEMPLATES / template).read_text(encoding="utf-8")


def write(out: Path, store: BlockStore, parts, side: Path) -> Path:
    """out/<Name-Size-MXFP4_MOE>.gguf from parts (("embed" | block | "head", store-named tensors merged in
    float32), as export.merged_parts yields them) and the store's stored experts; side: the HF export's config and
    tokenizer files, in a folder named as the model."""
    cfg, planned = store.cfg, plan(store)
    w = gguf.GGUFWriter(path=None, arch=ARCH.file_arch)
    w.add_chat_template(default_template(side.name))
    for p in planned:
        w.add_tensor_info(p.name, p.shape, np.dtype(np.float32), p.nbytes, raw_dtype=p.qtype)
    with rewriting():  # the tokenizer's own chat template, where it has one, in the default's place
        path = out / file_name(add_metadata(w, cfg, ARCH, FTYPE, side), FTYPE)
    offsets, at = write_layout(w, path, planned)
    fd, written = os.open(path, os.O_RDWR), set()
    try:
        os.truncate(fd, at)
        for part, tensors in parts:
            for name, t in tensors.items():
                key = f"{part}:{name}"
                if name == TID2EID:
                    ids = (t[..., 0].long() * 256 + t[..., 1].long()).to(torch.int32)  # its two base-256 digits
                    os.pwrite(fd, ids.numpy().tobytes(), offsets[key][0])
                elif key in offsets:  # (not a hashed layer's correction bias, which the converter drops)
                    write_rows(fd, t, *offsets[key])
                written.add(key)
            for w_, _ in EXPERTS if isinstance(part, int) else ():
                os.pwrite(fd, expert_rows(store, part, tensors, w_).tobytes(), offsets[f"{part}:{w_}"][0])
                written.add(f"{part}:{w_}")
            del tensors
        assert written >= set(offsets), sorted(set(offsets) - written)  # every planned tensor has its bytes
        os.fsync(fd)
    finally:
        os.close(fd)
    return path

