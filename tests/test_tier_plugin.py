"""A tier defined here alone, registered through phantom.stream.tiers, trains like the resident model
and the cost model plans it from what the tier declares.

The tier serves blocks from an in-memory object store (one `bytes` object per block, as a remote store's
GET would return) with a per-read latency. Nothing in phantom names it: placement, the scheduler, the
transfer stage, the trace and the cost model read it from the tier interface. The tiny preset's
shapes, synthetic fp32 weights; about two seconds.
"""
from __future__ import annotations

import json
import threading
import time

import pytest
import torch

import phantom
from phantom.arch.presets import preset
from phantom.files.store import BlockStore
from phantom.convert.synthetic import write_synthetic
from phantom.plan import costinputs as ci, costmodel as cm
from phantom.stream import tiers
from phantom.stream.placement import Activations, Placement
from conftest import batch, max_rel_err, randomize_lora

CFG = preset("tiny")
B, T, STEPS = 2, 16, 3
LATENCY = 1e-3  # seconds per read: small, so the test stays fast; the cost model is checked at larger ones
NAME = "objstore"


class ObjectStoreTier(tiers.Tier):
    """Blocks held as immutable objects in an in-memory key-value store, fetched whole with a latency."""

    name = NAME
    lane = "object-store"

    def __init__(self, latency_s: float, gbps: float = 2.0, capacity: int = 0):
        self.latency_s, self.gbps, self.capacity = latency_s, gbps, capacity
        self.gets = 0
        self._lock = threading.Lock()

    def read_s(self, nbytes: int, profile) -> float:
        return self.latency_s + nbytes / (self.gbps * 1e9)

    def budget(self, free) -> int:
        return self.capacity  # bytes the store may hold for an `offload="auto"` run (0: only when named)

    def host_bytes(self, n_blocks: int, block_bytes: int, shared: bool, host_is_device: bool) -> int:
        return n_blocks * block_bytes  # the objects live in this process's memory

    def open(self, ctx: tiers.TierContext, blocks: list[int]) -> tiers.Held:
        return ObjectStoreHeld(self, ctx, blocks)


class ObjectStoreHeld(tiers.Held):
    def __init__(self, tier: ObjectStoreTier, ctx: tiers.TierContext, blocks: list[int]):
        super().__init__(tier, ctx)
        self.objects: dict[int, bytes] = {}
        for i in blocks:  # "upload": each block's bytes become one object
            buf = torch.empty(ctx.store.block_nbytes, dtype=torch.uint8)
            ctx.store.read_block_into(i, buf)
            self.objects[i] = bytes(buf.numpy())

    def read_into(self, block: int, into: torch.Tensor):
        time.sleep(self.tier.latency_s)
        into.copy_(torch.frombuffer(bytearray(self.objects[block]), dtype=torch.uint8))
        with self.tier._lock:
            self.tier.gets += 1
        return None  # the object store's own integrity is not phantom's to check here


@pytest.fixture
def objstore():
    tier = tiers.register(ObjectStoreTier(LATENCY))
    yield tier
    tiers.unregister(NAME)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return write_synthetic(tmp_path_factory.mktemp("plugin") / "tiny", CFG, torch.float32, seed=3, progress=False)


def train(model, steps: int = STEPS) -> tuple[list[float], dict[str, torch.Tensor], list[dict]]:
    """LoRA training with AdamW: each step's loss, the last step's LoRA gradients, each step's metrics."""
    randomize_lora(model)
    opt = torch.optim.AdamW(model.trainable_parameters(), lr=1e-2)
    losses, metrics = [], []
    if model.scheduler is not None:
        model.scheduler.take_metrics()
    for k in range(steps):
        opt.zero_grad()
        tokens, targets = batch(CFG, B, T, seed=k)
        loss = model(tokens, targets=targets)
        loss.backward()
        losses.append(loss.item())
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        opt.step()
        if model.scheduler is not None:
            metrics.append(model.scheduler.take_metrics())
    return losses, grads, metrics


@pytest.fixture(scope="module")
def resident(store):
    with phantom.load(store, offload="none") as model:
        return train(model)


