"""DeepSeek-V4's GGUF (deepseek4) against llama.cpp's own converter: a tiny V4 in the Hub's layout (DeepSeek's names
without `model.`, its config keys, FP8 tiles and FP4 experts; a hashed layer, a sliding one, compressed sparse
attention at rate 4 under the indexer's top 8, heavy compression at rate 128), prepared into a store as shipped;
`merge_lora.py --format gguf` of the store must be the very file the pinned convert_hf_to_gguf.py writes from the
checkpoint; with an adapter, the experts it leaves keep their bytes and the weights it changes hold the merged model
in the file's types; llama.cpp (where built) computes the file as transformers computes the checkpoint, within the
file's rounding.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from conftest import llama_cpp, llama_cpp_runtime, max_rel_err, need, real_tokenizer
from test_convert import load_script
from test_deepseek_v4 import SHIPPED, prepare_from, ship_v4
from test_export_gguf import convert, differences, header, read

transformers = need("transformers")
gguf = need("gguf")

# SHIPPED's V4 with llama.cpp's layout of it: 3 layers (sliding, compressed sparse at 4, heavily compressed at 128),
# 16 indexer heads (with 2, keys every head scores below zero tie at exactly 0 at the top-8's edge, and llama.cpp's
# top-k breaks the tie otherwise than torch's), DeepSeek-V3's tokenizer (a pre-tokenizer the converter knows)
HUB = dict(SHIPPED, layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
           compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
           max_position_embeddings=512, index_topk=8, index_n_heads=16, num_nextn_predict_layers=0, vocab_size=129280)
TOP = {"embed_tokens.weight": "embed.weight", **{f"hc_head.hc_{w}": f"hc_head_{w}" for w in ("fn", "base", "scale")}}


def merged_gguf(store: Path, adapter: Path | None, out: Path) -> Path:
    """The file `merge_lora.py --format gguf` (no --outtype: V4 keeps its types) writes into out."""
    args = ["--model", str(store), "--out", str(out), "--format", "gguf", "--quiet"]
    assert load_script("merge_lora").main(args + (["--adapter", str(adapter)] if adapter else [])) == 0
    return next(out.glob("*.gguf"))


def hub_v4(folder: Path) -> Path:
    """A tiny DeepSeek-V4 as the Hub ships V4 (its names, config keys, FP8 and FP4) in folder/ship."""
    from family_check import hf_model
    from safetensors.torch import load_file, save_file
    (folder / "src").mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(real_tokenizer("deepseek_v3") / name, folder / "src" / name)
    ship = ship_v4(hf_model("DeepseekV4Config", **HUB), folder)
    state = {}
    for name, t in load_file(str(ship / "model.safetensors")).items():
        name = TOP.get(name.removeprefix("model."), name.removeprefix("model."))
        state[re.sub(r"^(layers\.\d+\.attn)\.norm\.", r"\1.kv_norm.", name)] = t  # save_pretrained's attn.norm
    save_file(state, str(ship / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((ship / "config.json").read_text())
    rates, compress = config.pop("compress_rates"), config["rope_parameters"]["compress"]
    config["compress_ratios"] = [rates.get(t, 0) for t in config.pop("layer_types")]
    config["num_hash_layers"] = config.pop("mlp_layer_types").count("hash_moe")
    config["rope_theta"] = config.pop("rope_parameters")["main"]["rope_theta"]
    config["rope_scaling"] = {"type": "yarn", **{k: compress[k] for k in ("beta_fast", "beta_slow", "factor",
                                                                         "original_max_position_embeddings")}}
    (ship / "config.json").write_text(json.dumps(config, indent=2))
    return ship


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(the Hub-layout checkpoint, its store, the converter's GGUF of the checkpoint), and the same for a copy named
    as DeepSeek-V4-Flash-0731 whose tokenizer has no chat template (the file then has llama.cpp's own for it)."""
    root = tmp_path_factory.mktemp("v4")
    ship = hub_v4(root)
    bare = shutil.copytree(ship, root / "ship-0731")
    config = json.loads((bare / "tokenizer_config.json").read_text())
    config.pop("chat_template")
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    out = {}
    for src in (ship, bare):
        store = prepare_from(src, root / "store" / src.name)  # named as the checkpoint: the file's general.name
        (root / f"lc-{src.name}").mkdir()
        out[src.name] = src, store, root / f"lc-{src.name}"
    convert([[[], "convert_hf_to_gguf.py", str(src), "--outfile", str(lc)] for src, _, lc in out.values()])
    return {name: (src, store, next(lc.glob("*.gguf"))) for name, (src, store, lc) in out.items()}


