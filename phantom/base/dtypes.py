"""Element types once: phantom's names, torch's (and Hugging Face's) names, sizes and safetensors codes.

torch-free, so the cost model and the placement rule read the same table as the store and the
exporter; phantom.files.tensorfile maps each entry to its torch dtype by `torch_name`.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ElementType:
    """One element type. name: phantom's (flags, tuned profiles), None for the integer types a file
    holds but nothing computes in; torch_name: torch's attribute and the Hugging Face / manifest name."""

    name: str | None
    torch_name: str
    itemsize: int
    code: str  # safetensors header dtype


FLOATS = (ElementType("fp32", "float32", 4, "F32"), ElementType("bf16", "bfloat16", 2, "BF16"),
          ElementType("fp16", "float16", 2, "F16"))
INTEGERS = (ElementType(None, "int64", 8, "I64"), ElementType(None, "int32", 4, "I32"),
            ElementType(None, "uint8", 1, "U8"), ElementType(None, "int8", 1, "I8"))
# FP8 checkpoints' weights and DeepSeek-V4's e8m0 scales (powers of two): read, never computed in
CODES = (ElementType(None, "float8_e4m3fn", 1, "F8_E4M3"), ElementType(None, "float8_e8m0fnu", 1, "F8_E8M0"))
ALL = FLOATS + INTEGERS + CODES
NAMES = tuple(f.name for f in FLOATS)  # what --dtype and a store's dtype may be
_FLOAT_BY_NAME = {alias: f for f in FLOATS for alias in (f.name, f.torch_name)}


def lookup(name) -> ElementType:
    """A floating type by either of its names ("bf16" or "bfloat16"), or by its torch dtype."""
    try:
        return _FLOAT_BY_NAME[str(name).removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; use one of {', '.join(NAMES)}") from None


def stored(torch_name: str) -> ElementType:
    """Any element type a file may hold, by torch's name ("uint8", "bfloat16")."""
    try:
        return next(t for t in ALL if t.torch_name == str(torch_name).removeprefix("torch."))
    except StopIteration:
        raise ValueError(f"unknown element type {torch_name!r}") from None
