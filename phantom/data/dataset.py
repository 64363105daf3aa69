"""Training data as tokens: plain text and records (phantom.data.recordformats) rendered through the
model's chat template where it has one, tokenized once into a memory-mapped cache beside the file
(phantom.data.tokencache) with prompt tokens masked (-100), or data already tokenized
(phantom.data.tokenfiles); split into training and held-out parts. Rows and batches are
phantom.data.batches.
"""
from __future__ import annotations

import errno
import hashlib
import logging
from array import array
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from phantom.base.safejson import read_lines
from phantom.data import chat, sources, tokencache, tokenfiles
from phantom.data.recordformats import Recipe, detect_format, is_records, records, segments
from phantom.data.special_tokens import IGNORE_INDEX
from phantom.data.tokenizer import TINY_TEXT, Tokenizer

log = logging.getLogger(__name__)

CACHE_VERSION = 1
CACHE_DIR = ".phantom-cache"
DEFAULT_DATA = TINY_TEXT


@dataclass
class TokenData:
    """A tokenized data set: one stream of examples, each starting with BOS.

    Attributes:
        tokens: (N,) token ids.
        labels: (N,) the token where it is trained as a target, -100 on prompt tokens (and BOS).
        starts: (E,) offset of each example in the stream; plain text is one example.
        fmt: the format it was read as (see phantom.data.recordformats.FORMATS).
        key: identifies the source file, its format and the tokenizer (the cache key).
    """

    tokens: np.ndarray
    labels: np.ndarray
    starts: np.ndarray
    fmt: str
    key: str

    def __len__(self) -> int:
        return len(self.tokens)

    def slice(self, a: int, b: int) -> "TokenData":
        """Tokens [a, b) as a view; the examples starting inside it are kept."""
        s = self.starts[(self.starts >= a) & (self.starts < b)] - a
        if len(s) == 0 or s[0] != 0:
            s = np.concatenate([[0], s]).astype(np.int64)
        return TokenData(self.tokens[a:b], self.labels[a:b], s, self.fmt, f"{self.key}[{a}:{b}]")


def encode_example(tok: Tokenizer, pieces: list[tuple[str, bool]]) -> tuple[list[int], list[int]]:
    """Tokens and labels of one example: what the model puts first (its BOS, where it has one), the
    pieces, EOS after the last trained piece. The first token is never a target."""
    tokens, labels = list(tok.prefix), [IGNORE_INDEX] * len(tok.prefix)
    for k, (text, trained) in enumerate(pieces):
        if not isinstance(text, str):
            raise ValueError(f"expected a string, got {type(text).__name__}")
        ids = tok.encode(text, bos=False, eos=trained and k == len(pieces) - 1)
        tokens += ids
        labels += ids if trained else [IGNORE_INDEX] * len(ids)
    if labels:
        labels[0] = IGNORE_INDEX  # not a target of anything in its example (packed: of the one before)
    return tokens, labels


def encode_record(tok: Tokenizer, record, fmt: str | None, recipe: Recipe) -> tuple[str, list[int], list[int]]:
    """(format, tokens, labels) of one record: through the chat template if the recipe has one (as int32
    arrays), else plain (lists)."""
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    fmt = fmt or detect_format(record)
    if recipe.template is not None and fmt != "jsonl-text":
        try:
            messages = chat.to_messages(record, fmt)
            return fmt, *chat.encode_chat_arrays(tok, recipe.template, messages, recipe.train_on)
        except KeyError as e:
            raise ValueError(f"{fmt} record without {e}") from None
        except (TypeError, AttributeError) as e:
            raise ValueError(f"bad {fmt} record ({e})") from None
    tokens, labels = encode_example(tok, segments(record, fmt))
    if recipe.train_on == "prompt-too":
        labels = [IGNORE_INDEX] + tokens[1:]
    elif recipe.train_on == "last":
        labels = last_trained_run(labels)
    return fmt, tokens, labels


def last_trained_run(labels: list[int]) -> list[int]:
    """labels with only the last run of trained tokens kept (the last assistant turn)."""
    k = len(labels)
    while k > 0 and labels[k - 1] == IGNORE_INDEX:
        k -= 1
    while k > 0 and labels[k - 1] != IGNORE_INDEX:
        k -= 1
    return [IGNORE_INDEX] * k + labels[k:]


def tokenize(path: Path, tok: Tokenizer, recipe: Recipe | None = None
             ) -> tuple[str, np.ndarray, np.ndarray, np.ndarray]:
    """Format, tokens, labels and example starts of a data file (no cache).

    Plain text is one example: the model's BOS (where it has one), every non-empty line (sentencepiece
    turns the line break into a word boundary), its EOS.
    Records (JSONL, tables, dataset folders) are one example each.
    """
    recipe = recipe or Recipe()
    tokens, labels, starts = array("i"), array("i"), array("q")
    if not is_records(path):
        fmt = "text"
        starts.append(0)
        tokens.extend(tok.prefix)  # the model's BOS, where it puts one before a text
        for _, line in read_lines(path):
            if line.strip():
                tokens.extend(tok.encode(line, bos=False))
        if len(tokens) == len(tok.prefix):
            raise ValueError(f"{path} is empty; give a data file with some text in it")
        tokens.extend(tok.encode("", bos=False, eos=True))  # the document ends with the model's EOS
        labels = array("i", [IGNORE_INDEX]) + tokens[1:]
    else:
        fmt = None
        for where, record in records(path, recipe):
            try:
                fmt, t, lab = encode_record(tok, record, fmt, recipe)
            except ValueError as e:
                raise ValueError(where.format(e)) from None
            starts.append(len(tokens))
            tokens.frombytes(np.asarray(t, np.int32).tobytes())  # a long chat's arrays, not element by element
            labels.frombytes(np.asarray(lab, np.int32).tobytes())
        if fmt is None:
            raise ValueError(f"{path} is empty; give one JSON object per line")
    return fmt, np.frombuffer(tokens, np.int32), np.frombuffer(labels, np.int32), np.frombuffer(starts, np.int64)


