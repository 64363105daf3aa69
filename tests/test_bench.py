"""benchmarks/bench.py --modes diskread (the tiers' read measurement) runs end to end on a tiny store: its
tables hold every contender, and the bytes read per step are the cost model's to the megabyte."""
from __future__ import annotations

import os
import re

import pytest
import torch

import phantom.files.directio
import phantom.files.store
from phantom.convert.synthetic import write_synthetic
from test_convert import load_script
from test_tiers import CFG  # 8 blocks: room for a RAM half and a disk half


def test_diskread_races_every_contender_and_predicts_the_bytes_read(tmp_path):
    store = write_synthetic(tmp_path / "s8", CFG, torch.float32, seed=0, progress=False)
    fd = phantom.files.directio._open_direct(store / "manifest.json")
    if fd is None:
        pytest.skip("this filesystem refuses O_DIRECT (the bench refuses it too)")
    os.close(fd)
    bench = load_script("bench")
    args = bench.parse_args(["--modes", "diskread", "--store", str(store), "--batch-size", "1", "--seq-len", "8",
                             "--steps", "1", "--lora-rank", "2"])
    text = bench.diskread(args, phantom.files.store.BlockStore(store), rounds=1, read_rounds=2)
    for row in ("| raw O_DIRECT, best of the grid", "| raw O_DIRECT as above, into 4 KiB pages",
                "| disk tier, first pass (verify fast: crc32", "manifest without crc32", "| disk tier, again"):
        assert row in text, row
    rows = {cells[1].strip(): cells for cells in (line.split("|") for line in text.splitlines())
            if len(cells) == 10 and cells[1].strip() in ("ram", "disk", "half")}
    assert [rows[name][2].strip() for name in ("ram", "disk", "half")] == ["0/8/0", "0/0/8", "0/4/4"]
    for name in ("ram", "disk", "half"):
        assert rows[name][5] == rows[name][6], (name, rows[name])  # MB read/step measured == predicted
    assert re.search(r"bytes read x0\.\d\d measured, x0\.\d\d predicted", text)
    assert list(store.parent.glob(".diskread-*")) == []  # the old-format copy is removed


def test_quant_mode_reports_each_store_and_refuses_a_store_that_would_read_nothing(tmp_path, capsys):
    """--modes quant on a tiny bf16 store: a row per store and batch with its bytes against bf16's (rounds:
    the medians, and each round's error); a store no larger than the slots (nothing read after the warm-up) is one error line, exit 2."""
    bench = load_script("bench")
    common = ["--modes", "quant", "--dim", "128", "--heads", "4", "--vocab", "256", "--dtype", "bf16",
              "--quant-batches", "1x8", "--steps", "1", "--out", str(tmp_path / "q.md")]
    with pytest.raises(SystemExit) as e:
        bench.main(common + ["--layers", "3"])
    assert e.value.code == 2 and capsys.readouterr().err.startswith("error: --modes quant needs more blocks")
    bench.main(common + ["--layers", "4", "--rounds", "2"])
    rows = [l.split("|") for l in (tmp_path / "q.md").read_text().splitlines() if l.startswith("| ") and " x 8 " in l]
    assert [r[1].strip() for r in rows] == ["bf16", "nf4", "int8"]  # a row each, over both rounds
    assert all(len(r[10].split(",")) == 2 for r in rows)  # each round's error beside the medians'
    ratio = {r[1].strip(): float(r[4]) for r in rows}
    assert ratio["bf16"] == 1.0 and ratio["nf4"] < 0.3 < ratio["int8"] < 0.55


def test_costterms_rows_keep_the_blocks_the_cost_model_counts(tmp_path):
    """--modes costterms on a tiny fp32 store, one round: a row for each disk depth and the RAM row, each beside
    its prediction, and recompute auto (no keep budget) keeps the same blocks in the run as in the cost model."""
    bench = load_script("bench")
    out = tmp_path / "c.md"
    bench.main(["--modes", "costterms", "--dim", "128", "--heads", "4", "--layers", "4", "--vocab", "256",
                "--batch-size", "2", "--seq-len", "16", "--prefetch", "1,2", "--steps", "1", "--out", str(out)])
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in out.read_text().splitlines()
            if line.startswith("| disk |") or line.startswith("| ram |")]
    assert [(r[0], r[1], r[2]) for r in rows] == [("disk", "auto", "1"), ("disk", "auto", "2"), ("ram", "auto", "1")]
    for r in rows:
        run, model = r[6].split(", ")
        assert run == model == "4" and float(r[3]) > 0 and float(r[4]) > 0
