"""Routed expert reads (phantom.stream.experts): a mixture-of-experts block streamed from disk or RAM reads its
non-expert bytes ahead of use and, after its router has run over the step's tokens, only the experts some
token routes to. Against transformers' own modules and peft (tiny random Qwen3-MoE, Mixtral, Qwen2-MoE with its
shared expert and OLMoE, of 4 layers and 8 experts, a few tokens a step so that some experts are not hit); the bytes read are counted against the
manifest's ranges of the experts transformers' routers pick.
"""
from __future__ import annotations

import functools

import pytest
import torch

import phantom
from family_check import batch, cross_entropy, lora_step, make, peft_step, prepare, rel_err
from phantom.files.store import BlockStore
from phantom.stream.experts import ExpertLayout, ExpertReads, block_seconds, expected_hits, expected_runs
from phantom.stream.trace import LoadStats
from phantom.stream.scheduler import BlockScheduler

MODELS = {"qwen3_moe": dict(num_hidden_layers=4), "mixtral": dict(num_hidden_layers=4, num_local_experts=8),
          "qwen2_moe": dict(num_hidden_layers=4), "olmoe": dict(num_hidden_layers=4)}  # shared expert; q/k norms
ATTENTION = ("q", "k", "v", "o")
RUNS = [(o, p, r) for o in ("disk", "ram") for p in (0, 2) for r in ("all", "none")]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for name, fields in MODELS.items():
        model = make(name, **fields)
        out[name] = model, prepare(model, tmp_path_factory.mktemp(name))
    return out


@pytest.fixture
def ram_streams(monkeypatch):
    """The RAM tier through slots (CUDA's path) on the CPU, which would otherwise compute where it lies."""
    import phantom.model.phantom_model as pmodel
    monkeypatch.setattr(pmodel, "BlockScheduler", functools.partial(BlockScheduler, zero_copy=False))


def few(b: int, t: int):
    """A few tokens and their targets (every one counted): a step that leaves some experts unpicked."""
    return batch(b, t)[0], batch(b, t, seed=1)[0]


def hits(model, tokens) -> list[set[int]]:
    """The experts transformers' routers pick for tokens, per layer."""
    with torch.no_grad():
        logits = model(tokens, output_router_logits=True).router_logits
    k = model.config.num_experts_per_tok
    return [set(torch.topk(l.float().softmax(-1), k, dim=-1).indices.unique().tolist()) for l in logits]


@pytest.mark.parametrize("name", MODELS)
def test_routed_reads_give_transformers_logits_loss_and_peft_lora_gradients(models, name, tmp_path, ram_streams):
    """From disk and RAM, prefetch 0 and 2, recompute all and none, two micro-batches: logits and loss within
    1e-5 of transformers', every LoRA gradient within 1e-4 of peft's; the steps read some experts, not all."""
    model, store = models[name]
    tokens, targets = few(2, 3)
    assert any(len(h) < 8 for h in hits(model, tokens))  # the test reads some experts, not every one
    adapter = tmp_path / "adapter"
    lora_step(store, tokens, targets, adapter, ATTENTION, offload="none")
    ref_logits, ref_loss, ref_grads = peft_step(model, adapter, tokens, targets)
    for offload, prefetch, recompute in RUNS:
        run = (offload, prefetch, recompute)
        logits, loss, grads = lora_step(store, tokens, targets, lora_targets=ATTENTION, offload=offload, prefetch=prefetch,
                                        recompute=recompute, micro_batch=1, expert_reads="routed", verify="none")
        assert rel_err(logits, ref_logits) < 1e-5, run
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
        assert grads.keys() == ref_grads.keys()
        for key, (ga, gb) in grads.items():
            assert rel_err(ga, ref_grads[key][0]) < 1e-4 and rel_err(gb, ref_grads[key][1]) < 1e-4, (run, key)


