"""Stores out to one GGUF file (llama.cpp, Ollama, LM Studio): base + adapter merged, streamed.

The file is the one llama.cpp's convert_hf_to_gguf.py writes from phantom's merged Hugging Face export of
the same model: its metadata keys (general.*, the architecture's hyperparameters, tokenizer.ggml.*) in the
same order and values, its tensor names, shapes, types and order (the safetensors order the converter
reads: Hugging Face names in natural order), and the same bytes (gguf's own quantizers). The layout is
planned from shapes first, so the header is written before any weight is read; each part (embed, a
block, head) is then converted and written at its offset, one part in memory at a time.
May import gguf, phantom.arch, phantom.data, phantom.files and phantom.model's checkpoints and HF layout.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch

from phantom.arch.config import ModelConfig
from phantom.arch.family import family
from phantom.files.hfshards import natural_key
from phantom.data.tokenizer import is_tiktoken_file
from phantom.files.store import BlockStore
from phantom.model.checkpoints import part_shapes
from phantom.model.gguf_vocab import add_vocab, read_json
from phantom.model.hflayout import to_hf

T = gguf.GGMLQuantizationType
OUTTYPES = {"f32": (gguf.LlamaFileType.ALL_F32, T.F32), "f16": (gguf.LlamaFileType.MOSTLY_F16, T.F16),
            "bf16": (gguf.LlamaFileType.MOSTLY_BF16, T.BF16), "q8_0": (gguf.LlamaFileType.MOSTLY_Q8_0, T.Q8_0)}
ROUTERS = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")  # kept in f32, as llama.cpp's quantizer keeps them


@dataclass(frozen=True)
class Arch:
    """How llama.cpp's converter class for a family writes it.

    permute_qk: LlamaModel's undo_permute: llama.cpp's `llama` rotates adjacent pairs, so q/k rows go back
    into Meta's interleaved order (the store's own); the other archs rotate Hugging Face's halves.
    llama_keys: LlamaModel's extras: vocab_size, rope.dimension_count, add_space_prefix, and a Llama-style
    tokenizer.json read as sentencepiece pieces."""

    arch: gguf.MODEL_ARCH
    permute_qk: bool = False
    llama_keys: bool = False
    sentencepiece: bool = True  # a tokenizer.model is read first (Qwen-MoE's class reads BPE alone)


ARCHES = {"llama": Arch(gguf.MODEL_ARCH.LLAMA, permute_qk=True, llama_keys=True),
          "mistral": Arch(gguf.MODEL_ARCH.LLAMA, permute_qk=True, llama_keys=True),
          "qwen2": Arch(gguf.MODEL_ARCH.QWEN2),
          "qwen3": Arch(gguf.MODEL_ARCH.QWEN3),
          "qwen3_moe": Arch(gguf.MODEL_ARCH.QWEN3MOE, sentencepiece=False),
          "qwen2_moe": Arch(gguf.MODEL_ARCH.QWEN2MOE, sentencepiece=False)}
# whether llama.cpp renormalizes the chosen experts' weights (build_moe_ffn's norm_w in its src/models/*.cpp)
RENORMALIZES = {"qwen3_moe": True, "qwen2_moe": False}
EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(down|gate|up)_proj\.weight")
PROJECTIONS = ("down", "gate", "up")  # the order the converter stacks a layer's experts in


@dataclass(frozen=True)
class Planned:
    """One tensor of the file: where it comes from (its Hugging Face name; a layer's experts stacked: the
    name of the stack), its GGUF name, shape (rows first, as numpy holds it), type and bytes."""

    hf_name: str
    name: str
    shape: tuple[int, ...]
    qtype: T
    nbytes: int


def converter_order(hf_name: str, cfg: ModelConfig) -> tuple:
    """Where the converter writes a tensor: in the natural order of the Hugging Face names it reads, a
    layer's stacked experts where it reads the last expert's last tensor (down, gate, up)."""
    m = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(down|gate|up)_proj\.weight", hf_name)
    if m is None:
        return natural_key(hf_name), 0
    last = f"model.layers.{m[1]}.mlp.experts.{cfg.n_experts - 1}.up_proj.weight"
    return natural_key(last), PROJECTIONS.index(m[2])


def default_outtype(dtype: torch.dtype) -> str:
    """The converter's "auto": bf16 weights stay bf16, anything else becomes f16."""
    return "bf16" if dtype == torch.bfloat16 else "f16"


