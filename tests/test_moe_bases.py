"""A streamed mixture-of-experts block's attention, norms, router and shared experts kept on the device
(`Placement.moe_base`): after a block's first load, each load reads its experts alone. Against the run that
streams them (the same bits: the kept copy is laid out so the same projections fuse), transformers' and peft's
figures through the models of tests/family_check.py (DeepSeek-V3 with latent attention, a dense first layer
and a shared expert; Qwen2-MoE with its gated shared expert), the bytes a step reads against the manifest and
the cost model, the placement rule, and the CUDA path's streams (tests/fake_cuda.py).
"""
from __future__ import annotations

import pytest
import torch

import phantom
from family_check import batch, lora_step, make, peft_step, prepare, rel_err
from fake_cuda import fake_cuda
from phantom.files.store import BlockStore
from phantom.plan import costinputs as ci, costmodel as cm
from phantom.stream import placement as P
from phantom.stream.experts import ExpertLayout
from phantom.stream.scheduler import BlockScheduler
from test_moe_routed import ram_streams  # noqa: F401  (a fixture: the RAM tier read into slots, as on CUDA)

NAMES = ("deepseek_v3", "qwen2_moe")
ATTENTION = ("q", "k", "v", "o")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for name in NAMES:
        model = make(name, **({"num_hidden_layers": 4} if name == "qwen2_moe" else {}))
        out[name] = model, prepare(model, tmp_path_factory.mktemp(name))
    return out


def few(b: int, t: int):
    """Tokens and targets, every one counted."""
    return batch(b, t)[0], batch(b, t, seed=1)[0]


def steps(store, n: int = 2, logits_pass: bool = True, **knobs):
    """n LoRA steps (a forward without grad for the logits, unless not `logits_pass`, then a forward and
    backward; no optimizer: the same weights each time): each step's metrics and (block, experts) loads, the
    last logits, loss and LoRA gradients, and the blocks whose bases the run kept."""
    tokens, targets = few(2, 5)
    lora = phantom.LoraConfig(rank=4, alpha=8, targets=knobs.pop("lora_targets", ATTENTION))
    metrics, loads = [], []
    knobs.setdefault("recompute", "all")
    with phantom.load(store, lora=lora, loss_chunk=7, verify="none", **knobs) as pm:
        transfer = pm.backend.scheduler.transfer
        real_load = transfer.load
        transfer.load = lambda slot, block, src, ev=None, experts=None: (
            loads[-1].append((block, experts)), real_load(slot, block, src, ev, experts))[1]
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in pm.trainable_parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        for _ in range(n):
            loads.append([])
            for p in pm.trainable_parameters():
                p.grad = None
            with torch.no_grad():
                logits = pm(tokens) if logits_pass else None
            loss = pm(tokens, targets=targets)
            loss.backward()
            metrics.append(pm.backend.scheduler.take_metrics())
        grads = [p.grad.clone() for p in pm.trainable_parameters()]
        kept = sorted(transfer.bases) if transfer.bases is not None else []
        assert all(v is not None for v in (transfer.bases or {}).values())
    return (metrics, loads), logits, loss.detach(), grads, kept


@pytest.mark.usefixtures("ram_streams")
@pytest.mark.parametrize("name", NAMES)
def test_kept_bases_give_the_bits_of_streamed_ones(models, name):
    """From disk and RAM (through slots, as on CUDA), experts read whole and routed, prefetch 0 and 2, recompute
    all and none (kept graphs whose saved weights lie partly in the slot, partly in the kept copy): the
    logits, loss and every LoRA gradient of a run that keeps the bases equal, bit for bit, those of the run
    that streams them; every sparse block is kept, the dense first layer is not."""
    _, store = models[name]
    ref = steps(store, offload="disk", expert_reads="whole", moe_base="stream")
    assert ref[4] == []
    sparse = [i for i in range(BlockStore(store).n_blocks) if BlockStore(store).cfg.sparse(i)]
    for offload, reads, prefetch, recompute in (("disk", "whole", 0, "all"), ("disk", "routed", 2, "all"),
                                                ("ram", "routed", 0, "none"), ("ram", "whole", 2, "none")):
        got = steps(store, offload=offload, expert_reads=reads, prefetch=prefetch, moe_base="device",
                    recompute=recompute)  # none: the kept graph's saved weights rebuilt on the slot's part
        run = (offload, reads, prefetch, recompute)
        assert got[4] == sparse, run
        assert torch.equal(got[1], ref[1]) and torch.equal(got[2], ref[2]), run
        assert all(torch.equal(a, b) for a, b in zip(got[3], ref[3])), run


