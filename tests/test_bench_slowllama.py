"""benchmarks/bench_slowllama.py without a slowllama checkout: one clear line on stderr and exit 2 (slowllama is
not a dependency; the benchmark itself is a notes recipe, notes/bench-slowllama.md)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_slowllama.py"


def test_missing_slowllama_dir(tmp_path):
    out = subprocess.run([sys.executable, str(SCRIPT), "--slowllama", str(tmp_path / "nope")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --slowllama") and "llama2_loader.py" in lines[0]
    assert out.stdout == ""
