"""Chat and instruction data end to end: records through the model's template from JSONL, Parquet, a
`datasets` save_to_disk folder and a Hub dataset in the local cache give the same tokens; columns map;
bad records fail with one line naming the file and record, and leave no cache behind."""
from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import numpy as np
import pytest

import phantom
from phantom.data import chat, dataset as D, recordformats as R
from phantom.data.tokenizer import Tokenizer

FINETUNE = Path(__file__).resolve().parent.parent / "scripts" / "finetune.py"
RECORDS = [{"instruction": "Who lit the lamp?", "input": "", "output": "The keeper."},
           {"instruction": "When?", "input": "In the book", "output": "At dusk."},
           {"instruction": "Where did the terns nest?", "input": "", "output": "On the flat rocks."}]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(phantom.BlockStore(phantom.resolve_model("tiny")).tokenizer_path)


@pytest.fixture(scope="module")
def recipe(tok):
    template = chat.read_template(phantom.resolve_model("tiny"), tok)
    assert template is not None and template.source == chat.TINY_CHAT_TEMPLATE  # kept in the store
    return R.Recipe(template)


def jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def same(a: D.TokenData, b: D.TokenData) -> bool:
    return (np.array_equal(np.asarray(a.tokens), np.asarray(b.tokens)) and
            np.array_equal(np.asarray(a.labels), np.asarray(b.labels)) and list(a.starts) == list(b.starts))


def test_template_renders_alpaca_and_trains_the_answer_and_end_of_turn(tok, recipe, tmp_path):
    d = D.load(jsonl(tmp_path / "a.jsonl", RECORDS), tok, recipe=recipe)
    assert d.fmt == "alpaca"
    first = d.tokens[:d.starts[1]].tolist()
    text = recipe.template.render(chat.to_messages(RECORDS[0], "alpaca"))[0]
    assert first == tok.encode_rendered(text)[0] and first[-1] == tok.eos_id
    trained = [t for t, label in zip(first, d.labels[:d.starts[1]].tolist()) if label != D.IGNORE_INDEX]
    assert tok.decode(trained).strip() == "The keeper." and trained[-1] == tok.eos_id


def test_parquet_datasets_folder_and_hub_cache_equal_jsonl(tok, recipe, tmp_path, monkeypatch):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    datasets = pytest.importorskip("datasets")
    want = D.load(jsonl(tmp_path / "a.jsonl", RECORDS), tok, recipe=recipe)
    pq.write_table(pa.Table.from_pylist(RECORDS), tmp_path / "a.parquet")
    assert same(D.load(tmp_path / "a.parquet", tok, recipe=recipe), want)
    datasets.Dataset.from_list(RECORDS).save_to_disk(str(tmp_path / "saved"))
    assert same(D.load(tmp_path / "saved", tok, recipe=recipe), want)
    datasets.DatasetDict({"train": datasets.Dataset.from_list(RECORDS[:1]),
                          "test": datasets.Dataset.from_list(RECORDS)}).save_to_disk(str(tmp_path / "dict"))
    assert same(D.load(tmp_path / "dict", tok, recipe=R.Recipe(recipe.template, split="test")), want)
    with pytest.raises(ValueError, match="no split 'dev'; it has train, test"):
        D.load(tmp_path / "dict", tok, recipe=R.Recipe(recipe.template, split="dev"))
    # a Hub dataset id found in the local cache, read offline: the snapshot refs/main names
    cache = tmp_path / "hub"
    snap = cache / "datasets--lamp--keeper" / "snapshots" / "abc123"
    (snap / "data").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(RECORDS), snap / "data" / "train-00000-of-00001.parquet")
    pq.write_table(pa.Table.from_pylist(RECORDS[:1]), snap / "data" / "test-00000-of-00001.parquet")
    (cache / "datasets--lamp--keeper" / "refs").mkdir()
    (cache / "datasets--lamp--keeper" / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    assert same(D.load("lamp/keeper", tok, recipe=recipe), want)
    assert len(D.load("lamp/keeper", tok, recipe=R.Recipe(recipe.template, split="test")).starts) == 1
    with pytest.raises(FileNotFoundError, match="Hub dataset id in the local cache"):
        D.load("lamp/other", tok, recipe=recipe)


def test_columns_map_other_names(tok, recipe, tmp_path):
    want = D.load(jsonl(tmp_path / "a.jsonl", RECORDS), tok, recipe=recipe)
    renamed = [{"question": r["instruction"], "input": r["input"], "answer": r["output"]} for r in RECORDS]
    cols = R.Recipe(recipe.template, columns=R.parse_columns("instruction=question,output=answer"))
    assert same(D.load(jsonl(tmp_path / "b.jsonl", renamed), tok, recipe=cols), want)
    with pytest.raises(ValueError, match="KEY=COLUMN"):
        R.parse_columns("instruction")


def test_sharegpt_and_messages_give_the_same_tokens(tok, recipe, tmp_path):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who?"},
            {"role": "assistant", "content": "The keeper."}, {"role": "user", "content": "When?"},
            {"role": "assistant", "content": "At dusk."}]
    speaker = {"system": "system", "user": "human", "assistant": "gpt"}
    a = D.load(jsonl(tmp_path / "m.jsonl", [{"messages": msgs}]), tok, recipe=recipe)
    b = D.load(jsonl(tmp_path / "s.jsonl", [{"conversations": [{"from": speaker[m["role"]], "value": m["content"]}
                                                                  for m in msgs]}]), tok, recipe=recipe)
    assert a.fmt == "chat" and b.fmt == "sharegpt" and same(a, b)
    last = D.load(tmp_path / "m.jsonl", tok, recipe=R.Recipe(recipe.template, train_on="last"))
    n_all, n_last = (int((np.asarray(d.labels) != D.IGNORE_INDEX).sum()) for d in (a, last))
    assert 0 < n_last < n_all


