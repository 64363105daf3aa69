"""Files phantom did not write, made to break it: JSON nested 200,000 deep, a 5000-digit integer, NaN
where a number is read, a safetensors header whose tensors share bytes or have fractional offsets, a
token cache holding a pickle, invalid UTF-8 on line 3, an adapter of rank 10**12, a --revision that is
a path. Through the scripts: exit 2, one `error:` line naming the file (and line), no traceback,
nothing left behind. Stores are made consistent (checksums recomputed) where a crafted store would be,
so only the check under test can refuse them.
"""
from __future__ import annotations

import configparser
import json
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
from packaging.requirements import Requirement

from phantom.data import dataset as data, tokencache
from phantom.base import safejson
from phantom.base.checksum import Checksums
from phantom.arch.config import ModelConfig
from phantom.arch.presets import preset
from phantom.convert.convert import convert_checkpoint
from phantom.convert.hub import snapshot
from phantom.model.lora import LoraConfig
from phantom.files.store import BlockStore, StoreError
from phantom.files.storeformat import block_file
from phantom.data.tokenizer import TINY_TEXT, Tokenizer
from test_bad_inputs import FT, REPO, adapter, check, finetune, refused_at_open, script, tiny, weights  # noqa: F401 - fixtures
from test_convert import LLAMA2, make_bad, random_model, write_hf
from test_export_hf import llama3_style_tokenizer_json

DEEP = b"[" * 200_000 + b"]" * 200_000


def text_lines(n: int = 60) -> list[bytes]:
    return TINY_TEXT.read_bytes().splitlines(keepends=True)[:n]


# -- data files -----------------------------------------------------------------------------------

DATA_CASES = {
    "jsonl_deep": ("d.jsonl", b'{"text": "a"}\n' + DEEP + b"\n", ["d.jsonl:2:", "nested more than 100 deep"]),
    "jsonl_5000_digits": ("d.jsonl", b'{"text": ' + b"1" * 5000 + b"}\n", ["d.jsonl:1:", "integer of 5000 digits"]),
    "json_list_deep": ("d.json", b'[{"text": "a"},\n' + DEEP + b"]\n", ["d.json:2:", "nested more than 100 deep"]),
    "utf8_line_3": ("d.txt", b"".join(text_lines()[:2]) + b"caf\xe9\n" + b"".join(text_lines()[2:]),
                    ["d.txt:3:", "not UTF-8"]),
}


@pytest.mark.parametrize("case", DATA_CASES)
def test_bad_data_file_is_one_line(tiny, tmp_path, capsys, case):
    name, content, words = DATA_CASES[case]
    (tmp_path / name).write_bytes(content)
    check(capsys, finetune(tmp_path, "--data", tmp_path / name), tmp_path, *words)


def make_cache(tiny: Path, tmp_path: Path) -> Path:
    """A data file and the token cache data.load writes beside it (what finetune reads next time)."""
    (tmp_path / "d.txt").write_bytes(b"".join(text_lines()))
    data.load(tmp_path / "d.txt", Tokenizer(tiny / "tokenizer.model"), vocab_size=64)
    (folder,) = (tmp_path / data.CACHE_DIR).iterdir()
    return folder


CACHE_CASES = {
    "pickle": (lambda f: (f / "tokens.npy").write_bytes(pickle.dumps(list(range(100)))), ["tokens.npy"]),
    "object_array": (lambda f: np.save(f / "tokens.npy", np.array([1, "x"], dtype=object), allow_pickle=True),
                     ["tokens.npy"]),
    "ids_past_vocab": (lambda f: np.save(f / "tokens.npy", np.full(len(np.load(f / "tokens.npy")), 1000, np.int32)),
                       ["token ids outside the vocabulary of 64"]),
    "short_labels": (lambda f: np.save(f / "labels.npy", np.load(f / "labels.npy")[:-1]), ["labels"]),
}


@pytest.mark.parametrize("case", CACHE_CASES)
def test_damaged_token_cache_is_one_line_naming_it(tiny, tmp_path, capsys, case):
    damage, words = CACHE_CASES[case]
    folder = make_cache(tiny, tmp_path)
    damage(folder)
    line = check(capsys, finetune(tmp_path, "--data", tmp_path / "d.txt"), tmp_path, "damaged token cache", *words)
    assert f"remove {folder}" in line


