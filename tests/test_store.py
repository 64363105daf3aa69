"""The block store: bit-exact round trip, interop with the safetensors library, refusal of bad files."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

import phantom
from phantom.config import block_tensor_shapes, embed_tensor_shapes, head_tensor_shapes
from phantom.store import BlockStore, StoreError, StoreWriter, block_file
from conftest import SMALL


def random_tensors(shapes, gen, dtype):
    return {k: torch.randn(s, generator=gen).to(dtype) for k, s in shapes.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_is_bit_exact(tmp_path, dtype):
    gen = torch.Generator().manual_seed(0)
    written = {"embed": random_tensors(embed_tensor_shapes(SMALL), gen, dtype),
               "head": random_tensors(head_tensor_shapes(SMALL), gen, dtype),
               "blocks": [random_tensors(block_tensor_shapes(SMALL), gen, dtype) for _ in range(SMALL.n_layers)]}
    with StoreWriter(tmp_path / "s", SMALL, dtype) as w:
        w.write_embed(written["embed"])
        for i, b in enumerate(written["blocks"]):
            w.write_block(i, b)
        w.write_head(written["head"])
        w.finish()
    store = BlockStore(tmp_path / "s", verify="full")
    assert store.cfg == SMALL and store.dtype == dtype
    buf = torch.empty(store.block_nbytes, dtype=torch.uint8)  # one reusable buffer for every block
    for i, expected in enumerate(written["blocks"]):
        store.read_block_into(i, buf)
        got = store.block_views(buf)
        assert got.keys() == expected.keys()
        for k in expected:
            assert got[k].dtype == dtype and torch.equal(got[k].view(torch.uint8), expected[k].view(torch.uint8)), k
        # the files are plain safetensors that the reference library reads identically
        ref = load_file(str(tmp_path / "s" / block_file(i)))
        assert all(torch.equal(ref[k].view(torch.uint8), expected[k].view(torch.uint8)) for k in expected)
    for k, v in written["embed"].items():
        assert torch.equal(store.load_embed()[k].view(torch.uint8), v.view(torch.uint8))
        assert torch.equal(store.mmap_embed().view(torch.uint8), v.view(torch.uint8))
    for k, v in written["head"].items():
        assert torch.equal(store.load_head()[k].view(torch.uint8), v.view(torch.uint8))


@pytest.fixture
def store_copy(small_store, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(small_store, dst)
    return dst


def test_truncated_block_is_refused_on_open(store_copy):
    path = store_copy / block_file(2)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    with pytest.raises(StoreError, match=r"002\.safetensors.*(truncated|size)"):
        BlockStore(store_copy)


def test_corrupted_block_is_refused_before_use(store_copy):
    path = store_copy / block_file(1)
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF  # one flipped byte inside a weight, size unchanged
    path.write_bytes(bytes(data))
    store = BlockStore(store_copy)  # fast mode: sizes and headers look fine
    buf = torch.empty(store.block_nbytes, dtype=torch.uint8)
    store.read_block_into(0, buf)
    with pytest.raises(StoreError, match=r"001\.safetensors.*checksum"):
        store.read_block_into(1, buf)
    with pytest.raises(StoreError, match=r"001\.safetensors.*checksum"):
        BlockStore(store_copy, verify="full")
    # the model never computes with it: the prefetch thread's error reaches the training thread
    model = phantom.load(store_copy, offload="disk")
    with pytest.raises(StoreError, match="checksum"):
        model(torch.zeros(1, 4, dtype=torch.long))
    model.close()
    with pytest.raises(StoreError, match="checksum"):
        phantom.load(store_copy, offload="ram")


def test_corrupt_header_is_refused(store_copy):
    path = store_copy / block_file(0)
    data = bytearray(path.read_bytes())
    data[8:12] = b"\xff\xfe{["
    path.write_bytes(bytes(data))
    with pytest.raises(StoreError, match=r"000\.safetensors.*header"):
        BlockStore(store_copy)


def test_huge_header_claim_is_refused_without_allocating(store_copy):
    path = store_copy / block_file(0)
    data = bytearray(path.read_bytes())
    data[:8] = (10 << 40).to_bytes(8, "little")  # "10 TB of header"
    path.write_bytes(bytes(data))
    with pytest.raises(StoreError, match="corrupt safetensors header"):
        BlockStore(store_copy)


def test_manifest_paths_cannot_escape(store_copy):
    m = json.loads((store_copy / "manifest.json").read_text())
    m["tokenizer"] = "../../etc/passwd"
    (store_copy / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(StoreError, match="escapes"):
        BlockStore(store_copy).tokenizer_path


def test_missing_store_says_how_to_prepare(tmp_path):
    with pytest.raises(FileNotFoundError, match="prepare_model.py"):
        BlockStore(tmp_path / "nothing")


def test_failed_write_leaves_nothing(tmp_path):
    with pytest.raises(ValueError):
        with StoreWriter(tmp_path / "s", SMALL, torch.float32) as w:
            w.write_block(0, {"attention.wq.weight": torch.zeros(3, 3)})
    assert list(tmp_path.iterdir()) == []
