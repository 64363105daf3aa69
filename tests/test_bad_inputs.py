"""Bad inputs through the CLIs (finetune, prepare_model, merge_lora, generate) and the API: exit 2, one
`error: ...` line that names the problem, no traceback, nothing half-written (no *.tmp, no partial store).
Scripts run in-process (an uncaught exception fails the test as a traceback would); the pickle payload
also runs as a real subprocess. A tiny model is generated once into a temporary PHANTOM_WEIGHTS.
"""
from __future__ import annotations

import errno
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import phantom
import phantom.base.fileio
import phantom.train.loop
from phantom.data import dataset as data
from phantom.arch.presets import preset
from phantom.convert.synthetic import ensure_tiny, write_synthetic
from phantom.files.store import BlockStore, StoreError
from phantom.files.storeformat import block_file
from phantom.data.tokenizer import Tokenizer
from test_convert import LLAMA2, load_script, make_bad, random_model, write_meta

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = {}
FT = ["--iters", "2", "--batch-size", "2", "--seq-len", "32", "--val-split", "0", "--save-every", "0", "--quiet"]


def script(name: str):
    if name not in SCRIPTS:
        SCRIPTS[name] = load_script(name)
    return SCRIPTS[name]


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    root = tmp_path_factory.mktemp("weights")
    ensure_tiny(root / "tiny")
    return root


@pytest.fixture
def tiny(weights, monkeypatch, tmp_path):
    """A private copy of the tiny store (to damage), with PHANTOM_WEIGHTS pointing at the shared one."""
    monkeypatch.setenv("PHANTOM_WEIGHTS", str(weights))
    return Path(shutil.copytree(weights / "tiny", tmp_path / "tiny"))


def leftovers(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.endswith((".tmp", ".old")) or ".tmp." in p.name]


def check(capsys, code: int, root: Path, *words: str) -> str:
    """Exit 2, one `error:` line containing every word, no traceback, no temporary files under root."""
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2, err
    assert "Traceback" not in err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for w in words:
        assert w in lines[0], (w, lines[0])
    assert not leftovers(root), leftovers(root)
    return lines[0]


def finetune(tmp_path: Path, *args) -> int:
    return script("finetune").main([*FT, "--out", str(tmp_path / "out"), *map(str, args)])


# -- finetune: flags ------------------------------------------------------------------------------