# -- stores ---------------------------------------------------------------------------------------

def rewrite_header(store: Path, rel: str, change) -> None:
    """rel's safetensors header replaced by change(header) (bytes, or a dict written as JSON), padded to
    its old length, and the manifest's size and checksums of the file made to match, as a store crafted
    that way would have them."""
    path = store / rel
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    new = change(json.loads(raw[8:8 + n]))
    new = new if isinstance(new, bytes) else json.dumps(new).encode()
    assert len(new) <= n
    raw = raw[:8] + new + b" " * (n - len(new)) + raw[8 + n:]
    path.write_bytes(raw)
    m = json.loads((store / "manifest.json").read_text())
    sums = Checksums(m["files"][rel]["crc32"]["chunk"])
    sums.update_header(raw[:8 + n])
    sums.update(raw[8 + n:])
    m["files"][rel].update(size=len(raw), **sums.record())
    (store / "manifest.json").write_text(json.dumps(m))


def tensors(header: dict, offsets) -> dict:
    return {k: v if k == "__metadata__" else {**v, "data_offsets": offsets(*v["data_offsets"])}
            for k, v in header.items()}


def float_shapes(header: dict) -> dict:
    return {k: v if k == "__metadata__" else {**v, "shape": [x + 0.0 for x in v["shape"]]} for k, v in header.items()}


def every_block(change):
    def damage(store: Path):
        for i in range(4):
            rewrite_header(store, block_file(i), change)
    return damage


def manifest(change):
    def damage(store: Path):
        path = store / "manifest.json"
        path.write_bytes(change(json.loads(path.read_text())))
    return damage


def norm_eps(value):
    return manifest(lambda m: json.dumps({**m, "config": {**m["config"], "norm_eps": value}}).encode())


STORE_CASES = {
    "tensors_share_bytes": (every_block(lambda h: tensors(h, lambda a, b: [0, b - a])), ["overlap in bytes"]),
    "fractional_offsets": (every_block(lambda h: tensors(h, lambda a, b: [a + 0.5, b + 0.5])),
                           ["000.safetensors", "not non-negative integers"]),
    "float_shapes": (every_block(float_shapes), ["000.safetensors", "not non-negative integers"]),
    "header_deep": (lambda s: rewrite_header(s, block_file(0), lambda h: b"[" * 2000 + b"]" * 2000),
                    ["000.safetensors", "corrupt safetensors header", "nested more than 100 deep"]),
    "manifest_deep": (manifest(lambda m: b'{"format": "phantom-store", "x": ' + DEEP + b"}"),
                      ["manifest.json:1:", "nested more than 100 deep"]),
    "manifest_5000_digits": (manifest(lambda m: json.dumps(m).encode()[:-1] + b', "x": ' + b"9" * 5000 + b"}"),
                             ["manifest.json:1:", "integer of 5000 digits"]),
    "norm_eps_nan": (norm_eps(float("nan")), ["manifest.json:1:", "NaN is not finite"]),
    "norm_eps_inf": (norm_eps(float("inf")), ["manifest.json:1:", "Infinity is not finite"]),
    "norm_eps_text": (norm_eps("1e-5"), ["manifest.json", "norm_eps '1e-5' is not a finite number"]),
}


@pytest.mark.parametrize("case", STORE_CASES)
def test_crafted_store_is_refused_at_open(tiny, tmp_path, capsys, case):
    refused_at_open(tiny, tmp_path, capsys, *STORE_CASES[case])