def test_a_step_reads_the_hit_experts_and_the_rest_once_each_way(models, tmp_path):
    """Disk, one slot, recompute all: each block's forward load reads its non-expert bytes, then the experts
    transformers' router picks (the manifest's ranges); the backward's reload reads the same experts with the
    rest in one request (the last block is still in the slot at the turn); the trace has an experts lane."""
    model, store = models["qwen3_moe"]
    tokens, targets = few(1, 4)
    want = hits(model, tokens)
    lay = ExpertLayout.of_store(BlockStore(store))
    ranges = [tuple(r) for r in __import__("json").loads((store / "manifest.json").read_text())
              ["files"]["blocks/000.safetensors"]["experts"]]
    assert ranges == list(lay.ranges)
    expert = lambda e: ranges[e][1] - ranges[e][0]  # noqa: E731
    loads = []
    with phantom.load(store, offload="disk", prefetch=0, recompute="all", expert_reads="routed", verify="none",
                      trace=True, moe_base="stream") as pm:
        transfer = pm.backend.scheduler.transfer
        real_load, real_fill = transfer.load, transfer.fill
        transfer.load = lambda slot, block, src, ev=None, experts=None: (
            loads.append(("load", block, experts)), real_load(slot, block, src, ev, experts))[1]
        transfer.fill = lambda slot, block, src, experts: (  # where the slot lacks some of them
            not frozenset(experts) <= slot.experts and loads.append(("fill", block, frozenset(experts))),
            real_fill(slot, block, src, experts))[1]
        pm(tokens, targets=targets).backward()
        m = pm.backend.scheduler.take_metrics()
        lanes = {e["tid"] for e in pm.backend.scheduler.tracer.events}
        assert pm.backend.scheduler.tracer.lanes["experts"] in lanes
    n = len(want)
    assert loads[:2 * n] == [x for i in range(n) for x in (("load", i, frozenset()), ("fill", i, frozenset(want[i])))]
    assert loads[2 * n:] == [("load", i, frozenset(want[i])) for i in range(n - 2, -1, -1)]
    hit_bytes = [sum(expert(e) for e in want[i]) for i in range(n)]
    assert m["bytes_read"] == sum(lay.base_bytes + hit_bytes[i] for i in range(n)) + \
        sum(lay.base_bytes + hit_bytes[i] for i in range(n - 1))
    assert m["bytes_experts"] == sum(hit_bytes) + sum(hit_bytes[:-1]) and m["expert_reads"] == n
    assert lay.base_bytes + lay.n_experts * expert(0) == BlockStore(store).block_nbytes


def test_a_checked_store_reads_routed_from_the_first_step_checking_each_part(models, tmp_path):
    """verify fast: a routed read checks what it read by the manifest's crc32 of each expert and of the rest,
    so the first step already reads routed, with the logits of a whole read. A byte changed in a routed
    expert, or in the rest, is one StoreError naming it; one in an expert no token picks is not read, and
    the whole read that reads it finds it. A store without the rest's crc32 (written before it was
    recorded) reads each file whole once, as before."""
    import json
    import shutil
    from phantom.files.tensorfile import StoreError
    model, src = models["mixtral"]
    tokens = batch(b=1, t=2)[0]
    block = BlockStore(src).block_nbytes

    def run(store, mode="routed"):
        with phantom.load(store, offload="disk", prefetch=0, expert_reads=mode, lora=None) as pm, torch.no_grad():
            return pm(tokens), pm.backend.scheduler.take_metrics()

    whole, _ = run(src, "whole")
    logits, m = run(src)
    assert torch.equal(logits, whole) and 0 < m["bytes_experts"] and m["bytes_read"] < 4 * block
    hit = sorted(hits(model, tokens)[0])
    missed = next(e for e in range(8) if e not in hit)
    entry = BlockStore(src).blocks[0]
    for name, at, match in (("hit", entry.experts[hit[0]][0][0] + 5, f"expert {hit[0]}'s bytes"),
                            ("rest", 3, "its bytes outside the experts"),
                            ("missed", entry.experts[missed][0][0] + 5, None)):
        store = tmp_path / name
        shutil.copytree(src, store)
        path = store / entry.path.relative_to(src)
        raw = bytearray(path.read_bytes())
        raw[entry.data_start + at] ^= 0x10
        path.write_bytes(bytes(raw))
        if match is None:
            assert torch.equal(run(store)[0], whole)  # its bytes were not read, nor checked
            with pytest.raises(StoreError, match="checksum mismatch"):
                run(store, "whole")
        else:
            with pytest.raises(StoreError, match=match):
                run(store)
    older = tmp_path / "older"
    shutil.copytree(src, older)
    manifest = json.loads((older / "manifest.json").read_text())
    for info in manifest["files"].values():
        info.pop("experts_rest_crc32", None)
    (older / "manifest.json").write_text(json.dumps(manifest))
    with phantom.load(older, offload="disk", prefetch=0, expert_reads="routed", lora=None) as pm, torch.no_grad():
        assert torch.equal(pm(tokens), whole)
        m1 = pm.backend.scheduler.take_metrics()
        pm(tokens)
        m2 = pm.backend.scheduler.take_metrics()
    assert m1["bytes_read"] == 4 * block and m1["bytes_experts"] == 0
    assert 0 < m2["bytes_experts"] and m2["bytes_read"] < 4 * block


