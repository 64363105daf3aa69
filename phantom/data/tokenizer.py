"""Tokenizers: one wrapper over sentencepiece (Llama-2, CodeLlama, Mistral), Hugging Face `tokenizers`
(tokenizer.json) and tiktoken (Llama-3's `tokenizer.model`), and in-process training of the tiny model's
tokenizer.
"""
from __future__ import annotations

import base64
import hashlib
import io
import json
import logging
import re
import struct
from pathlib import Path

import numpy as np
import sentencepiece as spm

from phantom.data.special_tokens import NAMES, SideFiles, nested_repeat, post_processor_ids, split_patterns

log = logging.getLogger(__name__)
ASSETS = Path(__file__).parent.parent / "assets"
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


# Meta's tokenizer.py numbers its special tokens after the BPE ranks, in LLAMA3_SPECIAL's order: BOS is the
# first, EOS the second; its generation stops at EOS, <|eom_id|> (the ninth) and <|eot_id|> (the tenth).
LLAMA3_BOS, LLAMA3_EOS, LLAMA3_STOPS = 0, 1, (1, 8, 9)
# transformers' LlamaTokenizer rebuilds the tokenizer.json it reads with no normalizer and a Metaspace
# pre-tokenizer (tokenization_llama.py); these classes are read that way, unless the file is byte-level
# (AutoTokenizer then reads it as it is).
METASPACE_CLASSES = ("LlamaTokenizer", "LlamaTokenizerFast", "CodeLlamaTokenizer", "CodeLlamaTokenizerFast")


def llama3_encoding(path: Path, name: str = "llama3"):
    """The tiktoken Encoding of a Llama-3 tokenizer.model (ranks from the file, Llama-3's pattern and specials)."""
    try:
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe
    except ImportError:
        raise ValueError(f"{path} is a tiktoken (Llama-3) tokenizer; pip install tiktoken to use it") from None
    try:
        ranks = load_tiktoken_bpe(str(path))
    except ValueError as e:  # a line that is not `base64 rank` (binascii.Error is one too)
        raise ValueError(f"{path}: not a tiktoken tokenizer.model ({' '.join(str(e).split())[:200]})") from None
    if not ranks:
        raise ValueError(f"{path}: not a tiktoken tokenizer.model (no ranks)")
    n = max(ranks.values()) + 1
    special = {tok: n + i for i, tok in enumerate(LLAMA3_SPECIAL)}
    try:
        return tiktoken.Encoding(name=name, pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks, special_tokens=special)
    except ValueError as e:
        raise ValueError(f"{path}: not a tiktoken tokenizer.model ({e})") from None