def test_the_gguf_is_the_converters_file_of_the_shipped_checkpoint(built, tmp_path):
    """Every byte: the keys (V4's hyper-connection, compression and indexer keys, sqrt(softplus) scoring), the
    hashed layer's table as int32, the experts' FP4 bytes repacked into MXFP4, the FP8 weights as Q8_0, the rest in
    the checkpoint's types, in the converter's order; the file type MXFP4_MOE whatever the store's dtype."""
    for name, (_, store, theirs) in built.items():
        ours = merged_gguf(store, None, tmp_path / name)
        assert ours.name == theirs.name
        assert ours.read_bytes() == theirs.read_bytes(), differences(ours, theirs)[:8]
    _, store, theirs = built["ship"]
    fields, tensors = header(theirs)
    kinds = {name: kind for name, _, kind in tensors}
    assert kinds["blk.0.ffn_gate_tid2eid.weight"] == "I32" and kinds["blk.1.ffn_up_exps.weight"] == "MXFP4"
    assert kinds["blk.1.attn_q_b.weight"] == "Q8_0" and kinds["token_embd.weight"] == "BF16"
    assert fields["deepseek4.expert_gating_func"] == 4 and fields["deepseek4.hash_layer_count"] == 1
    template = json.loads((built["ship"][0] / "tokenizer_config.json").read_text())["chat_template"]
    assert list(fields)[:2] == ["general.architecture", "tokenizer.chat_template"]
    assert fields["tokenizer.chat_template"] == template  # the tokenizer's, in llama.cpp's template's place
    flash = (llama_cpp() / "models" / "templates" / "deepseek-ai-DeepSeek-V4-Flash-0731.jinja").read_text()
    assert header(built["ship-0731"][2])[0]["tokenizer.chat_template"] == flash  # a tokenizer without one


def test_the_packaged_templates_are_llama_cpps():
    """phantom's copies of llama.cpp's DeepSeek-V4 chat templates are the pinned release's, byte for byte."""
    from phantom.export.gguf_deepseek4 import TEMPLATES
    for name in ("deepseek-ai-DeepSeek-V4.jinja", "deepseek-ai-DeepSeek-V4-Flash-0731.jinja"):
        assert (TEMPLATES / name).read_bytes() == (llama_cpp() / "models" / "templates" / name).read_bytes()


def adapter(store: Path, folder: Path, targets: tuple[str, ...]) -> Path:
    """A random LoRA adapter of store on targets, saved in folder."""
    import phantom
    with phantom.load(store, offload="none", lora=phantom.LoraConfig(rank=4, alpha=8, targets=targets)) as model, \
            torch.no_grad():
        gen = torch.Generator().manual_seed(1)
        for p in model.trainable_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
        model.save_adapter(folder)
    return folder


def merged_hf(store: Path, lora: Path, out: Path) -> dict[str, torch.Tensor]:
    assert load_script("merge_lora").main(["--model", str(store), "--adapter", str(lora), "--out", str(out),
                                           "--format", "hf", "--quiet"]) == 0
    return transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()


def dequantized(tensor, qtype: str) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(tensor.data, getattr(gguf.GGMLQuantizationType, qtype)))


def test_an_adapter_is_merged_in_the_files_types(built, tmp_path):
    """A LoRA on attention leaves every expert's bytes as the base file has them and puts the merged HF export's
    values in the attention's Q8_0 weights (within Q8_0's rounding, away from the base ones); a LoRA on the experts
    writes their merged weights quantized by transformers' MXFP4 rule."""
    from phantom.arch.quant import dequantize_mxfp4_into, quantize_mxfp4
    _, store, _ = built["ship"]
    base = {t.name: t for t in read(merged_gguf(store, None, tmp_path / "base")).tensors}
    on_attention = adapter(store, tmp_path / "a", ("q", "kv", "o"))
    m = {t.name: t for t in read(merged_gguf(store, on_attention, tmp_path / "ga")).tensors}
    assert all(bytes(m[n].data) == bytes(t.data) for n, t in base.items() if "_exps." in n)
    hf = merged_hf(store, on_attention, tmp_path / "hfa")
    want = hf["model.layers.1.self_attn.q_b_proj.weight"]
    q_b, before = (dequantized(f["blk.1.attn_q_b.weight"], "Q8_0").reshape(want.shape) for f in (m, base))
    assert max_rel_err(q_b, want) < 1e-2 < max_rel_err(before, want)
    on_experts = adapter(store, tmp_path / "e", ("up",))
    m = {t.name: t for t in read(merged_gguf(store, on_experts, tmp_path / "ge")).tensors}
    hf = merged_hf(store, on_experts, tmp_path / "hfe")
    merged = hf["model.layers.1.mlp.experts.gate_up_proj"][:, HUB["moe_intermediate_size"]:]  # gate, then up rows
    want = torch.stack([dequantize_mxfp4_into(quantize_mxfp4(w), torch.empty_like(w)) for w in merged])
    assert torch.equal(dequantized(m["blk.1.ffn_up_exps.weight"], "MXFP4").reshape(want.shape), want)
    assert bytes(m["blk.1.ffn_up_exps.weight"].data) != bytes(base["blk.1.ffn_up_exps.weight"].data)


