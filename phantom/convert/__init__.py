"""Checkpoints in: Meta's and Hugging Face's files (16-bit or quantized as shipped) read into block stores, copied or linked; synthetic stores; the Hub cache."""
