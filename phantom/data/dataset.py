"""Training data: plain text and instruction or chat records (JSONL, Parquet, `datasets` folders, Hub
datasets in the local cache), rendered through the model's chat template where it has one, tokenized
once into a memory-mapped cache with prompt tokens masked (-100), cut into windows or packed into rows
(with segment ids, so packed examples stay apart), served by a DataLoader; or data already tokenized
(flat .bin / .npy files of token ids, as nanoGPT and litgpt write them), memory-mapped as they are.
"""
from __future__ import annotations

import errno
import hashlib
import logging
import signal
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from phantom.data import chat, sources, tokencache
from phantom.base.safejson import read_lines, read_records  # noqa: F401 - data.read_records is their API
from phantom.data.tokenizer import TINY_TEXT, Tokenizer

log = logging.getLogger(__name__)

IGNORE_INDEX = -100
CACHE_VERSION = 1
CACHE_DIR = ".phantom-cache"
FORMATS = ("text", "prompt", "alpaca", "chat", "sharegpt", "jsonl-text", "tokens")
CHAT_FORMATS = ("prompt", "alpaca", "chat", "sharegpt")  # rendered through the chat template, if the model has one
TOKEN_SUFFIXES = (".bin", ".npy")  # pre-tokenized: a flat array of token ids
TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
DEFAULT_DATA = TINY_TEXT

# Stanford Alpaca's prompts (github.com/tatsu-lab/stanford_alpaca, train.py).
ALPACA = ("Below is an instruction that describes a task, paired with an input that provides further context. "
          "Write a response that appropriately completes the request.\n\n"
          "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n")
ALPACA_NO_INPUT = ("Below is an instruction that describes a task. Write a response that appropriately completes "
                   "the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n")
# Chat turns as plain "Role: content" lines, for a model with no chat template; only the assistant's
# content (and EOS) is trained.
CHAT_ROLES = {"system": "System", "user": "User", "assistant": "Assistant"}


@dataclass(frozen=True)
class Recipe:
    """How records become tokens (part of the cache key).

    Attributes:
        template: the model's chat template (phantom.data.chat); None: plain "Role: content" rendering.
        train_on: "all" assistant turns, the "last" one, or "prompt-too" (every token).
        columns: (format key, column) pairs: records keep their data under other names.
        split: the split of a Hub dataset or `datasets` folder (default: train).
    """

    template: chat.ChatTemplate | None = None
    train_on: str = "all"
    columns: tuple[tuple[str, str], ...] = ()
    split: str | None = None

    def __post_init__(self):
        if self.train_on not in chat.TRAIN_ON:
            raise ValueError(f"--train-on must be one of {', '.join(chat.TRAIN_ON)}, not {self.train_on!r}")

    @property
    def key(self) -> str:
        t = self.template.fingerprint if self.template is not None else "plain"
        return f"{t}|{self.train_on}|{sorted(self.columns)}|{self.split}"


def parse_columns(text: str | None) -> tuple[tuple[str, str], ...]:
    """--columns "prompt=question,response=answer" as (key, column) pairs."""
    pairs = []
    for item in (text or "").split(","):
        if not item.strip():
            continue
        key, sep, column = item.partition("=")
        if not sep or not key.strip() or not column.strip():
            raise ValueError(f"--columns takes KEY=COLUMN pairs separated by commas (e.g. prompt=question,"
                             f"response=answer), not {item!r}")
        pairs.append((key.strip(), column.strip()))
    return tuple(pairs)