class Tokenizer:
    """Encodes text to ids and back, with the special tokens the model's own files name.

    Reads a sentencepiece `tokenizer.model`, a tiktoken (Llama-3) `tokenizer.model` or a Hugging Face
    `tokenizer.json`; `kind` says which ("sentencepiece", "tiktoken" or "hf"). BOS, EOS, PAD and UNK come
    from the tokenizer_config.json (and special_tokens_map.json) beside it, as transformers reads them,
    else from the tokenizer file itself; the ids put around a text (`prefix`, `suffix`) from tokenizer.json's
    post-processor; the generation stop ids from generation_config.json's eos_token_id, else EOS. A
    token the files do not name is None (Qwen has no BOS).
    """

    chunk_chars = 1 << 18  # a long rendered text is encoded in pieces of about this many characters

    def __init__(self, path: Path | str):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"tokenizer not found at {self.path}")
        side = SideFiles.read(self.path.parent)
        self.prefix: list[int] = []
        self.suffix: list[int] = []
        if self.path.suffix == ".json":
            self.kind = "hf"
            defaults = self._open_hf(side)
        elif is_tiktoken_file(self.path):
            self.kind = "tiktoken"
            defaults = self._open_tiktoken()
        else:
            self.kind = "sentencepiece"
            defaults = self._open_sentencepiece(side)
        for name in NAMES:
            text = side.token_text(name) if side.has(name) else defaults.get(name)
            setattr(self, f"{name}_token", text)
            setattr(self, f"{name}_id", None if text is None else self._id_of(text, name))
        if self.kind != "hf":  # tokenizer.json's post-processor says what it adds; the others add BOS
            self.prefix = [self.bos_id] if self.bos_id is not None and side.config.get("add_bos_token", True) else []
            self.suffix = [self.eos_id] if self.eos_id is not None and side.config.get("add_eos_token") else []
        stops = side.stop_ids()
        self.stop_ids: list[int] = stops if stops is not None else (
            defaults.get("stops") or ([self.eos_id] if self.eos_id is not None else []))
        self.fingerprint = hashlib.sha256(self.path.read_bytes() + side.raw).hexdigest()[:16]

    def _open_tiktoken(self) -> dict:
        self._tt = llama3_encoding(self.path)
        self.vocab_size = self._tt.n_vocab
        self._n_ranks = self._tt.n_vocab - len(LLAMA3_SPECIAL)
        return {"bos": LLAMA3_SPECIAL[LLAMA3_BOS], "eos": LLAMA3_SPECIAL[LLAMA3_EOS],
                "stops": [self._n_ranks + k for k in LLAMA3_STOPS]}

    def _open_sentencepiece(self, side) -> dict:
        try:
            self._sp = spm.SentencePieceProcessor(model_file=str(self.path))
        except (RuntimeError, OSError) as e:
            raise ValueError(f"{self.path}: not a sentencepiece, tiktoken or tokenizer.json file ({e})") from None
        self.vocab_size = self._sp.vocab_size()
        ids = {"bos": self._sp.bos_id(), "eos": self._sp.eos_id(), "pad": self._sp.pad_id(), "unk": self._sp.unk_id()}
        return {k: self._sp.id_to_piece(i) for k, i in ids.items() if i >= 0}

    def _open_hf(self, side) -> dict:
        try:
            from tokenizers import Tokenizer as HFTokenizer
            from tokenizers import pre_tokenizers
        except ImportError:
            raise ValueError(f"{self.path} is a Hugging Face tokenizer.json; pip install tokenizers to use it") from None
        try:
            text = self.path.read_text(encoding="utf-8")
            spec = json.loads(text)
            self._hf = HFTokenizer.from_str(text)
        except Exception as e:  # tokenizers raises its own exception type for a bad file
            raise ValueError(f"{self.path}: not a readable tokenizer.json ({' '.join(str(e).split())[:200]})") from None
        for pattern in split_patterns([spec.get("normalizer"), spec.get("pre_tokenizer")]):
            if nested_repeat(pattern):
                raise ValueError(f"{self.path}: its pattern {pattern[:80]!r} repeats a repeated group, which "
                                 f"backtracks without end on some texts; not a tokenizer phantom reads")
        if side.config.get("tokenizer_class") in METASPACE_CLASSES and (spec.get("model") or {}).get("type") == "BPE" \
                and '"ByteLevel"' not in text:  # a byte-level one (DeepSeek-V3's) is read as it is
            add_prefix = side.config.get("add_prefix_space")
            scheme = "never" if add_prefix is False else ("always" if side.config.get("legacy", False) else "first")
            self._hf.normalizer = None
            self._hf.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme=scheme, split=False)
        self.vocab_size = self._hf.get_vocab_size()
        added = self._hf.get_added_tokens_decoder()
        self._special = {i for i, t in added.items() if t.special}
        cut = [t.content for t in added.values() if t.special and t.content and not (t.lstrip or t.single_word or
                                                                                    t.normalized)]
        self._cut_tokens = {c: ({t for t in cut if t[0] == c}, sorted({len(t) for t in cut if t[0] == c}))
                            for c in {t[0] for t in cut}}  # first character -> the tokens a piece may begin with
        self.prefix, self.suffix = post_processor_ids(spec)
        first = self._hf.id_to_token(self.prefix[0]) if self.prefix else None
        return {"bos": first}  # no config: BOS is what the post-processor puts first; no EOS is known

    def _id_of(self, text: str, name: str) -> int | None:
        if self.kind == "hf":
            i = self._hf.token_to_id(text)
        elif self.kind == "tiktoken":
            try:
                i = self._tt.encode_single_token(text)
            except KeyError:
                i = None
        else:
            i = self._sp.piece_to_id(text)
            i = i if self._sp.id_to_piece(i) == text else None
        if i is None and name in ("pad", "unk"):  # transformers would add it past the model's vocabulary
            log.warning("%s: the %s_token %r is not in the vocabulary of %s; the model has none", self.path.parent,
                        name, text, self.path.name)
        elif i is None:
            raise ValueError(f"{self.path.parent}: the {name}_token {text!r} of tokenizer_config.json is not in the "
                             f"vocabulary of {self.path.name}")
        return i

    @property
    def pad_or_eos(self) -> int:
        """The id that pads rows: the model's pad token, else EOS (as TRL pads a model without one), else 0."""
        return next((i for i in (self.pad_id, self.eos_id) if i is not None), 0)

    def is_special(self, i: int) -> bool:
        """Whether id i is a special (control) token: written by a template, never by text."""
        if self.kind == "hf":
            return i in self._special
        if self.kind == "tiktoken":
            return i >= self._n_ranks
        return self._sp.is_control(i)

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        """text's ids; bos: with what the model puts before a text (its BOS, where it adds one); eos: with EOS
        after (a document's end), where the model has one. Special-token text in text is plain text."""
        if self.kind == "sentencepiece":
            ids = self._sp.encode(text)
        elif self.kind == "tiktoken":
            ids = self._tt.encode(text, disallowed_special=())  # special-token text in data is plain text
        else:
            ids = self._hf_encode(text).ids
        return (self.prefix if bos else []) + ids + ([self.eos_id] if eos and self.eos_id is not None else [])

    def _hf_encode(self, text: str):
        try:
            return self._hf.encode(text, add_special_tokens=False)
        except BaseException as e:  # the regex engine's panic is a BaseException (pyo3's PanicException)
            if type(e).__name__ != "PanicException":
                raise
            why = " ".join(str(e).split())[:120]
            raise ValueError(f"{self.path}: the tokenizer failed on a text ({why})") from None

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
            ids, starts, ends = self.encode_arrays(text)
            return ids.tolist(), list(zip(starts.tolist(), ends.tolist()))
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

    def encode_arrays(self, text: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """encode_rendered as int32 ids, start and end offsets, in bounded memory: a long text
        is encoded in pieces of about chunk_chars, cut where a special token begins (the tokenizers
        library splits a text at its added tokens before anything else, so the pieces encode as the
        whole does), in parallel."""
        if self.kind != "hf":
            ids, offsets = self.encode_rendered(text)
            offsets = np.array(offsets, np.int32).reshape(-1, 2)
            return np.array(ids, np.int32), offsets[:, 0].copy(), offsets[:, 1].copy()
        cuts = self._cuts(text)
        parts = [np.zeros(0, np.int32)], [np.zeros(0, np.int32)], [np.zeros(0, np.int32)]
        for k in range(0, len(cuts) - 1, 4):  # a few pieces at a time: parallel, and their encodings freed
            group = [(a, b) for a, b in zip(cuts[k:k + 4], cuts[k + 1:k + 5])]
            try:
                encs = self._hf.encode_batch([text[a:b] for a, b in group], add_special_tokens=False)
            except BaseException as e:  # the regex engine's panic (see _hf_encode)
                if type(e).__name__ != "PanicException":
                    raise
                raise ValueError(f"{self.path}: the tokenizer failed on a text") from None
            for (a, _), enc in zip(group, encs):
                offsets = np.array(enc.offsets, np.int32).reshape(-1, 2) + a  # a text under 2**31 characters
                parts[0].append(np.array(enc.ids, np.int32))
                parts[1].append(offsets[:, 0].copy())
                parts[2].append(offsets[:, 1].copy())
        return tuple(np.concatenate(p) for p in parts)

    def _cuts(self, text: str) -> list[int]:
        """0, the positions at which pieces of text begin, len(text). A piece begins at a special token
        the library matches as written (not normalized, not stripping or matching whole words only)."""
        cuts, at = [0], self.chunk_chars
        while at < len(text):
            found = None
            for first in self._cut_tokens:
                k = text.find(first, at)
                contents, lengths = self._cut_tokens[first]
                while k >= 0 and (found is None or k < found):
                    if any(text[k:k + n] in contents for n in lengths):
                        found = k
                        break
                    k = text.find(first, k + 1)
            if found is None:
                break
            cuts.append(found)
            at = found + self.chunk_chars
        return cuts + [len(text)]

    def decode(self, ids: list[int], specials: bool = False) -> str:
        """The text of ids; specials: with special tokens by their text (else they are dropped)."""
        ids = [i for i in ids if 0 <= i < self.vocab_size]
        if self.kind == "hf":
            return self._hf.decode(ids, skip_special_tokens=not specials)
        if self.kind == "tiktoken":
            return self._tt.decode(ids if specials else [i for i in ids if i < self._n_ranks])
        out, run = [], []
        for i in ids + [None]:
            if i is None or self._sp.is_control(i):
                out.append(self._sp.decode(run))
                run = []
                if i is not None and specials:
                    out.append(self._sp.id_to_piece(i))
            else:
                run.append(i)
        return "".join(out)


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
    from tokenizers import AddedToken, Regex, decoders, models, normalizers, processors
    from tokenizers import Tokenizer as HFTokenizer
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
