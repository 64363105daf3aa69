"""How a quantized store keeps its linear weights: the format record and the tensors each weight is
stored as. torch-free, so the cost model counts a block's bytes by the rule the store lays it out by
(phantom.arch.quant holds the quantizers and dequantizers)."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

from phantom.base import dtypes

METHODS = ("nf4", "int8")  # what prepare_model.py --quantize writes
SHIPPED = ("fp8-block", "int4-group", "mxfp4")  # read as checkpoints ship them (phantom.convert.checkpoints)
FP8_BLOCK = (128, 128)  # DeepSeek-V3's weight_block_size: rows, columns of weight per float32 scale
INT4_GROUP = 32  # Kimi-K2-Thinking's group_size: consecutive values of a row per scale
MX_GROUP = 32  # MXFP4 (OCP Microscaling): e2m1 values per E8M0 scale
SCALE_DTYPES = ("bfloat16", "float16", "float32")  # int4-group: a group scale's dtype, as the checkpoint ships it


class QuantError(ValueError):
    """Quantized tensors that do not match their record, or scales no quantizer writes."""


@dataclass(frozen=True)
class QuantFormat:
    """How a store's linear weights are stored: the manifest's "quantization" record, less its tensors.

    nf4: 4-bit codes of `blocksize` consecutive values per absmax scale (row-major, as bitsandbytes'
    quantize_4bit); with double_quant the fp32 scales are themselves stored as 8-bit dynamic codes of
    `absmax_blocksize` scales each, an fp32 scale per group and one fp32 offset (QLoRA's "double
    quantization"). int8: LLM.int8's row-wise absmax, round(w * 127 / absmax) in [-127, 127].
    fp8-block: the checkpoint's own bytes (DeepSeek-V3's FP8): float8 e4m3 weights and a float32
    `scale_inv` per `block` (rows, columns) tile, partial tiles at the edges; `unquantized` names the
    block tensors the checkpoint ships in 16 bits although quantized() would pick them.
    int4-group: compressed-tensors' symmetric pack-quantized weights (Kimi-K2-Thinking's INT4): each row's
    4-bit values (q in [-8, 7], stored q + 8) eight to an int32 word, the first in the low bits, and one
    `scale_dtype` scale per `group` values; w = q * scale rounded to scale_dtype.
    mxfp4: gpt-oss's experts: two e2m1 values a byte (the first in the low nibble), one E8M0 byte (2^(e-127))
    per 32 values of a row. experts_only: the plans' layout of a shipped 4-bit checkpoint (Kimi-K2-Thinking's
    and gpt-oss's): only the routed experts quantized, every other weight 16-bit. float32: the block tensors a
    shipped checkpoint keeps in float32 beside its 16-bit ones (DeepSeek-V3's router correction bias), stored so,
    as shipped (so --link reads them in place). gate_up: an expert's gate and up as gpt-oss ships them, one tensor
    of alternating rows (gate_up_proj's): `experts.E.w13.weight.*` and `experts.E.w13.bias`, gate the even rows and
    up the odd ones (gate_up_part), read in place by --link.
    """

    method: str
    blocksize: int = 64
    double_quant: bool = True
    absmax_blocksize: int = 256
    block: tuple[int, int] = FP8_BLOCK
    unquantized: tuple[str, ...] = ()
    group: int = INT4_GROUP
    scale_dtype: str = "bfloat16"
    experts_only: bool = False
    float32: tuple[str, ...] = ()
    gate_up: bool = False
    experts: str = ""  # the routed experts' own method beside fp8-block's (DeepSeek-V4's mxfp4); "": fmt.method

    def __post_init__(self):
        if self.method not in METHODS + SHIPPED or self.experts not in ("", "mxfp4") or \
                (self.experts and self.method != "fp8-block"):
            raise QuantError(f"unknown quantization {self.method!r}; use one of {', '.join(METHODS + SHIPPED)}")
        if self.method == "fp8-block" and (len(self.block) != 2 or min(self.block) < 1):
            raise QuantError(f"fp8-block needs a weight_block_size of two positive sizes, not {list(self.block)}")
        if self.method == "int4-group" and (self.group < 8 or self.group % 8 or self.scale_dtype not in SCALE_DTYPES):
            raise QuantError(f"int4-group needs a group size that is a multiple of 8 and a scale dtype of "
                             f"{', '.join(SCALE_DTYPES)}, not {self.group} and {self.scale_dtype}")
        if self.method == "nf4" and (self.blocksize not in (32, 64, 128, 256, 512, 1024, 2048, 4096)
                                     or self.absmax_blocksize != 256):
            raise QuantError(f"nf4 needs a block size of 32..4096 (a power of two) and 256 scales per "
                             f"double-quantized group, not {self.blocksize} and {self.absmax_blocksize}")

    @property
    def shipped(self) -> bool:
        """Read as a checkpoint ships it (linkable in place), not quantized by phantom."""
        return self.method in SHIPPED

    def quantizes(self, name: str, shape: tuple[int, ...]) -> bool:
        """Whether this store keeps block tensor `name` quantized."""
        expert = name.startswith("feed_forward.experts.")
        return quantized(name, shape) and (name not in self.unquantized or (expert and bool(self.experts))) and \
            (not self.experts_only or expert)

    def record(self) -> dict:
        return {**self._record(), **({"float32": list(self.float32)} if self.float32 else {}),
                **({"gate_up": True} if self.gate_up else {}), **({"experts": self.experts} if self.experts else {})}

    def _record(self) -> dict:
        if self.method == "fp8-block":
            return {"method": self.method, "weight_block_size": list(self.block), "unquantized": list(self.unquantized)}
        if self.method == "int4-group":
            return {"method": self.method, "group_size": self.group, "scale_dtype": self.scale_dtype,
                    "unquantized": list(self.unquantized), "experts_only": self.experts_only}
        if self.method == "mxfp4":
            return {"method": self.method, "unquantized": list(self.unquantized), "experts_only": self.experts_only}
        if self.method == "int8":
            return {"method": "int8"}
        return {"method": "nf4", "blocksize": self.blocksize, "double_quant": self.double_quant,
                "absmax_blocksize": self.absmax_blocksize}

    @classmethod
    def from_record(cls, rec: dict) -> "QuantFormat":
        """The format of a manifest's record (its optional "float32" names and "gate_up", see the class)."""
        names, gate_up, experts = rec.get("float32", []), rec.get("gate_up", False), rec.get("experts", "")
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names) or \
                (names and rec.get("method") not in SHIPPED):
            raise QuantError(f"float32 is a list of tensor names of a shipped format, got {names!r:.80}")
        if gate_up not in (False, True) or (gate_up and rec.get("method") != "mxfp4"):
            raise QuantError(f"gate_up is true or false, and true only for mxfp4, got {gate_up!r:.20}")
        fmt = cls._from_record({k: v for k, v in rec.items() if k not in ("float32", "gate_up", "experts")})
        return replace(fmt, float32=tuple(names), gate_up=gate_up, experts=experts)

    @classmethod
    def _from_record(cls, rec: dict) -> "QuantFormat":
        try:
            if rec["method"] == "int8":
                if set(rec) - {"method", "tensors"}:
                    raise QuantError(f"int8 takes no settings, got {sorted(set(rec) - {'method', 'tensors'})}")
                return cls("int8")
            if rec["method"] == "fp8-block":
                if set(rec) - {"method", "weight_block_size", "unquantized", "tensors"}:
                    raise QuantError(f"fp8-block takes weight_block_size and unquantized, got {sorted(rec)}")
                return cls("fp8-block", block=tuple(int(x) for x in rec["weight_block_size"]),
                           unquantized=tuple(str(n) for n in rec["unquantized"]))
            if rec["method"] in ("int4-group", "mxfp4"):
                keys = set(cls(rec["method"]).record()) | {"tensors"}
                if set(rec) - keys or set(keys) - {"tensors"} - set(rec):
                    raise QuantError(f"{rec['method']} takes {', '.join(sorted(keys - {'method', 'tensors'}))}, "
                                     f"got {sorted(rec)}")
                extra = dict(group=int(rec["group_size"]), scale_dtype=str(rec["scale_dtype"])) \
                    if rec["method"] == "int4-group" else {}
                return cls(rec["method"], unquantized=tuple(str(n) for n in rec["unquantized"]),
                           experts_only=rec["experts_only"] is True, **extra)
            return cls(rec["method"], int(rec["blocksize"]), bool(rec["double_quant"]), int(rec["absmax_blocksize"]))
        except (KeyError, TypeError) as e:
            raise QuantError(f"bad quantization record ({type(e).__name__}: {e})") from None


def shipped_format(qc, where) -> QuantFormat:
    """The store format of a config.json's quantization_config that phantom reads as shipped: FP8 in blocks
    (DeepSeek-V3, Kimi-K2, Qwen3-FP8, GLM-4.5-FP8), compressed-tensors' symmetric INT4 in groups
    (Kimi-K2-Thinking), MXFP4 (gpt-oss); anything else is refused in one line naming `where`. Which weights
    are quantized (and an INT4 scale's dtype) the checkpoint's files say (phantom.convert.checkpoints)."""
    method = qc.get("quant_method") if isinstance(qc, dict) else qc
    if method == "compressed-tensors":
        return _int4_format(qc, where)
    if method == "mxfp4":
        return QuantFormat("mxfp4")
    if method != "fp8":
        raise QuantError(f"{where}: quantization_config.quant_method {method!r} is not read; phantom reads 'fp8' in "
                         f"blocks (DeepSeek-V3's FP8), 'compressed-tensors' pack-quantized INT4 (Kimi-K2-Thinking's), "
                         f"'mxfp4' (gpt-oss's) or 16-bit checkpoints")
    block = qc.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(x, int) and x > 0 for x in block)):
        raise QuantError(f"{where}: quantization_config.weight_block_size {block!r} is not two positive sizes; "
                         f"phantom reads FP8 in blocks (per-tensor FP8 is not read)")
    for key, want in (("fmt", ("e4m3",)), ("activation_scheme", ("dynamic",)), ("scale_fmt", (None, "ue8m0"))):
        if qc.get(key, want[0]) not in want:  # ue8m0 (DeepSeek-V3.1): float32 scales that are powers of two
            raise QuantError(f"{where}: quantization_config.{key} {qc[key]!r} is not read; phantom reads "
                             f"{' or '.join(map(repr, want))}")
    if qc.get("expert_dtype", "fp8") not in ("fp8", "fp4"):
        raise QuantError(f"{where}: quantization_config.expert_dtype {qc['expert_dtype']!r} is not read; phantom "
                         f"reads 'fp8' or 'fp4' (DeepSeek-V4's experts, as MXFP4)")
    return QuantFormat("fp8-block", block=tuple(block), experts="mxfp4" if qc.get("expert_dtype") == "fp4" else "")