def check_supported(store: BlockStore, outtype: str | None = None) -> Arch:
    """The family's Arch, or a ValueError naming what GGUF export does not cover."""
    cfg = store.cfg
    if outtype is not None and outtype not in OUTTYPES:
        raise ValueError(f"--outtype must be one of {', '.join(OUTTYPES)}, not {outtype!r}")
    if cfg.family not in ARCHES:
        raise ValueError(f"GGUF export covers {', '.join(ARCHES)} models; this is a {cfg.family} model: "
                         f"use --format hf (llama.cpp's convert_hf_to_gguf.py reads it)")
    if cfg.rope_scaling is not None and cfg.rope_scaling.rope_type not in ("llama3", "linear"):
        raise ValueError(f"GGUF export covers RoPE scaling llama3 and linear, not {cfg.rope_scaling.rope_type!r}; "
                         f"use --format hf")
    if cfg.family in RENORMALIZES and cfg.norm_topk_prob != RENORMALIZES[cfg.family]:
        raise ValueError(f"llama.cpp's {ARCHES[cfg.family].arch.name.lower()} fixes norm_topk_prob (whether the chosen "
                         f"experts' weights are renormalized) at {str(RENORMALIZES[cfg.family]).lower()}, as the "
                         f"family's own configs set it, and this model sets it otherwise; use --format hf")
    if store.tokenizer_path is None or is_tiktoken_file(store.tokenizer_path):
        raise ValueError(f"{store.path}: GGUF export needs a sentencepiece tokenizer.model or a tokenizer.json "
                         f"(llama.cpp reads its vocabulary from the file), and this store has neither")
    return ARCHES[cfg.family]


def tensor_type(name: str, shape: tuple[int, ...], qtype: T) -> T:
    """The converter's rule: vectors, norms, biases and routers in f32; q8_0 rows that are not whole
    blocks of 32 in f16 (its QuantError fallback); the rest in the file's type."""
    if len(shape) <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight") or \
            name.split(".", 2)[-1] in ROUTERS:
        return T.F32
    if shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:
        return T.F16
    return qtype


def llama_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Hugging Face's half-split q/k rows -> interleaved pairs, per head (the converter's LlamaModel.permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(cfg: ModelConfig, arch: Arch, part: str | int, tensors: dict[str, torch.Tensor]) -> dict:
    """{Hugging Face name: (GGUF name, tensor)} of one part, as the converter maps and permutes them."""
    tmap = gguf.get_tensor_name_map(arch.arch, cfg.n_layers)
    out = {}
    for hf_name, t in to_hf(cfg, part, tensors).items():
        if arch.permute_qk and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            t = llama_permute(t, cfg.n_heads)
        elif arch.permute_qk and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            t = llama_permute(t, cfg.kv_heads)
        out[hf_name] = t
    out = stack_experts(cfg, out)
    names = {hf_name: tmap.get_name(hf_name, try_suffixes=(".weight", ".bias")) for hf_name in out}
    if missing := [n for n, g in names.items() if g is None]:
        raise AssertionError(f"gguf has no {arch.arch.name} name for {missing}")
    return {hf_name: (names[hf_name], t) for hf_name, t in out.items()}


