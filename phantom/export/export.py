"""Stores out to checkpoints: base weights plus a LoRA adapter merged, written in Hugging Face's or Meta's format.

Streamed: one part (embed, each block, head) is in memory at a time, whichever the format. The tokenizer
travels with the weights: an HF folder gets the store's tokenizer files plus, where the store lacks them, a
tokenizer_config.json and generation_config.json derived from the tokenizer, so `AutoTokenizer` and
`pipeline("text-generation")` load it as it is.
"""
from __future__ import annotations

import dataclasses

import importlib.util
import json
import logging
import mmap
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
from tqdm import tqdm

from phantom.arch.config import ModelConfig
from phantom.arch.layers import LoraLinear, make_block
from phantom.arch.ops import permute_from_hf, rope_rows
from phantom.base import fileio, safejson
from phantom.base.fileio import atomic_write as atomic_write_bytes
from phantom.data.chat import read_template
from phantom.data.tokenizer import Tokenizer, sentencepiece_to_json
from phantom.files import runfolder
from phantom.files.hfshards import DEFAULT_MAX_SHARD_SIZE, parse_size
from phantom.files.store import BlockStore
from phantom.convert import requant, visionlanguage
from phantom.convert.checkpoints import part_shapes, release_pages
from phantom.convert.convert import tokenizer_files
from phantom.model.adapterfiles import load_adapter, read_adapter_config
from phantom.convert.hflayout import hf_config, to_hf
from phantom.model.lora import apply_lora, expert_names, for_family

log = logging.getLogger(__name__)

FORMATS = ("hf", "meta", "gguf", "gguf-lora")


def adapter_loras(cfg: ModelConfig, adapter: Path) -> dict[int, dict[str, LoraLinear]]:
    """{layer: {store weight name: its LoRA (A, B in Meta's layout)}} from a PEFT adapter folder."""
    lora_cfg = for_family(read_adapter_config(adapter), cfg)
    layers = nn.ModuleList(make_block(cfg, "meta", layer=i) for i in range(cfg.n_layers))
    for i, block in enumerate(layers):
        apply_lora(block, lora_cfg, i, expert_names(cfg))
    load_adapter(layers, cfg, adapter)  # checks names and shapes; un-permutes q/k's lora_B; unstacks experts
    loras: dict[int, dict[str, LoraLinear]] = {}
    for i, block in enumerate(layers):  # each expert's own LoRA too (feed_forward.experts.E.w1.weight)
        for name, m in block.named_modules():
            if isinstance(m, LoraLinear):
                loras.setdefault(i, {})[f"{name}.weight"] = m
    return loras


def merged_parts(store: BlockStore, adapter: Path | None, dtype: torch.dtype,
                 progress: bool = True) -> Iterator[tuple[str | int, dict[str, torch.Tensor]]]:
    """("embed" | block index | "head", Meta-named tensors in dtype), base + adapter, one part at a time."""
    loras = adapter_loras(store.cfg, Path(adapter)) if adapter else {}
    yield "embed", {k: v.to(dtype) for k, v in store.load_embed().items()}
    for i in tqdm(range(store.n_blocks), desc="merging", unit="block", disable=not progress or None):
        block = store.load_block(i, torch.float32)  # a quantized block: dequantized in fp32, rounded once below
        with torch.no_grad():
            for name, lora in loras.get(i, {}).items():
                block[name] = block[name].float() + lora.delta_weight()  # W + scale * B @ A
        yield i, {k: v.to(dtype) for k, v in block.items()}
        del block  # before the next one is read
    yield "head", {k: v.to(dtype) for k, v in store.load_head().items()}


# ---------------------------------------------------------------------------------------------
# Hugging Face: config.json + safetensors shards by size (+ model.safetensors.index.json past one)

def hf_specs(cfg: ModelConfig, dtype: torch.dtype, fused_experts: bool = False) -> list[tuple[str, torch.dtype, tuple]]:
    """(Hugging Face name, dtype, shape) of every tensor, from shapes alone (meta tensors through
    to_hf): the shard plan is made before any weight is read."""
    out = []
    for part in ("embed", *range(cfg.n_layers), "head"):
        shapes = part_shapes(cfg, part)
        hf = to_hf(cfg, part, {n: torch.empty(s, dtype=dtype, device="meta") for n, s in shapes.items()}, fused_experts)
        out += [(name, t.dtype, tuple(t.shape)) for name, t in hf.items()]
    return out