def test_generation_with_routed_reads_equals_transformers_generate(models):
    from phantom.model.generate import generate
    model, store = models["mixtral"]
    prompt = batch(b=1, t=5)[0]
    with torch.no_grad():
        want = model.generate(prompt, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    with phantom.load(store, offload="disk", prefetch=1, lora=None, expert_reads="routed", verify="none") as pm:
        got = list(generate(pm, prompt[0].tolist(), max_new_tokens=8, temperature=0.0))
        assert pm.backend.scheduler.take_metrics()["expert_reads"] > 0
    assert got == want[0, 5:].tolist()


def test_full_finetuning_reads_whole_blocks_and_refuses_routed(models, tmp_path):
    """Full finetuning updates every expert (AdamW decays those no token picks) and writes whole blocks back:
    `routed` is refused in one line, `auto` reads whole blocks."""
    _, store = models["qwen3_moe"]
    with pytest.raises(ValueError, match="^expert_reads routed needs frozen experts: full finetuning"):
        phantom.load(store, mode="full", offload="disk", expert_reads="routed", work_dir=tmp_path / "a")
    tokens, targets = few(1, 3)
    with phantom.load(store, mode="full", offload="disk", prefetch=0, work_dir=tmp_path / "b", verify="none") as pm:
        pm(tokens, targets=targets).backward()
        m = pm.backend.scheduler.take_metrics()
    assert m["bytes_experts"] == 0 and m["bytes_read"] % BlockStore(store).block_nbytes == 0


@pytest.mark.parametrize("method", ["nf4", "int8"])
def test_a_quantized_store_reads_routed_when_asked(models, tmp_path, method):
    """NF4 and int8 experts lie back to back with their ranges in the manifest: `routed` reads the hit
    experts' codes and scales alone and dequantizes those, with the logits, loss and LoRA gradients of whole
    reads (each tensor dequantized by the same code); `auto` reads a quantized store whole (its choice does
    not count the experts' dequantization after the router)."""
    from phantom.arch.quantformat import QuantFormat
    from phantom.convert.quantstore import quantize_store
    _, src = models["mixtral"]
    store = quantize_store(src, tmp_path / "q", QuantFormat(method), dtype=torch.bfloat16, progress=False)["out"]
    tokens, targets = few(2, 3)
    ref = lora_step(store, tokens, targets, lora_targets=ATTENTION, offload="disk", expert_reads="whole",
                    dtype=torch.float32)
    block = BlockStore(store).block_nbytes
    with phantom.load(store, offload="disk", prefetch=0, expert_reads="routed", lora=None, dtype=torch.float32) as pm:
        with torch.no_grad():
            pm(tokens)
        m = pm.backend.scheduler.take_metrics()
    assert 0 < m["bytes_experts"] and m["bytes_read"] < 4 * block and m["dequant_s"] > 0
    for offload, prefetch, recompute in (("disk", 0, "all"), ("disk", 2, "none"), ("ram", 2, "all")):
        logits, loss, grads = lora_step(store, tokens, targets, lora_targets=ATTENTION, offload=offload,
                                        prefetch=prefetch, recompute=recompute, expert_reads="routed",
                                        dtype=torch.float32)
        assert torch.equal(logits, ref[0]) and torch.equal(loss, ref[1]), (offload, prefetch, recompute)
        assert all(torch.equal(g, r) for key in grads for g, r in zip(grads[key], ref[2][key]))
    with phantom.load(store, offload="disk", lora=None) as pm:
        assert pm.backend.scheduler.routed.policy is None


def test_a_store_that_cannot_read_experts_apart_reads_whole_or_refuses_routed(tmp_path):
    """Experts 33 wide: an NF4 expert's scales would fall unaligned after its codes, so the store keeps the
    size order and records no expert ranges: `routed` is one ValueError, `auto` reads whole."""
    from phantom.arch.presets import preset
    from phantom.arch.quantformat import QuantFormat
    from phantom.convert.synthetic import write_synthetic
    cfg = preset("qwen3-30B-A3B", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, explicit_head_dim=16, vocab_size=64,
                 n_experts=4, experts_per_token=2, expert_dim=33)
    out = write_synthetic(tmp_path / "q", cfg, torch.bfloat16, progress=False, quant=QuantFormat("nf4"))
    with pytest.raises(ValueError, match="keeps each expert's codes and scales apart"):
        phantom.load(out, offload="disk", expert_reads="routed", lora=None)
    with phantom.load(out, offload="disk", lora=None) as pm:
        assert pm.backend.scheduler.routed.policy is None
    with pytest.raises(ValueError, match="expert_reads must be one of auto, routed, whole"):
        phantom.Placement(expert_reads="some")


def test_the_hit_estimate_and_the_choice():
    """Uniform routing hits E (1 - (1 - k/E)^N) experts; a measured distribution its own sum; a routed read
    pays where the step is read-bound and few experts are hit, not where the compute hides the whole read."""
    assert expected_hits(None, 1, 128, 8) == pytest.approx(8)
    assert expected_hits(None, 128, 128, 8) == pytest.approx(128 * (1 - (1 - 8 / 128) ** 128))
    skewed = torch.tensor([0.5] * 8 + [0.0] * 120) * 2  # 8 experts take every choice
    assert expected_hits(skewed, 4096, 128, 8) == pytest.approx(8)
    whole, routed = block_seconds(0.01, 100, 10, 128, 8, 1e-4, 1e-4)
    assert whole == pytest.approx(1280 * 1e-4 + 100 * 1e-4) and routed == pytest.approx(0.01 + 80e-4 + 1e-4)
    lay = ExpertLayout(tuple((100 + 10 * e, 110 + 10 * e) for e in range(128)), ((0, 100),), (), 1380, 8)
    policy = ExpertReads(lay, "auto", 2)
    assert policy.plan(8) == frozenset()  # nothing measured yet: whole
    policy.observe_times(compute_s=1e-3, nbytes=1 << 20, read_s=(1 << 20) * 1e-4)
    assert policy.plan(8) == {0, 1} and policy.plan(4096) == frozenset()
    policy.observe(0, torch.arange(8).repeat(64, 1))  # block 0's router sends every token to experts 0..7
    assert policy.plan(4096) == {0}
    policy.observe_times(compute_s=10.0)  # compute-bound: the whole read hides behind it
    assert policy.plan(8) == frozenset()


def test_routed_expert_reads_pay_for_each_request_they_make():
    """A routed read makes a request for each run of consecutive hit experts (touching ranges joined), and each
    costs the device's latency beside its bytes: the runs expected equal those of sampled steps' hits (numpy's
    draws), and the choice takes the request cost measured on the run's own routed reads."""
    import numpy as np
    rng = np.random.default_rng(0)
    probs = torch.tensor(rng.dirichlet(np.ones(64)) * 4)  # a skewed router's share of choices, summing to k = 4
    for tokens in (1, 8, 64):
        draws = rng.random((4000, tokens, 64)) < probs.numpy()  # each expert picked by each token apart
        hit = draws.any(axis=1)
        runs = (hit[:, 0] + (hit[:, 1:] & ~hit[:, :-1]).sum(1)).mean()
        assert expected_runs(probs, tokens, 64, 4) == pytest.approx(runs, rel=0.03)
        assert expected_hits(probs, tokens, 64, 4) == pytest.approx(hit.sum(1).mean(), rel=0.03)
    assert expected_runs(None, 10**6, 64, 4) == pytest.approx(1)  # every expert hit: one request
    whole, routed = block_seconds(0.01, 100, 10, 128, 8, 1e-4, 5e-4, runs=8)
    assert whole == pytest.approx(1380e-4) and routed == pytest.approx(0.01 + 80e-4 + 8 * 5e-4)
    lay = ExpertLayout(tuple((100 + 10 * e, 110 + 10 * e) for e in range(128)), ((0, 100),), (), 1380, 8)
    policy = ExpertReads(lay, "auto", 1)
    policy.observe_times(compute_s=1e-3, nbytes=1 << 20, read_s=(1 << 20) * 1e-4)
    assert policy.plan(8) == {0}  # 8 experts, a round trip each at the tier's default: routed pays
    fill = LoadStats(bytes_read=1 << 20, read_s=(1 << 20) * 1e-4 + 8 * 5e-3, requests=8)  # 5 ms a request
    policy.observe_fill(fill)
    assert policy.request_s == pytest.approx(5e-3) and policy.s_per_byte == pytest.approx(1e-4)
    assert policy.plan(8) == frozenset()


def test_the_cost_model_pays_each_request_at_the_profiles_request_cost(models):
    """predict_expert_reads: the routed step's serial expert read pays disk_request_s for each expected run of
    hit experts; with prefetch 0 every load is in series, so doubling it adds runs x it for each forward load."""
    import dataclasses
    from phantom.plan import costinputs as ci
    from phantom.plan.costexperts import predict_expert_reads
    _, store = models["qwen3_moe"]
    cfg = BlockStore(store).cfg
    profile = ci.MachineProfile(machine="t", device="cpu", disk_gbps=2.0, free_device_bytes=None, free_host_bytes=None)
    shape = ci.shape_of(cfg, "fp32", "fp32", seq_len=1)
    args = (shape, cfg, "fp32", phantom.Placement(offload="disk", prefetch=0), phantom.Activations(recompute="all"))
    fast, slow = (predict_expert_reads(dataclasses.replace(profile, disk_request_s=r), *args, rows=1)
                  for r in (1e-3, 2e-3))
    runs = expected_runs(None, 1, cfg.n_experts, cfg.experts_per_token)
    assert slow.routed_s - fast.routed_s == pytest.approx(cfg.n_layers * runs * 1e-3, rel=1e-6)
    assert slow.whole_s == fast.whole_s and slow.routed_bytes == fast.routed_bytes


def test_finetune_reads_experts_routed_and_records_their_bytes(models, tmp_path):
    """finetune.py --expert-reads routed: each step's record counts the experts' bytes apart, and the round
    trips reading them after a router."""
    from test_convert import load_script
    _, store = models["qwen3_moe"]
    out = tmp_path / "run"
    assert load_script("finetune").main(["--model", str(store), "--iters", "2", "--seq-len", "8", "--batch-size", "1",
                                         "--offload", "disk", "--prefetch", "0", "--expert-reads", "routed",
                                         "--out", str(out), "--device", "cpu", "--quiet"]) == 0
    steps = [r for r in map(__import__("json").loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    block = BlockStore(store).block_nbytes
    assert all(0 < r["bytes_experts"] and r["bytes_read"] < r["loads"] * block for r in steps)
    assert all(r["expert_reads"] == 4 for r in steps)  # one round trip a block, in the forward (prefetch 0)


def test_the_cost_model_predicts_the_bytes_a_routed_step_reads(models):
    """One token a step hits exactly k experts a block: the cost model's routed bytes are what the scheduler
    reads (its whole bytes the whole blocks'), and it picks routed reads where the step is read-bound."""
    import dataclasses
    from phantom.plan import costinputs as ci
    from phantom.plan.costexperts import predict_expert_reads
    _, store = models["qwen3_moe"]
    cfg = BlockStore(store).cfg
    profile = ci.MachineProfile(machine="t", device="cpu", disk_gbps=0.05, free_device_bytes=None,  # read-bound
                                free_host_bytes=None)
    shape = ci.shape_of(cfg, "fp32", "fp32", seq_len=1)
    pred = predict_expert_reads(profile, shape, cfg, "fp32", phantom.Placement(offload="disk", prefetch=0,
                                                                               moe_base="stream"),
                                phantom.Activations(recompute="all"), rows=1)
    measured = {}
    for mode in ("whole", "routed"):
        with phantom.load(store, offload="disk", prefetch=0, recompute="all", expert_reads=mode, verify="none",
                          moe_base="stream") as pm:
            for _ in range(2):
                pm(torch.tensor([[3]]), targets=torch.tensor([[4]])).backward()
                measured[mode] = pm.backend.scheduler.take_metrics()["bytes_read"]
    assert pred.hits == pytest.approx(cfg.experts_per_token)
    assert (measured["whole"], measured["routed"]) == (pred.whole_bytes, pred.routed_bytes)
    assert pred.choice == "routed"
    slow = dataclasses.replace(profile, fwd_flops=1e3)  # compute-bound: the whole read hides behind it
    assert predict_expert_reads(slow, shape, cfg, "fp32", phantom.Placement(offload="disk", prefetch=2),
                                phantom.Activations(recompute="all"), rows=1).choice == "whole"


def test_a_block_read_whole_after_a_routed_step_gets_the_experts_its_slot_lacks(models):
    """auto may switch a block from routed to whole between steps while a routed load's slot still holds it
    (every block stays in a slot here): the whole step reads the experts the slot lacks first."""
    model, store = models["qwen3_moe"]
    first, second = batch(b=1, t=2)[0], batch(b=2, t=20, seed=3)[0]
    with torch.no_grad():
        want = model(second).logits
    with phantom.load(store, offload="disk", prefetch=4, expert_reads="routed", verify="none", lora=None) as pm:
        with torch.no_grad():
            pm(first)
            pm.backend.scheduler.take_metrics()
            pm.backend.scheduler.routed.policy.mode = "whole"
            got = pm(second)
        m = pm.backend.scheduler.take_metrics()
    assert m["loads"] == 0 and m["bytes_experts"] > 0
    assert rel_err(got, want) < 1e-5


def test_a_linked_store_reads_its_experts_routed_from_the_checkpoint(tmp_path):
    """prepare_model.py --link: each expert's range is found in the checkpoint's files (the linked ranges)."""
    model = make("mixtral", num_hidden_layers=2, num_local_experts=8)
    store = prepare(model, tmp_path, link=True)
    tokens = batch(b=1, t=3)[0]
    with torch.no_grad():
        want = model(tokens).logits
    with phantom.load(store, offload="disk", prefetch=0, expert_reads="routed", verify="none", lora=None) as pm:
        with torch.no_grad():
            got = pm(tokens)
        m = pm.backend.scheduler.take_metrics()
    assert rel_err(got, want) < 1e-5
    assert 0 < m["bytes_experts"] and m["bytes_read"] < 2 * BlockStore(store).block_nbytes


def test_dense_layers_among_sparse_ones_read_whole_and_the_sparse_ones_routed(tmp_path):
    """mlp_only_layers [0]: block 0 (a dense MLP) is read whole, blocks 1 and 2 routed; logits and loss
    equal transformers'."""
    model = make("qwen3_moe", num_hidden_layers=3, mlp_only_layers=[0])
    store = prepare(model, tmp_path)
    tokens, targets = few(1, 3)
    with torch.no_grad():
        want = model(tokens).logits
    with phantom.load(store, offload="disk", prefetch=0, recompute="all", expert_reads="routed", verify="none",
                      lora=None) as pm:
        assert pm.backend.scheduler.routed.policy.sparse == (1, 2)
        with torch.no_grad():
            got = pm(tokens)
            loss = pm(tokens, targets=targets)
        m = pm.backend.scheduler.take_metrics()
    assert rel_err(got, want) < 1e-5
    torch.testing.assert_close(loss, cross_entropy(want, targets), rtol=1e-5, atol=0)
    assert m["expert_reads"] > 0


def test_auto_reads_whole_until_it_has_measured_then_decides_each_step(models):
    """expert_reads auto (the default): the first step reads whole blocks and measures the routers' hits, a
    block's compute and the read rate; the next step's choice is ExpertReads.pays on those measurements."""
    model, store = models["qwen3_moe"]
    tokens, targets = few(1, 3)
    with phantom.load(store, offload="disk", prefetch=0, verify="none", moe_base="stream") as pm:
        policy = pm.backend.scheduler.routed.policy
        assert policy.mode == "auto"
        pm(tokens, targets=targets).backward()
        assert pm.backend.scheduler.take_metrics()["bytes_experts"] == 0
        assert policy.compute_s > 0 and policy.s_per_byte > 0
        assert [set(torch.nonzero(policy.counts[i]).flatten().tolist()) for i in range(4)] == hits(model, tokens)
        expected = {i for i in range(4) if policy.pays(i, 3)}  # on the first step's measurements
        pm(tokens, targets=targets).backward()
        assert policy.routed == expected
        assert (pm.backend.scheduler.take_metrics()["bytes_experts"] > 0) == bool(expected)
