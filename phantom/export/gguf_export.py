"""Stores out to one GGUF file (llama.cpp, Ollama, LM Studio): base + adapter merged, streamed.

The file is the one llama.cpp's convert_hf_to_gguf.py writes from phantom's merged Hugging Face export of
the same model: its metadata keys (general.*, the architecture's hyperparameters, tokenizer.ggml.*) in the
same order and values, its tensor names, shapes, types and order (the safetensors order the converter
reads: Hugging Face names in natural order), and the same bytes (gguf's own quantizers). The layout is
planned from shapes first, so the header is written before any weight is read; each part (embed, a
block, head) is then converted and written at its offset, one part in memory at a time.
Each family's converter class (its architecture, keys and tensor changes) is in gguf_arch. May import gguf,
phantom.arch, phantom.data, phantom.files and phantom.model's checkpoints, HF layout and GGUF modules.
"""
from __future__ import annotations

import logging
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch

from phantom.arch.config import ModelConfig
from phantom.files.hfshards import natural_key
from phantom.data.tokenizer import is_tiktoken_file
from phantom.files.store import BlockStore
from phantom.convert.checkpoints import part_shapes
from phantom.export.gguf_arch import ARCHES, Arch, add_early_keys, config_refusal, embed_rows, extra_tensors, \
    refusal, yarn_difference
from phantom.export.gguf_vocab import add_vocab, phi3_name_refusal, read_json
from phantom.convert.hflayout import to_hf

log = logging.getLogger(__name__)

T = gguf.GGMLQuantizationType
OUTTYPES = {"f32": (gguf.LlamaFileType.ALL_F32, T.F32), "f16": (gguf.LlamaFileType.MOSTLY_F16, T.F16),
            "bf16": (gguf.LlamaFileType.MOSTLY_BF16, T.BF16), "q8_0": (gguf.LlamaFileType.MOSTLY_Q8_0, T.Q8_0)}
# kept in f32, as llama.cpp's quantizer keeps them: routers, the convolution of linear attention, the DSA indexer's
# head weights
KEPT_F32 = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "ssm_conv1d.weight", "indexer.proj.weight")


@dataclass(frozen=True)
class Planned:
    """One tensor of the file: where it comes from (its Hugging Face name, or the name a family's reshape gives
    it; a layer's experts stacked: the name of the stack), its GGUF name, shape (rows first, as numpy holds it),
    type and bytes, and where the converter writes it."""

    hf_name: str
    name: str
    shape: tuple[int, ...]
    qtype: T
    nbytes: int
    order: tuple = ()


def converter_order(hf_name: str, source: tuple[str, int], arch: Arch, cfg: ModelConfig) -> tuple:
    """Where the converter writes a tensor: in the natural order of the Hugging Face names it reads (source:
    that name and the tensor's place among those the family's reshape makes of it), a layer's stacked experts
    where it reads the last expert's last tensor, in the order it stacks them."""
    if source[0] != hf_name:  # made by the family's reshape
        return natural_key(source[0]), source[1]
    stack, projections = arch.experts
    prefix, _, rest = hf_name.partition(".experts.")
    layer = re.fullmatch(r"model\.layers\.(\d+)\.\w+", prefix)
    if layer is None or rest.removesuffix(".weight") not in projections or \
            prefix + ".experts" != stack.format(layer[1]):
        return natural_key(hf_name), 0
    last = f"{stack.format(layer[1])}.{cfg.n_experts - 1}.{projections[-1]}.weight"
    return natural_key(last), projections.index(rest.removesuffix(".weight"))


def default_outtype(dtype: torch.dtype) -> str:
    """The converter's "auto": bf16 weights stay bf16, anything else becomes f16."""
    return "bf16" if dtype == torch.bfloat16 else "f16"


def check_supported(store: BlockStore, outtype: str | None = None) -> Arch:
    """The family's Arch, or a ValueError naming what GGUF export does not cover."""
    cfg = store.cfg
    if outtype is not None and outtype not in OUTTYPES:
        raise ValueError(f"--outtype must be one of {', '.join(OUTTYPES)}, not {outtype!r}")
    if cfg.hc_mult:  # DeepseekV4ForCausalLM
        raise ValueError("a GGUF LoRA adapter of DeepSeek-V4 is not written (llama.cpp's converter writes none for "
                         "it): export the merged model, --format gguf or hf")
    if cfg.family not in ARCHES:
        raise ValueError(f"GGUF export covers {', '.join(ARCHES)} models; this is a {cfg.family} model: "
                         f"use --format hf (llama.cpp's convert_hf_to_gguf.py reads it)")
    if (why := refusal(cfg)) is not None:
        raise ValueError(f"{why}; use --format hf")
    if (difference := yarn_difference(cfg)) is not None:
        log.warning("%s", difference)
    if store.tokenizer_path is None or is_tiktoken_file(store.tokenizer_path):
        raise ValueError(f"{store.path}: GGUF export needs a sentencepiece tokenizer.model or a tokenizer.json "
                         f"(llama.cpp reads its vocabulary from the file), and this store has neither")
    if cfg.family == "gemma2" and store.tokenizer_path.name != "tokenizer.model":
        raise ValueError(f"{store.path}: llama.cpp's converter reads Gemma-2's vocabulary from a sentencepiece "
                         f"tokenizer.model, and this store has none; use --format hf")
    return ARCHES[cfg.family]


