"""Bytes on disk: safetensors files, direct I/O, Hugging Face shards, sealed folders, run folders, and the block store built on them."""
