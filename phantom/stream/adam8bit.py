"""8-bit AdamW (Dettmers et al. 2021, bitsandbytes' AdamW8bit): both moments as 8-bit codes of a
dynamic map, one fp32 scale (the block's absolute maximum) per block of 256 elements.

A weight's moments take 2 bytes and 1/32 instead of 8 (fp32 AdamW): the optimizer state of a full
finetune, which phantom reads and writes once a step from host RAM or disk, shrinks to a quarter.
The algorithm is bitsandbytes' blockwise update: the first moment on the signed dynamic map, the
second on the unsigned one; each step dequantizes a block's codes (code * scale), updates the
moments and the weight in fp32 (weight decay first, as bitsandbytes' CPU kernel), then requantizes
the new moments to the nearest code of each value over the block's new absolute maximum. Tensors
of fewer than 4096 elements keep fp32 moments (bitsandbytes' min_8bit_size).

Speed: the update is one function over a tensor's blocks, run in chunks of CHUNK elements so that
its temporaries stay in cache, and compiled by torch.compile where it can be (CPU: one C++ loop
over the chunk, vectorized and threaded; CUDA: one Triton kernel): eager torch would make ~30
passes over memory and gather through int64 indices. Where the compiler cannot run (no C++
compiler, `mps`), the same function runs eagerly, a few times slower, with a warning. The nearest
code is found without a search: a table indexed by the top 18 bits of the float gives the
number of code midpoints below the float's bucket, and each bucket holds at most one midpoint
(checked when the table is built), so one comparison finishes it.
"""
from __future__ import annotations

import logging
import math
import threading

import torch

from phantom.stream import cpukernel

log = logging.getLogger(__name__)

BLOCK = 256  # elements per scale
MIN_8BIT = 4096  # smaller tensors keep fp32 moments
CHUNK = 1024 * BLOCK  # elements per call of the update: its temporaries stay in cache
LUT_SIZE = 65536  # bitsandbytes' CPU lookup: bins of [-1, 1]
ROUNDINGS = ("nearest", "bnb_cpu")  # the requantization: exact nearest code, or bitsandbytes' CPU lookup
TABLE_SHIFT = 14  # the table is indexed by a float's top 32 - 14 = 18 bits (sign, exponent, 9 mantissa bits)
OPTIMIZERS = ("adamw_torch", "adamw_8bit")  # transformers' TrainingArguments names
MOMENT_NAMES = ("exp_avg", "exp_avg_sq", "exp_avg_q", "exp_avg_scale", "exp_avg_sq_q", "exp_avg_sq_scale")


def check_optimizer(name: str) -> str:
    if name not in OPTIMIZERS:
        raise ValueError(f"--optim must be one of {', '.join(OPTIMIZERS)}, not {name!r}")
    return name


def check_rounding(name: str) -> str:
    if name not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {', '.join(ROUNDINGS)}, not {name!r}")
    return name


def dynamic_map(signed: bool, max_exponent_bits: int = 7, total_bits: int = 8) -> torch.Tensor:
    """The dynamic quantization map (bitsandbytes' create_dynamic_map): per decade 10^-6 .. 1 a
    linear fraction whose resolution doubles with the decade, plus 0 and 1; 256 sorted fp32 values."""
    data: list[float] = []
    non_sign_bits = total_bits - 1
    additional = 2 ** (non_sign_bits - max_exponent_bits) - 1
    for i in range(max_exponent_bits):
        items = 2 ** (i + non_sign_bits - max_exponent_bits) + 1 if signed else \
            2 ** (i + non_sign_bits - max_exponent_bits + 1) + 1
        bounds = torch.linspace(0.1, 1, items, dtype=torch.float32)
        means = (bounds[:-1] + bounds[1:]) / 2.0
        scale = 10 ** (-(max_exponent_bits - 1) + i)  # times the fp32 means in fp32, as bitsandbytes
        data += (scale * means).tolist() + ((-scale * means).tolist() if signed else [])
    if additional > 0:
        bounds = torch.linspace(0.1, 1, additional + 1, dtype=torch.float32)
        means = (bounds[:-1] + bounds[1:]) / 2.0
        scale = 10 ** (-(max_exponent_bits - 1) + max_exponent_bits - 1)
        data += (scale * means).tolist() + ((-scale * means).tolist() if signed else [])
    data += [0.0, 1.0] + [0.0] * (2 ** total_bits - len(data) - 2)
    return torch.tensor(sorted(data), dtype=torch.float32)


