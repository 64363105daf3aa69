"""Adapter lanes: several LoRA adapters trained on one read of the weights.

An `Adapter` is one LoRA's copy of the block modules (base weights as placeholders, bound to the same
loaded tensors as every other adapter's; its own LoRA parameters) and its own dropout RNG. A forward
is given `Lane`s: consecutive row ranges of the batch, each run through its adapter's blocks. The
executor (and the resident backend) run each loaded block over every lane's micro-batches before it is
released, so K adapters cost one read of the weights per step. Each lane's rows are split into
micro-batches on their own, as its own run splits them, and each adapter's dropout draws from its own
stream, as its own run draws from the global RNG: an adapter's numbers are its own run's.
Imports torch only.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn as nn


class RngStream:
    """An adapter's dropout stream: the CPU (and CUDA) generator state its own run would have, swapped
    into the global generators around its micro-batches and saved back after them."""

    def __init__(self, device: torch.device, cpu: torch.Tensor, cuda: torch.Tensor | None = None):
        self.device, self.cpu, self.cuda = device, cpu, cuda

    @classmethod
    def capture(cls, device: torch.device) -> "RngStream":
        """The global generators' state now (what a run's first dropout would draw from)."""
        return cls(device, torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None)

    @classmethod
    def seeded(cls, device: torch.device, seed: int) -> "RngStream":
        """The state torch.manual_seed(seed) gives, without touching the global generators."""
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else [], device_type="cuda"):
            torch.manual_seed(seed)
            return cls.capture(device)

    def copy(self) -> "RngStream":
        return RngStream(self.device, self.cpu.clone(), None if self.cuda is None else self.cuda.clone())

    @contextlib.contextmanager
    def active(self):
        """The global generators draw from this stream until the `with` ends (then this stream keeps
        where they got to, and the global ones are put back)."""
        cpu, cuda = torch.get_rng_state(), torch.cuda.get_rng_state(self.device) if self.cuda is not None else None
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)
        try:
            yield
        finally:
            self.cpu = torch.get_rng_state()
            torch.set_rng_state(cpu)
            if self.cuda is not None:
                self.cuda = torch.cuda.get_rng_state(self.device)
                torch.cuda.set_rng_state(cuda, self.device)


@dataclass(eq=False)
class Adapter:
    """One adapter of a multi-adapter model: its name, LoRA config, block modules and dropout stream."""

    name: str
    lora: object  # phantom.model.lora.LoraConfig, named as the family's modules
    layers: nn.ModuleList
    rng: RngStream

    def __post_init__(self):
        self.dropout = any(isinstance(m, nn.Dropout) for m in self.layers.modules())

    def trained(self, i: int) -> list[nn.Parameter]:
        """Block i's LoRA parameters."""
        return [p for n, p in self.layers[i].named_parameters() if "lora_" in n]

    def parameters(self) -> list[nn.Parameter]:
        return [p for n, p in self.layers.named_parameters() if "lora_" in n]

    def rng_for(self, streams: dict | None = None):
        """The dropout stream to draw from (a replay's copy in `streams` where given); none without dropout."""
        if not self.dropout:
            return contextlib.nullcontext()
        return (streams[id(self)] if streams is not None else self.rng).active()


@dataclass(frozen=True, eq=False)
class Lane:
    """`rows` consecutive rows of a forward's batch, run through `adapter`'s blocks."""

    adapter: Adapter
    rows: int


def split_rows(x: torch.Tensor, lanes: list[Lane] | None, micro_batch: int | None) -> list[torch.Tensor]:
    """x's micro-batches: each lane's rows split on their own (no micro-batch spans two lanes)."""
    if lanes and sum(lane.rows for lane in lanes) != x.shape[0]:
        raise ValueError(f"the lanes hold {sum(lane.rows for lane in lanes)} rows, the batch {x.shape[0]}")
    parts = x.split([lane.rows for lane in lanes]) if lanes else (x,)
    return [c for part in parts for c in (part.split(micro_batch) if micro_batch else (part,))]


def chunk_lanes(lanes: list[Lane] | None, micro_batch: int | None, total: int) -> list[Lane | None]:
    """The lane of each micro-batch split_rows gives (None for every one without lanes)."""
    if not lanes:
        return [None] * (-(-total // micro_batch) if micro_batch else 1)
    return [lane for lane in lanes for _ in range(-(-lane.rows // micro_batch) if micro_batch else 1)]


def replay_streams(lanes: list[Lane] | None) -> dict | None:
    """Copies of the lanes' dropout streams as a block's forward starts (its recompute replays them)."""
    if not lanes or not any(lane.adapter.dropout for lane in lanes):
        return None
    return {id(lane.adapter): lane.adapter.rng.copy() for lane in lanes}


def bind_shared(block: nn.Module, source: nn.Module) -> None:
    """Give `block` (an adapter's copy of a resident block) the base weights `source` holds: the same
    tensors, not copies (its LoRA parameters stay its own)."""
    for name, p in source.named_parameters():
        if "lora_" in name:
            continue
        owner, _, leaf = name.rpartition(".")
        module = block.get_submodule(owner) if owner else block
        if leaf in module._parameters:
            module._parameters[leaf] = p
        else:
            module.register_parameter(leaf, p)
    for name, b in source.named_buffers():
        owner, _, leaf = name.rpartition(".")
        (block.get_submodule(owner) if owner else block)._buffers[leaf] = b