INT4_WEIGHTS = {"num_bits": (4,), "type": ("int",), "symmetric": (True,), "strategy": ("group",),
                "dynamic": (False,), "actorder": (None, "static"), "block_structure": (None,)}


def _int4_format(qc: dict, where) -> QuantFormat:
    """compressed-tensors' config of weight-only symmetric INT4 in groups, packed (Kimi-K2-Thinking's)."""
    def refuse(what, got):
        raise QuantError(f"{where}: quantization_config{what} {got!r} is not read; phantom reads compressed-tensors' "
                         f"pack-quantized symmetric INT4 weights in groups (Kimi-K2-Thinking's), 16-bit activations")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or len(groups) != 1:
        refuse(".config_groups", groups)
    (name, group), = groups.items()
    if not isinstance(group, dict) or not isinstance(group.get("weights"), dict):
        refuse(f".config_groups.{name}", group)
    for key in ("input_activations", "output_activations"):
        if group.get(key) is not None:
            refuse(f".config_groups.{name}.{key}", group[key])
    fmt = group.get("format") or qc.get("format")
    if fmt != "pack-quantized":
        refuse(".format", fmt)
    if qc.get("quantization_status", "compressed") != "compressed" or qc.get("kv_cache_scheme") is not None:
        refuse(".quantization_status / kv_cache_scheme", (qc.get("quantization_status"), qc.get("kv_cache_scheme")))
    weights = group["weights"]
    for key, want in INT4_WEIGHTS.items():
        if weights.get(key) not in want:
            refuse(f".config_groups.{name}.weights.{key}", weights.get(key))
    size = weights.get("group_size")
    if not isinstance(size, int) or size < 8 or size % 8:
        refuse(f".config_groups.{name}.weights.group_size", size)
    return QuantFormat("int4-group", group=size)


