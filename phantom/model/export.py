"""Stores out to checkpoints: base weights plus a LoRA adapter merged, written in Hugging Face's or Meta's format.

Streamed: one part (embed, each block, head) is in memory at a time, whichever the format. The tokenizer
travels with the weights: an HF folder gets the store's tokenizer files plus, where the store lacks them, a
tokenizer_config.json and generation_config.json derived from the tokenizer, so `AutoTokenizer` and
`pipeline("text-generation")` load it as it is.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import mmap
import os
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn as nn
from tqdm import tqdm

from phantom.arch.config import ModelConfig, rope_rows
from phantom.arch.family import family
from phantom.arch.family_moe import FUSED_EXPERTS, MOE_FIELDS
from phantom.arch.layers import LoraLinear, TransformerBlock, permute_for_hf
from phantom.base import fileio, safejson
from phantom.base.fileio import atomic_write as atomic_write_bytes
from phantom.data.chat import read_template
from phantom.data.tokenizer import Tokenizer, sentencepiece_to_json
from phantom.files import runfolder
from phantom.files.hfshards import DEFAULT_MAX_SHARD_SIZE, ShardWriter, parse_size
from phantom.files.store import BlockStore
from phantom.files.tensorfile import dtype_name
from phantom.model.checkpoints import part_shapes, release_pages
from phantom.model.convert import tokenizer_files
from phantom.model.lora import apply_lora, for_family, load_adapter, read_adapter_config

log = logging.getLogger(__name__)

FORMATS = ("hf", "meta", "gguf")


def adapter_loras(cfg: ModelConfig, adapter: Path) -> dict[int, dict[str, LoraLinear]]:
    """{layer: {store weight name: its LoRA (A, B in Meta's layout)}} from a PEFT adapter folder."""
    lora_cfg = for_family(read_adapter_config(adapter), cfg)
    layers = nn.ModuleList(TransformerBlock(cfg, device="meta", layer=i) for i in range(cfg.n_layers))
    for i, block in enumerate(layers):
        apply_lora(block, lora_cfg, i)
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
    if cfg.rotary_dim is not None:  # Phi-4-mini
        c["partial_rotary_factor"] = cfg.rotary_dim / cfg.head_dim
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
                "truncate": s.truncate}
    return {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor, "original_max_position_embeddings": s.original_max_seq_len}


def to_hf(cfg: ModelConfig, part: str | int, tensors: dict[str, torch.Tensor],
          fused_experts: bool = False) -> dict[str, torch.Tensor]:
    """Store names and q/k layout -> the family's Hugging Face names and layout (its conversion script's
    permute); the parts of a fused tensor (Phi-3's qkv_proj) stacked by rows, in the family's order.
    Experts one tensor each (what save_pretrained writes), or transformers 5's 3-D tensors."""
    fam, permuted = family(cfg), rope_rows(cfg)
    hf = {name: permute_for_hf(t, permuted[name], cfg.rope_dim) if name in permuted else t
          for name, t in tensors.items()}
    out = {}
    hf_names, fused = fam.layout(cfg, fused_experts)
    for key, names in fused.items() if isinstance(part, int) else ():
        if present := [n for n in names if n in hf]:
            if len(present) != len(names):
                raise ValueError(f"{key.format(part)} fuses {', '.join(names)}: {', '.join(present)} alone given")
            out[key.format(part)] = torch.cat([hf.pop(n) for n in names])
            if fused_experts and key in FUSED_EXPERTS:  # (experts, rows of each, columns)
                out[key.format(part)] = out[key.format(part)].unflatten(0, (cfg.n_experts, -1))
    return out | {hf_names[(isinstance(part, int), name)].format(part): t.contiguous() for name, t in hf.items()}


def hf_specs(cfg: ModelConfig, dtype: torch.dtype) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """(Hugging Face name, dtype, shape) of every tensor, from shapes alone (meta tensors through
    to_hf): the shard plan is made before any weight is read."""
    out = []
    for part in ("embed", *range(cfg.n_layers), "head"):
        hf = to_hf(cfg, part, {n: torch.empty(s, dtype=dtype, device="meta") for n, s in part_shapes(cfg, part).items()})
        out += [(name, t.dtype, tuple(t.shape)) for name, t in hf.items()]
    return out


def write_hf(tmp: Path, cfg: ModelConfig, parts, dtype: torch.dtype, max_shard_size: str | int) -> None:
    """Shards by size as save_pretrained writes them (phantom.files.hfshards), one part in memory at a time."""
    writer = ShardWriter(tmp, hf_specs(cfg, dtype), parse_size(max_shard_size))
    for part, tensors in parts:
        hf = to_hf(cfg, part, tensors)
        for name in list(hf):
            writer.write(name, hf.pop(name))
        del tensors, hf  # before the next part is made
    writer.finish()
    (tmp / "config.json").write_text(json.dumps(hf_config(cfg, dtype), indent=2) + "\n")


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
    llama = ModelConfig(dim=cfg.dim, n_layers=cfg.n_layers, n_heads=cfg.n_heads, vocab_size=cfg.vocab_size)
    fields = ("explicit_head_dim", "qkv_bias", "o_bias", "mlp_bias", "activation", "qk_norm", "tie_embeddings",
              "sliding_window", "norm_offset", "embed_scale", "post_norms", "query_pre_attn_scalar", "attn_softcap",
              "final_softcap", "local_rope_theta", "rotary_dim")
    return [f for f in fields if getattr(cfg, f) != getattr(llama, f)]


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
    """torch.save's file, streamed: the skeleton is saved without data, then filled through a shared mapping."""
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
    for part, tensors in parts:
        for name, t in tensors.items():
            ckpt[key(part, name)].copy_(t)
        release_pages(ckpt[key(part, name)] for name in tensors)  # written back by the kernel; not kept resident
        del tensors  # before the next part is made: one part in memory at a time
    del ckpt
    with open(path, "rb+") as f:
        os.fsync(f.fileno())
    (tmp / "params.json").write_text(json.dumps(meta_params(cfg), indent=2) + "\n")


def gguf_module():
    """phantom.model.gguf_export, which needs the optional gguf package (llama.cpp's own writer)."""
    try:
        from phantom.model import gguf_export
    except ImportError as e:
        if e.name != "gguf":
            raise
        raise ValueError("--format gguf needs the gguf package (llama.cpp's writer): pip install 'phantom[gguf]'") \
            from None
    return gguf_export


def export(model: Path | str, out: Path | str, adapter: Path | str | None = None, fmt: str = "hf",
           dtype: torch.dtype | None = None, overwrite: bool = False, progress: bool = True,
           max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE, outtype: str | None = None) -> Path:
    """Write a store (plus a LoRA adapter, merged) as a full checkpoint in Hugging Face's, Meta's or GGUF format.

    Args:
        model: the store folder.
        out: the checkpoint folder to create (written to a temporary folder, renamed when complete).
        adapter: a PEFT-layout LoRA adapter folder (as PhantomModel.save_adapter writes), or None.
        fmt: "hf" (config.json + safetensors shards + index), "meta" (params.json + consolidated.00.pth) or
            "gguf" (one llama.cpp file, Name-Size-Type.gguf, and an Ollama Modelfile; phantom.model.gguf_export).
        dtype: the checkpoint's dtype (default: the store's); gguf: the merged weights' dtype, which outtype
            is made from.
        outtype: gguf: f32, f16, bf16 or q8_0 (default: bf16 weights bf16, others f16).
        overwrite: replace the phantom export at out (a folder that is not one is refused).
        progress: a tqdm bar over the blocks.
        max_shard_size: "hf": the most bytes of one safetensors shard (int, or like "5GB"; transformers'
            save_pretrained default): model.safetensors alone, or shards and an index past it.

    Raises:
        FileNotFoundError, ValueError, StoreError: a missing or mismatched store or adapter, a bad argument.
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose hf, meta or gguf")
    parse_size(max_shard_size)  # a bad size is refused before any work
    out = Path(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} already exists; remove it or choose another --out")
    runfolder.check_replaceable(out, "export")  # overwrite: only an export phantom wrote goes
    store = BlockStore(model)
    if outtype is not None and fmt != "gguf":
        raise ValueError("--outtype is for --format gguf (hf and meta take --dtype)")
    if fmt == "gguf":
        gguf_export = gguf_module()
        gguf_export.check_supported(store, outtype)  # refused before any work
    if fmt == "meta" and (fields := meta_unsupported(store.cfg)):
        raise ValueError(f"{model}: Meta's format holds Llama's maths only, and this {store.cfg.family} model sets "
                         f"{', '.join(fields)}; use --format hf")
    dtype = dtype or store.dtype
    with fileio.replacing_folder(out) as tmp:  # the old folder (overwrite) goes only once this one is complete
        parts = merged_parts(store, Path(adapter) if adapter else None, dtype, progress)
        if fmt == "gguf":
            gguf_export.export_gguf(store, tmp, parts, dtype, outtype, Path(model).resolve().name)
        elif fmt == "hf":
            write_hf(tmp, store.cfg, parts, dtype, max_shard_size)
        else:
            write_meta(tmp, store.cfg, parts, dtype)
        if fmt == "hf":
            write_tokenizer_files(store, tmp)
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
