"""The benchmarks behind benchmarks/bench.py (and bench_slowllama.py's shared helpers)."""
