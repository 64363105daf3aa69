"""prepare_model.py --link copies no tensor, 16-bit or quantized, dense or mixture of experts: q/k rows stay in the
RoPE layout the checkpoint ships them in (Hugging Face's halves: the store's config says rope_interleave false and
the attention rotates halves), so every tensor is read in place. Four checkpoints, each written by its reference
tool: a bf16 Llama by transformers' save_pretrained, gpt-oss with the Hub's MXFP4 experts (tests/mxfp4_checkpoint.py),
a Qwen3-MoE with compressed-tensors INT4 experts and bf16 attention (compressed-tensors' compressor,
tests/int4_checkpoint.py) and an FP8 DeepSeek-V3 (tests/fp8_checkpoint.py, its float32 router bias kept in float32).
Each linked store holds no tensor bytes (its manifest indexes the checkpoint's, under 64 KiB) and its logits equal
the copied store's bit for bit (gpt-oss's experts keep gate and up in the alternating rows they ship in). A store
written before the layout was recorded (q/k permuted into pairs) still opens and computes the same logits.
"""
from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch

import phantom
from phantom.arch.ops import rope_rows
from phantom.arch.ops import permute_from_hf
from phantom.files.store import BlockStore
from phantom.files.tensorfile import write_safetensors
from family_check import batch, check_linked_in_place, make, rel_err
from test_convert import load_script
from test_export_hf import llama3_style_tokenizer_json


def bf16_llama(folder):
    model = make("llama-tied").to(torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)


def gpt_oss_mxfp4(folder):
    from mxfp4_checkpoint import write_mxfp4
    write_mxfp4(make("gpt_oss"), folder)


def qwen3_moe_int4(folder):
    from int4_checkpoint import write_int4
    write_int4(make("qwen3_moe"), folder, ("lm_head", r"re:.*self_attn.*"))  # attention stays bf16


def deepseek_v3_fp8(folder):
    from fp8_checkpoint import write_fp8
    write_fp8(make("deepseek_v3", hidden_size=144, q_lora_rank=136, moe_intermediate_size=40, intermediate_size=200),
              folder)


CHECKPOINTS = {"llama-bf16": bf16_llama, "gpt-oss-mxfp4": gpt_oss_mxfp4, "qwen3-moe-int4": qwen3_moe_int4,
               "deepseek-v3-fp8": deepseek_v3_fp8}


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    made = {}

    def get(name):
        if name not in made:
            root = tmp_path_factory.mktemp(name)
            CHECKPOINTS[name](root / "hf")
            llama3_style_tokenizer_json(root / "hf")
            for kind in ("copy", "link"):
                args = ["--src", str(root / "hf"), "--out", str(root / kind), "--quiet", *["--link"] * (kind == "link")]
                assert load_script("prepare_model").main(args) == 0
            made[name] = root
        return made[name]
    return get


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_a_linked_store_holds_no_tensor_and_computes_the_copied_logits_bit_for_bit(stores, name):
    root = stores(name)
    tokens, _ = batch(t=24)
    knobs = {} if name == "llama-bf16" else {"expert_reads": "whole"}
    own = check_linked_in_place(root / "copy", root / "link", tokens, **knobs)
    linked = json.loads((root / "link" / "manifest.json").read_text())["links"]["files"]
    assert all(t["file"].startswith("/") for f in linked.values() for t in f["tensors"])  # all in the checkpoint
    store = BlockStore(root / "link")
    assert not rope_rows(store.cfg) and (store.cfg.kv_lora_rank or not store.cfg.rope_interleave), own


def test_a_store_with_q_k_in_pairs_still_opens_as_before(stores, tmp_path):
    """A store written before the layout was recorded (q/k rows permuted into Meta's pairs, no rope_interleave in
    its manifest's config) reads as it did, rotates pairs, and computes the logits of the store in the shipped
    layout (within rounding: the q.k sums run over the head's dims in another order)."""
    src = stores("llama-bf16") / "copy"
    old = tmp_path / "old"
    shutil.copytree(src, old)
    manifest = json.loads((old / "manifest.json").read_text())
    assert manifest["config"].pop("rope_interleave") is False  # the shipped layout, recorded
    store = BlockStore(src)
    rows = rope_rows(dataclasses.replace(store.cfg, rope_interleave=True))
    for i in range(store.n_blocks):
        rel = f"blocks/{i:03d}.safetensors"
        tensors = {k: permute_from_hf(v, rows[k], store.cfg.rope_dim) if k in rows else v
                   for k, v in store.load_block(i).items()}
        (old / rel).unlink()
        manifest["files"][rel] = write_safetensors(old / rel, tensors)
    (old / "manifest.json").write_text(json.dumps(manifest))
    assert BlockStore(old).cfg.rope_interleave
    tokens, _ = batch(t=24)
    out = []
    for path in (src, old):
        with phantom.load(path, offload="disk", lora=None, dtype=torch.float32) as pm, torch.no_grad():
            out.append(pm(tokens))
    assert rel_err(out[1], out[0]) < 1e-5
