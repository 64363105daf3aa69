"""Checkpoint conversion: tiny random Llamas written here in Meta's 2-shard format and in Hugging Face's
(q/k permuted), converted, and compared with each other and with the in-memory original; bad inputs.
"""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import phantom
from phantom.arch.config import ModelConfig, RopeScaling, block_tensor_shapes, embed_tensor_shapes, head_tensor_shapes
from phantom.arch.family import LLAMA_KEYS
from phantom.convert.checkpoints import META_SPLIT_DIMS, HF_PERMUTED
from phantom.convert.convert import convert_checkpoint
from phantom.arch.layers import TransformerBlock
from phantom.arch.ops import permute_for_hf, rms_norm, rope_table

REPO = Path(__file__).resolve().parent.parent
LLAMA2 = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, multiple_of=32)
LLAMA3 = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, multiple_of=32,
                     ffn_dim_multiplier=1.3, rope_theta=500000.0, rope_scaling=RopeScaling())


def random_model(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """A full state dict in Meta's names and layout, fp32, norms not all ones."""
    gen = torch.Generator().manual_seed(seed)
    shapes = {**embed_tensor_shapes(cfg), **head_tensor_shapes(cfg)}
    for i in range(cfg.n_layers):
        shapes.update({f"layers.{i}.{k}": s for k, s in block_tensor_shapes(cfg).items()})
    return {k: (1 + 0.1 * torch.randn(s, generator=gen)) if len(s) == 1 else 0.1 * torch.randn(s, generator=gen)
            for k, s in shapes.items()}


def meta_params(cfg: ModelConfig) -> dict:
    p = {"dim": cfg.dim, "n_layers": cfg.n_layers, "n_heads": cfg.n_heads, "n_kv_heads": cfg.n_kv_heads,
         "vocab_size": -1, "multiple_of": cfg.multiple_of, "ffn_dim_multiplier": cfg.ffn_dim_multiplier,
         "norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling:
        p["use_scaled_rope"] = True
    return p


def write_meta(src: Path, cfg: ModelConfig, sd: dict, n_shards: int = 2, embed_dim: int = 1) -> Path:
    """Meta's layout: params.json + consolidated.NN.pth, each tensor cut as model parallelism cuts it."""
    src.mkdir(parents=True)
    (src / "params.json").write_text(json.dumps(meta_params(cfg)))
    shards = [{"rope.freqs": torch.zeros(cfg.head_dim // 2)} for _ in range(n_shards)]
    for key, t in sd.items():
        dims = META_SPLIT_DIMS[key.split(".", 2)[-1] if key.startswith("layers.") else key]
        dim = embed_dim if key == "tok_embeddings.weight" else (dims[0] if dims else None)
        parts = t.chunk(n_shards, dim) if dim is not None else [t] * n_shards
        for shard, part in zip(shards, parts):
            shard[key] = part.clone()
    for k, shard in enumerate(shards):
        torch.save(shard, src / f"consolidated.{k:02d}.pth")
    return src


def hf_config(cfg: ModelConfig, arch: str = "LlamaForCausalLM") -> dict:
    c = {"architectures": [arch], "model_type": "llama", "hidden_size": cfg.dim, "intermediate_size": cfg.hidden_dim,
         "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
         "num_key_value_heads": cfg.kv_heads, "vocab_size": cfg.vocab_size, "rms_norm_eps": cfg.norm_eps,
         "rope_theta": cfg.rope_theta, "max_position_embeddings": cfg.max_seq_len, "tie_word_embeddings": False,
         "torch_dtype": "float32", "hidden_act": "silu"}
    if cfg.rope_scaling:
        s = cfg.rope_scaling
        c["rope_scaling"] = {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                             "high_freq_factor": s.high_freq_factor,
                             "original_max_position_embeddings": s.original_max_seq_len}
    return c


def hf_state_dict(cfg: ModelConfig, sd: dict) -> dict[str, torch.Tensor]:
    """Meta state dict -> HF names, q/k rows permuted as HF's convert_llama_weights_to_hf.py does."""
    out = {}
    for hf, name in LLAMA_KEYS.items():
        for i in range(cfg.n_layers) if "{}" in hf else [None]:
            t = sd[f"layers.{i}.{name}" if i is not None else name]
            if name in HF_PERMUTED:
                t = permute_for_hf(t, getattr(cfg, HF_PERMUTED[name]))
            out[hf.format(i)] = t.contiguous()
    return out


def shipped_rows(cfg: ModelConfig, sd: dict, i: int) -> dict[str, torch.Tensor]:
    """Block i of a Meta state dict as a store made from its Hugging Face checkpoint holds it: q/k rows as
    shipped (HF's RoPE halves; the store's config says rope_interleave False)."""
    return {k[len(f"layers.{i}."):]: permute_for_hf(v, getattr(cfg, HF_PERMUTED[k.split(".", 2)[2]]))
            if k.split(".", 2)[2] in HF_PERMUTED else v for k, v in sd.items() if k.startswith(f"layers.{i}.")}


def write_hf(src: Path, cfg: ModelConfig, sd: dict, arch: str = "LlamaForCausalLM") -> Path:
    """HF's layout: config.json + two safetensors shards split by layer + model.safetensors.index.json."""
    src.mkdir(parents=True)
    (src / "config.json").write_text(json.dumps(hf_config(cfg, arch)))
    hf = hf_state_dict(cfg, sd)
    files = {1: {k: v for k, v in hf.items() if k.startswith("model.layers.0.") or k == "model.embed_tokens.weight"}}
    files[2] = {k: v for k, v in hf.items() if k not in files[1]}
    weight_map = {}
    for n, tensors in files.items():
        name = f"model-{n:05d}-of-00002.safetensors"
        save_file(tensors, src / name, metadata={"format": "pt"})
        weight_map.update({k: name for k in tensors})
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return src


def reference_logits(cfg: ModelConfig, sd: dict, tokens: torch.Tensor) -> torch.Tensor:
    """The in-memory original, run with phantom.arch.layers directly (no store)."""
    h = torch.nn.functional.embedding(tokens, sd["tok_embeddings.weight"])
    rope = rope_table(cfg, tokens.shape[1])
    for i in range(cfg.n_layers):
        block = TransformerBlock(cfg)
        block.load_state_dict({k: sd[f"layers.{i}.{k}"] for k in block_tensor_shapes(cfg)})
        h = block(h, rope)
    return torch.nn.functional.linear(rms_norm(h, sd["norm.weight"], cfg.norm_eps), sd["output.weight"])


def store_logits(store: Path, tokens: torch.Tensor, offload: str = "none") -> torch.Tensor:
    with phantom.load(store, offload=offload, lora=None, verify="full") as model, torch.no_grad():
        return model(tokens)


TOKENS = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("cfg,embed_dim", [(LLAMA2, 1), (LLAMA3, 0)], ids=["llama2", "llama3"])
def test_meta_and_hf_convert_to_the_same_logits(tmp_path, cfg, embed_dim):
    sd = random_model(cfg)
    meta = convert_checkpoint(write_meta(tmp_path / "meta", cfg, sd, 2, embed_dim), tmp_path / "s_meta",
                              progress=False)
    hf = convert_checkpoint(write_hf(tmp_path / "hf", cfg, sd), tmp_path / "s_hf", progress=False)
    assert meta["format"] == "meta" and hf["format"] == "hf"
    for out, kind in ((meta["out"], "meta"), (hf["out"], "hf")):  # each store says what it was made from
        origin = phantom.BlockStore(out).manifest["origin"]
        assert origin == {"kind": kind, "path": str((tmp_path / kind).resolve())}
    for c in (meta["config"], hf["config"]):  # HF states the FFN width, Meta derives it: same shapes
        assert block_tensor_shapes(c) == block_tensor_shapes(cfg) and c.vocab_size == cfg.vocab_size
        assert (c.rope_theta, c.rope_scaling, c.n_kv_heads) == (cfg.rope_theta, cfg.rope_scaling, cfg.n_kv_heads)
    ref = reference_logits(cfg, sd, TOKENS)
    for logits in (store_logits(meta["out"], TOKENS), store_logits(hf["out"], TOKENS),
                   store_logits(hf["out"], TOKENS, offload="disk")):
        torch.testing.assert_close(logits, ref, rtol=0, atol=1e-5)


def test_converted_tensors_are_exact_and_dtype_converts(tmp_path):
    sd = random_model(LLAMA2, seed=1)
    src = write_hf(tmp_path / "hf", LLAMA2, sd, arch="MistralForCausalLM")
    store = phantom.BlockStore(convert_checkpoint(src, tmp_path / "s", progress=False)["out"])
    assert not store.cfg.rope_interleave  # q/k rows as shipped: HF's halves, rotated so
    for k, v in store.load_block(1).items():
        assert torch.equal(v, shipped_rows(LLAMA2, sd, 1)[k]), k
    bf16 = convert_checkpoint(src, tmp_path / "s16", dtype=torch.bfloat16, progress=False)
    assert phantom.BlockStore(bf16["out"]).dtype == torch.bfloat16 and bf16["disk_bytes"] > 0


# ---------------------------------------------------------------------------------------------
# Bad inputs: one line naming the file, exit 2, no store left behind

def load_script(name: str):
    """A command of scripts/ or a benchmark of benchmarks/, by name, as a module."""
    path = next(p for p in (REPO / "scripts" / f"{name}.py", REPO / "benchmarks" / f"{name}.py") if p.is_file())
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def prepare(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "scripts" / "prepare_model.py"), *args],
                          capture_output=True, text=True, cwd=REPO)


def break_meta(src: Path, how: str) -> str:
    """Damage a Meta checkpoint; returns the file name the error must name."""
    if how == "no_params":
        (src / "params.json").unlink()
        return "params.json"
    if how == "missing_shard":
        (src / "consolidated.01.pth").unlink()
        return "consolidated.01.pth"
    if how == "truncated":
        data = (src / "consolidated.01.pth").read_bytes()
        (src / "consolidated.01.pth").write_bytes(data[: len(data) // 2])
        return "consolidated.01.pth"
    if how == "shapes":
        p = json.loads((src / "params.json").read_text())
        (src / "params.json").write_text(json.dumps({**p, "ffn_dim_multiplier": 1.5}))
        return "consolidated.00.pth"
    raise AssertionError(how)


def break_hf(src: Path, how: str) -> str:
    if how == "no_config":
        (src / "config.json").unlink()
        return "config.json"
    if how == "missing_shard":
        (src / "model-00002-of-00002.safetensors").unlink()
        return "model-00002-of-00002.safetensors"
    if how == "truncated":
        data = (src / "model-00001-of-00002.safetensors").read_bytes()
        (src / "model-00001-of-00002.safetensors").write_bytes(data[:-100])
        return "model-00001-of-00002.safetensors"
    if how == "shapes":
        c = json.loads((src / "config.json").read_text())
        (src / "config.json").write_text(json.dumps({**c, "intermediate_size": 256}))
        return "model-00001-of-00002.safetensors"
    if how == "arch":
        c = json.loads((src / "config.json").read_text())
        (src / "config.json").write_text(json.dumps({**c, "architectures": ["GPT2LMHeadModel"]}))
        return "config.json"
    raise AssertionError(how)


CASES = [("meta", h) for h in ("no_params", "missing_shard", "truncated", "shapes")] + \
        [("hf", h) for h in ("no_config", "missing_shard", "truncated", "shapes", "arch")] + [("unknown", "")]


def make_bad(tmp_path: Path, fmt: str, how: str) -> tuple[Path, str]:
    sd = random_model(LLAMA2)
    if fmt == "meta":
        src = write_meta(tmp_path / "src", LLAMA2, sd)
        name = break_meta(src, how)
    elif fmt == "hf":
        src = write_hf(tmp_path / "src", LLAMA2, sd)
        name = break_hf(src, how)
    else:
        src, name = tmp_path / "src", "src"
        src.mkdir()
        (src / "model.gguf").write_bytes(b"GGUF")
    return src, name


@pytest.mark.parametrize("fmt,how", CASES, ids=[f"{f}-{h}" if h else f for f, h in CASES])
def test_bad_inputs_exit_2_with_one_line(tmp_path, capsys, fmt, how):
    src, name = make_bad(tmp_path, fmt, how)
    out = tmp_path / "weights" / "x"
    assert load_script("prepare_model").main(["--src", str(src), "--out", str(out), "--quiet"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and name in lines[0], lines
    assert not out.exists() and not (out.parent.exists() and any(out.parent.iterdir()))  # no temp left


def test_bad_input_from_the_command_line(tmp_path):
    src, name = make_bad(tmp_path, "meta", "truncated")
    r = prepare("--src", str(src), "--out", str(tmp_path / "x"), "--dtype", "fp32")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and r.stderr.startswith("error: ") and name in r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "x").exists()


# ---------------------------------------------------------------------------------------------
# --link: a store that reads the checkpoint's safetensors files in place

def test_linked_store_reads_in_place_and_checks_its_sources(tmp_path):
    sd = random_model(LLAMA3, seed=2)
    src = write_hf(tmp_path / "hf", LLAMA3, sd)
    copy = convert_checkpoint(src, tmp_path / "copy", progress=False)
    link = convert_checkpoint(src, tmp_path / "link", link=True, progress=False)
    assert link["linked_bytes"] == sum(t.numel() * 4 for t in sd.values())  # every tensor stays in place, q/k too
    assert link["disk_bytes"] < 64 << 10 and not list((link["out"] / "blocks").iterdir())
    manifest = json.loads((link["out"] / "manifest.json").read_text())
    assert all(Path(f).is_absolute() for f in manifest["links"]["sources"] if "local" not in f)
    ref = reference_logits(LLAMA3, sd, TOKENS)
    for offload in ("none", "disk", "ram"):
        torch.testing.assert_close(store_logits(link["out"], TOKENS, offload), ref, rtol=0, atol=1e-5)
    linked = phantom.BlockStore(link["out"])
    for i in range(2):
        assert linked.load_block(i).keys() == phantom.BlockStore(copy["out"]).load_block(i).keys()
        assert all(torch.equal(v, shipped_rows(LLAMA3, sd, i)[k]) for k, v in linked.load_block(i).items())
        assert all(torch.equal(v, shipped_rows(LLAMA3, sd, i)[k])
                   for k, v in linked.block_views(linked.map_block(i)).items())
    shard = src / "model-00002-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF  # flip a byte inside the last tensor: same size and header, different data
    shard.write_bytes(bytes(data))
    with pytest.raises(phantom.StoreError, match="checksum mismatch"):
        phantom.BlockStore(link["out"], verify="full")
    fast = phantom.BlockStore(link["out"])  # fast: the crc32 record of the linked data, on first read
    assert all(e.crc is not None and e.crc[1] is None for e in fast.blocks)
    with pytest.raises(phantom.StoreError, match=r"checksum mismatch in its linked files .*model-00002-of-00002"
                                                 r"\.safetensors.*crc32"):
        for i in range(fast.n_blocks):
            fast.load_block(i)
        fast.load_head()
    shard.write_bytes(bytes(data[:-4]))
    with pytest.raises(phantom.StoreError, match="model-00002-of-00002.safetensors"):
        phantom.BlockStore(link["out"])
    shard.unlink()
    with pytest.raises(phantom.StoreError, match="missing"):
        phantom.BlockStore(link["out"])


def test_link_is_refused_or_copies_where_it_must(tmp_path):
    sd = random_model(LLAMA2)
    with pytest.raises(ValueError, match="--link"):
        convert_checkpoint(write_hf(tmp_path / "hf", LLAMA2, sd), tmp_path / "s", dtype=torch.bfloat16, link=True)
    meta = convert_checkpoint(write_meta(tmp_path / "meta", LLAMA2, sd), tmp_path / "m", link=True, progress=False)
    assert meta["linked_bytes"] == 0 and "links" not in json.loads((meta["out"] / "manifest.json").read_text())


def test_linked_manifest_may_not_point_anywhere(tmp_path):
    src = write_hf(tmp_path / "hf", LLAMA2, random_model(LLAMA2))
    out = convert_checkpoint(src, tmp_path / "link", link=True, progress=False)["out"]
    manifest = json.loads((out / "manifest.json").read_text())
    entry = manifest["links"]["files"]["blocks/000.safetensors"]
    entry["tensors"][0]["file"] = "/etc/passwd"  # not in links.sources
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(phantom.StoreError, match="not listed in links.sources"):
        phantom.BlockStore(out)
    entry["tensors"][0]["file"] = "../hf/model-00001-of-00002.safetensors"
    manifest["links"]["sources"][entry["tensors"][0]["file"]] = {"size": 0, "header_sha256": ""}
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(phantom.StoreError, match="escapes the store folder"):
        phantom.BlockStore(out)


def test_transformers_checkpoint_converts_to_its_logits(tmp_path):
    """Nice to have: a tiny LlamaForCausalLM saved by transformers itself converts to the same logits."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    c = hf_config(LLAMA3)
    config = transformers.LlamaConfig(**{k: v for k, v in c.items() if k not in ("architectures", "torch_dtype")})
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    store = convert_checkpoint(tmp_path / "hf", tmp_path / "s", progress=False)["out"]
    with torch.no_grad():
        expected = model(TOKENS).logits
    torch.testing.assert_close(store_logits(store, TOKENS), expected, rtol=0, atol=1e-4)


def test_transformers_v5_config_with_rope_parameters(tmp_path):
    """transformers >= 5 saves rope_theta and the Llama-3.1 scaling under "rope_parameters"."""
    src = write_hf(tmp_path / "hf", LLAMA3, random_model(LLAMA3))
    c = json.loads((src / "config.json").read_text())
    c["rope_parameters"] = {**c.pop("rope_scaling"), "rope_theta": c.pop("rope_theta")}
    (src / "config.json").write_text(json.dumps(c))
    cfg = convert_checkpoint(src, tmp_path / "s", progress=False)["config"]
    assert (cfg.rope_theta, cfg.rope_scaling) == (LLAMA3.rope_theta, LLAMA3.rope_scaling)
