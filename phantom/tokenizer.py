"""Tokenizers: a thin wrapper over sentencepiece (Llama-2, CodeLlama, Mistral) and in-process training
of the tiny model's tokenizer. Imports nothing from phantom.
"""
from __future__ import annotations

import hashlib
import io
from pathlib import Path

import sentencepiece as spm

ASSETS = Path(__file__).parent / "assets"
TINY_TEXT = ASSETS / "tiny.txt"


class Tokenizer:
    """Encodes text to ids and back, with BOS/EOS as the model was trained with."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"tokenizer not found at {self.path}")
        if self.path.suffix == ".json":
            try:
                from tokenizers import Tokenizer as HFTokenizer
            except ImportError:
                raise ValueError(f"{self.path} is a Hugging Face tokenizer.json; pip install tokenizers "
                                 f"to use it") from None
            self._hf = HFTokenizer.from_file(str(self.path))
            self._sp = None
            self.vocab_size = self._hf.get_vocab_size()
            self.bos_id = self._hf.token_to_id("<|begin_of_text|>") or self._hf.token_to_id("<s>") or 0
            self.eos_id = self._hf.token_to_id("<|end_of_text|>") or self._hf.token_to_id("</s>") or 0
        else:
            self._sp = spm.SentencePieceProcessor(model_file=str(self.path))
            self._hf = None
            self.vocab_size = self._sp.vocab_size()
            self.bos_id, self.eos_id = self._sp.bos_id(), self._sp.eos_id()
        self.fingerprint = hashlib.sha256(self.path.read_bytes()).hexdigest()[:16]

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        ids = self._sp.encode(text) if self._sp is not None else self._hf.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def decode(self, ids: list[int]) -> str:
        ids = [i for i in ids if i < self.vocab_size]
        return self._sp.decode(ids) if self._sp is not None else self._hf.decode(ids)


def train_tiny_tokenizer(out: Path, vocab_size: int = 512, text: Path = TINY_TEXT) -> Path:
    """Train a BPE sentencepiece model on the shipped text, deterministically (single thread)."""
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(Path(text).read_text().splitlines()), model_writer=model,
        model_type="bpe", vocab_size=vocab_size, hard_vocab_limit=False, character_coverage=1.0,
        num_threads=1, shuffle_input_sentence=False, bos_id=1, eos_id=2, unk_id=0, pad_id=-1,
        minloglevel=2)
    Path(out).write_bytes(model.getvalue())
    return Path(out)
