"""Tokenizers: one wrapper over sentencepiece (Llama-2, CodeLlama, Mistral), Hugging Face `tokenizers`
(tokenizer.json) and tiktoken (Llama-3's `tokenizer.model`), and in-process training of the tiny model's
tokenizer.
"""
from __future__ import annotations

import base64
import hashlib
import io
import re
import struct
from pathlib import Path

import sentencepiece as spm

ASSETS = Path(__file__).parent / "assets"
TINY_TEXT = ASSETS / "tiny.txt"

# Llama-3's split pattern and special tokens, as Meta's llama-models tokenizer.py defines them: 256 special
# tokens follow the BPE ranks (<|begin_of_text|> is the first, <|end_of_text|> the second).
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                  "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|step_id|>", "<|start_header_id|>",
                  "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
LLAMA3_SPECIAL += [f"<|reserved_special_token_{2 + i}|>" for i in range(256 - len(LLAMA3_SPECIAL))]


def is_tiktoken_file(path: Path) -> bool:
    """A tiktoken BPE file is text, one `base64(token) rank` per line; a sentencepiece model is a protobuf."""
    with open(path, "rb") as f:
        first = f.readline(4096).split()
    try:
        return len(first) == 2 and int(first[1]) >= 0 and base64.b64decode(first[0], validate=True) is not None
    except ValueError:
        return False


def llama3_encoding(path: Path, name: str = "llama3"):
    """The tiktoken Encoding of a Llama-3 tokenizer.model (ranks from the file, Llama-3's pattern and specials)."""
    try:
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe
    except ImportError:
        raise ValueError(f"{path} is a tiktoken (Llama-3) tokenizer; pip install tiktoken to use it") from None
    ranks = load_tiktoken_bpe(str(path))
    special = {tok: len(ranks) + i for i, tok in enumerate(LLAMA3_SPECIAL)}
    return tiktoken.Encoding(name=name, pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks, special_tokens=special)


