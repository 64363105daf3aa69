"""A tokenizer's special tokens as transformers reads them from the model's own files: the token texts of
tokenizer_config.json (special_tokens_map.json filling what it leaves out), the tokens tokenizer.json's
post-processor puts around a text, and the stop ids of generation_config.json. No token is chosen by its
text: a model without a BOS (Qwen) has none.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from phantom.base import safejson

IGNORE_INDEX = -100  # the label of a token that carries no loss (F.cross_entropy's ignore_index, as transformers)
NAMES = ("bos", "eos", "pad", "unk")
SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


@dataclass(frozen=True)
class SideFiles:
    """The JSON files next to a tokenizer file ({} for each one that is absent)."""

    config: dict
    special_map: dict
    generation: dict
    raw: bytes  # their bytes, for the tokenizer's fingerprint

    @classmethod
    def read(cls, folder: Path) -> "SideFiles":
        parts, raw = [], b""
        for name in SIDE_FILES:
            path = folder / name
            if not path.is_file():
                parts.append({})
                continue
            data = path.read_bytes()
            raw += name.encode() + b"\0" + data
            value = safejson.loads(data, str(path))
            if not isinstance(value, dict):
                raise ValueError(f"{path}: expected a JSON object, found {type(value).__name__}")
            parts.append(value)
        return cls(*parts, raw)

    def token_text(self, name: str) -> str | None:
        """The text of the `name` token ("bos", "eos", ...): tokenizer_config.json's `{name}_token`, else
        special_tokens_map.json's (as transformers fills in what the config leaves unset)."""
        key = f"{name}_token"
        for source in (self.config, self.special_map):
            value = source.get(key)
            value = value.get("content") if isinstance(value, dict) else value
            if value:
                if not isinstance(value, str):
                    raise ValueError(f"{key} must be a token's text, not {type(value).__name__}")
                return value
        return None

    def has(self, name: str) -> bool:
        return f"{name}_token" in self.config or f"{name}_token" in self.special_map

    def stop_ids(self) -> list[int] | None:
        """generation_config.json's eos_token_id (an id or a list of ids); None where it has none."""
        value = self.generation.get("eos_token_id")
        if value is None:
            return None
        ids = value if isinstance(value, list) else [value]
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise ValueError(f"generation_config.json: eos_token_id must be an id or a list of ids, not {value!r}")
        return ids


def post_processor_ids(tokenizer_json: dict) -> tuple[list[int], list[int]]:
    """(ids before, ids after) the text that tokenizer.json's post-processor adds to one sequence
    (TemplateProcessing's "single", alone or in a Sequence); ([], []) for any other processor."""
    proc = tokenizer_json.get("post_processor") or {}
    procs = proc.get("processors", []) if proc.get("type") == "Sequence" else [proc]
    before, after = [], []
    for p in procs:
        if not isinstance(p, dict) or p.get("type") != "TemplateProcessing":
            continue
        specials = p.get("special_tokens", {})
        side = before
        for piece in p.get("single", []):
            if "Sequence" in piece:
                side = after
            elif "SpecialToken" in piece:
                side += specials[piece["SpecialToken"]["id"]]["ids"]
    return before, after


def nested_repeat(pattern: str) -> bool:
    """Whether a regex repeats a group that itself repeats without bound (`(a+)+`): such patterns
    backtrack exponentially, and the tokenizers library's regex engine aborts the process on them."""
    stack, i, unbounded_inside = [False], 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if c == "[":
            i = _class_end(pattern, i)
            continue
        if c == "(":
            stack.append(False)
        elif c == ")" and len(stack) > 1:
            unbounded_inside = stack.pop()
            if _unbounded_at(pattern, i + 1):
                if unbounded_inside:
                    return True
                stack[-1] = True
            elif unbounded_inside:
                stack[-1] = True
        elif _unbounded_at(pattern, i) and pattern[i - 1:i] not in ("(", "") and c != "?":
            stack[-1] = True
        i += 1
    return False


def _unbounded_at(pattern: str, i: int) -> bool:
    if pattern[i:i + 1] in ("+", "*"):
        return True
    if pattern[i:i + 1] == "{":
        close = pattern.find("}", i)
        return close > 0 and pattern[i + 1:close].endswith(",")
    return False


def _class_end(pattern: str, i: int) -> int:
    """The index after the character class that opens at i."""
    j = i + 1
    if pattern[j:j + 1] == "^":
        j += 1
    if pattern[j:j + 1] == "]":
        j += 1
    while j < len(pattern) and pattern[j] != "]":
        j += 2 if pattern[j] == "\\" else 1
    return j + 1


def split_patterns(node) -> list[str]:
    """Every regex a tokenizer.json's normalizer or pre-tokenizer holds ({"Regex": ...} anywhere in it)."""
    if isinstance(node, dict):
        out = [node["Regex"]] if isinstance(node.get("Regex"), str) else []
        return out + [p for v in node.values() for p in split_patterns(v)]
    if isinstance(node, list):
        return [p for v in node for p in split_patterns(v)]
    return []
