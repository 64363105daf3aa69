"""Records and their formats: how a JSONL line, a table row or a `datasets` record (prompt/response,
Alpaca, chat messages, ShareGPT, text) becomes the pieces of one example, trained or not, with its
columns renamed and the recipe (template, trained turns, columns, split) that is part of the cache
key. Apart from tokenizing so a new record format is one function here.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from phantom.base.safejson import read_records
from phantom.data import chat, sources

FORMATS = ("text", "prompt", "alpaca", "chat", "sharegpt", "jsonl-text", "tokens")
CHAT_FORMATS = ("prompt", "alpaca", "chat", "sharegpt")  # rendered through the chat template, if the model has one

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


def is_records(path: Path) -> bool:
    return path.suffix in (".jsonl", ".json") or path.is_dir() or sources.is_dataset(path)


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
