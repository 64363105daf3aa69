"""The block store: bit-exact round trip, interop with the safetensors library, refusal of bad files."""
from __future__ import annotations

import hashlib
import json
import shutil
import zlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import phantom
import phantom.base.checksum
import phantom.files.directio
import phantom.files.tensorfile
from phantom.convert.synthetic import write_synthetic
from phantom.arch.config import block_tensor_shapes, embed_tensor_shapes, head_tensor_shapes
from phantom.files.store import BlockStore, StoreError
from phantom.files.storeformat import block_file
from phantom.files.storewriter import StoreWriter
from phantom.files.workingcopy import clone_store
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


def flip_byte(path: Path, at: int, mask: int = 0xFF) -> None:
    """Flip bits of one byte of a file in place (size and, away from the header, header unchanged)."""
    data = bytearray(path.read_bytes())
    data[at] ^= mask
    path.write_bytes(bytes(data))


def test_corrupted_block_is_refused_before_use(store_copy):
    flip_byte(store_copy / block_file(1), -10)  # one flipped byte inside a weight, size unchanged
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


def test_checksums_chunk_the_data_whatever_the_writes():
    data = torch.randint(0, 256, (10_000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    raw = bytes(data.numpy())
    sums = phantom.base.checksum.Checksums(chunk=1000)
    sums.update_header(b"head")
    for a, b in ((0, 7), (7, 2500), (2500, 2500), (2500, 9999), (9999, 10_000)):  # across chunk ends, empty
        sums.update(raw[a:b])
    rec = sums.record()
    assert rec["sha256"] == hashlib.sha256(b"head" + raw).hexdigest()
    assert rec["crc32"] == {"chunk": 1000, "header": zlib.crc32(b"head"),
                            "data": [zlib.crc32(raw[a:a + 1000]) for a in range(0, 10_000, 1000)]}
    assert phantom.base.checksum.crc32_chunks(memoryview(raw), 3000) == [zlib.crc32(raw[a:a + 3000]) for a in range(0, 10_000, 3000)]


@pytest.fixture
def chunked_store(tmp_path, monkeypatch):
    """A store whose blocks span several crc32 chunks (the first and last chunk's bytes are flipped below)."""
    monkeypatch.setattr(phantom.base.checksum, "CHECK_CHUNK", 4096)
    return write_synthetic(tmp_path / "s", SMALL, torch.float32, seed=1, progress=False)


def test_new_store_records_sha256_and_crc32(chunked_store):
    m = json.loads((chunked_store / "manifest.json").read_text())
    store = BlockStore(chunked_store, verify="full")
    for rel, info in m["files"].items():
        if not rel.endswith(".safetensors"):
            continue
        data = (chunked_store / rel).read_bytes()
        start = next(e for e in [store.embed, store.head, *store.blocks] if e.path.name == rel.split("/")[-1]).data_start
        assert info["sha256"] == hashlib.sha256(data).hexdigest()
        assert info["crc32"]["header"] == zlib.crc32(data[:start])
        assert info["crc32"]["data"] == [zlib.crc32(data[a:a + 4096]) for a in range(start, len(data), 4096)], rel
        assert len(info["crc32"]["data"]) > 2


@pytest.mark.parametrize("where", ["first", "last", "header"])
def test_fast_verify_finds_a_flipped_byte_by_crc32_on_first_read(chunked_store, where, monkeypatch):
    path = chunked_store / block_file(2)
    data = bytearray(path.read_bytes())
    start = phantom.files.tensorfile.read_header(path)[1]
    if where == "header":  # in the header's padding: still valid JSON, same tensors, only the checksum sees it
        assert data[start - 1:start] == b" "
        data[start - 1] = ord("\t")
    else:
        data[start + 5 if where == "first" else -10] ^= 0x01
    path.write_bytes(bytes(data))
    store = BlockStore(chunked_store)  # fast: sizes and headers look fine
    assert all(e.crc is not None for e in store.blocks)
    buf = torch.empty(store.block_nbytes, dtype=torch.uint8)
    for i in (0, 1, 3):
        store.read_block_into(i, buf)
    monkeypatch.setattr(hashlib, "sha256", None)  # fast verify of a new store hashes with crc32 alone
    with pytest.raises(StoreError, match=r"blocks/002\.safetensors: checksum mismatch \(crc32 of its "
                                         + {"first": "data bytes 0..4096", "last": "data bytes", "header": "header"}[where]):
        store.read_block_into(2, buf)
    with pytest.raises(StoreError, match=r"002\.safetensors: checksum mismatch"):  # the scheduler's way:
        BlockStore(chunked_store).read_block_into(2, buf, defer_verify=True)  # checked by the read itself
    with pytest.raises(StoreError, match=r"002\.safetensors: checksum mismatch"):
        BlockStore(chunked_store).load_block(2)
    with pytest.raises(StoreError, match=r"002\.safetensors: checksum mismatch"):
        BlockStore(chunked_store).map_block(2)
    monkeypatch.undo()
    with pytest.raises(StoreError, match=r"002\.safetensors: checksum mismatch \(the file"):  # full: sha256
        BlockStore(chunked_store, verify="full")


def test_store_without_crc32_opens_and_verifies_by_sha256(chunked_store):
    """A store written before crc32 was recorded: fast verify falls back to each file's sha256."""
    m = json.loads((chunked_store / "manifest.json").read_text())
    for info in m["files"].values():
        info.pop("crc32", None)
    (chunked_store / "manifest.json").write_text(json.dumps(m))
    store = BlockStore(chunked_store)
    assert all(e.crc is None for e in store.blocks)
    buf = torch.empty(store.block_nbytes, dtype=torch.uint8)
    store.read_block_into(1, buf)
    flip_byte(chunked_store / block_file(1), -10)
    with pytest.raises(StoreError, match=r"001\.safetensors: checksum mismatch \(the file is corrupt"):
        BlockStore(chunked_store).read_block_into(1, buf)


def test_bad_crc32_record_is_refused_on_open(chunked_store):
    m = json.loads((chunked_store / "manifest.json").read_text())
    m["files"][block_file(3)]["crc32"]["data"].pop()
    (chunked_store / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(StoreError, match=r"bad crc32 record for blocks/003\.safetensors"):
        BlockStore(chunked_store)


def test_rewritten_file_carries_a_new_crc32(chunked_store):
    store = BlockStore(clone := clone_store(chunked_store, chunked_store.parent / "work"))
    new = {k: torch.ones_like(v) for k, v in store.load_block(1).items()}
    store.write_block(1, new)
    again = BlockStore(clone)
    assert all(torch.equal(v, new[k]) for k, v in again.load_block(1).items())
    BlockStore(clone, verify="full")
    BlockStore(chunked_store, verify="full")  # the original is untouched


def direct_reads(monkeypatch, refused: bool) -> list:
    """The descriptors of O_DIRECT reads, recorded as os.preadv is called; with `refused` each such read
    fails as a filesystem that accepts O_DIRECT at open but refuses its reads (EINVAL)."""
    import errno
    import fcntl
    import os
    direct, real_preadv = [], os.preadv

    def preadv(fd, buffers, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            direct.append(fd)
            if refused:
                raise OSError(errno.EINVAL, "Invalid argument (O_DIRECT read)")
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", preadv)
    return direct


@pytest.mark.parametrize("crc_chunk", [4096, 3 * 4096, 3000, 1 << 20])
@pytest.mark.parametrize("refused", [False, True])
def test_read_hashes_each_piece_as_it_lands(tmp_path, monkeypatch, crc_chunk, refused):
    """readinto_exact(crc_chunk=...): requests of whole pieces hashed by their threads, the bytes past
    O_DIRECT's reach added onto their piece, the same after O_DIRECT reads are refused; other piece
    sizes hashed after the read. Always the crc32 of each piece of the bytes read."""
    monkeypatch.setattr(phantom.files.directio, "READ_CHUNK", 8 * 4096)
    monkeypatch.setattr(phantom.files.directio, "_direct_ok", {})
    gen = torch.Generator().manual_seed(crc_chunk)
    raw = bytes(torch.randint(0, 256, (5 * 8 * 4096 + 3 * 4096 + 1234,), dtype=torch.uint8, generator=gen).numpy())
    path = tmp_path / "f"
    path.write_bytes(b"\0" * 4096 + raw)
    host = torch.empty(len(raw) + 4096, dtype=torch.uint8)
    skip = -host.data_ptr() % 4096
    buf = host[skip: skip + len(raw)]
    direct = direct_reads(monkeypatch, refused)
    got = phantom.files.directio.readinto_exact(path, 4096, buf, crc_chunk=crc_chunk)
    assert bytes(buf.numpy()) == raw
    assert got == [zlib.crc32(raw[a:a + crc_chunk]) for a in range(0, len(raw), crc_chunk)]
    if phantom.files.directio._direct_ok:  # this filesystem takes O_DIRECT
        assert direct


def test_crc32_records_do_not_depend_on_the_implementation(chunked_store, monkeypatch):
    """ISA-L's crc32 (isal installed) and zlib's give the same values: a store written with one verifies
    with the other, and a flipped byte is found by either."""
    other = "zlib"
    if phantom.base.checksum.CRC32 == "zlib":
        pytest.importorskip("isal.isal_zlib")
        other = "isal"
    store = BlockStore(chunked_store, crc32=other)
    buf = torch.empty(store.block_nbytes, dtype=torch.uint8)
    for i in range(store.n_blocks):
        store.read_block_into(i, buf)
    store.load_embed(), store.load_head()
    flip_byte(chunked_store / block_file(0), -1, 0x80)
    with pytest.raises(StoreError, match=r"000\.safetensors: checksum mismatch \(crc32"):
        BlockStore(chunked_store).read_block_into(0, buf)


@pytest.mark.parametrize("refused", [False, True])
def test_many_ranges_of_one_file_read_each_byte_where_it_belongs(tmp_path, monkeypatch, refused):
    """readinto_pieces: ranges at any offset and length (under 4 KiB, unaligned ends, longer than a request)
    land at their buffer offsets, O_DIRECT where aligned, the same after O_DIRECT reads are refused; the
    rest of the buffer is untouched. Against Python's own file reads."""
    monkeypatch.setattr(phantom.files.directio, "READ_CHUNK", 4 * 4096)
    monkeypatch.setattr(phantom.files.directio, "_direct_ok", {})
    gen = torch.Generator().manual_seed(7)
    raw = bytes(torch.randint(0, 256, (40 * 4096 + 777,), dtype=torch.uint8, generator=gen).numpy())
    path = tmp_path / "f"
    path.write_bytes(raw)
    host = torch.zeros(len(raw) + 4096, dtype=torch.uint8)
    buf = host[-host.data_ptr() % 4096:][: len(raw)]
    pieces = [(0, 0, 4096), (4096 + 10, 4096 + 10, 3 * 4096 - 5), (5 * 4096, 5 * 4096, 19 * 4096),  # aligned, 14 pages
              (20 * 4096 + 1, 20 * 4096 + 1, 20 * 4096 + 100), (24 * 4096, 30 * 4096, 30 * 4096 + 8192 + 3),
              (40 * 4096, 40 * 4096, 40 * 4096 + 777)]  # the file's last bytes; one piece read from elsewhere
    direct = direct_reads(monkeypatch, refused)
    phantom.files.directio.readinto_pieces(path, pieces, buf, drop_cache=True)
    want = bytearray(len(raw))
    for off, s, e in pieces:
        with open(path, "rb") as f:
            f.seek(off)
            want[s:e] = f.read(e - s)
    assert bytes(buf.numpy()) == bytes(want)
    if phantom.files.directio._direct_ok and not refused:  # this filesystem takes O_DIRECT
        assert direct