@pytest.mark.parametrize("prefetch", [0, 1])
def test_a_registered_tier_trains_streamed_equal_to_resident(store, resident, objstore, prefetch, tmp_path):
    ref_losses, ref_grads, _ = resident
    with phantom.load(store, offload=NAME, prefetch=prefetch, trace=True) as model:
        sched = model.scheduler
        assert sched.tiers == (NAME,) * CFG.n_layers and sched.layout.streamed == tuple(range(CFG.n_layers))
        losses, grads, metrics = train(model)
        sched.tracer.write(tmp_path / "trace.json")
    for got, ref in zip(losses, ref_losses):
        assert abs(got - ref) <= 1e-6 * max(1.0, abs(ref))
    assert grads.keys() == ref_grads.keys() and grads
    for name in grads:
        assert max_rel_err(grads[name], ref_grads[name]) <= 1e-6, name
    nbytes = BlockStore(store).block_nbytes
    loads = metrics[-1]["loads"]
    assert loads > 0 and metrics[-1]["bytes_read"] == loads * nbytes  # counted as reads, not RAM copies
    assert objstore.gets >= STEPS * loads
    trace = json.loads((tmp_path / "trace.json").read_text())
    lane = {e["args"]["name"]: e["tid"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert "object-store" in lane
    assert sum(e["ph"] == "X" and e["tid"] == lane["object-store"] for e in trace["traceEvents"]) == objstore.gets


def test_auto_fills_a_registered_tier_by_its_budget_between_ram_and_disk(store, resident):
    """RAM by its budget, then the registered tier by the budget it declares, then disk: the run trains
    like the resident model and reads the bytes the cost model plans for that layout."""
    nbytes = BlockStore(store).block_nbytes
    tier = tiers.register(ObjectStoreTier(LATENCY, capacity=nbytes + nbytes // 2))  # room for one block
    try:
        place = Placement(offload="auto", prefetch=0, ram_budget=nbytes + nbytes // 2)
        with phantom.load(store, placement=place) as model:
            # one slot: the streamed blocks' ends are read once a step, so disk takes them
            assert model.scheduler.tiers == ("disk", "ram", NAME, "disk") and model.scheduler.offload == "mixed"
            losses, grads, metrics = train(model)
            gets = tier.gets
            train(model, steps=1)
            gets = tier.gets - gets
        planned = plan(place, free_host=1 << 40)
    finally:
        tiers.unregister(NAME)
    ref_losses, ref_grads, _ = resident
    assert losses == pytest.approx(ref_losses, rel=1e-6, abs=1e-6)
    for name in ref_grads:
        assert max_rel_err(grads[name], ref_grads[name]) <= 1e-6, name
    assert planned.tiers == ("disk", "ram", NAME, "disk")
    assert planned.layout.loads() == {"disk": 2, "ram": 0, NAME: 2} and gets == 2  # forward and backward
    assert planned.bytes_read == metrics[-1]["bytes_read"] == 4 * nbytes and planned.loads == metrics[-1]["loads"]
    assert metrics[-1]["bytes_ram"] == 2 * nbytes  # the RAM tier used in place, forward and backward


def plan(placement: Placement, free_host: int | None = None) -> cm.Prediction:
    shape = ci.shape_of(CFG, "fp32", "fp32", seq_len=T)
    profile = ci.MachineProfile(machine="test", device="cpu", dtype="fp32", fwd_flops=20e9, disk_gbps=1.0,
                                free_host_bytes=free_host)
    return cm.predict(profile, shape, placement, Activations(recompute="all"), rows=B)


def test_the_cost_model_plans_a_registered_tier_from_its_declared_latency(store, objstore):
    """The plan's block loads are the run's, each costs the tier's latency and rate (a CPU reads into the
    slot: no copy after), and doubling the latency adds one latency per load to the predicted step."""
    place = Placement(offload=NAME, prefetch=0)
    first = plan(place)
    block = ci.shape_of(CFG, "fp32", "fp32", seq_len=T).block_bytes
    assert first.tiers == (NAME,) * CFG.n_layers and first.split[NAME] == CFG.n_layers
    assert first.transfer_s == pytest.approx(first.loads * (LATENCY + block / 2e9), rel=1e-12)
    with phantom.load(store, offload=NAME, prefetch=0) as model:
        assert model.scheduler.tiers == first.tiers
        _, _, metrics = train(model, steps=2)
    assert first.loads == metrics[-1]["loads"] and first.bytes_read == metrics[-1]["bytes_read"]

    tiers.register(ObjectStoreTier(2 * LATENCY), replace=True)
    second = plan(place)
    assert second.step_s - first.step_s == pytest.approx(first.loads * LATENCY, rel=1e-9)
    assert second.transfer_s == pytest.approx(first.loads * (2 * LATENCY + block / 2e9), rel=1e-12)

    tiers.register(ObjectStoreTier(1.0), replace=True)  # a second per read: the step waits on the tier
    slow = plan(Placement(offload=NAME, prefetch=1))
    assert slow.bound == "disk" and slow.step_s >= slow.loads * 1.0

    on_disk = plan(Placement(offload="disk", prefetch=0), free_host=1 << 40)
    held = plan(place, free_host=1 << 40)
    assert 0 <= held.host_bytes - on_disk.host_bytes - CFG.n_layers * block < 4096  # the objects' memory


def test_full_finetuning_refuses_a_tier_that_cannot_take_updates_when_it_opens(store, objstore, tmp_path):
    """The object store has no Held.update: a full run is refused before its first step, not at its
    first update, and the tier's loader threads are stopped."""
    with pytest.raises(ValueError, match=f"the {NAME} tier cannot take updated weights"):
        phantom.load(store, offload=NAME, mode="full", work_dir=tmp_path / "work")
    assert objstore.gets == 0  # nothing was read for a run that cannot go on


def test_an_unregistered_tier_is_refused(store):
    with pytest.raises(ValueError, match="offload must be one of"):
        Placement(offload=NAME)
    with pytest.raises(ValueError, match="built-in"):
        tiers.register(type("Fake", (tiers.Tier,), {"name": "disk"})())