@dataclass
class TokenData:
    """A tokenized data set: one stream of examples, each starting with BOS.

    Attributes:
        tokens: (N,) token ids.
        labels: (N,) the token where it is trained as a target, -100 on prompt tokens (and BOS).
        starts: (E,) offset of each example in the stream; plain text is one example.
        fmt: the format it was read as (see FORMATS).
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


# -- reading and tokenizing ----------------------------------------------------------------------

def detect_format(record: dict) -> str:
    if "messages" in record:
        return "chat"
    if "conversations" in record:
        return "sharegpt"
    if "instruction" in record:
        return "alpaca"
    if "prompt" in record and "response" in record:
        return "prompt"
    if "text" in record:
        return "jsonl-text"
    raise ValueError(f"unknown record keys {sorted(record)[:6]}; expected prompt/response, instruction/input/output "
                     f"(Alpaca), messages (chat), conversations (ShareGPT) or text; --columns KEY=COLUMN maps "
                     f"other names")


def segments(record, fmt: str) -> list[tuple[str, bool]]:
    """The example as (text, trained) pieces: prompts are not trained, responses are."""
    try:
        if fmt == "prompt":
            return [(record["prompt"], False), (record["response"], True)]
        if fmt == "alpaca":
            template = ALPACA if record.get("input") else ALPACA_NO_INPUT
            return [(template.format(instruction=record["instruction"], input=record.get("input", "")), False),
                    (record["output"], True)]
        if fmt == "jsonl-text":
            return [(record["text"], True)]
        messages = chat.to_messages(record, "sharegpt") if fmt == "sharegpt" else record["messages"]
        out = []
        for m in messages:
            if m.get("role") not in CHAT_ROLES:
                raise ValueError(f"unknown chat role {m.get('role')!r}; use {', '.join(CHAT_ROLES)}")
            role = CHAT_ROLES[m["role"]]
            if m["role"] == "assistant":
                out += [(f"{role}:", False), (m["content"], True)]
            else:
                out.append((f"{role}: {m['content']}", False))
        if not any(trained for _, trained in out):
            raise ValueError("a chat needs at least one assistant message to train on")
        return out
    except KeyError as e:
        raise ValueError(f"{fmt} record without {e}") from None
    except (TypeError, AttributeError) as e:
        raise ValueError(f"bad {fmt} record ({e})") from None


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


def records(path: Path, recipe: Recipe) -> Iterator[tuple[str, dict]]:
    """(where, record) of a JSONL/JSON file, a Parquet/Arrow table, a `save_to_disk` folder or a cached
    Hub snapshot (its --data-split); `where` is an error's format string naming the file, line and record
    number. Columns are renamed as recipe.columns says."""
    k = 0
    for file in sources.data_files(path, recipe.split):
        numbered = read_records(file) if file.suffix in (".jsonl", ".json") else \
            ((None, r) for r in sources.table_records(file))
        for line, record in numbered:
            k += 1
            where = f"{file}:{line}: {{}} (record {k})" if line is not None else f"{file}: record {k}: {{}}"
            if recipe.columns and isinstance(record, dict):
                try:
                    record = rename_columns(record, recipe.columns)
                except ValueError as e:
                    raise ValueError(where.format(e)) from None
            yield where, record


def rename_columns(record: dict, columns: tuple[tuple[str, str], ...]) -> dict:
    missing = [f"{column!r} (--columns {key}={column})" for key, column in columns if column not in record]
    if missing:
        raise ValueError(f"no column {', '.join(missing)}; the record has {', '.join(sorted(record)[:8])}")
    renamed = {column for _, column in columns}
    return {**{k: v for k, v in record.items() if k not in renamed}, **{key: record[column] for key, column in columns}}


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


def is_records(path: Path) -> bool:
    return path.suffix in (".jsonl", ".json") or path.is_dir() or sources.is_dataset(path)


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
            cache; or token ids already tokenized (.bin, .npy; see load_tokens). None: the shipped tiny text.
        tok: the model's tokenizer (None: only token files can be read).
        cache: read and write the cache (False: tokenize in memory).
        vocab_size: the model's vocabulary, which token ids are checked against (default: tok's).
        dtype: element type of a .bin of token ids ("uint16" or "uint32"; see token_dtype).
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
    if path.suffix in TOKEN_SUFFIXES:
        return load_tokens(path, vocab_size or tok.vocab_size, dtype)
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


# -- pre-tokenized files ---------------------------------------------------------------------------

def token_dtype(path: Path, vocab_size: int, dtype: str | None = None) -> np.dtype:
    """The element type of a .bin of token ids: given (--data-dtype), else uint16 when the vocabulary
    fits (nanoGPT's convention), else uint32."""
    if dtype is not None:
        if dtype not in TOKEN_DTYPES:
            raise ValueError(f"--data-dtype must be one of {', '.join(TOKEN_DTYPES)}, not {dtype!r}")
        return np.dtype(TOKEN_DTYPES[dtype])
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def load_tokens(path: Path | str, vocab_size: int, dtype: str | None = None) -> TokenData:
    """A flat file of token ids, memory-mapped (nothing is copied or cached): every token is trained.

    `.npy` records its dtype (any unsigned or signed integer type, 1-D); `.bin` is raw
    little-endian ids of `dtype` (see token_dtype). Each id is checked against the vocabulary once,
    in chunks, so a file from another tokenizer fails here and not as an index error mid-run.

    Raises:
        ValueError: not a flat integer array, a size that is not a whole number of ids, or an id
            outside [0, vocab_size) (the error names the file and the id's offset).
    """
    path = Path(path)
    if path.suffix == ".npy":
        try:
            tokens = np.load(path, mmap_mode="r", allow_pickle=False)
        except ValueError as e:
            raise ValueError(f"{path}: not a .npy array of token ids ({e})") from None
        if tokens.ndim != 1 or tokens.dtype.kind not in "ui":
            raise ValueError(f"{path}: expected a 1-D integer array of token ids, found {tokens.dtype} of shape "
                             f"{tokens.shape}")
    else:
        dt = token_dtype(path, vocab_size, dtype)
        size = path.stat().st_size
        if size % dt.itemsize:
            raise ValueError(f"{path}: {size} bytes is not a whole number of {dt.name} token ids; pass the "
                             f"--data-dtype it was written with")
        if size == 0:
            raise ValueError(f"{path} is empty; give a file of token ids")
        tokens = np.memmap(path, dtype=dt.newbyteorder("<"), mode="r")
    check_ids(tokens, vocab_size, path)
    st = path.stat()
    ident = f"tokens|{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{tokens.dtype.str}"
    key = hashlib.sha256(ident.encode()).hexdigest()[:16]
    return TokenData(tokens, tokens, np.zeros(1, np.int64), "tokens", key)


def check_ids(tokens: np.ndarray, vocab_size: int, path: Path, chunk: int = 1 << 24) -> None:
    """Raise ValueError naming the first id outside [0, vocab_size) and its offset (in ids)."""
    for at in range(0, len(tokens), chunk):
        part = np.asarray(tokens[at:at + chunk])
        bad = np.flatnonzero((part >= vocab_size) | (part < 0)) if part.dtype.kind == "i" else \
            np.flatnonzero(part >= vocab_size)
        if len(bad):
            i = at + int(bad[0])
            raise ValueError(f"{path}: token id {int(tokens[i])} at offset {i} (byte {i * tokens.dtype.itemsize}) is "
                             f"outside the model's vocabulary of {vocab_size}; tokenize the data with this model's "
                             f"tokenizer, or pass the --data-dtype the file was written with")


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


# -- rows of seq_len -----------------------------------------------------------------------------

class Windows(Dataset):
    """Plain text as windows of seq_len + 1 tokens; item i is the window starting at token i.

    Random windows sample any start; sequential ones step by seq_len (see BatchSampler).
    """

    def __init__(self, data: TokenData, seq_len: int, name: str = "data"):
        if len(data) < seq_len + 1:
            raise ValueError(f"the {name} ({len(data)} tokens) is shorter than one sequence of {seq_len} + 1 "
                             f"tokens; use a smaller --seq-len or more data")
        self.data, self.seq_len = data, seq_len
        self.n = len(data) - seq_len  # possible starts
        self.n_sequential = (len(data) - 1) // seq_len

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = np.asarray(self.data.tokens[i:i + self.seq_len + 1], dtype=np.int64)
        y = np.asarray(self.data.labels[i + 1:i + self.seq_len + 1], dtype=np.int64)
        return torch.from_numpy(w[:-1]), torch.from_numpy(y)


class Packed(Dataset):
    """Examples packed greedily, in order, into rows of seq_len + 1 tokens, padded with -100 targets.

    An example longer than a row is truncated. With `segments`, items are (x, y, segment ids): the
    model then keeps the examples of a row apart (a block-diagonal causal mask, positions from 0 for
    each; see phantom.arch.layers.packed_layout). Without, the examples of a row attend to each other; either
    way the target of an example's first token is masked, so no loss crosses an example boundary.
    """

    def __init__(self, data: TokenData, seq_len: int, pad_id: int = 0, segments: bool = False):
        self.data, self.seq_len, self.pad_id, self.segments = data, seq_len, pad_id, segments
        ends = np.append(data.starts[1:], len(data))
        self.rows: list[list[tuple[int, int]]] = [[]]
        used, truncated = 0, 0
        for s, e in zip(data.starts.tolist(), ends.tolist()):
            n = min(e - s, seq_len + 1)
            truncated += n < e - s
            if used + n > seq_len + 1:
                self.rows.append([])
                used = 0
            self.rows[-1].append((s, n))
            used += n
        if truncated:
            log.warning("%d of %d examples are longer than --seq-len %d + 1 and were truncated",
                        truncated, len(data.starts), seq_len)
        self.n = self.n_sequential = len(self.rows)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        toks = np.full(self.seq_len + 1, self.pad_id, np.int64)
        labs = np.full(self.seq_len + 1, IGNORE_INDEX, np.int64)
        segs = np.full(self.seq_len + 1, len(self.rows[i]), np.int64)  # the padding is a segment of its own
        at = 0
        for k, (s, n) in enumerate(self.rows[i]):
            toks[at:at + n] = self.data.tokens[s:s + n]
            labs[at:at + n] = self.data.labels[s:s + n]
            segs[at:at + n] = k
            at += n
        x, y = torch.from_numpy(toks[:-1]), torch.from_numpy(labs[1:])
        return (x, y, torch.from_numpy(segs[:-1])) if self.segments else (x, y)


def rows(data: TokenData, seq_len: int, pad_id: int = 0, name: str = "data", segments: bool = False
         ) -> Windows | Packed:
    """Plain text as windows, instruction data as packed rows (`name` is for error messages; `segments`:
    packed rows come with their segment ids, see Packed)."""
    if seq_len < 1:
        raise ValueError(f"--seq-len must be >= 1, got {seq_len}")
    return Windows(data, seq_len, name) if data.fmt in ("text", "tokens") else Packed(data, seq_len, pad_id, segments)


# -- batches -------------------------------------------------------------------------------------

class BatchSampler(torch.utils.data.Sampler):
    """Row indices of each step's batch, a pure function of (seed, step): resuming needs only the step.

    Args:
        ds: Windows or Packed.
        batch: rows per batch.
        seed: seeds a torch.Generator per step (random windows) or per epoch (shuffled rows).
        shuffle: random windows / a new permutation of rows each epoch; False: in order, cycling.
        start: the first step to yield (the data position of a resumed run).
    """

    def __init__(self, ds: Windows | Packed, batch: int, seed: int = 0, shuffle: bool = True, start: int = 0):
        self.ds, self.batch, self.seed, self.shuffle, self.position = ds, batch, seed, shuffle, start
        self._perm: tuple[int, torch.Tensor] | None = None

    def indices(self, step: int) -> list[int]:
        if self.shuffle and isinstance(self.ds, Windows):
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
            return torch.randint(self.ds.n, (self.batch,), generator=g).tolist()
        n = self.ds.n_sequential
        out = []
        for r in range(step * self.batch, (step + 1) * self.batch):
            epoch, k = divmod(r, n)
            out.append(self.order(epoch)[k] * (self.ds.seq_len if isinstance(self.ds, Windows) else 1))
        return out

    def order(self, epoch: int) -> list[int] | range:
        if not self.shuffle:
            return range(self.ds.n_sequential)
        if self._perm is None or self._perm[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = (epoch, torch.randperm(self.ds.n_sequential, generator=g).tolist())
        return self._perm[1]

    def __iter__(self):
        step = self.position
        while True:
            yield self.indices(step)
            step += 1

    def state_dict(self) -> dict:
        return {"seed": self.seed, "position": self.position, "shuffle": self.shuffle}


def _worker_init(_):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the training thread's to handle


def loader(ds: Windows | Packed, batch: int, seed: int = 0, shuffle: bool = True, start: int = 0,
           workers: int = 1, pin_memory: bool = False, prefetch: int = 4) -> DataLoader:
    """An endless DataLoader of (x, y) batches (batch, seq_len) from step `start` on.

    Args:
        workers: processes preparing batches ahead (0: in the training thread).
        pin_memory: page-locked batches for asynchronous host-to-device copies (CUDA).
        prefetch: batches each worker keeps ready.
    """
    sampler = BatchSampler(ds, batch, seed, shuffle, start)
    return DataLoader(ds, batch_sampler=sampler, num_workers=workers, pin_memory=pin_memory,
                      prefetch_factor=prefetch if workers else None, worker_init_fn=_worker_init if workers else None,
                      generator=torch.Generator().manual_seed(seed))


def render_prompt(prompt: str, fmt: str, template: chat.ChatTemplate | None = None) -> str:
    """A raw prompt in the template the data was trained with (for samples; BOS is the sampler's)."""
    if template is not None and fmt in CHAT_FORMATS:
        text = template.render([{"role": "user", "content": prompt}], add_generation_prompt=True)[0]
        bos = template.special.get("bos_token")
        return text[len(bos):] if bos and text.startswith(bos) else text
    if fmt == "alpaca":
        return ALPACA_NO_INPUT.format(instruction=prompt)
    if fmt == "chat":
        return f"User: {prompt} Assistant:"
    return prompt
