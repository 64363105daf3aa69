"""What the cost model is given: a model's shape (`Shape`, from a `ModelConfig` alone: `shape_of`), a
machine's rates (`MachineProfile`, measured by phantom.plan.profiles or given by hand), and what one
block load costs at those rates in each tier (`LoadTimes`, from phantom.stream.tiers: a tier declares
its own rate). A profile measured on a few blocks predicts the whole model, and a preset can be planned
before its weights exist. No I/O, no clocks: every function here is a function of its arguments.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from phantom.arch import carry, dsa
from phantom.arch.config import ModelConfig, block_tensor_shapes
from phantom.arch.deltanet import mixer_flops
from phantom.arch.quantformat import QuantFormat, as_format, block_nbytes
from phantom.base import dtypes
from phantom.stream import placement as P
from phantom.stream import tiers as T

GB = 1e9

@dataclass(frozen=True)
class Workload:
    """What one training step computes: `rows` rows of `seq_len` tokens in the compute dtype, over a store
    in `store_dtype` (its linear weights quantized as `quant`: a store's QuantFormat, or "nf4" / "int8" for
    prepare_model.py's format of that method, or None)."""

    rows: int
    seq_len: int
    dtype: str = "bf16"
    store_dtype: str = "bf16"
    quant: str | QuantFormat | None = None

@dataclass(frozen=True)
class Shape:
    """What the cost model needs of a model, derived from its config and dtypes (see `shape_of`).

    block_bytes is one block in the store's dtype (what is read, and held in RAM); resident_bytes the
    same block in the compute dtype (a resident block); slot_bytes one device slot (store bytes plus
    the converted copy when the dtypes differ); tier_bytes the block size the scheduler budgets
    tiers with. flops_per_row is one block's forward over one row of seq_len tokens.
    """

    n_blocks: int
    block_bytes: int
    resident_bytes: int
    sizes: P.BlockBytes  # one block in each tier (phantom.stream.placement.block_sizes: the scheduler's rule)
    head_bytes: int
    embed_bytes: int
    flops_per_row: float
    head_flops_per_row: float
    act_bytes_per_row: int
    keep_bytes_per_row: int
    seq_len: int
    store_bytes: int  # the store's files: blocks, embedding, head (headers of a few KiB left out)
    dequant_bytes: int = 0  # a quantized store: the compute-dtype bytes each load dequantizes into
    moe_blocks: tuple[int, ...] = ()  # the blocks with experts (Placement.moe_base may keep their other weights)
    base_bytes: int = 0  # one such block's stored non-expert bytes: what a load reads less where they are kept
    graph_bytes_per_token: int = 0  # one block's graph and its backward's gradients at their peak, per token
    row_bytes_per_token: int = 0  # what a tiled block keeps at the row's full length, per token
    row_grad_bytes_per_token: int = 0  # and the gradients its attention's backward holds beside it, per token
    carry_bytes_per_row: int = 0  # state blocks hand to later ones, held through the step (phantom.arch.carry)
    chunk_bytes: int = 0  # a block's chunk of sparse attention at its peak (phantom.arch.dsa), where the row is sparse

    def kept(self) -> "Shape":
        """A load of a block whose attention, norms, router and shared experts the device keeps: experts alone."""
        return dataclasses.replace(self, block_bytes=self.block_bytes - self.base_bytes,
                                   dequant_bytes=max(0, self.dequant_bytes - self.sizes.base)
                                   if self.dequant_bytes else 0)

    @property
    def slot_bytes(self) -> int:
        return self.sizes.slot

    @property
    def tier_bytes(self) -> int:
        return self.sizes.budget

    @property
    def converts(self) -> bool:
        """Store and compute dtypes differ (or the store is quantized): the RAM tier is not used in place."""
        return self.sizes.converts

def keep_elems_per_token(cfg: ModelConfig) -> float:
    """Elements autograd saves per token for one block's graph (weights excluded).

    Fitted to the bytes `WeightHandles` counts for LoRA on q, v over five block shapes (dim 64-256,
    GQA and not, hidden 176-1024, seq 32-256; each within 3%): the norms' and projections' inputs
    (~8.5 dim), SwiGLU's three hidden-wide tensors, k and v. Attention runs as SDPA (flash): no
    T x T matrix is kept. A measured profile corrects it by its `keep_scale`.
    """
    hyper = 6 * cfg.hc_mult * cfg.dim  # DeepSeek-V4's two hyper-connections: the streams, their fp32 norm, the mix
    return 8.5 * cfg.dim + 3 * cfg.token_hidden_dim + 2 * cfg.kv_heads * cfg.head_dim + 16 + hyper

def grad_elems_per_token(cfg: ModelConfig) -> float:
    """Elements per token a block's backward holds beside its graph at their peak: the gradients of two of the
    MLP's hidden-wide tensors and of one model-wide tensor (a dim-512 block: 9.3 of the 35.8 model-width vectors a
    token that a LoRA step's peak memory grows by at rows of 4k-16k tokens untiled, notes/long-rows.md)."""
    return 2 * cfg.token_hidden_dim + cfg.dim


def row_elems_per_token(cfg: ModelConfig) -> float:
    """Elements per token a block keeps at the row's whole length when its token-wise parts run in chunks
    (phantom.arch.tiled: each part keeps only its input): q, k and v and the attention's output (what SDPA keeps:
    no T x T scores) and the MLP's input."""
    return attention_elems_per_token(cfg) + cfg.dim


def attention_elems_per_token(cfg: ModelConfig) -> float:
    """q, k, v and attention's output per token; as many gradients are held at full length in its backward (a
    tiled LoRA step on a 7B-shaped 2-block store grows by 13.1 model-width vectors a token between 8k and 16k
    tokens: 2 stored inputs, the output and its gradient, these 8 and the MLP's input, notes/long-rows.md)."""
    return 2 * cfg.n_heads * cfg.head_dim + 2 * cfg.kv_heads * cfg.head_dim


def shape_of(cfg: ModelConfig, store_dtype: str = "bf16", dtype: str = "bf16", seq_len: int = 1024,
             quant: str | QuantFormat | None = None) -> Shape:
    """The cost model's view of a model from its config alone: no store needed. quant (a QuantFormat, or
    "nf4" / "int8" as prepare_model.py writes them): a quantized store of it (its other tensors in
    store_dtype), its block bytes counted by the store's own layout rule, dequantized into `dtype` at
    each load."""
    stored, computed = dtypes.lookup(store_dtype), dtypes.lookup(dtype)
    s, c = stored.itemsize, computed.itemsize
    fmt = as_format(quant)
    # dense layers among a mixture of experts' sparse ones: reads, compute and the tiers count the blocks'
    # mean, the slots the largest block
    per_block = [(cfg.block_params(i), cfg.block_params(i) * s if fmt is None else
                  block_nbytes(fmt, block_tensor_shapes(cfg, i), stored.torch_name))
                 for i in (range(cfg.n_layers) if cfg.mixed_layers else (None,))]
    largest_params, largest = max(per_block)
    params = round(sum(p for p, _ in per_block) / len(per_block))
    block = round(sum(b for _, b in per_block) / len(per_block))
    head_params = cfg.vocab_size * cfg.dim + cfg.dim
    embed_params = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.dim  # tied: the head's table is it
    moe = tuple(i for i in range(cfg.n_layers) if cfg.sparse(i))
    # the rest of a sparse block beside its experts (the device keeps it: Placement.moe_base): the most parameters
    # on the device, the mean bytes a load no longer reads (linear attention's blocks among full attention's)
    bases = [{n: sh for n, sh in block_tensor_shapes(cfg, i).items() if not n.startswith("feed_forward.experts.")}
             for i in moe]
    base_params = max((sum(math.prod(sh) for sh in b.values()) for b in bases), default=0)
    base_stored = round(sum(sum(math.prod(sh) for sh in b.values()) * s if fmt is None else
                            block_nbytes(fmt, b, stored.torch_name) for b in bases) / len(bases)) if moe else 0
    return Shape(
        n_blocks=cfg.n_layers, block_bytes=block, resident_bytes=params * c, moe_blocks=moe, base_bytes=base_stored,
        sizes=dataclasses.replace(P.block_sizes(largest, largest_params, s, c, quant is not None, stored == computed),
                                  base=base_params * c),
        head_bytes=head_params * c, embed_bytes=embed_params * s,
        # matmuls (a mixture of experts: the experts a token routes to) + causal attention (or the delta rule)
        flops_per_row=seq_len * (2 * cfg.mean_block_params(active=True) + mixer_flops(cfg, seq_len)),
        head_flops_per_row=seq_len * 4 * cfg.vocab_size * cfg.dim,  # logits and their input gradient
        act_bytes_per_row=seq_len * cfg.dim * max(1, cfg.hc_mult) * c,  # DeepSeek-V4: hc_mult streams a token
        keep_bytes_per_row=int(seq_len * c * keep_elems_per_token(cfg)),
        seq_len=seq_len,
        graph_bytes_per_token=int(c * (keep_elems_per_token(cfg) + grad_elems_per_token(cfg))),
        row_bytes_per_token=int(c * row_elems_per_token(cfg)),
        row_grad_bytes_per_token=int(c * attention_elems_per_token(cfg)),
        carry_bytes_per_row=seq_len * carry.bytes_per_token(cfg, seq_len),
        chunk_bytes=2 * dsa.CHUNK_BYTES if cfg.index_topk and seq_len > cfg.index_topk else 0,
        store_bytes=cfg.n_layers * block + (head_params + embed_params) * s,
        dequant_bytes=params * c if quant is not None else 0)

@dataclass(frozen=True)
class MachineProfile:
    """A machine's rates, independent of the model (seconds, bytes, GB/s = 1e9 bytes/s, FLOP/s).

    Block compute is `call + rows * flops_per_row / rate` for each kind of call: the no-grad
    forward at `fwd_flops`, the graph-building forward (a kept block, or the recompute) and the
    backward at `fwd_flops / fwd_grad_ratio` and `fwd_flops / bwd_ratio`. `keep_scale` corrects the
    config's estimate of kept activation bytes. `compile_speedup` (eager / compiled block time) and
    `compile_s` are not measured by the tuner (None); a profile that gives them has compiled rows
    predicted with the speed-up. Free bytes of None mean: unknown, not a limit.
    """

    machine: str
    device: str  # "cuda", "cpu", "mps"
    dtype: str = "bf16"
    disk_gbps: float = 2.0  # cold reads (the page cache does not help a store larger than it)
    disk_warm_gbps: float | None = None
    disk_request_s: float | None = None  # a cold read request's cost beside its bytes (routed experts; None: the tier's)
    h2d_gbps: float = 25.0  # pinned host -> device (on a CPU: a host memcpy)
    dequant_gbps: float = 4.0  # quantized stores: compute-dtype GB/s dequantized (profiles.measure_dequant)
    fwd_flops: float = 100e12
    fwd_grad_ratio: float = 1.0
    bwd_ratio: float = 1.0  # LoRA: input gradients only, about the forward's FLOPs
    fwd_call_s: float = 0.0
    fwd_grad_call_s: float = 0.0
    bwd_call_s: float = 0.0
    head_flops: float | None = None  # None: at fwd_flops
    keep_scale: float = 1.0
    disk_jitter: float = 0.0  # relative spread of one block read (profiles.relative_spread)
    busy_compute_slowdown: float = 1.0  # compute while blocks are read / alone
    busy_read_slowdown: float = 1.0  # reads while a block computes / alone
    compile_speedup: float | None = None
    compile_s: float | None = None
    free_device_bytes: int | None = None
    free_host_bytes: int | None = None
    free_disk_bytes: int | None = None
    quick: bool = False
    measured_on: str = ""  # the shape the rates were measured on ("" when given by hand)
    measured_at: str = ""
    datasheet: str = ""  # the card whose datasheet gave the rates (phantom.plan.gpusheets): not measured

    @property
    def host_is_device(self) -> bool:
        """A CPU: blocks compute in host memory, so device and host are one pool."""
        return self.device == "cpu"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "MachineProfile":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

@dataclass(frozen=True)
class LoadTimes:
    """Seconds one block load takes: read by its tier (phantom.stream.tiers.Tier.read_s; 0 for a tier
    that holds the block in host memory), copied over the link, dequantized (on a CPU by the compute's
    threads, not the loader: `compute_dequant_s`)."""

    read_s: dict[str, float]  # by tier name
    link_s: float
    dequant_s: float
    host_is_device: bool

    @classmethod
    def of_block(cls, profile: MachineProfile, shape: Shape, tiers, warm: bool) -> "LoadTimes":
        """A block of shape at the profile's rates, for each of `tiers`; `warm`: the page cache holds the
        disk tier's files (its reads run at the warm disk rate)."""
        rates = dataclasses.replace(profile, disk_gbps=profile.disk_warm_gbps) if warm else profile
        return cls(read_s={t: T.get(t).read_s(shape.block_bytes, rates) for t in set(tiers)},
                   link_s=shape.block_bytes / (profile.h2d_gbps * GB),
                   dequant_s=shape.dequant_bytes / (profile.dequant_gbps * GB), host_is_device=profile.host_is_device)

    def of(self, tier: str) -> float:
        """X of a block of this tier, the loader's: a CPU reads a reading tier's block straight into its slot (no
        copy) and leaves the dequantization to the compute."""
        copy = 0.0 if T.get(tier).reads and self.host_is_device else self.link_s
        return self.read_s.get(tier, 0.0) + copy + (0.0 if self.host_is_device else self.dequant_s)

    @property
    def compute_dequant_s(self) -> float:
        """Seconds of a load's dequantization on the compute's threads (a CPU's; a device's is the loader's)."""
        return self.dequant_s if self.host_is_device else 0.0