class Tokenizer:
    """Encodes text to ids and back, with BOS/EOS as the model was trained with.

    Reads a sentencepiece `tokenizer.model`, a tiktoken (Llama-3) `tokenizer.model` or a Hugging Face
    `tokenizer.json`; `kind` says which ("sentencepiece", "tiktoken" or "hf").
    """

    def __init__(self, path: Path | str):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"tokenizer not found at {self.path}")
        if self.path.suffix == ".json":
            self.kind = "hf"
            self._open_hf()
        elif is_tiktoken_file(self.path):
            self.kind = "tiktoken"
            self._tt = llama3_encoding(self.path)
            self.vocab_size = self._tt.n_vocab
            self.bos_id, self.eos_id = self._tt.encode_single_token("<|begin_of_text|>"), \
                self._tt.encode_single_token("<|end_of_text|>")
            self.bos_token, self.eos_token = "<|begin_of_text|>", "<|end_of_text|>"
        else:
            self.kind = "sentencepiece"
            try:
                self._sp = spm.SentencePieceProcessor(model_file=str(self.path))
            except (RuntimeError, OSError) as e:
                raise ValueError(f"{self.path}: not a sentencepiece, tiktoken or tokenizer.json file ({e})") from None
            self.vocab_size = self._sp.vocab_size()
            self.bos_id, self.eos_id = self._sp.bos_id(), self._sp.eos_id()
            self.bos_token, self.eos_token = self._sp.id_to_piece(self.bos_id), self._sp.id_to_piece(self.eos_id)
            self.unk_token = self._sp.id_to_piece(self._sp.unk_id())
        self.fingerprint = hashlib.sha256(self.path.read_bytes()).hexdigest()[:16]

    def _open_hf(self) -> None:
        try:
            from tokenizers import Tokenizer as HFTokenizer
        except ImportError:
            raise ValueError(f"{self.path} is a Hugging Face tokenizer.json; pip install tokenizers to use it") from None
        try:
            self._hf = HFTokenizer.from_file(str(self.path))
        except Exception as e:  # tokenizers raises its own exception type for a bad file
            raise ValueError(f"{self.path}: not a readable tokenizer.json ({e})") from None
        self.vocab_size = self._hf.get_vocab_size()
        self.bos_token = next((t for t in ("<|begin_of_text|>", "<s>") if self._hf.token_to_id(t) is not None), None)
        self.eos_token = next((t for t in ("<|end_of_text|>", "</s>") if self._hf.token_to_id(t) is not None), None)
        self.bos_id = self._hf.token_to_id(self.bos_token) if self.bos_token else 0
        self.eos_id = self._hf.token_to_id(self.eos_token) if self.eos_token else 0

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        if self.kind == "sentencepiece":
            ids = self._sp.encode(text)
        elif self.kind == "tiktoken":
            ids = self._tt.encode(text, disallowed_special=())  # special-token text in data is plain text
        else:
            ids = self._hf.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def special_tokens(self) -> list[str]:
        """The text of the tokens a rendered chat names by their text (BOS, EOS, added and control tokens)."""
        if self.kind == "sentencepiece":
            return [self._sp.id_to_piece(i) for i in range(self.vocab_size)
                    if self._sp.is_control(i) or self._sp.is_unknown(i)]
        if self.kind == "tiktoken":
            return list(LLAMA3_SPECIAL)
        return [t.content for t in self._hf.get_added_tokens_decoder().values()]

    def encode_rendered(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids and (start, end) character offsets of a rendered chat, read as transformers'
        `tokenizer(text, add_special_tokens=False)` reads it: a special token's text is that token."""
        if self.kind == "hf":
            enc = self._hf.encode(text, add_special_tokens=False)
            return enc.ids, [tuple(o) for o in enc.offsets]
        if self.kind == "tiktoken":
            ids = self._tt.encode(text, allowed_special="all")
            _, starts = self._tt.decode_with_offsets(ids)
            return ids, list(zip(starts, starts[1:] + [len(text)]))
        ids, offsets, at = [], [], 0
        specials = sorted(self.special_tokens(), key=len, reverse=True)
        for piece in re.split("(" + "|".join(map(re.escape, specials)) + ")", text):
            if piece in specials:
                ids.append(self._sp.piece_to_id(piece))
                offsets.append((at, at + len(piece)))
            elif piece:
                pieces = self._sp.encode(piece, out_type=str)
                ids += [self._sp.piece_to_id(p) for p in pieces]
                offsets += [(at + s, at + e) for s, e in _align(pieces, piece)]
            at += len(piece)
        return ids, offsets

    def decode(self, ids: list[int]) -> str:
        ids = [i for i in ids if i < self.vocab_size]
        if self.kind == "sentencepiece":
            return self._sp.decode(ids)
        if self.kind == "tiktoken":  # special tokens (numbered after the BPE ranks) are dropped, as the others do
            return self._tt.decode([i for i in ids if i < self._tt.max_token_value - len(LLAMA3_SPECIAL) + 1])
        return self._hf.decode(ids)


def _align(pieces: list[str], text: str) -> list[tuple[int, int]]:
    """Character spans of sentencepiece pieces in the text they came from. The normalizer folds a
    whitespace run into one "\u2581", so a "\u2581" takes the run it stands for and any other character
    one character of the text (NFKC rewrites that change lengths are rare enough to shift a span by one)."""
    spans, at = [], 0
    for piece in pieces:
        start = at
        for ch in piece:
            while at < len(text) and text[at].isspace():
                at += 1
            if ch != "\u2581":
                at = min(len(text), at + 1)
        spans.append((start, at))
    return spans


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


# -- sentencepiece to tokenizer.json ----------------------------------------------------------------

def _fields(buf: bytes):
    """(field number, value) of a protobuf message: ints for varints, bytes for length-delimited fields,
    4/8 raw bytes for fixed-width ones."""
    at = 0

    def varint():
        nonlocal at
        out = shift = 0
        while True:
            b = buf[at]
            at += 1
            out |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                return out

    while at < len(buf):
        key = varint()
        field, wire = key >> 3, key & 7
        if wire == 0:
            yield field, varint()
        elif wire == 2:
            n = varint()
            yield field, buf[at:at + n]
            at += n
        elif wire in (1, 5):
            n = 8 if wire == 1 else 4
            yield field, buf[at:at + n]
            at += n
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")


def sentencepiece_spec(path: Path) -> dict:
    """What a converter needs from a sentencepiece model file, read from its protobuf wire format
    (sentencepiece_model.proto's field numbers), so no protobuf package is needed."""
    spec = {"pieces": [], "model_type": 1, "byte_fallback": False, "unk_piece": "<unk>", "charsmap": b"",
            "add_dummy_prefix": True, "remove_extra_whitespaces": True}
    for field, value in _fields(Path(path).read_bytes()):
        if field == 1:  # SentencePiece: piece, score, type (NORMAL 1, UNKNOWN 2, CONTROL 3, USER_DEFINED 4, BYTE 6)
            piece = {"score": 0.0, "type": 1}
            for f, v in _fields(value):
                if f == 1:
                    piece["piece"] = v.decode("utf-8")
                elif f == 2:
                    piece["score"] = struct.unpack("<f", v)[0]
                elif f == 3:
                    piece["type"] = v
            spec["pieces"].append(piece)
        elif field == 2:  # TrainerSpec
            for f, v in _fields(value):
                if f == 3:
                    spec["model_type"] = v
                elif f == 35:
                    spec["byte_fallback"] = bool(v)
                elif f == 45:
                    spec["unk_piece"] = v.decode("utf-8")
        elif field == 3:  # NormalizerSpec
            names = {2: "charsmap", 3: "add_dummy_prefix", 4: "remove_extra_whitespaces"}
            spec.update({names[f]: v if f == 2 else bool(v) for f, v in _fields(value) if f in names})
    return spec


def sentencepiece_to_json(path: Path, bos: str | None = None) -> str:
    """tokenizer.json text for a sentencepiece model, as transformers' converters build it (BPE merges from
    the vocabulary's order, or Unigram scores; the normalizer's charsmap, whitespace and dummy prefix;
    byte fallback), so transformers' fast tokenizer reads it with the `tokenizers` library alone. `bos`:
    the token its post-processor puts first (as LlamaTokenizer adds BOS)."""
    from tokenizers import AddedToken, Regex, Tokenizer as HFTokenizer, decoders, models, normalizers, processors
    spec = sentencepiece_spec(path)
    pieces = spec["pieces"]
    if spec["model_type"] == 2:
        vocab = {p["piece"]: i for i, p in enumerate(pieces)}
        merges = []
        for merged in vocab:  # transformers' generate_merges: each piece's splits, ordered by the piece's id
            local = [(merged[:k], merged[k:]) for k in range(1, len(merged)) if merged[:k] in vocab and merged[k:] in vocab]
            merges += [(vocab[merged], len(a), len(b), vocab[a], vocab[b], a, b) for a, b in local]
        merges = [(m[5], m[6]) for m in sorted(merges)]
        model = models.BPE(vocab, merges, unk_token=spec["unk_piece"], fuse_unk=True, byte_fallback=spec["byte_fallback"])
    elif spec["model_type"] == 1:
        unk = next((i for i, p in enumerate(pieces) if p["type"] == 2), 0)
        model = models.Unigram([(p["piece"], p["score"]) for p in pieces], unk, spec["byte_fallback"])
    else:
        raise ValueError(f"{path}: sentencepiece model type {spec['model_type']} has no tokenizer.json conversion")
    tok = HFTokenizer(model)
    norm = [normalizers.Precompiled(spec["charsmap"])] if spec["charsmap"] else []
    if spec["remove_extra_whitespaces"]:
        norm += [normalizers.Strip(), normalizers.Replace(Regex(" {2,}"), " ")]
    norm += [normalizers.Replace(" ", "\u2581")] + ([normalizers.Prepend("\u2581")] if spec["add_dummy_prefix"] else [])
    tok.normalizer = normalizers.Sequence(norm)
    dec = [decoders.Replace("\u2581", " ")] + ([decoders.ByteFallback()] if spec["byte_fallback"] else [])
    tok.decoder = decoders.Sequence(dec + [decoders.Fuse()] + (
        [decoders.Strip(content=" ", left=1)] if spec["add_dummy_prefix"] else []))
    tok.add_tokens([AddedToken(p["piece"], normalized=False, special=p["type"] in (2, 3))
                    for p in pieces if p["type"] in (2, 3, 4)])
    if bos is not None:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, tok.token_to_id(bos))])
    return tok.to_str()