def write_hf(tmp: Path, store: BlockStore, parts, dtype: torch.dtype, max_shard_size: str | int) -> None:
    """Shards by size as save_pretrained writes them (phantom.files.hfshards), one part in memory at a time: the
    text model, or a vision-language checkpoint whole where the store keeps one (phantom.convert.visionlanguage)."""
    cfg, fused = store.cfg, visionlanguage.fused_experts(store)
    writer = visionlanguage.shard_writer(tmp, store, hf_specs(cfg, dtype, fused), parse_size(max_shard_size))
    for part, tensors in parts:
        hf = to_hf(cfg, part, tensors, fused)
        for name in list(hf):
            writer.write(name, hf.pop(name))
        del tensors, hf  # before the next part is made
    writer.finish()
    config = visionlanguage.checkpoint_config(store, hf_config(cfg, dtype), dtype, quantized=False)
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")


# ---------------------------------------------------------------------------------------------
# The tokenizer, for Hugging Face loaders

def derived_tokenizer_config(tok: Tokenizer, cfg: ModelConfig, fast: bool = False) -> dict:
    """tokenizer_config.json for a store that came without one: the class that reads its file, its specials.

    A sentencepiece model is read by transformers' LlamaTokenizer, which assumes Llama's sentencepiece
    settings (no normalization, whitespace kept, byte fallback); a model trained otherwise (phantom's tiny
    tokenizer collapses runs of spaces) encodes the same ordinary text, but not every text: see
    tokenizer_caveat, which an export logs.
    """
    c = {"bos_token": tok.bos_token, "eos_token": tok.eos_token, "model_max_length": cfg.max_seq_len,
         "add_bos_token": True, "add_eos_token": False}
    if tok.kind == "sentencepiece" and fast:  # the tokenizer.json written beside it (tokenizer.sentencepiece_to_json)
        return {"tokenizer_class": "PreTrainedTokenizerFast", **c, "unk_token": tok.unk_token}
    if tok.kind == "sentencepiece":
        return {"tokenizer_class": "LlamaTokenizer", **c, "unk_token": tok.unk_token}
    return {"tokenizer_class": "PreTrainedTokenizerFast", **c}


def tokenizer_caveat(store: BlockStore) -> str | None:
    """A line for whoever loads an export with transformers, where its LlamaTokenizer may encode some
    text otherwise than the store's own sentencepiece model (see derived_tokenizer_config). Logged by
    the export, not at each adapter a finetune run writes (the first command's output stays quiet)."""
    if store.tokenizer_path is None or "tokenizer_config.json" in tokenizer_files(store):
        return None
    tok = Tokenizer(store.tokenizer_path)
    probe = "Tabs\tand  two spaces,\nnew lines: é."
    if tok.kind != "sentencepiece" or tok.decode(tok.encode(probe, bos=False)) == probe:
        return None
    return (f"{tok.path} normalizes text (whitespace or unknown characters); transformers' LlamaTokenizer "
            f"assumes it does not, so it may encode such text differently")


def hf_tokenizer_files(store: BlockStore) -> dict[str, bytes]:
    """name -> bytes: the store's tokenizer files (checked), plus what it lacks: a tokenizer.json converted
    from a sentencepiece model (so transformers needs neither sentencepiece nor protobuf), and the two
    configs, tokenizer_config.json carrying the store's chat template."""
    files = {name: path.read_bytes() for name, path in tokenizer_files(store).items()}
    if store.tokenizer_path is None:
        return files
    tok = Tokenizer(store.tokenizer_path)
    if "tokenizer.json" not in files and tok.kind == "sentencepiece" and importlib.util.find_spec("tokenizers"):
        files["tokenizer.json"] = sentencepiece_to_json(store.tokenizer_path, tok.bos_token).encode()
    if "tokenizer_config.json" not in files:
        config = derived_tokenizer_config(tok, store.cfg, fast="tokenizer.json" in files)
        if (template := read_template(store.path, tok)) is not None:
            config["chat_template"] = template.source
        files["tokenizer_config.json"] = json.dumps(config, indent=2).encode()
    if "generation_config.json" not in files:
        gen = {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id}
        files["generation_config.json"] = json.dumps(gen, indent=2).encode()
    return files