def test_tensors_sharing_some_bytes_are_refused_and_empty_ones_are_not(tiny):
    def shift(h):  # the second tensor starts 4 bytes into the first; an empty tensor anywhere is fine
        names = sorted((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"])
        a, b = h[names[1]]["data_offsets"]
        return {**h, names[1]: {**h[names[1]], "data_offsets": [a - 4, b - 4]}}
    rewrite_header(tiny, block_file(1), shift)
    with pytest.raises(StoreError, match=r"001\.safetensors: tensors .* overlap in bytes"):
        BlockStore(tiny)


def test_linked_tensors_sharing_bytes_of_their_source_are_refused(tmp_path):
    """A --link store's manifest places a block's tensors in the checkpoint's files: two at one offset."""
    store = convert_checkpoint(write_hf(tmp_path / "hf", LLAMA2, random_model(LLAMA2)), tmp_path / "s", link=True,
                               progress=False)["out"]
    m = json.loads((store / "manifest.json").read_text())
    entry = m["links"]["files"][block_file(0)]["tensors"]
    same = [t for t in entry if t["file"] == entry[-1]["file"]]
    same[-1]["offset"] = same[0]["offset"]
    (store / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(StoreError, match="overlap in bytes"):
        BlockStore(store)


# -- adapters, model folders, hub revisions ------------------------------------------------------------

def adapter_config(edit):
    def damage(folder: Path):
        path = folder / "adapter_config.json"
        path.write_text(edit(path.read_text()))
    return damage


def alpha(text: str):
    return adapter_config(lambda t: json.dumps({**json.loads(t), "lora_alpha": 0}).replace('"lora_alpha": 0',
                                                                                          f'"lora_alpha": {text}'))


ADAPTER_CASES = {
    "alpha_nan": (alpha("NaN"), ["adapter_config.json:1:", "NaN is not finite"]),
    "alpha_infinity": (alpha("Infinity"), ["adapter_config.json:1:", "Infinity is not finite"]),
    "alpha_1e999": (alpha("1e999"), ["adapter_config.json:1:", "1e999 is not finite"]),
    "rank_10_12": (adapter_config(lambda t: json.dumps({**json.loads(t), "r": 10 ** 12})),
                   ["adapter_model.safetensors", "has rank 4", "rank 1000000000000"]),
    "deep": (adapter_config(lambda t: '{"r": ' + DEEP.decode() + "}"), ["adapter_config.json:1:", "nested"]),
    "dora": (adapter_config(lambda t: json.dumps({**json.loads(t), "use_dora": True})), ["use_dora"]),
}


@pytest.mark.parametrize("case", ADAPTER_CASES)
def test_bad_adapter_is_one_line(tiny, adapter, tmp_path, capsys, case):
    damage, words = ADAPTER_CASES[case]
    damage(adapter)
    code = script("generate").main(["--model", str(tiny), "--adapter", str(adapter), "--prompt", "The",
                                    "--max-new-tokens", "2", "--device", "cpu"])
    check(capsys, code, tmp_path, *words)


@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json"])
def test_deep_json_in_a_model_folder_is_one_line(tmp_path, capsys, name):
    src = write_hf(tmp_path / "src", LLAMA2, random_model(LLAMA2))
    (src / name).write_bytes(b'{"weight_map": ' + DEEP + b"}")
    code = script("prepare_model").main(["--src", str(src), "--out", str(tmp_path / "w" / "x"), "--quiet"])
    check(capsys, code, tmp_path, f"{name}:1:", "nested more than 100 deep")
    assert not (tmp_path / "w" / "x").exists()


@pytest.mark.parametrize("value", ["NaN", "Infinity", "1e999"])
def test_non_finite_number_in_config_json_is_refused(tmp_path, capsys, value):
    src = write_hf(tmp_path / "src", LLAMA2, random_model(LLAMA2))
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "rms_norm_eps": "X"}).replace('"X"', value))
    code = script("prepare_model").main(["--src", str(src), "--out", str(tmp_path / "w" / "x"), "--quiet"])
    check(capsys, code, tmp_path, "config.json:1:", f"{value} is not finite")
    assert not (tmp_path / "w" / "x").exists()