def tensor_type(name: str, shape: tuple[int, ...], qtype: T) -> T:
    """The converter's rule: vectors, norms, biases, routers and convolutions in f32; q8_0 rows that are not whole
    blocks of 32 in f16 (its QuantError fallback); the rest in the file's type."""
    if len(shape) <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight") or \
            name.split(".", 2)[-1] in KEPT_F32:
        return T.F32
    if shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:
        return T.F16
    return qtype


def llama_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Hugging Face's half-split q/k rows -> interleaved pairs, per head (the converter's LlamaModel.permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(cfg: ModelConfig, arch: Arch, part: str | int, tensors: dict[str, torch.Tensor],
                 embed_rows: int | None = None) -> dict:
    """{Hugging Face name: (GGUF name, tensor, source)} of one part, as the converter maps, permutes, shifts and
    reshapes them (source: converter_order's); embed_rows: the rows of the embedding it keeps (Gemma3Model
    drops those past the tokenizer's)."""
    tmap = gguf.get_tensor_name_map(arch.arch, cfg.n_layers)
    out, sources = {}, {}
    for hf_name, t in to_hf(cfg, part, tensors).items():
        if arch.drop_head and hf_name == "lm_head.weight":
            continue
        if arch.permute_qk and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            t = llama_permute(t, cfg.n_heads)
        elif arch.permute_qk and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            t = llama_permute(t, cfg.kv_heads)
        if arch.norm_shift and hf_name.endswith("norm.weight") and not hf_name.endswith("linear_attn.norm.weight"):
            t = (t if t.dtype in (torch.float16, torch.float32) else t.to(torch.float32)) + 1  # as the converter
        if embed_rows is not None and hf_name == "model.embed_tokens.weight":
            t = t[:embed_rows]
        for i, (name, u) in enumerate(arch.reshape(cfg, hf_name, t) if arch.reshape else [(hf_name, t)]):
            out[name], sources[name] = u, (hf_name, i)
    out = stack_experts(cfg, arch, out)
    names = {hf_name: tmap.get_name(hf_name.replace("e_score_correction_bias", "e_score_correction.bias"),
                                    try_suffixes=(".weight", ".bias")) for hf_name in out}  # as filter_tensors
    if missing := [n for n, g in names.items() if g is None]:
        raise AssertionError(f"gguf has no {arch.arch.name} name for {missing}")
    return {hf_name: (names[hf_name], t, sources.get(hf_name, (hf_name, 0))) for hf_name, t in out.items()}


