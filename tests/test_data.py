"""phantom.data.dataset: formats, masks, the token cache, windows, packing, batches and user errors."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import phantom
from phantom.data import batches as B, dataset as D, recordformats as R
from phantom.data.tokenizer import Tokenizer, train_tiny_tokenizer

M = D.IGNORE_INDEX


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(phantom.BlockStore(phantom.resolve_model("tiny")).tokenizer_path)


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def enc(tok, text):
    return tok.encode(text, bos=False)


def test_plain_text_is_bos_lines_eos_all_trained(tok, tmp_path):
    (tmp_path / "a.txt").write_text("The keeper lit the lamp.\n\nThe ships passed.\n")
    d = D.load(tmp_path / "a.txt", tok)
    want = [tok.bos_id] + enc(tok, "The keeper lit the lamp.\n") + enc(tok, "The ships passed.\n") + [tok.eos_id]
    assert d.fmt == "text" and d.tokens.tolist() == want
    assert d.labels.tolist() == [M] + want[1:]
    assert d.starts.tolist() == [0]


def test_prompt_response_masks_the_prompt(tok, tmp_path):
    d = D.load(write_jsonl(tmp_path / "p.jsonl", [{"prompt": "Who lit the lamp?", "response": "The keeper."}]), tok)
    p, r = enc(tok, "Who lit the lamp?"), enc(tok, "The keeper.") + [tok.eos_id]
    assert d.fmt == "prompt"
    assert d.tokens.tolist() == [tok.bos_id] + p + r
    assert d.labels.tolist() == [M] * (1 + len(p)) + r


def test_alpaca_with_and_without_input(tok, tmp_path):
    recs = [{"instruction": "Name a bird.", "input": "", "output": "A tern."},
            {"instruction": "Count.", "input": "two short", "output": "Two."}]
    d = D.load(write_jsonl(tmp_path / "a.jsonl", recs), tok)
    p0 = enc(tok, R.ALPACA_NO_INPUT.format(instruction="Name a bird."))
    p1 = enc(tok, R.ALPACA.format(instruction="Count.", input="two short"))
    r0, r1 = enc(tok, "A tern.") + [tok.eos_id], enc(tok, "Two.") + [tok.eos_id]
    assert d.fmt == "alpaca"
    assert d.tokens.tolist() == [tok.bos_id] + p0 + r0 + [tok.bos_id] + p1 + r1
    assert d.labels.tolist() == [M] * (1 + len(p0)) + r0 + [M] * (1 + len(p1)) + r1
    assert d.starts.tolist() == [0, 1 + len(p0) + len(r0)]


def test_chat_trains_only_assistant_turns(tok, tmp_path):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Where?"},
            {"role": "assistant", "content": "The pier."}]
    d = D.load(write_jsonl(tmp_path / "c.jsonl", [{"messages": msgs}]), tok)
    s, u1, a1h, a1 = enc(tok, "System: Be brief."), enc(tok, "User: Hi"), enc(tok, "Assistant:"), enc(tok, "Hello.")
    u2, a2h, a2 = enc(tok, "User: Where?"), enc(tok, "Assistant:"), enc(tok, "The pier.") + [tok.eos_id]
    assert d.fmt == "chat"
    assert d.tokens.tolist() == [tok.bos_id] + s + u1 + a1h + a1 + u2 + a2h + a2
    assert d.labels.tolist() == [M] * (1 + len(s + u1 + a1h)) + a1 + [M] * len(u2 + a2h) + a2


def test_jsonl_text_and_json_list(tok, tmp_path):
    d = D.load(write_jsonl(tmp_path / "t.jsonl", [{"text": "The lamp."}]), tok)
    assert d.fmt == "jsonl-text" and d.labels.tolist() == [M] + enc(tok, "The lamp.") + [tok.eos_id]
    (tmp_path / "l.json").write_text(json.dumps([{"prompt": "a", "response": "b"}]))
    d = D.load(tmp_path / "l.json", tok)
    assert d.fmt == "prompt" and d.tokens.tolist() == [tok.bos_id] + enc(tok, "a") + enc(tok, "b") + [tok.eos_id]


@pytest.mark.parametrize("content, match", [
    ('{"prompt": "a", "response": "b"}\n{"prompt": "a", \n', r"b\.jsonl:2: not valid JSON"),
    ('{"prompt": "a", "response": "b"}\n\n{"prompt": "c"}\n', r"b\.jsonl:3: .*without 'response'"),
    ('{"question": "a"}\n', r"b\.jsonl:1: unknown record keys"),
    ('[1, 2]\n', r"b\.jsonl:1: .*expected a JSON object"),
    ('{"messages": [{"role": "user", "content": "a"}]}\n', r"b\.jsonl:1: .*at least one assistant"),
    ('\n\n', r"b\.jsonl is empty"),
])
def test_bad_jsonl_says_which_line(tok, tmp_path, content, match):
    (tmp_path / "b.jsonl").write_text(content)
    with pytest.raises(ValueError, match=match):
        D.load(tmp_path / "b.jsonl", tok)


def test_user_errors(tok, tmp_path):
    with pytest.raises(FileNotFoundError, match="--data"):
        D.load(tmp_path / "missing.txt", tok)
    (tmp_path / "e.txt").write_text("  \n")
    with pytest.raises(ValueError, match="empty"):
        D.load(tmp_path / "e.txt", tok)
    (tmp_path / "l1.txt").write_bytes("caf\xe9\n".encode("latin1"))
    with pytest.raises(ValueError, match=r"l1\.txt:1: not UTF-8"):
        D.load(tmp_path / "l1.txt", tok)
    (tmp_path / "s.txt").write_text("The keeper.")
    with pytest.raises(ValueError, match="shorter than one sequence"):
        B.rows(D.load(tmp_path / "s.txt", tok), seq_len=64)
    with pytest.raises(ValueError, match="val-split"):
        D.split(D.load(tmp_path / "s.txt", tok), 1.5)


class CountingTokenizer:
    def __init__(self, tok):
        self.tok, self.calls = tok, 0
        self.fingerprint, self.bos_id, self.eos_id, self.prefix = tok.fingerprint, tok.bos_id, tok.eos_id, tok.prefix
        self.vocab_size = tok.vocab_size

    def encode(self, *a, **k):
        self.calls += 1
        return self.tok.encode(*a, **k)


def test_cache_is_reused_and_invalidated_by_a_new_tokenizer(tok, tmp_path):
    path = tmp_path / "d.txt"
    path.write_text(D.DEFAULT_DATA.read_text()[:2000])
    counting = CountingTokenizer(tok)
    first = D.load(path, counting)
    n_calls = counting.calls
    again = D.load(path, counting)
    assert n_calls > 0 and counting.calls == n_calls  # nothing tokenized the second time
    assert isinstance(again.tokens, np.memmap) and again.tokens.tolist() == first.tokens.tolist()
    assert len(list((tmp_path / D.CACHE_DIR).iterdir())) == 1

    other = Tokenizer(train_tiny_tokenizer(tmp_path / "other.model", vocab_size=300))
    assert other.fingerprint != tok.fingerprint
    fresh = D.load(path, CountingTokenizer(other))
    assert fresh.key != first.key and fresh.tokens.tolist() == [other.bos_id] + sum(
        (other.encode(line, bos=False) for line in path.read_text().splitlines() if line.strip()), []) + [other.eos_id]
    assert len(list((tmp_path / D.CACHE_DIR).iterdir())) == 2

    path.write_text("The keeper wrote a new page.\n")  # an edited file is tokenized afresh too
    assert D.load(path, tok).tokens.tolist() == [tok.bos_id] + enc(tok, "The keeper wrote a new page.\n") + [tok.eos_id]


def test_windows_shift_targets_by_one():
    d = D.TokenData(np.arange(10, dtype=np.uint16), np.arange(10, dtype=np.int32), np.zeros(1, np.int64), "text", "k")
    ds = B.rows(d, seq_len=4)
    x, y = ds[3]
    assert x.tolist() == [3, 4, 5, 6] and y.tolist() == [4, 5, 6, 7]
    assert ds.n == 6 and ds.n_sequential == 2


def test_packing_fills_rows_greedily_and_masks_padding():
    # three examples of 3, 2 and 4 tokens; rows of seq_len 5 (+1): [ex0 ex1] [ex2]
    tokens = np.array([1, 10, 11, 1, 20, 1, 30, 31, 32], np.uint16)
    labels = np.array([M, M, 11, M, 20, M, M, 31, 32], np.int32)
    d = D.TokenData(tokens, labels, np.array([0, 3, 5]), "prompt", "k")
    ds = B.rows(d, seq_len=5, pad_id=0)
    assert len(ds) == 2
    x, y = ds[0]
    assert x.tolist() == [1, 10, 11, 1, 20] and y.tolist() == [M, 11, M, 20, M]
    x, y = ds[1]
    assert x.tolist() == [1, 30, 31, 32, 0] and y.tolist() == [M, 31, 32, M, M]
    x, y = B.rows(d, seq_len=2)[2]  # the 4-token example is truncated to a row of 3
    assert x.tolist() == [1, 30] and y.tolist() == [M, 31]


def test_split_holds_out_the_tail():
    d = D.TokenData(np.arange(100, dtype=np.uint16), np.arange(100, dtype=np.int32), np.zeros(1, np.int64), "text", "k")
    tr, va = D.split(d, 0.1)
    assert tr.tokens.tolist() == list(range(90)) and va.tokens.tolist() == list(range(90, 100))
    d = D.TokenData(np.arange(100, dtype=np.uint16), np.arange(100, dtype=np.int32), np.arange(0, 100, 10), "prompt",
                    "k")
    tr, va = D.split(d, 0.2)
    assert len(tr) == 80 and va.starts.tolist() == [0, 10] and D.split(d, 0) == (d, None)


def test_batches_are_a_function_of_seed_and_step():
    d = D.TokenData(np.arange(200, dtype=np.uint16), np.arange(200, dtype=np.int32), np.zeros(1, np.int64), "text", "k")
    ds = B.rows(d, 8)
    it = iter(B.BatchSampler(ds, 4, seed=3))
    first = [next(it) for _ in range(6)]
    resumed = iter(B.BatchSampler(ds, 4, seed=3, start=4))
    assert [next(resumed) for _ in range(2)] == first[4:]
    assert first[0] != next(iter(B.BatchSampler(ds, 4, seed=4)))
    seq = iter(B.BatchSampler(ds, 4, shuffle=False))
    assert next(seq) == [0, 8, 16, 24]
    # shuffled rows: each epoch is a permutation of all rows
    pd = D.TokenData(np.arange(60, dtype=np.uint16), np.arange(60, dtype=np.int32), np.arange(0, 60, 6), "prompt", "k")
    rows = B.rows(pd, 5)
    it = iter(B.BatchSampler(rows, 5, seed=0))
    epoch = next(it) + next(it)
    assert sorted(epoch) == list(range(10)) and epoch != list(range(10))


def test_loader_with_a_worker_gives_the_sampler_batches(tok):
    d = D.load(None, tok)
    ds = B.rows(d, 16)
    x, y = next(iter(B.loader(ds, 3, seed=1, workers=1)))
    starts = B.BatchSampler(ds, 3, seed=1).indices(0)
    assert x.dtype == torch.int64 and x.shape == (3, 16)
    assert x.tolist() == [ds[s][0].tolist() for s in starts] and y.tolist() == [ds[s][1].tolist() for s in starts]


def test_render_prompt():
    assert R.render_prompt("Hi", "text") == "Hi"
    assert R.render_prompt("Hi", "chat") == "User: Hi Assistant:"
    assert R.render_prompt("Hi", "alpaca").endswith("### Instruction:\nHi\n\n### Response:\n")


@pytest.mark.parametrize("dtype, suffix", [("uint16", ".bin"), ("uint32", ".bin"), ("uint16", ".npy"), ("int32", ".npy")])
def test_token_files_round_trip(tmp_path, dtype, suffix):
    ids = np.random.default_rng(0).integers(0, 97, 500).astype(dtype)
    path = tmp_path / f"train{suffix}"
    np.save(path, ids) if suffix == ".npy" else ids.tofile(path)
    got = D.load(path, None, vocab_size=97, dtype=dtype if suffix == ".bin" else None)
    assert got.fmt == "tokens" and np.array_equal(np.asarray(got.tokens), ids)
    train, val = D.split(got, 0.1)
    assert len(train) + len(val) == 500 and np.array_equal(np.asarray(val.tokens), ids[-len(val):])


def test_token_file_errors_name_the_file_and_offset(tmp_path):
    ids = np.arange(10, dtype=np.uint16)
    ids[7] = 500
    ids.tofile(tmp_path / "bad.bin")
    with pytest.raises(ValueError, match=r"bad.bin: token id 500 at offset 7 \(byte 14\)"):
        D.load(tmp_path / "bad.bin", None, vocab_size=97)
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
    with pytest.raises(ValueError, match="not a whole number of uint16"):
        D.load(tmp_path / "odd.bin", None, vocab_size=97)
    np.save(tmp_path / "two_d.npy", np.zeros((2, 3), np.int64))
    with pytest.raises(ValueError, match="1-D integer array"):
        D.load(tmp_path / "two_d.npy", None, vocab_size=97)
    (tmp_path / "t.txt").write_text("hello")
    with pytest.raises(ValueError, match="no tokenizer"):
        D.load(tmp_path / "t.txt", None, vocab_size=97)