@pytest.mark.parametrize("name", ["tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                                  "chat_template.json"])
def test_deep_json_beside_the_tokenizer_is_one_line(tmp_path, capsys, name):
    """Copied into the store as they are; read when a run loads the tokenizer and its template."""
    src = write_hf(tmp_path / "src", LLAMA2, random_model(LLAMA2))
    llama3_style_tokenizer_json(src)
    (src / name).write_bytes(b'{"a": ' + DEEP + b"}")
    assert script("prepare_model").main(["--src", str(src), "--out", str(tmp_path / "w"), "--quiet"]) == 0
    capsys.readouterr()
    line = check(capsys, finetune(tmp_path, "--model", tmp_path / "w", "--seq-len", "16"), tmp_path, name)
    assert "nested" in line or "recursion" in line, line


def test_revision_that_is_a_path_is_refused(tiny, tmp_path, capsys, monkeypatch):
    """--revision ../../../f would read tmp/f as a ref and open the snapshot it names."""
    cache, commit = tmp_path / "cache", "a" * 40
    (tmp_path / "f").write_text(commit)
    shutil.copytree(make_bad(tmp_path, "hf", "arch")[0], cache / "models--o--n" / "snapshots" / commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    code = finetune(tmp_path, "--model", "o/n", "--revision", "../../../f")
    check(capsys, code, tmp_path, "--revision '../../../f' is not a branch, tag or commit name")
    for good in ("main", "v1.0", "refs/pr/1", "feature/x", commit):
        with pytest.raises(FileNotFoundError):
            snapshot("o/m", good)
    for bad in ("..", "a/../b", "/etc/passwd", "a//b", ".hidden", "x.lock", "a b", "x~1", "a@{1}", "x/", "a\\b"):
        with pytest.raises(ValueError, match="not a branch, tag or commit name"):
            snapshot("o/m", bad)


# -- the API ------------------------------------------------------------------------------------------

def test_safejson_bounds_and_lines():
    assert safejson.loads('{"a": [1, 2.5, "[[[["]}', "f") == {"a": [1, 2.5, "[[[["]}
    assert safejson.loads("[" * 100 + "]" * 100, "f") is not None
    cases = {"[" * 101 + "]" * 101: "f:1: JSON nested more than 100 deep",
             '{"a":\n\n -' + "7" * 101 + "}": "f:3: an integer of 101 digits",
             '{"a": 1,\n "b": NaN}': "f:2: the number NaN is not finite",
             '{"a": 1,\n "b": -1e400}': "f:2: the number -1e400 is not finite",
             '{"a": 1,\n "b" 2}': "f:2: not valid JSON", b'{"a":\n "\xff"}': "f:2: not UTF-8"}
    for text, message in cases.items():
        with pytest.raises(ValueError, match=message.replace(".", r"\.")):
            safejson.loads(text, "f")
    assert safejson.loads('{"loss": NaN}', "f", finite=False)["loss"] != 0  # records keep a NaN loss


def test_configs_refuse_numbers_that_are_not():
    for bad in (dict(norm_eps=float("nan")), dict(rope_theta=float("inf")), dict(n_layers=2.5), dict(dim=0),
                dict(qkv_bias=1), dict(n_heads=True)):
        with pytest.raises(ValueError, match="is not"):
            preset("tiny", **bad)
    with pytest.raises(ValueError, match="norm_eps nan is not a finite number"):
        ModelConfig.from_dict({**preset("tiny").to_dict(), "norm_eps": float("nan")})
    for bad in (dict(alpha=float("nan")), dict(alpha=float("inf")), dict(rank=10 ** 12 + 0.5), dict(rank=True)):
        with pytest.raises(ValueError, match="LoRA"):
            LoraConfig(**bad)


def test_a_rank_past_both_sides_of_the_weight_is_refused_before_allocating(tiny):
    import phantom
    with pytest.raises(ValueError, match="LoRA rank 1000000000000 of layer 0 self_attn.q_proj exceeds both sides"):
        phantom.load(tiny, offload="none", lora=LoraConfig(rank=10 ** 12))


def test_token_cache_round_trip(tiny, tmp_path):
    folder = make_cache(tiny, tmp_path)
    fmt, tokens, labels, starts = tokencache.read_cache(folder, 64)
    fresh = data.load(tmp_path / "d.txt", Tokenizer(tiny / "tokenizer.model"), cache=False)
    assert fmt == fresh.fmt and tokens.tolist() == fresh.tokens.tolist() and labels.tolist() == fresh.labels.tolist()


def test_setup_cfg_asks_for_releases_without_the_known_holes():
    """torch < 2.6: weights_only=True can be bypassed (CVE-2025-32434); pyarrow < 14.0.1: CVE-2023-47248."""
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    reqs = [Requirement(r) for r in cfg["options"]["install_requires"].split("\n") if r.strip()]
    torch_req = next(r for r in reqs if r.name == "torch")
    assert not torch_req.specifier.contains("2.5.1") and torch_req.specifier.contains("2.6.0")
    arrow = [Requirement(r) for r in cfg["options.extras_require"]["datasets"].split("\n") if r.strip()]
    assert [r.name for r in arrow] == ["pyarrow"]
    assert not arrow[0].specifier.contains("14.0.0") and arrow[0].specifier.contains("14.0.1")