def read_as_shipped(qc) -> bool:
    """Whether shipped_format reads this quantization_config (the family tables' check of config.json)."""
    try:
        shipped_format(qc, "config.json")
        return True
    except QuantError:
        return False


def as_format(quant: "str | QuantFormat | None") -> "QuantFormat | None":
    """A plan's quantization: a method name means prepare_model.py's format of it (its defaults; fp8-block:
    DeepSeek-V3's 128 x 128 tiles over every linear weight; int4-group and mxfp4: the routed experts alone, as
    Kimi-K2-Thinking and gpt-oss ship them)."""
    if quant == "fp8-mxfp4":  # DeepSeek-V4 as shipped: FP8 tiles, the experts MXFP4 (its FP4)
        return QuantFormat("fp8-block", experts="mxfp4")
    if isinstance(quant, str):
        return QuantFormat(quant, experts_only=quant in ("int4-group", "mxfp4"))
    return quant


ROUTERS = ("feed_forward.gate.weight", "feed_forward.shared_expert_gate.weight")  # a mixture of experts' (phantom.arch.moe)


def quantized(name: str, shape: tuple[int, ...]) -> bool:
    """Which tensors of a block are quantized: the linear weights (matrices); norms stay 16-bit, and so do
    a mixture of experts' routers (a rounded router picks other experts, as bitsandbytes' users keep
    them out with llm_int8_skip_modules)."""
    return len(shape) == 2 and name not in ROUTERS