def stack_experts(cfg: ModelConfig, arch: Arch, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each layer's experts as one (experts, rows, columns) tensor per projection, named as the stack
    (model.layers.L.mlp.experts.down_proj.weight ...), as the converter stacks them."""
    stack, projections = arch.experts
    out = dict(hf)
    for layer in range(cfg.n_layers) if cfg.n_experts else ():
        names = {p: [f"{stack.format(layer)}.{e}.{p}.weight" for e in range(cfg.n_experts)] for p in projections}
        if names[projections[0]][0] in hf:
            for p in projections:
                out[f"{stack.format(layer)}.{p}.weight"] = torch.stack([out.pop(n) for n in names[p]])
    return out


def plan(cfg: ModelConfig, arch: Arch, qtype: T, embed_rows: int | None) -> list[Planned]:
    """Every tensor of the file, in the converter's order, from shapes alone (meta tensors)."""
    out = []
    for part in ("embed", *range(cfg.n_layers), "head"):
        meta = {n: torch.empty(s, device="meta") for n, s in part_shapes(cfg, part).items()}
        for hf_name, (name, t, source) in gguf_tensors(cfg, arch, part, meta, embed_rows).items():
            shape = tuple(t.shape)
            q = tensor_type(name, shape, qtype)
            out.append(Planned(hf_name, name, shape, q, tensor_nbytes(shape, q),
                               converter_order(hf_name, source, arch, cfg)))
    out.sort(key=lambda p: p.order)
    extra = [Planned("", name, tuple(t.shape), T.F32, t.numel() * 4) for name, t in extra_tensors(cfg).items()]
    return extra + out  # the converter's extra tensors come first


def add_metadata(w: gguf.GGUFWriter, cfg: ModelConfig, arch: Arch, ftype, folder: Path) -> gguf.Metadata:
    """general.* (gguf's Metadata from folder: its name, config.json and generation_config.json), the
    hyperparameters, then the tokenizer, as the converter orders them. The tensor infos must be in w. Raises
    ValueError where llama.cpp would not load the vocabulary under the file's name (gguf_vocab.phi3_name_refusal)
    or its converter would not read it (DeepSeek-V3.2's without add_bos_token)."""
    total, shared, expert, count = w.get_total_parameter_count()
    meta = gguf.Metadata.load(None, folder, None, total)
    meta.name = meta.name or folder.name
    if meta.size_label is None and total > 0:
        meta.size_label = gguf.size_label(total, shared, expert, count)
    add_early_keys(w, cfg)
    w.add_type(gguf.GGUFType.MODEL)
    meta.set_gguf_meta_model(w)
    config = read_json(folder / "config.json")
    config = {**config, **config.get("text_config", {})}  # a vision-language model's text model, as TextModel reads it
    if (why := config_refusal(cfg, arch, config)) is not None:
        raise ValueError(why)
    arch.hparams(w, config, ftype)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    tokenizer_config = read_json(folder / "tokenizer_config.json")
    if arch.name == "deepseek32" and tokenizer_config.get("add_bos_token") is not True:
        raise ValueError("llama.cpp's converter reads DeepSeek-V3.2's vocabulary only where tokenizer_config.json says "
                         "add_bos_token true (DeepseekV32Model asserts it), and this tokenizer's does not")
    prefix_space = tokenizer_config.get("add_prefix_space")
    if arch.vocab == "llama" and prefix_space is not None:
        w.add_add_space_prefix(prefix_space)
    add_vocab(w, folder, cfg.vocab_size, arch.vocab)
    if (why := phi3_name_refusal(meta.name, w.kv_data[0][gguf.Keys.Tokenizer.LIST].value)) is not None:
        raise ValueError(why)
    if arch.space_prefix and (folder / "tokenizer.model").is_file():
        w.add_add_space_prefix(False)
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


def write_layout(w: gguf.GGUFWriter, path: Path, planned: list[Planned]) -> tuple[dict, int]:
    """w's header, keys and tensor infos into path; ({hf_name (or name): (data offset, Planned)}, the file's end):
    where each tensor's bytes go, aligned as the writer aligns them."""
    w.write_header_to_file(path)
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.fout[0].flush()
    at = w.ggml_pad(w.fout[0].tell(), w.data_alignment)
    w.close()
    offsets = {}
    for p in planned:
        offsets[p.hf_name or p.name] = (at, p)
        at += w.ggml_pad(p.nbytes, w.data_alignment)
    return offsets, at


def tensor_nbytes(shape: tuple[int, ...], qtype: T) -> int:
    """A tensor's bytes in qtype (whole blocks of its last dim)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    return math.prod(shape) // block * size


def write_gguf(out: Path, cfg: ModelConfig, arch: Arch, parts, outtype: str, folder: Path) -> Path:
    """Write the GGUF file into the folder out from parts ((part, Meta-named tensors), as
    export.merged_parts yields them); folder holds the HF export's config and tokenizer files, named
    as the model. Returns the file's path."""
    ftype, qtype = OUTTYPES[outtype]
    rows = embed_rows(cfg, arch, folder)
    planned = plan(cfg, arch, qtype, rows)
    w = gguf.GGUFWriter(path=None, arch=arch.file_arch)
    for p in planned:
        w.add_tensor_info(p.name, p.shape, np.dtype(np.float32), p.nbytes, raw_dtype=p.qtype)
    path = out / file_name(add_metadata(w, cfg, arch, ftype, folder), ftype)
    offsets, at = write_layout(w, path, planned)
    fd = os.open(path, os.O_RDWR)
    try:
        os.truncate(fd, at)  # the padding between tensors: zeros, as the writer pads
        for name, t in extra_tensors(cfg).items():
            os.pwrite(fd, encode(t, T.F32), offsets[name][0])
        for part, tensors in parts:
            for hf_name, (_, t, _) in gguf_tensors(cfg, arch, part, tensors, rows).items():
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