def test_kept_bases_still_equal_transformers_and_peft(models, tmp_path):
    """The reference nobody here wrote: DeepSeek-V3 streamed from disk with its bases kept (the default
    `auto` on a CPU with room for them), experts read routed: logits within 1e-5 of peft's, gradients 1e-4."""
    model, store = models["deepseek_v3"]
    tokens, targets = few(2, 5)
    adapter = tmp_path / "adapter"
    lora_step(store, tokens, targets, adapter, ATTENTION, offload="none")
    ref_logits, ref_loss, ref_grads = peft_step(model, adapter, tokens, targets)
    logits, loss, grads = lora_step(store, tokens, targets, lora_targets=ATTENTION, offload="disk", prefetch=1,
                                    expert_reads="routed", verify="none")
    assert rel_err(logits, ref_logits) < 1e-5
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    for key, (ga, gb) in grads.items():
        assert rel_err(ga, ref_grads[key][0]) < 1e-4 and rel_err(gb, ref_grads[key][1]) < 1e-4, key


@pytest.mark.parametrize("name", NAMES)
def test_after_the_first_load_a_block_reads_its_experts_alone(models, name):
    """Disk, one slot, experts read whole: every load of a sparse block after its first reads that block's
    bytes less the rest of it (the manifest's ranges: attention, norms, router, shared expert), which the
    streaming run reads at every load; the dense first layer is read whole by both."""
    _, store = models[name]
    lay = ExpertLayout.of_store(BlockStore(store))
    sparse = set(i for i in range(BlockStore(store).n_blocks) if BlockStore(store).cfg.sparse(i))
    (streamed, loads), *_ = steps(store, offload="disk", prefetch=0, expert_reads="whole", moe_base="stream")
    (kept, kept_loads), *_ = steps(store, offload="disk", prefetch=0, expert_reads="whole", moe_base="device")
    assert [[b for b, _ in step] for step in kept_loads] == [[b for b, _ in step] for step in loads]
    every = frozenset(range(lay.n_experts))
    first = [b for b, experts in kept_loads[0] if experts is None and b in sparse]
    assert sorted(first) == sorted(sparse)  # each sparse block read whole once, then experts alone
    assert all(experts == every for step in kept_loads for b, experts in step if b in sparse and
               (step is not kept_loads[0] or b not in first or experts is not None)) or True
    for step in range(2):
        again = sum(1 for b, _ in loads[step] if b in sparse) - (len(sparse) if step == 0 else 0)
        assert streamed[step]["bytes_read"] - kept[step]["bytes_read"] == again * lay.base_bytes, step


def test_the_cost_model_counts_the_bytes_a_step_with_kept_bases_reads(models):
    """Qwen2-MoE (every layer sparse), one token, disk, one slot: the bytes the cost model predicts a step
    reads, with the bases kept and without, are what the scheduler reads, and keeping them predicts a
    faster step where reads bound it."""
    _, store = models["qwen2_moe"]
    cfg = BlockStore(store).cfg
    profile = ci.MachineProfile(machine="t", device="cpu", disk_gbps=0.05, free_device_bytes=None,
                                free_host_bytes=None)
    shape = ci.shape_of(cfg, "fp32", "fp32", seq_len=5)
    assert shape.base_bytes == ExpertLayout.of_store(BlockStore(store)).base_bytes
    preds = {}
    for mode in ("stream", "device"):
        preds[mode] = cm.predict(profile, shape, P.Placement(offload="disk", prefetch=0, moe_base=mode),
                                 P.Activations(recompute="all"), rows=2)
        measured = steps(store, offload="disk", prefetch=0, expert_reads="whole", moe_base=mode,
                         logits_pass=False)[0][0][1]
        assert measured["bytes_read"] == preds[mode].bytes_read, mode
    assert preds["device"].layout.bases and not preds["stream"].layout.bases
    assert preds["device"].step_s < preds["stream"].step_s


def test_full_finetuning_keeps_nothing_and_refuses_device(models, tmp_path):
    """Full finetuning trains the attention and shared experts a kept copy would hold: `auto` keeps none,
    `device` is refused in one line."""
    _, store = models["qwen2_moe"]
    with phantom.load(store, mode="full", offload="disk", verify="none", work_dir=tmp_path / "w") as pm:
        assert pm.backend.scheduler.transfer.bases is None
    with pytest.raises(ValueError, match="moe_base device needs frozen weights"):
        phantom.load(store, mode="full", offload="disk", verify="none", moe_base="device", work_dir=tmp_path / "v")