def weight_format(fmt: QuantFormat, name: str) -> QuantFormat:
    """The format block tensor `name` is kept in: fmt, or for a routed expert's weight its own (fmt.experts)."""
    return replace(fmt, method=fmt.experts, experts="") if fmt.experts and name.startswith("feed_forward.experts.") \
        else fmt


def stored_layout(fmt: QuantFormat, name: str, shape: tuple[int, ...]) -> dict[str, tuple[tuple[int, ...], str]]:
    """The tensors (name -> shape, dtype) a quantized weight of `shape` is stored as."""
    fmt, n = weight_format(fmt, name), shape[0] * shape[1]
    if fmt.method == "fp8-block":
        return {f"{name}.fp8": (tuple(shape), "float8_e4m3fn"),
                f"{name}.scale_inv": ((-(-shape[0] // fmt.block[0]), -(-shape[1] // fmt.block[1])), "float32")}
    if fmt.method == "int8":
        return {f"{name}.int8": (tuple(shape), "int8"), f"{name}.absmax": ((shape[0],), "float32")}
    if fmt.method == "int4-group":  # compressed-tensors' weight_packed and weight_scale
        return {f"{name}.packed": ((shape[0], -(-shape[1] // 8)), "int32"),
                f"{name}.scale": ((shape[0], -(-shape[1] // fmt.group)), fmt.scale_dtype)}
    if fmt.method == "mxfp4":  # gpt-oss's *_blocks and *_scales, one expert's rows
        return {f"{name}.blocks": ((shape[0], -(-shape[1] // MX_GROUP), MX_GROUP // 2), "uint8"),
                f"{name}.scales": ((shape[0], -(-shape[1] // MX_GROUP)), "uint8")}
    blocks = -(-n // fmt.blocksize)
    out = {f"{name}.nf4": (((n + 1) // 2,), "uint8")}
    if not fmt.double_quant:
        return {**out, f"{name}.absmax": ((blocks,), "float32")}
    return {**out, f"{name}.absmax": ((blocks,), "uint8"),
            f"{name}.absmax2": ((-(-blocks // fmt.absmax_blocksize),), "float32"),
            f"{name}.offset": ((1,), "float32")}


def block_layout(fmt: QuantFormat, shapes: dict[str, tuple[int, ...]],
                 dtype: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """A block's stored tensors (name -> shape, torch's dtype name): each quantized weight's parts, the
    rest as they are in `dtype` (the store's; fmt.float32's in float32); with fmt.gate_up an expert's gate and
    up as one tensor of alternating rows, w13, in gate's place."""
    out = {}
    for name, shape in shapes.items():
        if (part := gate_up_part(fmt, name)) is not None:
            fused, p = part
            shape = (2 * shape[0], *shape[1:])
            if p == 0:
                out.update(stored_layout(fmt, fused, shape) if fmt.quantizes(name, shape) else {fused: (shape, dtype)})
            continue
        out.update(stored_layout(fmt, name, shape) if fmt.quantizes(name, shape) else
                   {name: (tuple(shape), "float32" if name in fmt.float32 else dtype)})
    return out


GATE_UP = re.compile(r"(feed_forward\.experts\.\d+\.)w([13])\.(weight|bias)")


def gate_up_part(fmt: QuantFormat, name: str) -> tuple[str, int] | None:
    """(the stored w13 tensor, 0 for gate's even rows or 1 for up's odd ones) of an expert's gate or up weight or
    bias where fmt keeps them as gpt-oss ships them (fmt.gate_up); else None."""
    m = GATE_UP.fullmatch(name) if fmt.gate_up else None
    return None if m is None else (f"{m.group(1)}w13.{m.group(3)}", int(m.group(2) == "3"))


def block_nbytes(fmt: QuantFormat, shapes: dict[str, tuple[int, ...]], dtype: str) -> int:
    """Bytes of one block stored in this format: what the store's block files hold and the cost model counts."""
    return sum(math.prod(shape) * dtypes.stored(name).itemsize for shape, name in block_layout(fmt, shapes, dtype).values())