def cache_key(path: Path, tok: Tokenizer, recipe: Recipe | None = None) -> str:
    """The source files' paths, sizes and mtimes, the tokenizer and, for records, the recipe (when not
    the default; plain text is read the same whatever it says)."""
    recipe = recipe or Recipe()
    files = [path] if path.is_file() else sources.data_files(path, recipe.split)
    stats = "|".join(f"{f.resolve()}|{f.stat().st_size}|{f.stat().st_mtime_ns}" for f in files)
    counts = is_records(path) and recipe != Recipe()
    ident = f"{CACHE_VERSION}|{tok.fingerprint}|{stats}" + (f"|{recipe.key}" if counts else "")
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def load(path: Path | str | None, tok: Tokenizer | None, cache: bool = True, vocab_size: int | None = None,
         dtype: str | None = None, recipe: Recipe | None = None) -> TokenData:
    """Tokenize a data file once and memory-map the result from then on (token files: map them as they are).

    The tokens are cached in `.phantom-cache/` next to the file, keyed by the tokenizer's fingerprint
    and the file's size and mtime: a new tokenizer or an edited file is tokenized afresh.

    Args:
        path: plain text (any suffix but .jsonl/.json/.bin/.npy), or records with {"prompt", "response"},
            Alpaca's {"instruction", "input", "output"}, chat {"messages": [{"role", "content"}]},
            ShareGPT's {"conversations": [{"from", "value"}]} or {"text"} (the first record decides) in
            JSONL, a .json list, .parquet, a `save_to_disk` folder or a Hub dataset id found in the local
            cache; or token ids already tokenized (.bin, .npy; see phantom.data.tokenfiles). None: the shipped tiny text.
        tok: the model's tokenizer (None: only token files can be read).
        cache: read and write the cache (False: tokenize in memory).
        vocab_size: the model's vocabulary, which token ids are checked against (default: tok's).
        dtype: element type of a .bin of token ids ("uint16" or "uint32"; see tokenfiles.token_dtype).
        recipe: chat template, trained turns, column names and split (see Recipe).

    Raises:
        FileNotFoundError: no such file. ValueError: empty, not UTF-8, a bad record (with its line),
            an id outside the vocabulary (with its offset), or text with no tokenizer to read it.
    """
    recipe = recipe or Recipe()
    path = Path(path) if path is not None else DEFAULT_DATA
    if not path.exists():
        path = sources.resolve(str(path)) or path
    if not path.is_file() and not (path.is_dir() and is_records(path)):
        raise FileNotFoundError(f"data file {path} not found; pass --data FILE (plain text, JSONL, Parquet, a "
                                f"datasets folder, a Hub dataset id in the local cache, or token ids in a .bin or .npy)")
    if path.suffix in tokenfiles.TOKEN_SUFFIXES:
        tokens, key = tokenfiles.map_tokens(path, vocab_size or tok.vocab_size, dtype)
        return TokenData(tokens, tokens, np.zeros(1, np.int64), "tokens", key)  # every token is trained
    if tok is None:
        raise ValueError(f"{path} is text, and the model has no tokenizer to read it: pass token ids already "
                         f"tokenized (--data FILE.bin or FILE.npy), or prepare the store with a tokenizer")
    key = cache_key(path, tok, recipe)
    cache = cache and path.resolve() != DEFAULT_DATA.resolve()  # the shipped text is small: never cached
    folder = path.parent / CACHE_DIR / f"{path.name}.{key}"
    if cache and (folder / "meta.json").is_file():
        fmt, *arrays = tokencache.read_cache(folder, vocab_size or tok.vocab_size)
        log.info("using the token cache %s (%d tokens)", folder, len(arrays[0]))
        return TokenData(*arrays, fmt=fmt, key=key)
    log.info("tokenizing %s", path)
    fmt, tokens, labels, starts = tokenize(path, tok, recipe)
    tokens = tokens.astype(np.uint16 if tok.vocab_size <= 1 << 16 else np.int32)
    data = TokenData(tokens, labels, starts, fmt, key)
    if cache:
        try:
            tokencache.write_cache(folder, fmt, tokens, labels, starts)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):  # the run's own outputs would fail next: stop now
                raise
            log.warning("cannot write the token cache next to %s (%s); tokenizing again next time", path, e)
    return data


def split(data: TokenData, fraction: float) -> tuple[TokenData, TokenData | None]:
    """(train, held-out): the last `fraction` of the tokens (text) or of the examples (JSONL)."""
    if not 0 <= fraction < 1:
        raise ValueError(f"--val-split must be in [0, 1), got {fraction}")
    if fraction == 0:
        return data, None
    if len(data.starts) > 1:
        k = len(data.starts) - max(1, round(len(data.starts) * fraction))
        if k < 1:
            raise ValueError(f"{len(data.starts)} examples are too few to hold some out; add data or use --val-split 0")
        cut = int(data.starts[k])
    else:
        cut = len(data) - max(1, round(len(data) * fraction))
    return data.slice(0, cut), data.slice(cut, len(data))