class QuantMap:
    """A sorted 256-value map and what finds a float's nearest code fast: `table[bits >> TABLE_SHIFT]`
    counts the code midpoints below the float's bucket (each bucket holds at most one: checked), and
    `above[k]` is the least float above midpoint k (+inf last), so `table[key] + (x >= above[table[key]])`
    is the nearest code, a value half way between two codes taking the lower one. `lut` is bitsandbytes'
    CPU rounding table (the code nearest each of LUT_SIZE evenly spaced values of [-1, 1], fp32 midpoints:
    its csrc/cpu_ops.cpp build_quantize_lut)."""

    def __init__(self, code: torch.Tensor):
        self.code = code
        mids = (code[:-1].double() + code[1:].double()) / 2  # exact in float64
        nearest = mids.float()
        above = torch.where(nearest.double() <= mids, torch.nextafter(nearest, torch.tensor(math.inf)), nearest)
        self.above = torch.cat([above, torch.tensor([math.inf])])
        keys = torch.arange(1 << (32 - TABLE_SHIFT), dtype=torch.int64) << TABLE_SHIFT
        first = keys.to(torch.int32).view(torch.float32)  # the bucket's two end floats (in either order)
        last = (keys | ((1 << TABLE_SHIFT) - 1)).to(torch.int32).view(torch.float32)
        low, high = torch.minimum(first, last), torch.maximum(first, last)
        table = torch.bucketize(low.double(), mids, out_int32=True)  # midpoints < low
        spread = torch.bucketize(high.double(), mids, out_int32=True) - table
        if bool(((spread > 1) & ~low.isnan() & ~high.isnan()).any()):
            raise AssertionError("a table bucket holds two code midpoints: lower TABLE_SHIFT")
        self.table = table.clamp_max(255).to(torch.uint8)
        grid = -1.0 + (2.0 * torch.arange(LUT_SIZE, dtype=torch.float32)) / (LUT_SIZE - 1)
        self.lut = torch.bucketize(grid, 0.5 * (code[:-1] + code[1:]), out_int32=True).to(torch.uint8)

    def rounding(self, name: str, wide: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The (table, thresholds) the update's requantization reads for a ROUNDINGS name (wide: the
        table as int32, for the C loop's vector gathers)."""
        table = self.table if name == "nearest" else self.lut
        return (table.to(torch.int32) if wide else table), self.above


def nearest_codes(x: torch.Tensor, table: torch.Tensor, above: torch.Tensor) -> torch.Tensor:
    """The index (uint8) of the code nearest each element of x (fp32, within [-1, 1]) by a QuantMap's
    table and thresholds; a value half way between two codes takes the lower one, as a search does."""
    key = (x.view(torch.int32) >> TABLE_SHIFT) & ((1 << (32 - TABLE_SHIFT)) - 1)
    below = table[key.long()]
    return below + (x >= above[below.long()]).to(torch.uint8)


def lut_codes(x: torch.Tensor, lut: torch.Tensor) -> torch.Tensor:
    """bitsandbytes' CPU rounding of x (fp32, x = value * (1 / block max)): the code its lookup table holds
    for x's bin (csrc/cpu_ops.cpp norm_to_lut_index): the nearest code but at bin resolution, so every
    value within 1.5e-5 of zero takes the code nearest 1.5e-5, zero included."""
    index = ((x.clamp(-1.0, 1.0) + 1.0) * 0.5 * (LUT_SIZE - 1) + 0.5).to(torch.int32)
    return lut[index.long()]


def requantize(x: torch.Tensor, scale: torch.Tensor, table: torch.Tensor, above: torch.Tensor, lut: bool,
               floor: int) -> torch.Tensor:
    """Codes of x (rows of a block) for its blocks' `scale`: the nearest code of x / scale, a nonzero
    value never below code `floor` (the second moment's zero-point: a nonzero second moment coded as
    zero would make its weight's update m / eps; Li et al. 2023); or bitsandbytes' CPU lookup of
    x * (1 / scale), where a zero scale codes 0."""
    if lut:
        inverse = 1.0 / torch.where(scale > 0, scale, 1.0)
        return torch.where(scale[:, None] > 0, lut_codes(x * inverse[:, None], table), 0)
    codes = nearest_codes(x / torch.where(scale > 0, scale, 1.0)[:, None], table, above)
    return torch.where(x != 0, codes.clamp_min(floor), codes) if floor else codes


def quantize(x: torch.Tensor, qmap: QuantMap, rounding: str = "nearest") -> tuple[torch.Tensor, torch.Tensor]:
    """x's codes (uint8, x's shape) and one scale per block of BLOCK elements (its absolute maximum)."""
    flat = x.reshape(-1).float()
    blocks = -(-flat.numel() // BLOCK)
    padded = torch.nn.functional.pad(flat, (0, blocks * BLOCK - flat.numel())).view(blocks, BLOCK)
    scale = padded.abs().amax(1)
    codes = requantize(padded, scale, *qmap.rounding(rounding), rounding == "bnb_cpu", 0)
    return codes.view(-1)[:flat.numel()].view(x.shape), scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor, qmap: QuantMap) -> torch.Tensor:
    flat = qmap.code[codes.reshape(-1).long()]
    blocks = scale.numel()
    padded = torch.nn.functional.pad(flat, (0, blocks * BLOCK - flat.numel())).view(blocks, BLOCK)
    return (padded * scale[:, None]).view(-1)[:flat.numel()].view(codes.shape)


SIGNED, UNSIGNED = QuantMap(dynamic_map(True)), QuantMap(dynamic_map(False))


def _blocks_update(p, g, m_q, m_scale, v_q, v_scale, h, m_code, m_table, m_above, v_code, v_table, v_above,
                   lut: bool) -> None:
    """One chunk of the update in place: p (fp32), g and the codes (rows of BLOCK), the scales (a row's),
    the maps' codes and QuantMap.rounding's tables (lut: bitsandbytes' CPU rounding). h holds, in fp32: the
    decay factor, -lr / (1 - b1^t), sqrt(1 - b2^t), eps, b1, 1 - b1, b2, 1 - b2, the gradient's clip factor."""
    decay, step_size, c2, eps, b1, a1, b2, a2, coef = h.unbind()
    g = g.float() * coef
    m = m_code[m_q.long()] * m_scale[:, None] * b1 + a1 * g
    v = v_code[v_q.long()] * v_scale[:, None] * b2 + a2 * (g * g)
    # the square root correctly rounded, as the C loop's and CUDA's: torch's fp32 sqrt on a CPU is not (an ulp
    # apart for a fifth of values), its fp64 one is, and fp32 -> fp64 -> fp32 rounds a square root once
    p.copy_(p * decay + step_size * (m / (v.double().sqrt().float() / c2 + eps)))
    ms, vs = m.abs().amax(1), v.amax(1)
    m_q.copy_(requantize(m, ms, m_table, m_above, lut, 0))
    v_q.copy_(requantize(v, vs, v_table, v_above, lut, 1))
    m_scale.copy_(ms)
    v_scale.copy_(vs)


class _Kernel:
    """_blocks_update compiled once per process on CUDA (thread-safe; static shapes but for the rows), or eager
    where the compiler fails (once, with a warning). On a CPU it runs eagerly: the C loop (cpukernel) is the
    CPU's update, this form runs there only where no C compiler is (so inductor could not build it either)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._compiled: dict[str, object] = {}

    def _get(self, kind: str):
        with self._lock:
            if kind not in self._compiled:
                self._compiled[kind] = torch.compile(_blocks_update, dynamic=False) \
                    if kind == "cuda" else _blocks_update
            return self._compiled[kind]

    def run(self, device: torch.device, *args) -> None:
        kernel = self._get(device.type)
        try:
            kernel(*args)
        except Exception as e:  # noqa: BLE001 - a compiler that cannot build the kernel: run it eagerly
            if kernel is _blocks_update:
                raise
            log.warning("8-bit AdamW: torch.compile failed on %s (%s: %s); its update runs eagerly, a few times "
                        "slower", device.type, type(e).__name__, str(e)[:200])
            with self._lock:
                self._compiled[device.type] = _blocks_update
            _blocks_update(*args)


KERNEL = _Kernel()
_tables: dict[tuple, tuple[torch.Tensor, ...]] = {}


def tables(device: torch.device, rounding: str = "nearest", wide: bool = False) -> tuple[torch.Tensor, ...]:
    """What the update reads of both maps, on `device`: the signed map's codes, table (or lookup table) and
    thresholds, then the unsigned map's (wide: int32 tables, for the C loop's vector gathers)."""
    key = (torch.device(device), rounding, wide)
    if key not in _tables:
        _tables[key] = tuple(t.to(key[0]) for q in (SIGNED, UNSIGNED) for t in (q.code, *q.rounding(rounding, wide)))
    return _tables[key]


def hyper(lr: float, betas: tuple[float, float], eps: float, weight_decay: float, step: int, coef: float,
          device: torch.device) -> torch.Tensor:
    """The step's scalars, computed in double and rounded once to fp32 (as bitsandbytes' Python
    scalars reach its fp32 kernel)."""
    b1, b2 = betas
    vals = [1.0 - lr * weight_decay, -lr / (1.0 - b1 ** step), math.sqrt(1.0 - b2 ** step), eps,
            b1, 1.0 - b1, b2, 1.0 - b2, coef]
    return torch.tensor(vals, dtype=torch.float32).to(device)


def new_state(shape: torch.Size, device: torch.device, eight_bit: bool = True) -> dict[str, torch.Tensor]:
    """Zero moments for a tensor of `shape`: codes and scales from MIN_8BIT elements, else (or without
    `eight_bit`: fp32 AdamW's) fp32."""
    n = math.prod(shape)
    if n < MIN_8BIT or not eight_bit:
        return {"exp_avg": torch.zeros(shape, device=device), "exp_avg_sq": torch.zeros(shape, device=device)}
    blocks = -(-n // BLOCK)
    return {"exp_avg_q": torch.zeros(shape, dtype=torch.uint8, device=device),
            "exp_avg_scale": torch.zeros(blocks, device=device),
            "exp_avg_sq_q": torch.zeros(shape, dtype=torch.uint8, device=device),
            "exp_avg_sq_scale": torch.zeros(blocks, device=device)}


def state_bytes(n: int) -> int:
    """Bytes of the moments of an n-element tensor."""
    return 8 * n if n < MIN_8BIT else 2 * n + 2 * 4 * (-(-n // BLOCK))


def update(p: torch.Tensor, g: torch.Tensor, state: dict[str, torch.Tensor], h: torch.Tensor,
           rounding: str = "nearest") -> None:
    """One 8-bit AdamW step of the fp32 tensor p (contiguous) in place from its gradient g and its
    codes and scales (new_state's), h from `hyper`: on a CPU the C loop of phantom.stream.cpukernel over
    every core; elsewhere (or without a C compiler) `torch_update`."""
    m_q, m_s, v_q, v_s = (state[k].view(-1) for k in ("exp_avg_q", "exp_avg_scale", "exp_avg_sq_q", "exp_avg_sq_scale"))
    if (m_q.dtype, v_q.dtype, m_s.dtype, v_s.dtype, p.dtype) != (torch.uint8,) * 2 + (torch.float32,) * 3:
        raise TypeError(f"8-bit AdamW state of the wrong dtypes: codes {m_q.dtype}, {v_q.dtype}, scales {m_s.dtype}, "
                        f"{v_s.dtype}, weight {p.dtype}")
    lut = rounding == "bnb_cpu"
    flat_g = g.reshape(-1).float().contiguous()
    fn = cpukernel.load() if p.device.type == "cpu" else None
    if fn is not None:
        cpukernel.run(fn, p.view(-1), flat_g, (m_q, m_s, v_q, v_s), h.contiguous(), tables(p.device, rounding, True),
                      lut)
    else:
        torch_update(p.view(-1), flat_g, (m_q, m_s, v_q, v_s), h, (*tables(p.device, rounding), lut))


def torch_update(flat_p: torch.Tensor, flat_g: torch.Tensor, moments: tuple, h: torch.Tensor, maps: tuple) -> None:
    """The update in torch: whole blocks through the compiled kernel in chunks (rows marked dynamic, so one
    compilation serves every tensor), a last partial block eagerly."""
    m_q, m_s, v_q, v_s = moments
    n, full = flat_p.numel(), flat_p.numel() // BLOCK * BLOCK
    for start in range(0, full, CHUNK):
        end = min(start + CHUNK, full)
        rows = (end - start) // BLOCK
        tensors = (flat_p[start:end].view(rows, BLOCK), flat_g[start:end].view(rows, BLOCK),
                   m_q[start:end].view(rows, BLOCK), m_s[start // BLOCK:end // BLOCK],
                   v_q[start:end].view(rows, BLOCK), v_s[start // BLOCK:end // BLOCK])
        for t in tensors:
            torch._dynamo.maybe_mark_dynamic(t, 0)
        KERNEL.run(flat_p.device, *tensors, h, *maps)
    if full < n:  # the last partial block
        _blocks_update(flat_p[full:].view(1, -1), flat_g[full:].view(1, -1), m_q[full:].view(1, -1), m_s[-1:],
                       v_q[full:].view(1, -1), v_s[-1:], h, *maps)


def step_fp32(p: torch.Tensor, g: torch.Tensor, state: dict[str, torch.Tensor], h: torch.Tensor) -> None:
    """The same step with fp32 moments (tensors under MIN_8BIT elements), bitsandbytes' 32-bit update."""
    decay, step_size, c2, eps, b1, a1, b2, a2, coef = h.unbind()
    g = g.float() * coef
    m, v = state["exp_avg"], state["exp_avg_sq"]
    m.mul_(b1).add_(a1 * g)
    v.mul_(b2).add_(a2 * (g * g))
    p.mul_(decay).add_(step_size * (m / (v.sqrt() / c2 + eps)))


def step_tensor(p: torch.Tensor, g: torch.Tensor, state: dict[str, torch.Tensor], h: torch.Tensor,
                rounding: str = "nearest") -> None:
    """One step of p (fp32, in place) by whichever moments its state holds."""
    if "exp_avg" in state:
        step_fp32(p, g, state, h)
    else:
        update(p, g, state, h, rounding)


class AdamW8bit(torch.optim.Optimizer):
    """8-bit AdamW as a torch optimizer (the head, the embedding, the norms and LoRA's tensors): the
    same update as the streamed blocks'. Parameters of any float dtype are stepped in fp32 and copied
    back. Its state dict holds tensors and numbers only (a checkpoint reads it with weights_only).
    `rounding="bnb_cpu"` requantizes as bitsandbytes' CPU kernel does (to compare with it)."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, rounding: str = "nearest"):
        self.rounding = check_rounding(rounding)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's loader casts every state tensor of a float parameter to its dtype: the codes go back to uint8
        (exactly: they are 0..255)."""
        super().load_state_dict(state_dict)
        for state in self.state.values():
            for k in ("exp_avg_q", "exp_avg_sq_q"):
                if k in state:
                    state[k] = state[k].to(torch.uint8)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state.update(new_state(p.shape, p.device))
                state["step"] += 1
                h = hyper(group["lr"], group["betas"], group["eps"], group["weight_decay"], int(state["step"]), 1.0,
                          p.device)
                in_place = p.dtype == torch.float32 and p.is_contiguous()
                work = p.detach() if in_place else p.detach().float().contiguous()
                step_tensor(work, p.grad, {k: v for k, v in state.items() if k != "step"}, h, self.rounding)
                if not in_place:
                    p.detach().copy_(work)
        return loss
