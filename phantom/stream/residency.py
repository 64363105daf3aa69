"""Where a run's blocks wait between uses: the layout resolved from the store and the free memory,
and each tier opened to hold its blocks (the RAM tier read in, the device tier loaded once).

The block scheduler (phantom.stream.scheduler) streams through device slots what this holds; a tier's
own behaviour is phantom.stream.tiers', so a tier added there is held here without a change.
"""
from __future__ import annotations

import dataclasses
import logging

import torch

from phantom.files.store import BlockStore
from phantom.stream import placement as P
from phantom.stream import tiers as T
from phantom.stream.memory import free_memory
from phantom.stream.placement import Placement
from phantom.stream.trace import Metrics
from phantom.stream.transfer import Transfer

log = logging.getLogger(__name__)


def resolve_layout(store: BlockStore, device: torch.device, dtype: torch.dtype, placement: Placement,
                   zero_copy: bool | None, device_reserve: int) -> P.Layout:
    """The run's layout (phantom.stream.placement.resolve) from this store's block sizes and the free memory."""
    sizes = P.block_sizes(store.block_nbytes, store.dense_nbytes // store.dtype.itemsize, store.dtype.itemsize,
                          dtype.itemsize, store.quant is not None, dtype == store.dtype)
    moe, base_params = moe_bases(store)
    sizes = dataclasses.replace(sizes, base=base_params * dtype.itemsize)
    free = free_memory(device, shared=placement.shared_ram, reserve=device_reserve)
    layout = P.resolve(store.n_blocks, sizes, placement, free, host_is_device=device.type == "cpu",
                       in_place=zero_copy, moe_blocks=moe)
    ram_cap = placement.ram_budget if placement.ram_budget is not None else P.ram_budget(free.host)
    if placement.offload == "auto" and "disk" in layout.tiers and ram_cap is not None and ram_cap < sizes.budget:
        log.warning("RAM budget of %.1f MiB is smaller than one block (%.1f MiB): no RAM tier, the %d blocks "
                    "off the device are read from disk at each use; give --ram-budget at least %.0fM for one",
                    ram_cap / 2**20, sizes.budget / 2**20, layout.tiers.count("disk"), -(-sizes.budget // 2**20))
    return layout


def moe_bases(store: BlockStore) -> tuple[tuple[int, ...], int]:
    """The blocks with experts, and the most parameters one of them has beside its experts (attention or linear
    attention, norms, router, shared experts: what `Placement.moe_base` keeps on the device); ((), 0) for a
    dense model."""
    cfg = store.cfg
    moe = tuple(i for i in range(store.n_blocks) if cfg.n_experts and cfg.sparse(i))
    kinds = {store.layout_index(i): i for i in moe}  # one block of each layout (linear attention among full)
    return moe, max((sum(t.numel() for n, t in store.dense_like(i).items() if not n.startswith("feed_forward.experts."))
                     for i in kinds.values()), default=0)


class Residency:
    """Each tier of a layout holding its blocks for a run (phantom.stream.tiers.Tier.open), and what the
    scheduler asks of them: a block's source for a slot, its weights where it is computed without a
    slot, its host copy, its new values (full finetuning).

    The device tier is opened last: its loader slot is gone before the streaming slots come.
    """

    def __init__(self, store: BlockStore, layout: P.Layout, transfer: Transfer, metrics: Metrics,
                 shared_ram: bool, dtype: torch.dtype, device: torch.device):
        self.store, self.layout = store, layout
        ctx = T.TierContext(store=store, transfer=transfer, metrics=metrics, dtype=dtype, device=device,
                            shared=shared_ram)
        names = sorted(set(layout.tiers), key=lambda t: t == "device")
        self.held: dict[str, T.Held] = {}
        try:
            for name in names:
                self.held[name] = T.get(name).open(ctx, [i for i, t in enumerate(layout.tiers) if t == name])
        except BaseException:
            self.close()
            raise
        self.pinned_bytes = sum(h.pinned_bytes for h in self.held.values())

    def source(self, block: int) -> T.Held:
        """What holds the block (its tier's Held)."""
        return self.held[self.layout.tiers[block]]

    def tier(self, block: int) -> T.Tier:
        return self.source(block).tier

    def host(self, block: int) -> torch.Tensor | None:
        """The block's bytes in host memory, where its tier keeps them (the RAM tier)."""
        return self.source(block).host(block)

    def views(self, block: int) -> dict[str, torch.Tensor]:
        """A block that does not stream: its weights where it is computed (device tier, RAM in place)."""
        return self.source(block).views(block)

    def host_weights(self, block: int) -> dict[str, torch.Tensor]:
        """Block's weights in host memory: the RAM tier's views, or read from the store."""
        host = self.host(block)
        return self.store.block_views(host, block) if host is not None else self.store.load_block(block)

    def update(self, block: int, tensors: dict[str, torch.Tensor], non_blocking: bool) -> None:
        """New values of a block into what its tier holds (the store's file is the caller's)."""
        self.source(block).update(block, tensors, non_blocking)

    def close(self) -> None:
        for held in self.held.values():
            held.close()
