"""The benchmarks behind scripts/bench.py (and bench_slowllama.py's shared helpers)."""
