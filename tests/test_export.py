"""Export: a store plus a LoRA adapter merged into Hugging Face and Meta checkpoints, which convert back to
the logits of base + adapter; the base exported as it is matches HF's own layout tensor for tensor.
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import phantom
from phantom.convert.convert import convert_checkpoint
from phantom.export.export import FormatOptions, export
from test_convert import LLAMA3, TOKENS, hf_state_dict, load_script, random_model, store_logits, write_hf

ALL_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A store converted from an HF checkpoint (explicit FFN width, GQA, Llama-3.1 RoPE scaling)."""
    root = tmp_path_factory.mktemp("export")
    sd = random_model(LLAMA3, seed=3)
    store = convert_checkpoint(write_hf(root / "hf", LLAMA3, sd), root / "store", progress=False)["out"]
    return store, sd


@pytest.fixture(scope="module")
def adapter(base, tmp_path_factory):
    """A trained-looking adapter on every target (B nonzero), and the logits of base + adapter."""
    out = tmp_path_factory.mktemp("adapter") / "adapter"
    lora = phantom.LoraConfig(rank=4, alpha=8, targets=ALL_TARGETS)
    with phantom.load(base[0], offload="none", lora=lora) as model, torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        for p in model.trainable_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        expected = model(TOKENS)
        model.save_adapter(out)
    with torch.no_grad():
        assert (expected - store_logits(base[0], TOKENS)).abs().max() > 1e-2  # the adapter changes the output
    return out, expected


@pytest.mark.parametrize("fmt", ["hf", "meta"])
def test_merged_checkpoint_gives_base_plus_adapter_logits(tmp_path, base, adapter, fmt):
    out = export(base[0], tmp_path / "merged", adapter[0], fmt, progress=False)
    assert (out / ("config.json" if fmt == "hf" else "params.json")).is_file()
    back = convert_checkpoint(out, tmp_path / "back", progress=False)
    assert back["format"] == fmt and back["config"].hidden_dim == LLAMA3.hidden_dim
    assert back["config"].rope_scaling == LLAMA3.rope_scaling
    torch.testing.assert_close(store_logits(back["out"], TOKENS), adapter[1], rtol=0, atol=1e-5)


def test_base_export_is_hf_layout_exactly(tmp_path, base):
    out = export(base[0], tmp_path / "hf", None, "hf", dtype=torch.float32, progress=False,
                 options=FormatOptions(max_shard_size=50_000))
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    got = {}
    for name in sorted(set(index.values())):
        got.update(load_file(out / name))
    expected = hf_state_dict(LLAMA3, base[1])
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)


def weight_files(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("model"))


@pytest.mark.parametrize("max_shard_size", [None, 40_000, "0.1MB"])
def test_hf_export_is_sharded_as_save_pretrained_shards(tmp_path, base, adapter, max_shard_size):
    """The files, and the index past one shard, are what transformers' save_pretrained writes for the
    same model at the same max_shard_size (default: its 50GB, so model.safetensors alone); the export
    loads with AutoModelForCausalLM and gives base + adapter."""
    transformers = pytest.importorskip("transformers")
    size = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    out = export(base[0], tmp_path / "hf", adapter[0], "hf", dtype=torch.float32, progress=False,
                 options=FormatOptions(**size))
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS).logits, adapter[1], rtol=0, atol=1e-4)
    model.save_pretrained(tmp_path / "theirs", **size)
    assert weight_files(out) == weight_files(tmp_path / "theirs")
    if max_shard_size is None:
        assert weight_files(out) == ["model.safetensors"]
    else:
        assert len(weight_files(out)) > 3  # shards cut inside blocks, not one per block
        index = "model.safetensors.index.json"
        assert (out / index).read_text() == (tmp_path / "theirs" / index).read_text()


def test_merge_lora_cli(tmp_path, capsys, base, adapter):
    merge = load_script("merge_lora").main
    assert merge(["--model", str(base[0]), "--adapter", str(adapter[0]), "--out", str(tmp_path / "m"),
                  "--dtype", "bf16", "--quiet"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert phantom.BlockStore(convert_checkpoint(tmp_path / "m", tmp_path / "s", progress=False)["out"]).dtype \
        == torch.bfloat16
    assert merge(["--model", str(base[0]), "--adapter", str(tmp_path / "nope"), "--out", str(tmp_path / "m2")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "adapter_config.json" in err[0] and not (tmp_path / "m2").exists()
    assert merge(["--model", str(base[0]), "--out", str(tmp_path / "m3"), "--max-shard-size", "50000", "--quiet"]) == 0
    assert len(list((tmp_path / "m3").glob("model-*-of-*.safetensors"))) > 3
    for bad in (["--max-shard-size", "5 GiB"], ["--max-shard-size", "0"],
                ["--max-shard-size", "5GB", "--format", "meta"]):
        assert merge(["--model", str(base[0]), "--out", str(tmp_path / "m4"), *bad]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and "--max-shard-size" in err[0], err
        assert not (tmp_path / "m4").exists()


def test_transformers_loads_the_export(tmp_path, base, adapter):
    """Nice to have: transformers' own Llama gives the same logits from the merged HF export."""
    transformers = pytest.importorskip("transformers")
    out = export(base[0], tmp_path / "hf", adapter[0], "hf", progress=False)
    model = transformers.LlamaForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(TOKENS).logits
    torch.testing.assert_close(logits, adapter[1], rtol=0, atol=1e-4)


def test_peft_loads_the_adapter_unchanged(tmp_path, base, adapter):
    """Nice to have: peft applies phantom's adapter to transformers' Llama and gets phantom's logits."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    out = export(base[0], tmp_path / "hf", None, "hf", progress=False)
    model = transformers.LlamaForCausalLM.from_pretrained(out, torch_dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(model, adapter[0]).eval()
    with torch.no_grad():
        logits = model(TOKENS).logits
    torch.testing.assert_close(logits, adapter[1], rtol=0, atol=1e-4)


def test_the_tokenizer_caveat_is_said_by_the_export_not_by_each_adapter(tmp_path, caplog):
    """The tiny tokenizer collapses runs of spaces, which transformers' LlamaTokenizer does not: a merged
    export says so once; writing an adapter's tokenizer files (every finetune run) stays quiet."""
    import logging
    from phantom.export.export import tokenizer_caveat, write_tokenizer_files
    store = phantom.BlockStore(phantom.resolve_model("tiny"))
    assert "normalizes text" in tokenizer_caveat(store)
    with caplog.at_level(logging.INFO, logger="phantom"):
        write_tokenizer_files(store, tmp_path)
        assert "normalizes text" not in caplog.text
        export(store.path, tmp_path / "merged", progress=False)
    assert caplog.text.count("normalizes text") == 1
