"""MXFP4 (gpt-oss's experts): the codec against transformers' own dequantization, and mxfp4 stores of a mixture of
experts (the routed experts in MXFP4, the rest bf16, as gpt-oss ships them): what they hold, each expert's blocks and
scales one byte range read routed, and the cost model's bytes.

- phantom's dequantized values equal transformers' convert_moe_packed_tensors (the Mxfp4Config(dequantize=True)
  path) bit for bit, in fp32 and bf16, over every byte value and scales from 2^-127 to 2^127;
- a synthetic mxfp4 store's experts are near its bf16 twin's, its attention equal; its logits are the same read
  resident, routed and whole, from disk and RAM; its block files hold block_nbytes.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import phantom
from phantom.arch import quant
from phantom.arch.config import block_tensor_shapes
from phantom.arch.presets import PRESETS
from phantom.arch.quantformat import QuantFormat, as_format, block_nbytes
from phantom.files.store import BlockStore
from phantom.model.synthetic import write_synthetic
from phantom.plan import costinputs as ci
from conftest import need
from family_check import batch, rel_err

CFG = dataclasses.replace(PRESETS["qwen3-30B-A3B"], dim=64, n_layers=2, n_heads=4, n_kv_heads=2, explicit_head_dim=16,
                          vocab_size=97, intermediate_size=96, max_seq_len=64, n_experts=6, experts_per_token=2,
                          expert_dim=32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantized_values_equal_transformers_bit_for_bit(dtype):
    need("transformers")
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    gen = torch.Generator().manual_seed(0)
    experts, rows, groups = 3, 40, 4
    blocks = torch.randint(0, 256, (experts, rows, groups, 16), generator=gen, dtype=torch.uint8)
    blocks[0, 0, :, :] = torch.arange(256, dtype=torch.uint8).view(-1, 16)[:groups]  # every byte value
    blocks[0, 1, :, :] = torch.arange(256, dtype=torch.uint8).view(-1, 16)[-groups:]
    scales = torch.randint(110, 140, (experts, rows, groups), generator=gen, dtype=torch.uint8)
    scales[1, 0] = torch.tensor([0, 1, 253, 254], dtype=torch.uint8)  # 2^-127 (subnormal in fp32) .. 2^127
    theirs = convert_moe_packed_tensors(blocks.clone(), scales.clone(), dtype=dtype)  # (experts, columns, rows)
    fmt = QuantFormat("mxfp4")
    for e in range(experts):
        ours = quant.dequantize_into(fmt, {"blocks": blocks[e], "scales": scales[e]},
                                     torch.empty(rows, groups * 32, dtype=dtype))
        assert torch.equal(ours.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                           theirs[e].T.contiguous().view(ours.view(torch.int16 if dtype == torch.bfloat16 else
                                                                   torch.int32).dtype)), e


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("mxfp4")
    dense = write_synthetic(root / "bf16", CFG, torch.bfloat16, progress=False)
    fmt = as_format("mxfp4")
    return dense, write_synthetic(root / "mxfp4", CFG, torch.bfloat16, progress=False, quant=fmt)


def test_a_synthetic_mxfp4_store_holds_its_weights_and_an_expert_is_one_range(stores):
    dense, mx = BlockStore(stores[0]), BlockStore(stores[1])
    assert mx.quant.method == "mxfp4" and mx.quant.experts_only
    for i in range(mx.n_blocks):
        assert mx.block_size(i) == block_nbytes(mx.quant, block_tensor_shapes(mx.cfg, i), "bfloat16")
        assert len(mx.blocks[i].experts) == CFG.n_experts  # each expert's blocks and scales: one byte range
        names = [s.name for s in mx.blocks[i].specs]
        assert any(n.endswith(".blocks") for n in names) and not any("attention" in n and n.endswith(".blocks")
                                                                      for n in names)
        a, b = mx.load_block(i, torch.float32), dense.load_block(i, torch.float32)
        for k, v in b.items():
            err = ((a[k] - v).abs().mean() / v.abs().mean()).item()
            assert err < (0.15 if ".experts." in k else 1e-6), (k, err)
    ratio = ci.shape_of(PRESETS["qwen3-235B-A22B"], quant="mxfp4").block_bytes / \
        ci.shape_of(PRESETS["qwen3-235B-A22B"]).block_bytes
    assert 0.2656 < ratio < 0.29, ratio  # 4.25 bits a routed expert's value, attention bf16


def test_logits_are_the_same_read_resident_routed_and_whole(stores):
    tokens, _ = batch(2, 16)
    tokens = tokens % CFG.vocab_size
    with phantom.load(stores[1], offload="none", lora=None, dtype=torch.float32) as pm, torch.no_grad():
        expected = pm(tokens)
    for offload in ("disk", "ram"):
        for reads in ("routed", "whole"):
            with phantom.load(stores[1], offload=offload, prefetch=1, lora=None, dtype=torch.float32, expert_reads=reads,
                              micro_batch=1 if reads == "routed" else None) as pm, torch.no_grad():
                assert rel_err(pm(tokens), expected) < 1e-6, (offload, reads)