def write_tokenizer_files(store: BlockStore, folder: Path) -> list[str]:
    """Write what `hf_tokenizer_files` gives into folder (each file atomically); the names written.

    An adapter folder gets them too, so PeftModel + AutoTokenizer load from one place.
    """
    files = hf_tokenizer_files(store)
    for name, data in files.items():
        atomic_write_bytes(Path(folder) / name, data)
    return sorted(files)


def carry_token_ids(folder: Path) -> None:
    """config.json's bos/eos/pad token ids from the generation_config.json beside it (the model's own,
    or the one derived from its tokenizer), not the config class's defaults (Phi3Config's eos 32000,
    LlamaConfig's 2), which name other tokens of this vocabulary."""
    gen_path = folder / "generation_config.json"
    if not gen_path.is_file():
        return
    gen, config = safejson.load(gen_path), safejson.load(folder / "config.json")
    config.update({k: gen[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in gen})
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


# ---------------------------------------------------------------------------------------------
# Meta: params.json + consolidated.00.pth (one shard: model parallelism of 1)

def meta_unsupported(cfg: ModelConfig) -> list[str]:
    """The ModelConfig fields Meta's Llama format cannot express (a model that has them exports as hf)."""
    llama = {f.name: f.default for f in dataclasses.fields(ModelConfig)}  # not built: cfg's shapes may not be Llama's
    fields = ("explicit_head_dim", "qkv_bias", "o_bias", "mlp_bias", "activation", "qk_norm", "tie_embeddings",
              "sliding_window", "norm_offset", "embed_scale", "post_norms", "query_pre_attn_scalar", "attn_softcap",
              "final_softcap", "local_rope_theta", "rotary_dim", "n_experts", "attn_sinks")
    return [f for f in fields if getattr(cfg, f) != llama[f]]


def meta_params(cfg: ModelConfig) -> dict:
    """params.json; an explicit FFN width (HF configs) is expressed through Meta's ffn_dim_multiplier."""
    p = {"dim": cfg.dim, "n_layers": cfg.n_layers, "n_heads": cfg.n_heads, "n_kv_heads": cfg.kv_heads,
         "vocab_size": cfg.vocab_size, "multiple_of": cfg.multiple_of, "ffn_dim_multiplier": cfg.ffn_dim_multiplier,
         "norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta}
    if cfg.intermediate_size:
        base = int(2 * (4 * cfg.dim) / 3)
        p.update(multiple_of=1, ffn_dim_multiplier=(cfg.intermediate_size + 0.5) / base)
        assert int(p["ffn_dim_multiplier"] * base) == cfg.intermediate_size
    if cfg.rope_scaling is not None:
        if cfg.rope_scaling.rope_type != "llama3":
            raise ValueError(f"Meta's params.json has Llama-3.1's RoPE scaling only, not "
                             f"{cfg.rope_scaling.rope_type!r}; use --format hf")
        p.update(use_scaled_rope=True, rope_scaling_factor=cfg.rope_scaling.factor)
    return p


def write_meta(tmp: Path, cfg: ModelConfig, parts, dtype: torch.dtype) -> None:
    """torch.save's file, streamed: the skeleton is saved without data, then filled through a shared mapping; q/k
    rows in Meta's interleaved pairs, permuted from a store that keeps them in Hugging Face's halves."""
    from torch._subclasses.fake_tensor import FakeTensorMode  # shapes without memory, as skip_data expects

    def key(part, name):
        return name if isinstance(part, str) else f"layers.{part}.{name}"

    all_parts = ["embed", *range(cfg.n_layers), "head"]
    with FakeTensorMode():
        skeleton = {key(p, n): torch.empty(s, dtype=dtype) for p in all_parts for n, s in part_shapes(cfg, p).items()}
    path = tmp / "consolidated.00.pth"
    with torch.serialization.skip_data(materialize_fake_tensors=True):
        torch.save(skeleton, path)
    with torch.serialization.set_default_mmap_options(mmap.MAP_SHARED):
        ckpt = torch.load(path, mmap=True, weights_only=True)
    halves = {} if cfg.rope_interleave else rope_rows(dataclasses.replace(cfg, rope_interleave=True))
    for part, tensors in parts:
        for name, t in tensors.items():
            turned = isinstance(part, int) and name in halves
            ckpt[key(part, name)].copy_(permute_from_hf(t, halves[name], cfg.rope_dim) if turned else t)
        release_pages(ckpt[key(part, name)] for name in tensors)  # written back by the kernel; not kept resident
        del tensors  # before the next part is made: one part in memory at a time
    del ckpt
    with open(path, "rb+") as f:
        os.fsync(f.fileno())
    (tmp / "params.json").write_text(json.dumps(meta_params(cfg), indent=2) + "\n")


@dataclass(frozen=True)
class FormatOptions:
    """What one format lets a user choose.

    max_shard_size: "hf": the most bytes of one safetensors shard (int, or like "5GB"; transformers'
        save_pretrained default): model.safetensors alone, or shards and an index past it.
    outtype: "gguf", "gguf-lora": the file's weight type, f32, f16, bf16 or q8_0 (None: bf16 weights bf16,
        others f16, as llama.cpp's converter's "auto").
    requantize: "hf": a store of a checkpoint shipped quantized (fp8-block, int4-group, mxfp4) written in that
        format again, the merged weights requantized (phantom.convert.requant); else 16-bit weights."""

    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE
    outtype: str | None = None
    requantize: bool = False


def hf_side_files(store: BlockStore, dtype: torch.dtype, folder: Path) -> Path:
    """folder holding what the HF export writes beside its weights (config.json, the tokenizer files): what
    llama.cpp's converter reads a GGUF's metadata from, and the GGUF export reads the same way."""
    folder.mkdir(parents=True)
    write_tokenizer_files(store, folder)
    config = visionlanguage.checkpoint_config(store, hf_config(store.cfg, dtype), dtype, quantized=False)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if visionlanguage.record(store) is None:
        carry_token_ids(folder)
    return folder


def write_gguf(tmp: Path, store: BlockStore, name: str, parts, adapter, dtype: torch.dtype, outtype: str | None,
               progress: bool) -> None:
    """One GGUF file and an Ollama Modelfile into tmp, named from name (the model's folder); DeepSeek-V4's in the
    checkpoint's own types (phantom.export.gguf_deepseek4: merged in float32, its stored experts read again)."""
    from phantom.export import gguf_export
    with tempfile.TemporaryDirectory(prefix="phantom-gguf-") as scratch:  # named as the model: its GGUF name
        side = hf_side_files(store, dtype, Path(scratch) / name)
        if not store.cfg.hc_mult:
            gguf_export.export_gguf(store, tmp, parts, dtype, outtype, side)
            return
        from phantom.export import gguf_deepseek4
        path = gguf_deepseek4.write(tmp, store, merged_parts(store, Path(adapter) if adapter else None, torch.float32,
                                                             progress), side)
        (tmp / "Modelfile").write_text(f"FROM ./{path.name}\n")


def gguf_module(name: str = "gguf_export"):
    """phantom.export.gguf_export (or another GGUF module), which needs the optional gguf package (llama.cpp's own
    writer)."""
    try:
        return importlib.import_module(f"phantom.export.{name}")
    except ImportError as e:
        if e.name != "gguf":
            raise
        raise ValueError("--format gguf needs the gguf package (llama.cpp's writer): pip install 'phantom[gguf]'") \
            from None


def check_format(store: BlockStore, fmt: str, adapter, options: FormatOptions) -> None:
    """Refuse, before any work, what the format cannot hold or lacks."""
    outtype = options.outtype
    if options.requantize and fmt != "hf":
        raise ValueError("--requantize is for --format hf (the checkpoint's own quantized format)")
    if options.requantize:
        requant.shipped_record(store)
    if outtype is not None and not fmt.startswith("gguf"):
        raise ValueError("--outtype is for --format gguf and gguf-lora (hf and meta take --dtype)")
    if fmt == "gguf-lora" and adapter is None:
        raise ValueError("--format gguf-lora writes the adapter alone: give --adapter")
    if fmt == "gguf" and store.cfg.hc_mult:  # DeepSeek-V4: the converter's file of the shipped checkpoint
        if (why := gguf_module("gguf_deepseek4").refusal(store, outtype)) is not None:
            raise ValueError(why)
    elif fmt.startswith("gguf"):
        gguf_module().check_supported(store, outtype)
    visionlanguage.check_export(store, fmt, options.requantize)
    if fmt == "meta" and (fields := meta_unsupported(store.cfg)):
        raise ValueError(f"{store.path}: Meta's format holds Llama's maths only, and this {store.cfg.family} model "
                         f"sets {', '.join(fields)}; use --format hf")


def export(model: Path | str, out: Path | str, adapter: Path | str | None = None, fmt: str = "hf",
           dtype: torch.dtype | None = None, overwrite: bool = False, progress: bool = True,
           options: FormatOptions = FormatOptions()) -> Path:
    """Write a store (plus a LoRA adapter, merged) as a full checkpoint in Hugging Face's, Meta's or GGUF format.

    Args:
        model: the store folder.
        out: the checkpoint folder to create (written to a temporary folder, renamed when complete).
        adapter: a PEFT-layout LoRA adapter folder (as PhantomModel.save_adapter writes), or None.
        fmt: "hf" (config.json + safetensors shards + index), "meta" (params.json + consolidated.00.pth) or
            "gguf" (one llama.cpp file, Name-Size-Type.gguf, and an Ollama Modelfile; phantom.export.gguf_export).
        dtype: the checkpoint's dtype (default: the store's); gguf: the merged weights' dtype, which outtype
            is made from.
        overwrite: replace the phantom export at out (a folder that is not one is refused).
        progress: a tqdm bar over the blocks.
        options: the format's own choices (FormatOptions: hf's shard size, gguf's weight type).

    Raises:
        FileNotFoundError, ValueError, StoreError: a missing or mismatched store or adapter, a bad argument.
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose hf, meta, gguf or gguf-lora")
    parse_size(options.max_shard_size)  # a bad size is refused before any work
    out = Path(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} already exists; remove it or choose another --out")
    runfolder.check_replaceable(out, "export")  # overwrite: only an export phantom wrote goes
    store = BlockStore(model)
    check_format(store, fmt, adapter, options)
    dtype = dtype or store.dtype
    with fileio.replacing_folder(out) as tmp:  # the old folder (overwrite) goes only once this one is complete
        parts = merged_parts(store, Path(adapter) if adapter else None, dtype, progress)
        if fmt == "gguf-lora":
            from phantom.export.gguf_lora import export_gguf_lora
            export_gguf_lora(store, tmp, Path(adapter), options.outtype, Path(model).resolve().name)
        elif fmt == "gguf":
            write_gguf(tmp, store, Path(model).resolve().name, parts, adapter, dtype, options.outtype, progress)
        elif fmt == "hf" and options.requantize:
            loras = adapter_loras(store.cfg, Path(adapter)) if adapter else {}
            requant.write_requantized(tmp, store, loras, dtype, options.max_shard_size, progress)
        elif fmt == "hf":
            write_hf(tmp, store, parts, dtype, options.max_shard_size)
        else:
            write_meta(tmp, store.cfg, parts, dtype)
        if fmt == "hf":
            write_tokenizer_files(store, tmp)
            if visionlanguage.record(store) is None:  # a vision-language checkpoint's config.json says its own
                carry_token_ids(tmp)
            if caveat := tokenizer_caveat(store):
                log.info("%s", caveat)
        elif fmt == "meta" and store.tokenizer_path is not None:  # Meta's folder carries tokenizer.model alone
            main = store.tokenizer_path.name
            atomic_write_bytes(tmp / main, tokenizer_files(store)[main].read_bytes())
        fileio.atomic_write_json(tmp / runfolder.EXPORT_MARKER, {"format": runfolder.EXPORT_FORMAT, "model": str(model),
                                                                 "adapter": str(adapter) if adapter else None,
                                                                 "checkpoint_format": fmt})
    return out
