"""What a model is, with no I/O: its config and family tables, the layers, mixture-of-experts maths, quantization formats."""