BAD = {
    "refused_role": ({"messages": [{"role": "tool", "content": "x"}, {"role": "assistant", "content": "y"}]},
                     "refused it: unknown role tool"),
    "no_assistant": ({"messages": [{"role": "user", "content": "x"}]}, "at least one assistant"),
    "missing_field": ({"instruction": "x"}, "without 'output'"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_record_is_one_error_line_and_no_cache(tmp_path, case, capsys):
    record, message = BAD[case]
    path = jsonl(tmp_path / "bad.jsonl", [RECORDS[0], RECORDS[1], record] if case == "missing_field" else
                 [{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}] * 2 + [record])
    run_cli(["--data", str(path)], capsys, f"{path}:3: .*{message}.*record 3")
    assert not (tmp_path / D.CACHE_DIR).exists() or not any((tmp_path / D.CACHE_DIR).iterdir())


def test_template_that_raises_and_missing_column(tmp_path, capsys):
    path = jsonl(tmp_path / "c.jsonl", RECORDS)
    (tmp_path / "t.jinja").write_text("{% for m in messages %}{{ raise_exception('no ' + m['role']) }}{% endfor %}")
    run_cli(["--data", str(path), "--chat-template", str(tmp_path / "t.jinja")], capsys, "refused it: no user")
    run_cli(["--data", str(path), "--columns", "output=answer"], capsys,
            r"c.jsonl:1: no column 'answer' \(--columns output=answer\).*record 1")
    assert not (tmp_path / D.CACHE_DIR).exists() or not any((tmp_path / D.CACHE_DIR).iterdir())


def finetune():
    spec = importlib.util.spec_from_file_location("finetune_chat", FINETUNE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_cli(args, capsys, pattern):
    assert finetune().main(args + ["--show-data", "1", "-q", "--out", "/nonexistent/out"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and re.search(pattern, err[0]), err


def test_show_data_marks_loss_and_examples(tmp_path, capsys):
    path = jsonl(tmp_path / "a.jsonl", RECORDS)
    assert finetune().main(["--data", str(path), "--show-data", "1", "--val-split", "0", "--seq-len", "128", "-q"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("-- row 0: 128 tokens") and "3 example(s)" in lines[0] and len(lines) in (4, 5), lines
    # one line per packed example; the trained run starts with the token "▁The", the space included
    assert lines[1] == "   <s>Reader: Who lit the lamp? Writer:[[ The keeper.</s>]]"
    assert lines[3] == "   <s>Reader: Where did the terns nest? Writer:[[ On the flat rocks.</s>]]"
    assert len(lines) == 4 or lines[4].startswith("   (padding: ")
    assert finetune().main(["--data", str(path), "--show-data", "1", "--show-data-ids", "--val-split", "0",
                            "--seq-len", "128", "-q"]) == 0
    assert capsys.readouterr().out.splitlines()[1].startswith("   <s>⟨1⟩")  # every token, specials by text, its id


def test_train_on_last_and_data_split_flags(tmp_path, capsys):
    datasets = pytest.importorskip("datasets")
    chats = [{"messages": [{"role": "user", "content": "Who?"}, {"role": "assistant", "content": "The keeper."},
                           {"role": "user", "content": "When?"}, {"role": "assistant", "content": "At dusk."}]}]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(chats[:1] * 2),
                          "valid": datasets.Dataset.from_list(chats)}).save_to_disk(str(tmp_path / "dd"))
    args = ["--data", str(tmp_path / "dd"), "--data-split", "valid", "--show-data", "1", "--val-split", "0",
            "--seq-len", "64", "-q"]
    assert finetune().main(args + ["--train-on", "last"]) == 0
    line = capsys.readouterr().out.splitlines()[1]
    assert line == "   <s>Reader: Who? Writer: The keeper.</s>Reader: When? Writer:[[ At dusk.</s>]]", line
    assert finetune().main(args) == 0  # all turns (the default)
    assert "Writer:[[ The keeper.</s>]]Reader: When? Writer:[[ At dusk.</s>]]" in capsys.readouterr().out
