"""JSON that phantom did not write (configs, manifests, safetensors headers, adapter configs, data
records), read within bounds: nesting depth, integer digits, bytes read and, unless the caller allows
them, non-finite numbers. What breaks a bound is one error naming the file and the line, never a
RecursionError or a library's ValueError. Imports nothing of phantom's.
"""
from __future__ import annotations

import json
import math
import re
from itertools import accumulate
from pathlib import Path

MAX_DEPTH = 100  # configs and chat records nest under 10 deep; the parser itself recurses
MAX_INT_DIGITS = 100  # ids and sizes have under 20; Python refuses over 4300 with an error of its own
MAX_BYTES = 64 << 20  # a config, manifest or adapter config; data files pass max_bytes=None

_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}
# what the locator looks at outside strings: strings (skipped), numbers, the non-finite names, brackets, lines
_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|-?\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|-?Infinity|NaN|[\[\]{}]|\n')


class _Refused(Exception):
    """A callback of the parser met a value out of bounds (located afterwards by _locate)."""


def loads(text: str | bytes, where: str, *, line: int | None = 1, finite: bool = True, hint: str = "",
          error: type[Exception] = ValueError):
    """Parse one JSON document within the bounds above.

    Args:
        text: the document (bytes are decoded as UTF-8; a leading BOM is dropped).
        where: what the error names first (a path, or "path: what it is").
        line: the document's first line in its file (a JSONL line's number); None: no line in errors.
        finite: refuse NaN, Infinity and numbers that overflow to them (a config); False keeps them
            (records phantom or Python's json wrote, which may hold a NaN loss).
        hint: appended to a syntax error (what the format needs).
        error: the exception class raised (ValueError or a subclass, e.g. a store's error).
    """
    def fail(at: int | None, problem: str):
        place = f"{where}:{at}" if line is not None and at is not None else where
        raise error(f"{place}: {problem}") from None

    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as e:
            fail((line or 1) + text.count(b"\n", 0, e.start), f"not UTF-8 ({e.reason} at byte {e.start})")
    text = text.removeprefix("\ufeff")
    first = line or 1
    if _too_deep(text):
        at, problem = _locate(text, first, finite)
        fail(at, problem or f"JSON nested more than {MAX_DEPTH} deep")
    try:
        return json.loads(text, parse_int=_int, parse_float=_finite_float if finite else float,
                          parse_constant=_no_constant if finite else None)
    except json.JSONDecodeError as e:
        fail(first + e.lineno - 1, f"not valid JSON ({e.msg}){hint}")
    except (_Refused, RecursionError) as e:
        at, problem = _locate(text, first, finite)
        fail(at, problem if at is not None else str(e) or "nested too deeply")


def load(path: Path | str, *, max_bytes: int | None = MAX_BYTES, what: str = "JSON file", **kw):
    """loads() of a file's bytes, refusing one larger than max_bytes before reading more than that."""
    path = Path(path)
    with open(path, "rb") as f:
        raw = f.read(max_bytes + 1) if max_bytes is not None else f.read()
    if max_bytes is not None and len(raw) > max_bytes:
        raise kw.get("error", ValueError)(f"{path}: larger than the {max_bytes >> 20} MiB a {what} may hold")
    return loads(raw, str(path), **kw)


def _int(s: str) -> int:
    if len(s) - s.startswith("-") > MAX_INT_DIGITS:
        raise _Refused(f"an integer of {len(s)} digits (at most {MAX_INT_DIGITS})")
    return int(s)


def _finite_float(s: str) -> float:
    v = float(s)
    if not math.isfinite(v):
        raise _Refused(f"the number {s[:20]} is not finite")
    return v


def _no_constant(s: str):
    raise _Refused(f"{s} is not a number phantom accepts")


def _too_deep(text: str) -> bool:
    """Whether brackets outside strings nest deeper than MAX_DEPTH (at C speed: regexes and accumulate)."""
    if text.count("[") + text.count("{") <= MAX_DEPTH:
        return False
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    return max(accumulate(map(_STEP.__getitem__, brackets)), default=0) > MAX_DEPTH


def _locate(text: str, line: int, finite: bool) -> tuple[int | None, str]:
    """(line, problem) of the first value out of bounds; a slow scan, on the error path only."""
    depth = 0
    for m in _TOKEN.finditer(text):
        tok = m.group()
        if tok == "\n":
            line += 1
        elif tok in "[{":
            depth += 1
            if depth > MAX_DEPTH:
                return line, f"JSON nested more than {MAX_DEPTH} deep"
        elif tok in "]}":
            depth -= 1
        elif tok[0] == '"':
            line += tok.count("\n")
        elif tok.lstrip("-").isdigit() and len(tok.lstrip("-")) > MAX_INT_DIGITS:
            return line, f"an integer of {len(tok.lstrip('-'))} digits (at most {MAX_INT_DIGITS})"
        elif finite and not math.isfinite(float(tok)):
            return line, f"the number {tok[:20]} is not finite (phantom accepts finite numbers only)"
    return None, ""


# -- data files: lines and records, numbered as an editor numbers them --------------------------------

def read_lines(path: Path):
    """(line number, line) of a UTF-8 text file, streamed; errors say which line is bad."""
    n = 0
    try:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                yield n, line
    except UnicodeDecodeError as e:
        n, reason = _first_bad_line(path, e.reason)  # the text reader decodes ahead: find the line itself
        raise ValueError(f"{path}:{n}: not UTF-8 text ({reason}); convert the file, e.g. with "
                         f"iconv -f latin1 -t utf-8") from None


def _first_bad_line(path: Path, reason: str) -> tuple[int, str]:
    n = 0
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as e:
                return n, e.reason
    return n, reason  # a sequence cut at the end of the file


def read_records(path: Path):
    """(line number, record) of a JSONL file, or (index, record) of a .json file that holds one list.
    Records keep non-finite numbers (Python's json writes NaN)."""
    if path.suffix == ".json":
        text = "".join(line for _, line in read_lines(path))
        if text.lstrip().startswith("["):
            yield from enumerate(loads(text, str(path), finite=False), 1)
            return
    for n, line in read_lines(path):
        if line.strip():
            yield n, loads(line.rstrip("\n"), str(path), line=n, finite=False,
                           hint="; JSONL needs one JSON object per line")