def stack_experts(cfg: ModelConfig, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each layer's experts as one (experts, rows, columns) tensor per projection, named
    model.layers.L.mlp.experts.{down,gate,up}_proj.weight, as the converter stacks them."""
    experts = {n: EXPERT.fullmatch(n) for n in hf}
    out = {n: t for n, t in hf.items() if experts[n] is None}
    for layer in sorted({int(m[1]) for m in experts.values() if m is not None}):
        for proj in PROJECTIONS:
            parts = [hf[f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj.weight"] for e in range(cfg.n_experts)]
            out[f"model.layers.{layer}.mlp.experts.{proj}_proj.weight"] = torch.stack(parts)
    return out


def rope_freqs(cfg: ModelConfig) -> torch.Tensor | None:
    """Llama-3.1's RoPE scaling as llama.cpp reads it: each frequency's divisor (LlamaModel.generate_extra_tensors)."""
    s = cfg.rope_scaling
    if s is None or s.rope_type != "llama3":
        return None
    freqs = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim))
    low, high = s.original_max_seq_len / s.low_freq_factor, s.original_max_seq_len / s.high_freq_factor
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high:
            factors.append(1)
        elif wavelen > low:
            factors.append(s.factor)
        else:
            smooth = (s.original_max_seq_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
            factors.append(1 / ((1 - smooth) / s.factor + smooth))
    return torch.tensor(factors, dtype=torch.float32)


def plan(cfg: ModelConfig, arch: Arch, qtype: T) -> list[Planned]:
    """Every tensor of the file, in the converter's order, from shapes alone (meta tensors)."""
    out = []
    for part in ("embed", *range(cfg.n_layers), "head"):
        meta = {n: torch.empty(s, device="meta") for n, s in part_shapes(cfg, part).items()}
        for hf_name, (name, t) in gguf_tensors(cfg, arch, part, meta).items():
            shape = tuple(t.shape)
            q = tensor_type(name, shape, qtype)
            block, size = gguf.GGML_QUANT_SIZES[q]
            out.append(Planned(hf_name, name, shape, q, math.prod(shape) // block * size))
    out.sort(key=lambda p: converter_order(p.hf_name, cfg))
    if (freqs := rope_freqs(cfg)) is not None:  # the converter's extra tensors come first
        out.insert(0, Planned("", "rope_freqs.weight", tuple(freqs.shape), T.F32, freqs.numel() * 4))
    return out


def add_hparams(w: gguf.GGUFWriter, cfg: ModelConfig, arch: Arch, ftype: gguf.LlamaFileType) -> None:
    """The architecture's keys, in the order the converter's TextModel.set_gguf_parameters writes them."""
    w.add_block_count(cfg.n_layers)
    w.add_context_length(cfg.max_seq_len)
    w.add_embedding_length(cfg.dim)
    w.add_feed_forward_length(cfg.hidden_dim)
    w.add_head_count(cfg.n_heads)
    w.add_head_count_kv(cfg.kv_heads)
    if cfg.rope_scaling is not None and cfg.rope_scaling.rope_type == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(cfg.rope_scaling.factor)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    if cfg.n_experts:
        w.add_expert_count(cfg.n_experts)
        w.add_expert_used_count(cfg.experts_per_token)
    w.add_key_length(cfg.head_dim)  # phantom's config.json names head_dim
    w.add_value_length(cfg.head_dim)
    w.add_file_type(ftype)
    if cfg.n_experts:  # Qwen2MoeModel's own keys
        w.add_expert_feed_forward_length(cfg.expert_dim)
        if "shared_expert_intermediate_size" in family(cfg).moe.fields:
            w.add_expert_shared_feed_forward_length(cfg.shared_expert_dim)
    if arch.llama_keys:
        w.add_vocab_size(cfg.vocab_size)
        w.add_rope_dimension_count(cfg.head_dim)


def add_metadata(w: gguf.GGUFWriter, cfg: ModelConfig, arch: Arch, ftype, folder: Path) -> gguf.Metadata:
    """general.* (gguf's Metadata from folder: its name, config.json and generation_config.json), the
    hyperparameters, then the tokenizer, as the converter orders them. The tensor infos must be in w."""
    total, shared, expert, count = w.get_total_parameter_count()
    meta = gguf.Metadata.load(None, folder, None, total)
    meta.name = meta.name or folder.name
    if meta.size_label is None and total > 0:
        meta.size_label = gguf.size_label(total, shared, expert, count)
    w.add_type(gguf.GGUFType.MODEL)
    meta.set_gguf_meta_model(w)
    add_hparams(w, cfg, arch, ftype)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    prefix_space = read_json(folder / "tokenizer_config.json").get("add_prefix_space")
    if arch.llama_keys and prefix_space is not None:
        w.add_add_space_prefix(prefix_space)
    add_vocab(w, folder, cfg.vocab_size, llama_hf=arch.llama_keys, sentencepiece=arch.sentencepiece)
    return meta


def file_name(meta: gguf.Metadata, ftype: gguf.LlamaFileType) -> str:
    """The converter's default name: gguf's naming convention (Name-Size-Type.gguf)."""
    kind = ftype.name.partition("_")[2]
    return gguf.naming_convention(meta.name, meta.basename, meta.finetune, meta.version, meta.size_label, kind) + ".gguf"


CHUNK_BYTES = 64 << 20  # float32 bytes converted at a time: a 128k-token embedding is not copied whole


def encode(t: torch.Tensor, qtype: T) -> bytes:
    """A tensor's bytes in the file: through float32, as the converter reads every 16-bit weight (a tensor
    already of the file's type: its own bytes, which that round trip keeps); bf16 by torch's rounding (to
    nearest even, as gguf's quantizer; several times faster). Where a NaN is, gguf's own (it keeps NaN bits
    its way)."""
    t = t.detach()
    same = {T.BF16: torch.bfloat16, T.F16: torch.float16, T.F32: torch.float32}.get(qtype)
    if same is not None and t.dtype == same and not torch.isnan(t).any():  # exact both ways: the bytes as they are
        return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32).numpy().tobytes()
    f32 = t.to(torch.float32)
    if qtype == T.BF16 and not torch.isnan(f32).any():
        return f32.to(torch.bfloat16).view(torch.int16).numpy().tobytes()
    return gguf.quants.quantize(f32.numpy(), qtype).tobytes()


def write_rows(fd: int, t: torch.Tensor, offset: int, p: Planned) -> None:
    """t's bytes at offset, a slice of rows at a time (each type quantizes rows alone: the same bytes)."""
    rows = t.reshape(-1, t.shape[-1]) if t.dim() > 1 else t.reshape(1, -1)
    step = max(1, CHUNK_BYTES // (rows.shape[1] * 4))
    done = 0
    for i in range(0, rows.shape[0], step):
        data = encode(rows[i:i + step], p.qtype)
        os.pwrite(fd, data, offset + done)
        done += len(data)
    assert done == p.nbytes, (p, done)


def write_gguf(out: Path, cfg: ModelConfig, arch: Arch, parts, outtype: str, folder: Path) -> Path:
    """Write the GGUF file into the folder out from parts ((part, Meta-named tensors), as
    export.merged_parts yields them); folder holds the HF export's config and tokenizer files, named
    as the model. Returns the file's path."""
    ftype, qtype = OUTTYPES[outtype]
    planned = plan(cfg, arch, qtype)
    w = gguf.GGUFWriter(path=None, arch=gguf.MODEL_ARCH_NAMES[arch.arch])
    for p in planned:
        w.add_tensor_info(p.name, p.shape, np.dtype(np.float32), p.nbytes, raw_dtype=p.qtype)
    path = out / file_name(add_metadata(w, cfg, arch, ftype, folder), ftype)
    w.write_header_to_file(path)
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.fout[0].flush()
    start = w.ggml_pad(w.fout[0].tell(), w.data_alignment)
    w.close()
    offsets, at = {}, start
    for p in planned:
        offsets[p.hf_name or p.name] = (at, p)
        at += w.ggml_pad(p.nbytes, w.data_alignment)
    fd = os.open(path, os.O_RDWR)
    try:
        os.truncate(fd, at)  # the padding between tensors: zeros, as the writer pads
        if (freqs := rope_freqs(cfg)) is not None:
            os.pwrite(fd, encode(freqs, T.F32), offsets["rope_freqs.weight"][0])
        for part, tensors in parts:
            for hf_name, (_, t) in gguf_tensors(cfg, arch, part, tensors).items():
                write_rows(fd, t, *offsets[hf_name])
            del tensors  # before the next part is made: one part in memory at a time
        os.fsync(fd)
    finally:
        os.close(fd)
    return path


def export_gguf(store: BlockStore, out: Path, parts, dtype: torch.dtype, outtype: str | None, side: Path) -> Path:
    """Write store's model (parts: merged in dtype) as out/<Name-Size-Type>.gguf plus an Ollama Modelfile;
    side: the HF export's config and tokenizer files, in a folder named as the model."""
    arch = check_supported(store, outtype)
    outtype = outtype or default_outtype(dtype)
    path = write_gguf(out, store.cfg, arch, parts, outtype, side)
    (out / "Modelfile").write_text(f"FROM ./{path.name}\n")  # Ollama reads the chat template from the file
    return path