def test_what_llama_cpps_deepseek4_fixes_is_refused(built):
    """Its scoring (sqrt(softplus)), its 4 streams, a compression rate of 4 as the indexed one, the hashed layers
    first: a model otherwise is refused, naming what."""
    import dataclasses
    import types
    from phantom.export.gguf_deepseek4 import refusal
    from phantom.files.store import BlockStore
    store = BlockStore(built["ship"][1])
    assert refusal(store, None) is None
    for change, words in [(dict(router_score="sigmoid"), "scores experts by sqrt(softplus)"),
                          (dict(hc_mult=2), "mixes 4 residual streams"),
                          (dict(csa_rate=8), "takes a compression rate of 4 as compressed sparse attention"),
                          (dict(hash_layers=(1,)), "hashes the first hash_layer_count layers")]:
        edited = types.SimpleNamespace(cfg=dataclasses.replace(store.cfg, **change), quant=store.quant)
        assert words in refusal(edited, None), change


def test_refusals_are_one_line(built, tmp_path, capsys):
    """--outtype (the file keeps the checkpoint's types), a store of a 16-bit V4, a GGUF LoRA adapter of V4."""
    from family_check import make, prepare
    _, store, _ = built["ship"]
    sixteen = prepare(make("deepseek_v4"), tmp_path / "16")
    main = load_script("merge_lora").main
    for args, words in [(["--model", str(store), "--format", "gguf", "--outtype", "q8_0"], "drop --outtype"),
                        (["--model", str(sixteen), "--format", "gguf"], "this store is not of one"),
                        (["--model", str(store), "--format", "gguf-lora", "--adapter", str(tmp_path)],
                         "a GGUF LoRA adapter of DeepSeek-V4 is not written")]:
        capsys.readouterr()
        assert main([*args, "--out", str(tmp_path / "out"), "--quiet"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and words in err[0], err
        assert not (tmp_path / "out").exists()


# the checkpoint's FP8 weights (the file's Q8_0 ones) among transformers' parameters
FP8 = ("q_a_proj.weight", "self_attn.q_b_proj.weight", "self_attn.kv_proj.weight", "o_a_proj.weight", "o_b_proj.weight",
       "indexer.q_b_proj.weight", *(f"shared_experts.{p}_proj.weight" for p in ("gate", "up", "down")))


def q8_rounded(model):
    """model with its FP8 weights rounded through Q8_0 as the file holds them (the experts' FP4 values are exact)."""
    import copy
    model = copy.deepcopy(model)
    q8 = gguf.GGMLQuantizationType.Q8_0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(FP8):
                q = gguf.quants.dequantize(gguf.quants.quantize(p.numpy(), q8), q8)
                p.copy_(torch.from_numpy(q).reshape(p.shape))
    return model


def test_llama_cpp_computes_the_file_as_transformers_computes_the_checkpoint(built):
    """llama.cpp (where built) on phantom's file against transformers' DeepseekV4ForCausalLM on the checkpoint, within
    the file's rounding: no further than twice as far as transformers itself moves with its weights rounded as the
    file's (llama.cpp's CPU dot products round the activations to 8 bits besides); on 200 tokens (the indexer's
    top 8 of up to 50 compressed entries, a heavily compressed one), whose choices that rounding moves, the same
    greedy token at 3 positions in 4 (rounding the weights alone keeps 86%). With every tensor in f32, llama.cpp's
    deepseek4 computes this model to 6.5e-6 (notes/gguf-export.md)."""
    llama_cpp = llama_cpp_runtime()
    from test_gguf_llama_cpp import llama_cpp_logits, transformers_logits
    ship, _, theirs = built["ship"]
    reference = transformers.AutoModelForCausalLM.from_pretrained(ship, dtype=torch.float32).float().eval()
    rounded = q8_rounded(reference)
    short, long = [1, 5, 9, 2, 17, 33, 4, 8], [(7 * i + 3) % 400 for i in range(200)]
    got, exact, moved = (f(short) for f in (lambda t: llama_cpp_logits(llama_cpp, theirs, t),
                                            lambda t: transformers_logits(reference, t),
                                            lambda t: transformers_logits(rounded, t)))
    print(f"8 tokens: {max_rel_err(got, exact):.2e} from transformers, which rounding moves "
          f"{max_rel_err(moved, exact):.2e}")
    assert max_rel_err(got, exact) < 2 * max_rel_err(moved, exact)
    got, exact = llama_cpp_logits(llama_cpp, theirs, long), transformers_logits(reference, long)
    same = (got.argmax(-1) == exact.argmax(-1)).float().mean().item()
    print(f"200 tokens: {max_rel_err(got, exact):.2e}, the same greedy token at {same:.0%} of positions")
    assert same >= 0.75
