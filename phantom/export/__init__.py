"""Checkpoints out: a trained model merged into a Hugging Face checkpoint (16-bit or requantized as shipped) or a GGUF file, and adapters as GGUF LoRA files."""
