"""INT4 checkpoints read as shipped (int4-group stores): a tiny Llama with every linear weight INT4 and a tiny
DeepSeek-V3 (Kimi-K2-Thinking's shape) with its routed experts INT4 and the rest 16-bit as its `ignore` says,
written by compressed-tensors' own compressor (tests/int4_checkpoint.py), prepared copied and linked in place,
against the transformers model holding compressed-tensors' decompression of the same bytes:

- every dequantized weight equals compressed-tensors' decompression bit for bit;
- logits from disk and RAM within 1e-5 (fp32), the experts read routed and whole;
- LoRA gradients equal peft's within 1e-4 (on the INT4 projections of the Llama, on the INT4 experts of the
  DeepSeek-V3), the adapter loads in peft, the merged export loads in transformers;
- the store keeps the shipped bytes (<= 1.02x), a linked store copies none of them;
- full finetuning and INT4 configs phantom does not read are refused in one line.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch

import phantom
from phantom.arch import quant
from phantom.arch.config import ConfigError, block_tensor_shapes
from phantom.arch.family import config_from_hf
from phantom.arch.presets import PRESETS
from phantom.arch.quantformat import block_nbytes
from phantom.files.store import BlockStore
from phantom.model.convert import disk_usage
from phantom.model.export import export
from phantom.plan import costinputs as ci
from family_check import batch, check_lora, make, peft_step, rel_err, transformers
from int4_checkpoint import GROUP, KIMI_IGNORE, WEIGHTS, decompress, write_int4
from test_bad_inputs import check, script
from test_convert import load_script
from test_export_hf import llama3_style_tokenizer_json
from test_moe_lora import assert_equals_peft, few, phantom_step
from test_moe_routed import ram_streams  # noqa: F401  (a fixture: the RAM tier read into slots, as on CUDA)

MODELS = {"llama-tied": ("lm_head",), "deepseek_v3": tuple(KIMI_IGNORE)}
RUNS = [(off, reads) for off in ("disk", "ram") for reads in ("routed", "whole")]


@pytest.fixture(scope="module")
def int4(tmp_path_factory):
    """get(name) -> (shipped tensors, reference model, {"copy": store, "link": store}), each made once."""
    made = {}

    def get(name):
        if name not in made:
            root = tmp_path_factory.mktemp(name)
            shipped, ref = write_int4(make(name), root / "hf", MODELS[name])
            llama3_style_tokenizer_json(root / "hf")
            stores = {}
            for kind in ("copy", "link"):
                args = ["--src", str(root / "hf"), "--out", str(root / kind), "--quiet"] + (["--link"] if kind == "link" else [])
                assert load_script("prepare_model").main(args) == 0
                stores[kind] = root / kind
            made[name] = shipped, ref, stores
        return made[name]
    return get


@pytest.mark.parametrize("name", list(MODELS))
def test_dequantized_weights_equal_compressed_tensors_bit_for_bit(int4, name):
    """Each stored INT4 weight, dequantized by phantom into fp32 and bf16, equals compressed-tensors'
    decompression of the same bytes (bf16 products, then widened), q/k rows aside (phantom permutes them after)."""
    shipped, _, stores = int4(name)
    for kind, path in stores.items():
        store = BlockStore(path)
        assert (store.quant.method, store.quant.group, store.quant.scale_dtype) == ("int4-group", GROUP, "bfloat16")
        n = 0
        for i in range(store.n_blocks):
            buf = torch.empty(store.block_size(i), dtype=torch.uint8)
            store.read_block_into(i, buf)
            stored = store.block_views(buf, i)
            for key in [k for k in stored if k.endswith(".packed")]:
                parts = {"packed": stored[key], "scale": stored[key.replace(".packed", ".scale")]}
                rows, cols = parts["packed"].shape[0], parts["scale"].shape[1] * GROUP
                theirs = decompress({"w_packed": parts["packed"], "w_scale": parts["scale"],
                                     "w_shape": torch.tensor([rows, cols])}, "w_packed")
                for dtype in (torch.float32, torch.bfloat16):
                    ours = quant.dequantize_into(store.quant, parts, torch.empty(rows, cols, dtype=dtype))
                    assert torch.equal(ours, theirs.to(dtype)), (kind, i, key, dtype)
                n += 1
        assert n == sum(k.endswith("_packed") for k in shipped), kind


@pytest.mark.parametrize("name", list(MODELS))
def test_logits_equal_the_decompressed_transformers_model_from_disk_and_ram(int4, name):
    _, ref, stores = int4(name)
    tokens, _ = batch()
    with torch.no_grad():
        expected = ref(tokens).logits
    moe = name == "deepseek_v3"
    for kind, path in stores.items():
        if moe:  # every expert one byte range (its words and scales), so a routed read fetches it alone
            store = BlockStore(path)
            assert all(len(store.blocks[i].experts) == store.cfg.n_experts for i in range(1, store.n_blocks)), kind
        for offload, reads in RUNS if moe else [("disk", None), ("ram", None)]:
            knobs = dict(expert_reads=reads, micro_batch=1 if reads == "routed" else None) if moe else {}
            with phantom.load(path, offload=offload, prefetch=1, lora=None, dtype=torch.float32, **knobs) as pm:
                with torch.no_grad():
                    assert rel_err(pm(tokens), expected) < 1e-5, (kind, offload, reads)
