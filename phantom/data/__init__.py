"""Text to rows: the model's tokenizer and special tokens, chat templates and assistant masks, data files, token caches, packing and the loader."""
