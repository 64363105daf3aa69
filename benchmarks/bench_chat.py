"""How long one long conversation takes to become ids and labels (phantom.data.chat.encode_chat_arrays, the model's
own template and tokenizer), and the process's peak memory: a conversation of --messages turns, or one
record of about --line-mb megabytes (a JSONL line as a chat export writes it, parsed here).

    python benchmarks/bench_chat.py --model FOLDER --messages 8000
    python benchmarks/bench_chat.py --model FOLDER --line-mb 50

FOLDER: a store or a Hugging Face folder with tokenizer.json or tokenizer.model and a chat template.
One case per process: the peak (ru_maxrss) is the case's. PHANTOM_SRC=DIR benchmarks the phantom
package in DIR instead of this checkout's (an older version, for a before/after comparison).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.environ.get("PHANTOM_SRC") or str(Path(__file__).resolve().parent.parent))

from phantom.data import chat
from phantom.data.tokenizer import TINY_TEXT, Tokenizer  # noqa: E402


def conversation(messages: int, line_mb: float) -> list[dict]:
    """User and assistant turns of the shipped text's sentences; with line_mb, as few turns as needed,
    each about 1 MB, to make a record of line_mb megabytes."""
    sentences = [s.strip() + "." for s in TINY_TEXT.read_text().split(".") if s.strip()]
    if line_mb:
        chunk = " ".join(sentences)
        body = (chunk + " ") * (1_000_000 // len(chunk) + 1)
        messages = 2 * max(1, round(line_mb / 2))
        return [{"role": ("user", "assistant")[k % 2], "content": body[:1_000_000 - k]} for k in range(messages)]
    return [{"role": ("user", "assistant")[k % 2], "content": sentences[k % len(sentences)]} for k in range(messages)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True, help="a folder with the tokenizer and chat template")
    p.add_argument("--messages", type=int, default=8000, help="turns in the conversation")
    p.add_argument("--line-mb", type=float, default=0, help="instead: one record of this many megabytes")
    args = p.parse_args(argv)
    tok_path = next(args.model / n for n in ("tokenizer.json", "tokenizer.model") if (args.model / n).is_file())
    tok = Tokenizer(tok_path)
    template = chat.read_template(args.model, tok)
    line = json.dumps({"messages": conversation(args.messages, args.line_mb)})
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    record = json.loads(line)
    del line
    encode = getattr(chat, "encode_chat_arrays", chat.encode_chat)  # as data.tokenize does (older: lists)
    ids, labels = encode(tok, template, chat.to_messages(record, "chat"))
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    trained = int((np.asarray(labels) != chat.IGNORE_INDEX).sum())
    print(f"{len(record['messages'])} messages, {sum(len(m['content']) for m in record['messages']) / 1e6:.1f} MB "
          f"of text: {len(ids)} tokens, {trained} trained, {seconds:.2f} s, peak RSS {peak / 2**20:.2f} GiB "
          f"({base / 2**20:.2f} GiB before the record)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