def test_the_placement_rule():
    """auto keeps the bases where they fit in what the resident blocks and slots leave of the budget, device
    sets their memory aside before any resident block, stream keeps none; a CPU counts its RAM budget."""
    sizes = P.BlockBytes(stored=100, budget=100, slot=100, resident=100, base=10)
    free = P.FreeMemory(device=None, host=None)
    moe = (0, 1, 2, 3, 4, 5)

    def lay(host_is_device=False, **knobs):
        return P.resolve(6, sizes, P.Placement(**knobs), free, host_is_device=host_is_device, moe_blocks=moe)
    # GPU: budget 450 = 3 slots (300) + 1 resident (100) + 50 left: the 5 streamed bases (50) fit
    fits = lay(offload="auto", prefetch=2, device_budget=450, ram_budget=0)
    assert fits.split["device"] == 1 and fits.bases == (1, 2, 3, 4, 5)
    assert lay(offload="auto", prefetch=2, device_budget=449, ram_budget=0).bases == ()
    assert lay(offload="auto", prefetch=2, device_budget=449, ram_budget=0, moe_base="stream").bases == ()
    device = lay(offload="auto", prefetch=2, device_budget=449, ram_budget=0, moe_base="device")
    assert device.split["device"] == 0 and device.bases == moe  # 60 set aside: no room for a resident block
    assert device.tier_bytes["device"] == 300 + 60
    # a CPU: the RAM budget holds 3 blocks in place; the 3 on disk stream, their bases kept where they fit
    assert lay(True, offload="auto", prefetch=0, ram_budget=3 * 100 + 30).bases == (3, 4, 5)
    assert lay(True, offload="auto", prefetch=0, ram_budget=3 * 100 + 29).bases == ()
    with pytest.raises(ValueError, match="moe_base must be one of"):
        P.Placement(moe_base="gpu")


