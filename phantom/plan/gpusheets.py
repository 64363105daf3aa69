"""A plan for a GPU that is not here: a `MachineProfile` derived from a card's datasheet figures.

`scripts/tune.py --gpu NAME` plans for one of the cards in `SHEETS` on a machine without it (this one has no GPU;
most machines a plan is made on have none). Nothing here is measured: each rate the cost model takes from a
measured profile is derived from the sheet by the cost terms the measured profile feeds, and says so:

- a block's forward: its FLOPs (ci.Shape.flops_per_row: the matmuls of the active weights and attention's
  scores and weighted values) at the datasheet's dense bf16 tensor rate times `UTILISATION`; a graph-building
  forward the same FLOPs; the backward of a LoRA block its input gradients (the matmuls' FLOPs again) and
  attention's backward at `ATTENTION_BACKWARD` times its forward (`backward_ratio`); no fixed cost per call;
- a host-to-device copy: the PCIe link's rate per direction (generation x lanes) times `LINK_SHARE`;
- a quantized load's dequantization: the stored bytes read and the compute dtype's written at the datasheet's
  memory bandwidth times `UTILISATION`;
- the disk: this machine's, measured (phantom.plan.profiles.probe_disk: the disk is local, the card is not);
- free device memory: the datasheet's (the plan keeps its 15% margin of it).

The profile names the card (`MachineProfile.datasheet`), the plan says it is not measured, and
phantom.plan.profiles refuses to save or load such a profile: `finetune.py --prefetch auto` measures the card
it runs on. Pure functions: no I/O.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from phantom.arch.config import ModelConfig
from phantom.arch.deltanet import mixer_flops
from phantom.plan import costinputs as ci

UTILISATION = 0.5  # the share of the datasheet's peak a block reaches: an assumption, not a measurement (the
# peak is a dense GEMM's at its best shape and clock; a block adds norms, RoPE, attention's softmax and the
# casts between its matmuls); measure the card to replace it
ATTENTION_BACKWARD = 2.5  # attention's backward FLOPs over its forward's: FlashAttention-2 (Dao, 2023, section 4.1)
# counts 2.5x (the scores recomputed, then dP, dS, dQ, dK, dV: five T x T matmuls against the forward's two)
LINK_SHARE = 0.8  # the share of PCIe's rate a pinned copy reaches: an assumption, not a measurement (each
# packet's header and the link's flow control take the rest); measure the card to replace it
PCIE_GTS = {3: 8.0, 4: 16.0, 5: 32.0}  # PCI Express base specifications 3.0, 4.0, 5.0: GT/s per lane and direction
PCIE_ENCODING = 128 / 130  # the same specifications' 128b/130b line code: data bits per transferred bit
GIB = 1 << 30


@dataclass(frozen=True)
class GpuSheet:
    """A card's datasheet figures the cost model needs: memory, dense bf16 tensor rate (no sparsity), memory
    bandwidth, and its host link (PCIe generation and lanes)."""

    name: str
    memory_gib: int
    bf16_tflops: float
    memory_gbps: float
    pcie_gen: int
    pcie_lanes: int = 16

    @property
    def link_gbps(self) -> float:
        """The host link's rate per direction, GB/s: lanes x GT/s x the line code's share, 8 bits a byte."""
        return self.pcie_lanes * PCIE_GTS[self.pcie_gen] * PCIE_ENCODING / 8

    def describe(self) -> str:
        return (f"{self.name}: {self.memory_gib} GB, {self.bf16_tflops:g} TFLOP/s dense bf16, "
                f"{self.memory_gbps:,.0f} GB/s memory, PCIe {self.pcie_gen}.0 x{self.pcie_lanes}")


SHEETS = {
    # NVIDIA Ampere GA102 GPU Architecture whitepaper, appendix A (GeForce RTX 3090): peak BF16 tensor TFLOPS with
    # FP32 accumulate 71 (142 with sparsity), 24 GB GDDR6X, 936 GB/s, PCIe Gen 4
    "rtx3090": GpuSheet("NVIDIA GeForce RTX 3090", 24, 71.0, 936.0, 4),
    # NVIDIA Ada GPU Architecture whitepaper, appendix A (GeForce RTX 4090): peak BF16 tensor TFLOPS with FP32
    # accumulate 165.2 (330.4 with sparsity), 24 GB GDDR6X, 1008 GB/s, PCIe Gen 4
    "rtx4090": GpuSheet("NVIDIA GeForce RTX 4090", 24, 165.2, 1008.0, 4),
    # NVIDIA L4 Tensor Core GPU datasheet: BF16 tensor core 242 TFLOPS with sparsity (121 dense), 24 GB GDDR6,
    # 300 GB/s, PCIe Gen4 x16
    "l4": GpuSheet("NVIDIA L4", 24, 121.0, 300.0, 4),
    # NVIDIA A100 Tensor Core GPU datasheet: BF16 tensor core 312 TFLOPS (624 with sparsity); A100 40GB PCIe
    # 1,555 GB/s; A100 80GB PCIe 1,935 GB/s; PCIe Gen4 (64 GB/s both directions together)
    "a100-40gb": GpuSheet("NVIDIA A100 40GB PCIe", 40, 312.0, 1555.0, 4),
    "a100-80gb": GpuSheet("NVIDIA A100 80GB PCIe", 80, 312.0, 1935.0, 4),
    # NVIDIA H100 Tensor Core GPU datasheet: BF16 tensor core 1,979 TFLOPS (SXM) and 1,513 (PCIe) with sparsity,
    # half that dense; 80 GB; 3.35 TB/s (SXM) and 2 TB/s (PCIe); PCIe Gen5 (128 GB/s both directions together)
    "h100-sxm": GpuSheet("NVIDIA H100 SXM", 80, 989.5, 3350.0, 5),
    "h100-pcie": GpuSheet("NVIDIA H100 PCIe", 80, 756.5, 2000.0, 5),
}


def _key(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def sheet(name: str) -> GpuSheet:
    """The sheet of a card named as in SHEETS (case, spaces and dashes aside: "RTX 4090", "rtx-4090").

    Raises:
        ValueError: an unknown name; the message lists the known ones.
    """
    found = {_key(k): s for k, s in SHEETS.items()}.get(_key(name))
    if found is None:
        raise ValueError(f"no datasheet for a GPU named {name!r}: known are {', '.join(SHEETS)}")
    return found


def backward_ratio(cfg: ModelConfig, seq_len: int) -> float:
    """A LoRA block's backward FLOPs over its forward's at rows of seq_len tokens: the matmuls' input gradients
    (their forward FLOPs again: the frozen weights take no gradient) and attention's backward at
    ATTENTION_BACKWARD times its forward (the mixer's FLOPs as ci.shape_of counts them)."""
    matmuls, mixer = 2 * cfg.mean_block_params(active=True), mixer_flops(cfg, seq_len)
    return (matmuls + ATTENTION_BACKWARD * mixer) / (matmuls + mixer)


@dataclass(frozen=True)
class DiskRates:
    """This machine's disk as the disk tier reads it (phantom.plan.profiles.disk_rates): cold GB/s, one read's
    relative spread, a read request's seconds beside its bytes (None: the tier's default)."""

    gbps: float
    jitter: float = 0.0
    request_s: float | None = None


def derive(card: GpuSheet, cfg: ModelConfig, work: ci.Workload, disk: DiskRates,
           free_host_bytes: int | None) -> ci.MachineProfile:
    """The profile of `card` for `work` on `cfg`'s blocks, from its datasheet (see the module's docstring)."""
    shape = ci.shape_of(cfg, work.store_dtype, work.dtype, work.seq_len, work.quant)
    written = shape.dequant_bytes  # dequantize: read the stored bytes, write the compute dtype's
    dequant = card.memory_gbps * UTILISATION * written / (written + shape.block_bytes) if written else \
        ci.MachineProfile.dequant_gbps  # (a 16-bit store dequantizes nothing)
    return ci.MachineProfile(
        machine=f"datasheet-{_key(card.name)}", device="cuda", dtype=work.dtype, disk_gbps=disk.gbps,
        disk_jitter=disk.jitter, disk_request_s=disk.request_s, h2d_gbps=card.link_gbps * LINK_SHARE,
        dequant_gbps=dequant, fwd_flops=card.bf16_tflops * 1e12 * UTILISATION, fwd_grad_ratio=1.0,
        bwd_ratio=backward_ratio(cfg, work.seq_len), free_device_bytes=card.memory_gib * GIB,
        free_host_bytes=free_host_bytes, datasheet=card.name)


def describe_derivation(card: GpuSheet, profile: ci.MachineProfile) -> str:
    """The line a plan prints under it: where each rate came from."""
    return (f"datasheet  {card.describe()}; not measured: block compute {UTILISATION:.0%} of its bf16 rate "
            f"(backward {profile.bwd_ratio:.2f}x the forward), host-to-device {LINK_SHARE:.0%} of "
            f"{card.link_gbps:.1f} GB/s, the disk measured here; run tune.py on the GPU to measure it")
