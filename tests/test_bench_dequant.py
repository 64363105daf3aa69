"""benchmarks/bench_dequant.py runs end to end on a tiny model and reports both placements of the
dequantization (no figure is asserted: speed is the benchmark's to show, not a test's)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_dequant.py"


def test_bench_dequant_reports_both_placements(tmp_path, monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("bench_dequant", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "notes.md"
    assert bench.main(["--dim", "128", "--layers", "2", "--heads", "4", "--vocab", "256", "--method", "int8",
                       "--batches", "1x8", "--steps", "1", "--repeats", "1", "--out", str(out)]) == 0
    text = out.read_text()
    assert "projection by projection" in text and "| 1 x 8 |" in text and "a loader on one core beside" in text
    assert capsys.readouterr().out.strip() == text.strip()
    assert [p.name for p in tmp_path.iterdir()] == ["notes.md"]  # its stores are removed