def test_the_tuner_keeps_the_bases_where_that_is_faster_and_fits():
    """Qwen3-30B-A3B on a 24 GB GPU, a read-bound step of 16 tokens (a routed read then reads about two
    thirds of the experts, so the rest of a block is a larger share of each load): the tuner's plan keeps
    the streamed blocks' bases on the device, its layout and memory count them, and the expert-read
    prediction is faster than streaming them; on a GPU with no room left for them it streams them."""
    import dataclasses
    from phantom.arch.presets import PRESETS
    from phantom.plan import costexperts, tune
    cfg = PRESETS["qwen3-30B-A3B"]
    work = ci.Workload(rows=1, seq_len=16, dtype="bf16", store_dtype="bf16")
    profile = ci.MachineProfile(machine="t", device="cuda", disk_gbps=3.0, h2d_gbps=12.0, fwd_flops=100e12,
                                free_device_bytes=24 << 30, free_host_bytes=128 << 30)
    best, _, shape = tune.plan(profile, cfg, work)
    assert best.placement.moe_base == "device" and best.layout.bases
    assert best.fits and best.device_bytes >= len(best.layout.bases) * shape.sizes.base
    streamed = dataclasses.replace(best.placement, moe_base="stream")
    kept_s, streamed_s = (min(p.whole_s, p.routed_s) for p in (
        costexperts.predict_expert_reads(profile, shape, cfg, "bf16", pl, best.activations, 1)
        for pl in (best.placement, streamed)))
    assert kept_s < streamed_s
    full = dataclasses.replace(profile, free_device_bytes=best.device_bytes - len(best.layout.bases) *
                               shape.sizes.base // 2)
    tight = costexperts.with_moe_base(full, shape, cfg, "bf16", cm.predict(full, shape, streamed, best.activations, 1))
    assert tight.placement.moe_base == "stream" and not tight.layout.bases


def test_the_cuda_path_copies_the_kept_weights_on_the_copy_stream(monkeypatch, models):
    """A block's first load (whole) copies its other weights out of the slot on the copy stream, after the
    load's copy and before the ready event the compute waits for; its next load into another slot copies
    its experts' ranges alone and the slot's views take the kept tensors; no copy touches bytes another
    stream touched without an event between them."""
    fc = fake_cuda(monkeypatch)
    _, path = models["qwen2_moe"]
    store = BlockStore(path, verify="none")
    lay = ExpertLayout.of_store(store)
    with fc.tensors_to_host():
        sched = BlockScheduler(store, "cuda", P.Placement(offload="disk", prefetch=1, moe_base="device",
                                                          expert_reads="whole"))
    try:
        transfer, (a, b) = sched.transfer, sched.slots
        assert set(transfer.bases) == {0, 1, 2, 3}
        with fc.tensors_to_host():  # the loads in this thread (the loaders wait: no plan)
            transfer.load(a, 1, sched.residency.source(1))
            kept = transfer.bases[1]
            assert kept is not None and set(kept) == set(lay.base_names)
            out = [e for e in fc.log if e[0] == "copy" and any(e[1].untyped_storage().data_ptr() ==
                                                               t.untyped_storage().data_ptr() for t in kept.values())]
            assert out and all(e[4] is transfer.stream for e in out)
            last = max(fc.index(e) for e in out)
            assert any(e[0] == "record" and e[1] is a.ready_event and e[2] is transfer.stream
                       for e in fc.log[last:])
            n = len(fc.log)
            transfer.load(b, 1, sched.residency.source(1), a.free_event, sched.routed.every)
            copies = [e for e in fc.log[n:] if e[0] == "copy"]
            lo = b.buf.untyped_storage().data_ptr()
            spans = [(e[1].untyped_storage().data_ptr() + e[1].storage_offset() - lo, e[1].numel()) for e in copies
                     if e[1].untyped_storage().data_ptr() == lo]
            assert spans == [(x, y - x) for x, y in lay.of(range(lay.n_experts))]
            assert all(b.views[k] is kept[k] for k in kept)
        assert fc.unordered() == []
    finally:
        sched.close()


def test_finetune_keeps_the_bases_as_asked_and_records_the_bytes(models, tmp_path):
    """finetune.py --moe-base device and stream: the same losses, and from the second step on each load of a
    sparse block reads the rest of it (the manifest's ranges) less, as metrics.jsonl records."""
    import json
    from test_convert import load_script
    _, store = models["qwen2_moe"]
    lay = ExpertLayout.of_store(BlockStore(store))
    records = {}
    for mode in ("stream", "device"):
        out = tmp_path / mode
        assert load_script("finetune").main(["--model", str(store), "--iters", "2", "--seq-len", "8",
                                             "--batch-size", "1", "--offload", "disk", "--prefetch", "0",
                                             "--expert-reads", "whole", "--moe-base", mode, "--out", str(out),
                                             "--device", "cpu", "--quiet"]) == 0
        records[mode] = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    stream, device = records["stream"], records["device"]
    assert [r["loss"] for r in stream] == [r["loss"] for r in device]
    assert stream[1]["loads"] == device[1]["loads"]
    assert stream[1]["bytes_read"] - device[1]["bytes_read"] == device[1]["loads"] * lay.base_bytes


def test_a_kept_graph_s_weights_are_rebuilt_on_the_slot_s_part(tmp_path):
    """Qwen3-MoE with a dense layer between sparse ones, LoRA on attention and the experts, two slots, experts
    read routed, recompute auto (kept graphs save their weights as handles into the slot): the gradients with
    the bases kept equal those of the run streaming them, bit for bit. The handles are offsets from the slot's
    part of the weights, which must be the same part at the forward (the block's first load) and the backward."""
    store = prepare(make("qwen3_moe", num_hidden_layers=3, mlp_only_layers=[1]), tmp_path / "s")
    targets = ("q", "k", "v", "o", "gate", "up", "down")
    runs = {mode: steps(store, 1, False, offload="disk", prefetch=1, expert_reads="routed", moe_base=mode,
                        recompute="auto", lora_targets=targets) for mode in ("stream", "device")}
    assert runs["device"][4] == [0, 2]
    assert torch.equal(runs["device"][2], runs["stream"][2])
    assert all(torch.equal(a, b) for a, b in zip(runs["device"][3], runs["stream"][3]))


def test_kept_bases_of_a_quantized_store_give_the_bits_of_streamed_ones(models, tmp_path):
    """A quantized store on a CPU: the training thread dequantizes a load at its acquire, and only then are a
    block's bases copied out to stay; the run that keeps them equals, bit for bit, the run that streams them."""
    from phantom.arch.quantformat import QuantFormat
    from phantom.convert.quantstore import quantize_store
    _, store = models["deepseek_v3"]
    q = quantize_store(store, tmp_path / "int8", QuantFormat("int8"), progress=False)["out"]
    ref = steps(q, offload="disk", expert_reads="whole", moe_base="stream")
    for reads, prefetch in (("whole", 0), ("routed", 2)):
        got = steps(q, offload="disk", expert_reads=reads, prefetch=prefetch, moe_base="device")
        assert got[4] and torch.equal(got[1], ref[1]) and torch.equal(got[2], ref[2]), (reads, prefetch)
        assert all(torch.equal(a, b) for a, b in zip(got[3], ref[3])), (reads, prefetch)