FLAG_CASES = [
    (["--model", "7B"], ["model 7B is not prepared", "prepare_model.py"]),
    (["--model", "nosuch"], ["unknown model 'nosuch'"]),
    (["--iters", "-3"], ["--iters must be >= 1"]),
    (["--batch-size", "0"], ["--batch-size must be >= 1"]),
    (["--lr", "0"], ["lr > 0"]),
    (["--lr=-1e-3"], ["lr > 0"]),
    (["--seq-len", "4096"], ["--seq-len 4096 exceeds the model's max_seq_len 512"]),
    (["--prefetch", "-1"], ["prefetch must be >= 0"]),
    (["--lora-rank", "0"], ["LoRA rank must be >= 1"]),
    (["--resume"], ["no checkpoint", "without --resume"]),
    pytest.param(["--device", "cuda"], ["CUDA is not available"],
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")),
]


@pytest.mark.parametrize("args, words", FLAG_CASES, ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_finetune_bad_flags(tiny, tmp_path, capsys, args, words):
    check(capsys, finetune(tmp_path, *args), tmp_path, *words)
    assert not (tmp_path / "out" / "adapter").exists()


# -- finetune: data -------------------------------------------------------------------------------

DATA_CASES = {
    "missing": (None, ["data file", "not found"]),
    "empty": (b"", ["is empty"]),
    "too_short": (b"just a few words\n", ["shorter than one sequence of 32 + 1"]),
    "not_utf8": (b"caf\xe9 au lait\n" * 50, ["not UTF-8"]),
    "bad_json_line": (b'{"prompt": "a", "response": "b"}\n{"prompt": oops}\n', ["d.jsonl:2:", "not valid JSON"]),
    "image_json": (b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x.png"}}, '
                   b'{"type": "text", "text": "What is it?"}]}, {"role": "assistant", "content": "A cat."}]}\n',
                   ["d.jsonl:1:", "image_url parts", "text model only"]),
}


@pytest.mark.parametrize("case", DATA_CASES)
def test_finetune_bad_data(tiny, tmp_path, capsys, case):
    content, words = DATA_CASES[case]
    path = tmp_path / ("d.jsonl" if "json" in case else "d.txt")
    if content is not None:
        path.write_bytes(content)
    check(capsys, finetune(tmp_path, "--data", path), tmp_path, *words)
    assert not (path.parent / ".phantom-cache").exists() or not leftovers(path.parent / ".phantom-cache")


# -- finetune: damaged stores -----------------------------------------------------------------------

def flip_byte(store: Path):
    p = store / block_file(1)
    b = bytearray(p.read_bytes())
    b[-10] ^= 0xFF
    p.write_bytes(bytes(b))


def truncate(store: Path):
    p = store / block_file(2)
    p.write_bytes(p.read_bytes()[:-100])


def huge_header(store: Path):
    p = store / block_file(0)
    b = bytearray(p.read_bytes())
    b[:8] = (10 << 40).to_bytes(8, "little")  # "10 TB of header"
    p.write_bytes(bytes(b))


def manifest_tokenizer(value):
    def damage(store: Path):
        m = json.loads((store / "manifest.json").read_text())
        m["tokenizer"] = value(store) if callable(value) else value
        (store / "manifest.json").write_text(json.dumps(m))
    return damage


def symlinked_block(store: Path):
    outside = store.parent / "outside.safetensors"
    shutil.move(store / block_file(3), outside)
    (store / block_file(3)).symlink_to(outside)


def no_tokenizer(store: Path):
    m = json.loads((store / "manifest.json").read_text())
    (store / m.pop("tokenizer")).unlink()
    m["tokenizer"] = None
    (store / "manifest.json").write_text(json.dumps(m))


STORE_CASES = {
    "corrupt_block": (flip_byte, ["001.safetensors", "checksum mismatch"]),
    "truncated_block": (truncate, ["002.safetensors", "truncated"]),
    "header_claims_10TB": (huge_header, ["000.safetensors", "corrupt safetensors header", "claims 10995116277760"]),
    "manifest_dotdot": (manifest_tokenizer("../../etc/passwd"), ["'../../etc/passwd'", "escapes the store"]),
    "manifest_absolute": (manifest_tokenizer("/etc/passwd"), ["'/etc/passwd'", "escapes the store"]),
    "manifest_symlink": (symlinked_block, ["003.safetensors", "escapes the store"]),
    "tokenizer_missing": (no_tokenizer, ["has no tokenizer"]),
}


def refused_at_open(tiny: Path, tmp_path: Path, capsys, damage, words: list[str]) -> None:
    """finetune.py on the store `damage` left: one error line with `words`, no adapter written."""
    damage(tiny)
    check(capsys, finetune(tmp_path, "--model", tiny), tmp_path, *words)
    assert not (tmp_path / "out" / "adapter").exists()


@pytest.mark.parametrize("case", STORE_CASES)
def test_finetune_damaged_store(tiny, tmp_path, capsys, case):
    refused_at_open(tiny, tmp_path, capsys, *STORE_CASES[case])


# -- finetune: --resume from another run, disk full, permissions ----------------------------------------

@pytest.fixture(scope="module")
def trained(weights, tmp_path_factory):
    """An --out folder holding a checkpoint of a 2-step run on the tiny model."""
    out = tmp_path_factory.mktemp("trained") / "out"
    before, os.environ["PHANTOM_WEIGHTS"] = os.environ.get("PHANTOM_WEIGHTS"), str(weights)
    try:
        assert script("finetune").main([*FT, "--out", str(out)]) == 0
    finally:
        os.environ.pop("PHANTOM_WEIGHTS") if before is None else os.environ.update(PHANTOM_WEIGHTS=before)
    return out


@pytest.mark.parametrize("case", ["other_config", "other_model", "other_weights"])
def test_resume_refuses_another_runs_checkpoint(tiny, trained, tmp_path, capsys, case):
    shutil.copytree(trained, tmp_path / "out")
    if case == "other_config":
        args, words = ["--lora-rank", "4"], ["different run (lora:"]
    elif case == "other_model":  # same tokenizer, two blocks instead of four
        other = write_synthetic(tmp_path / "two", preset("tiny", n_layers=2), torch.float32,
                                tokenizer=tiny / "tokenizer.model", progress=False)
        args, words = ["--model", other], ["different run (model:"]
    else:  # the same shape and tokenizer, other values: only the weights' checksums tell
        other = write_synthetic(tmp_path / "same-shape", preset("tiny"), torch.float32, seed=12345,
                                tokenizer=tiny / "tokenizer.model", progress=False)
        args, words = ["--model", other], ["was trained on other weights than", "same-shape"]
    capsys.readouterr()
    check(capsys, finetune(tmp_path, "--resume", *args), tmp_path, *words)


def test_disk_full_during_a_checkpoint_keeps_the_previous_one(tiny, tmp_path, capsys, monkeypatch):
    real, calls = phantom.base.fileio.atomic_write, []

    def write(path, data):  # state.pt of the second checkpoint hits a full disk
        if Path(path).name == "state.pt":
            calls.append(path)
        if len(calls) == 2 and Path(path).name == "state.pt":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # as write() raises it: no file name
        return real(path, data)

    monkeypatch.setattr(phantom.base.fileio, "atomic_write", write)
    code = finetune(tmp_path, "--iters", "4", "--save-every", "2")
    line = check(capsys, code, tmp_path, "no space left on device writing", "checkpoint.tmp",
                 "the last checkpoint (step 2) is intact", "--resume")
    ckpt = tmp_path / "out" / "checkpoint"
    assert json.loads((ckpt / "meta.json").read_text())["step"] == 2
    monkeypatch.setattr(phantom.base.fileio, "atomic_write", real)
    assert finetune(tmp_path, "--iters", "4", "--save-every", "2", "--resume") == 0  # the previous one loads
    assert json.loads((ckpt / "meta.json").read_text())["step"] == 4
    assert not leftovers(tmp_path) and line


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores file permissions")
def test_out_folder_without_write_permission(tiny, tmp_path, capsys):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        code = script("finetune").main([*FT, "--out", str(locked / "out")])
    finally:
        locked.chmod(0o755)
    check(capsys, code, tmp_path, "permission denied", str(locked))


# -- prepare_model --------------------------------------------------------------------------------

class Payload:
    """Unpickling this runs `touch MARKER` (what a malicious checkpoint would do)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def write_malicious_meta(src: Path, marker: Path) -> Path:
    write_meta(src, LLAMA2, random_model(LLAMA2), n_shards=1)
    sd = torch.load(src / "consolidated.00.pth", weights_only=True)
    torch.save({**sd, "rope.freqs": Payload(marker)}, src / "consolidated.00.pth")
    return src


def test_prepare_refuses_a_pickle_that_runs_code(tmp_path, capsys):
    marker, out = tmp_path / "pwned", tmp_path / "weights" / "x"
    src = write_malicious_meta(tmp_path / "src", marker)
    with open(src / "consolidated.00.pth", "rb") as f:  # the payload is live: plain pickle would run it
        assert b"system" in f.read()
    code = script("prepare_model").main(["--src", str(src), "--out", str(out), "--quiet"])
    check(capsys, code, tmp_path, "consolidated.00.pth", "cannot read this shard")
    assert not marker.exists() and not out.exists()
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "prepare_model.py"), "--src", str(src), "--out",
                        str(out), "--quiet"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "cannot read this shard" in r.stderr, r.stderr
    assert not marker.exists() and not out.exists()


PREPARE_CASES = [("meta", "no_params", "params.json: missing"), ("meta", "missing_shard", "shard missing"),
                 ("hf", "no_config", "config.json: missing"), ("hf", "missing_shard", "shard missing"),
                 ("hf", "arch", "architecture GPT2LMHeadModel is not supported"),
                 ("unknown", "", "unknown checkpoint format")]


@pytest.mark.parametrize("fmt, how, words", PREPARE_CASES, ids=[f"{f}-{h}" for f, h, _ in PREPARE_CASES])
def test_prepare_bad_checkpoints(tmp_path, capsys, fmt, how, words):
    src, name = make_bad(tmp_path, fmt, how)
    out = tmp_path / "weights" / "x"
    code = script("prepare_model").main(["--src", str(src), "--out", str(out), "--quiet"])
    check(capsys, code, tmp_path, name, words)
    assert not out.exists()


def test_prepare_will_not_overwrite(tiny, tmp_path, capsys):
    code = script("prepare_model").main(["--synthetic", "--layers", "1", "--out", str(tiny), "--quiet"])
    check(capsys, code, tmp_path, "already exists", "choose another --out")
    BlockStore(tiny, verify="full")  # untouched


# -- merge_lora and generate ----------------------------------------------------------------------------

@pytest.fixture
def adapter(tiny, tmp_path):
    with phantom.load(tiny, offload="none", lora=phantom.LoraConfig(rank=4)) as model:
        return model.save_adapter(tmp_path / "adapter")


def test_merge_missing_adapter(tiny, tmp_path, capsys):
    code = script("merge_lora").main(["--model", str(tiny), "--adapter", str(tmp_path / "nope"), "--out",
                                      str(tmp_path / "merged"), "--quiet"])
    check(capsys, code, tmp_path, "no LoRA adapter", "nope")
    assert not (tmp_path / "merged").exists()


def test_merge_mismatched_adapter(tiny, adapter, tmp_path, capsys):
    other = write_synthetic(tmp_path / "two", preset("tiny", dim=64, n_heads=2, n_kv_heads=1), torch.float32,
                            progress=False)
    code = script("merge_lora").main(["--model", str(other), "--adapter", str(adapter), "--out",
                                      str(tmp_path / "merged"), "--quiet"])
    check(capsys, code, tmp_path, "adapter_model.safetensors", "match")
    assert not (tmp_path / "merged").exists()


@pytest.mark.parametrize("case", ["corrupt_weights", "bad_config", "missing"])
def test_generate_bad_adapter(tiny, adapter, tmp_path, capsys, case):
    words = {"corrupt_weights": ["adapter_model.safetensors", "corrupt safetensors header"],
             "bad_config": ["adapter_config.json:1: not valid JSON"],
             "missing": ["no LoRA adapter"]}[case]
    if case == "corrupt_weights":
        (adapter / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    elif case == "bad_config":
        (adapter / "adapter_config.json").write_text('{"r": "eight"')
    else:
        shutil.rmtree(adapter)
    code = script("generate").main(["--model", str(tiny), "--adapter", str(adapter), "--prompt", "The",
                                    "--max-new-tokens", "2", "--device", "cpu"])
    check(capsys, code, tmp_path, *words)


# -- the API ------------------------------------------------------------------------------------------

def test_api_errors_name_the_problem(tiny, tmp_path):
    with pytest.raises(ValueError, match="offload must be one of"):
        phantom.load(tiny, offload="tape")
    with pytest.raises(ValueError, match="unknown LoRA targets"):
        phantom.LoraConfig(targets=("q", "x"))
    with pytest.raises(FileNotFoundError, match="prepare_model.py"):
        BlockStore(tmp_path / "nothing")
    huge_header(tiny)
    with pytest.raises(StoreError, match="claims"):
        BlockStore(tiny)
    (tmp_path / "d.jsonl").write_text('{"text": "a"}\n{"text": "b"}\n[1,\n')
    with pytest.raises(ValueError, match=r"d\.jsonl:3: not valid JSON"):
        data.load(tmp_path / "d.jsonl", Tokenizer(tmp_path / "tiny" / "tokenizer.model"), cache=False)


def test_torch_load_is_weights_only_everywhere():
    calls = [(f, line) for d in ("phantom", "scripts") for f in (REPO / d).rglob("*.py")
             for line in f.read_text().splitlines() if "torch.load(" in line]
    assert calls, "no torch.load( found: the check would pass vacuously"
    bad = [(str(f), line.strip()) for f, line in calls if not re.search(r"weights_only\s*=\s*True", line)]
    assert not bad, bad


@pytest.mark.parametrize("script, target, argv", [
    ("prepare_model", "write_synthetic", ["--synthetic", "--preset", "7B", "--layers", "1", "--out", "{tmp}/s"]),
    ("merge_lora", "export", ["--model", "tiny", "--out", "{tmp}/m"]),
    ("generate", "generate_text", ["--model", "tiny", "--prompt", "a", "--max-new-tokens", "1"]),
])
def test_every_script_lets_a_bug_keep_its_traceback(tiny, tmp_path, capsys, monkeypatch, script, target, argv):
    """Bad input is one line; a ValueError raised inside a library is a bug: a line saying so, then the traceback."""
    mod = load_script(script)

    def broken(*a, **k):
        return json.loads("{")  # a ValueError from a library, not one of phantom's checks

    monkeypatch.setattr(mod, target, broken)
    with pytest.raises(ValueError, match="Expecting property name"):
        mod.main([a.replace("{tmp}", str(tmp_path)) for a in argv])
    assert "internal error: this is a bug" in capsys.readouterr().err
