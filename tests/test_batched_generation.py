"""Batched generation: eight prompts of different lengths in one left-padded batch give transformers' `generate`
tokens prompt by prompt (a dense model, a mixture of experts, a Gated DeltaNet hybrid; with a peft adapter; from
disk and from RAM); a seeded request samples the same completion in any batch; a step reads each block once for
every sequence; stop ids and stop strings end each sequence on its own.
"""
from __future__ import annotations

import pytest
import torch

import phantom
from phantom.model.adapterfiles import read_adapter_config
from phantom.model.generate import CACHE_SHARE, Request, Sampling, auto_batch_size, cache_bytes, generate_many, \
    sequence_bytes
from conftest import need, randomize_lora
from family_check import VOCAB, make

LENGTHS = [3, 9, 5, 12, 1, 7, 16, 4]
NEW = 6


def prompts(seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in LENGTHS]


def transformers_greedy(model, ps: list[list[int]], n: int = NEW) -> list[list[int]]:
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(p):].tolist() for p in ps]


def greedy(pm, ps, n: int = NEW, **kw) -> list[list[int]]:
    return [c.ids for c in generate_many(pm, [Request(p, n) for p in ps], **kw)]


@pytest.mark.parametrize("name,offload", [("llama-tied", "disk"), ("llama-tied", "ram"), ("qwen3_moe", "disk"),
                                          ("qwen3_5_moe", "ram"), ("qwen3_5_moe", "disk")])
def test_a_padded_batch_gives_transformers_tokens_prompt_by_prompt(family_models, name, offload):
    model, store = family_models(name)
    ps = prompts()
    want = transformers_greedy(model, ps)
    with phantom.load(store, offload=offload, prefetch=1, lora=None) as pm:
        assert greedy(pm, ps) == want
        assert greedy(pm, ps, batch_size=3) == want  # batches of other compositions and paddings


@pytest.mark.parametrize("name", ["llama-tied", "qwen3_5_moe"])
def test_with_an_adapter_the_batch_gives_peft_tokens(family_models, name, tmp_path):
    peft = need("peft")
    _, store = family_models(name)
    targets = ("q", "v") if name == "llama-tied" else ("q", "v", "in_proj_qkv")
    with phantom.load(store, offload="none", lora=phantom.LoraConfig(rank=4, targets=targets)) as pm:
        randomize_lora(pm, seed=1)
        pm.save_adapter(tmp_path / "adapter")
    ps = prompts(seed=2)
    want = transformers_greedy(peft.PeftModel.from_pretrained(make(name), tmp_path / "adapter").eval(), ps)
    with phantom.load(store, offload="disk", lora=read_adapter_config(tmp_path / "adapter")) as pm:
        pm.load_adapter(tmp_path / "adapter")
        assert greedy(pm, ps) == want
    with phantom.load(store, offload="disk", lora=None) as pm:
        assert greedy(pm, ps) != want  # the adapter changes what the model says


def test_a_seeded_request_samples_the_same_completion_in_any_batch(family_models):
    _, store = family_models("llama-tied")
    ps = prompts(seed=3)
    sampled = [Request(p, 8, Sampling(temperature=1.0, top_k=50, top_p=0.9), seed=100 + n) for n, p in enumerate(ps)]
    with phantom.load(store, offload="ram", lora=None) as pm:
        runs = [[c.ids for c in generate_many(pm, sampled, batch_size=b)] for b in (1, 3, 8)]
        assert runs[0] == runs[1] == runs[2]
        other = [Request(r.prompt, 8, r.sampling, seed=r.seed + 1) for r in sampled]
        assert [c.ids for c in generate_many(pm, other)] != runs[0]  # the seed draws them


def test_a_step_reads_each_block_once_for_every_sequence(small_store):
    """N new tokens: the prefill, then N - 1 steps of one token per live sequence, each block read once a step,
    for one prompt as for eight."""
    gen = torch.Generator().manual_seed(0)
    ps = [torch.randint(0, 97, (n,), generator=gen).tolist() for n in LENGTHS]
    with phantom.load(small_store, offload="disk", prefetch=1, lora=None) as pm:
        n_blocks = pm.cfg.n_layers
        loads = []
        for ps in (ps[:1], ps):
            pm.scheduler.take_metrics()
            greedy(pm, ps, n=NEW)
            loads.append(pm.scheduler.take_metrics()["loads"])
    slots = len(pm.scheduler.slots)
    assert slots < n_blocks  # nothing stays loaded from one step to the next
    # a block the previous call left in a slot may serve the first pass, as the loader's race with the compute goes
    assert all(NEW * n_blocks - slots <= n <= NEW * n_blocks for n in loads), loads


def test_each_sequence_stops_on_its_own(family_models):
    """A stop id ends the sequences that pick it (the id not in the completion), the others run on; the same
    tokens as the sequence alone up to there. A stop string cuts the text before it."""
    _, store = family_models("llama-tied")
    ps = prompts()
    with phantom.load(store, offload="none", lora=None) as pm:
        free = greedy(pm, ps)
        stop = free[3][2]  # the third token of the fourth prompt's completion
        stopped = generate_many(pm, [Request(p, NEW, stop_ids=frozenset({stop})) for p in ps])
    for f, c in zip(free, stopped):
        if stop in f:
            assert c.ids == f[:f.index(stop)] and c.finish == "stop" and c.stop_id == stop
        else:
            assert c.ids == f and c.finish == "length"
    assert {c.finish for c in stopped} == {"stop", "length"}  # some stopped, the others ran on


def test_stop_strings_cut_the_text(tmp_path):
    from phantom.arch.presets import preset
    from phantom.data.tokenizer import Tokenizer, train_tiny_tokenizer
    from phantom.convert.synthetic import write_synthetic
    tok_path = train_tiny_tokenizer(tmp_path / "tokenizer.model", vocab_size=preset("tiny").vocab_size)
    store = write_synthetic(tmp_path / "tiny", preset("tiny", n_layers=2), torch.float32, seed=0, tokenizer=tok_path,
                            progress=False)
    tok = Tokenizer(tok_path)
    prompt = tok.encode("Once upon a time", bos=True)
    with phantom.load(store, offload="none", lora=None) as pm:
        free = generate_many(pm, [Request(prompt, 12)], tokenizer=tok)[0]
        word = free.text.strip().split()[1] if len(free.text.split()) > 1 else free.text.strip()[:2]
        cut = generate_many(pm, [Request(prompt, 12, stop_strings=(word,))], tokenizer=tok)[0]
    assert cut.finish == "stop_string" and cut.text == free.text[:free.text.find(word)]
    assert free.ids[:len(cut.ids)] == cut.ids and len(cut.ids) < len(free.ids)


def test_the_batch_size_is_what_memory_holds(family_models):
    _, store = family_models("llama-tied")
    with phantom.load(store, offload="none", lora=None) as pm:
        reqs = [Request(p, NEW) for p in prompts()]
        per_seq = cache_bytes(pm, max(len(p) for p in prompts()) + NEW)
        assert per_seq == pm.cfg.n_layers * 2 * pm.cfg.kv_heads * pm.cfg.head_dim * (16 + NEW) * 4
        assert auto_batch_size(pm, reqs, free=10 ** 12) == len(reqs)  # all of them
        assert auto_batch_size(pm, reqs, free=0) == 1
        assert auto_batch_size(pm, reqs, free=int(3 * sequence_bytes(pm, reqs) / CACHE_SHARE) + 1) == 3


def test_bad_requests_are_refused(family_models):
    _, store = family_models("llama-tied")
    with phantom.load(store, offload="none", lora=None) as pm:
        for bad, says in [(Request([], 2), "empty"), (Request([1], 64), "max_seq_len"),
                          (Request([VOCAB + 5], 2), "token ids"), (Request([1], 2, stop_strings=("x",)), "tokenizer")]:
            with pytest.raises(ValueError, match=says):
                generate_many(pm, [Request([1, 2], 2), bad])
    with pytest.raises(ValueError, match="top_p"):
        Sampling(temperature=1.0, top_p=0.0)


@pytest.mark.parametrize("budget", [0, "some"])
def test_caches_kept_in_host_memory_give_the_same_tokens(family_models, budget):
    """Blocks whose caches do not fit the device budget keep them in host memory, uploaded for their block and
    their new columns written back (a Gated DeltaNet layer's state whole): the tokens do not change."""
    from phantom.stream.kvcache import CacheSet
    _, store = family_models("qwen3_5_moe")
    ps = prompts()
    with phantom.load(store, offload="disk", lora=None) as pm:
        want = greedy(pm, ps)
        if budget == "some":  # the first block's cache on the device, the second's on the host
            one = CacheSet(pm.cfg, len(ps), 16 + NEW, pm.device, pm.dtype)
            budget = one.caches[0].k.numel() * 4 + one.caches[0].v.numel() * 4
        sets = CacheSet(pm.cfg, len(ps), 16 + NEW, pm.device, pm.dtype, budget)
        assert sets.host_blocks == ([0, 1] if budget == 0 else [1])
        assert greedy(pm, ps, cache_budget=budget) == want


@pytest.mark.parametrize("n,prefetch", [(4, 1), (4, 2), (4, 4), (8, 2), (8, 4)])
def test_the_loads_of_steps_that_follow_one_another_are_the_cost_model_s(tmp_path, n, prefetch):
    """The scheduler's loads over a run of decode steps (the slots keep the blocks among both the first and the
    last of a pass) are what phantom.stream.placement.cycle_loads, which the cost model counts, says."""
    from phantom.arch.config import ModelConfig
    from phantom.convert.synthetic import write_synthetic
    from phantom.stream.placement import cycle_loads
    cfg = ModelConfig(dim=64, n_layers=n, n_heads=4, n_kv_heads=2, vocab_size=97, multiple_of=16, max_seq_len=64)
    store = write_synthetic(tmp_path / "s", cfg, torch.float32, seed=1, progress=False)
    with phantom.load(store, offload="disk", prefetch=prefetch, lora=None) as pm:
        generate_many(pm, [Request([1, 2, 3], 1)])  # the rhythm: a pass before
        pm.scheduler.take_metrics()
        generate_many(pm, [Request([1, 2, 3], 6), Request([4], 6)])
        loads = pm.scheduler.take_metrics()["loads"]
        slots = len(pm.scheduler.slots)
        expected = 6 * len(cycle_loads(pm.scheduler.layout.streamed, slots))
        # the first pass may find a block the warm-up pass left, as the loader's race with the compute goes
        assert expected - (slots if expected else 0) <= loads <= expected, (loads, expected)


def test_the_cost_model_of_generation_shares_the_reads_and_adds_the_compute():
    """A disk-streamed step takes the longer of its reads and its compute: at one sequence the reads (every
    block, each step), at many the compute; a prefill and N - 1 steps a batch; the rates read between points."""
    from phantom.arch.config import ModelConfig
    from phantom.plan.costgen import GenRates, between, predict_generation
    from phantom.plan.costinputs import MachineProfile, shape_of
    assert between(((1, 1.0), (8, 2.0), (64, 9.0)), 4) == pytest.approx(1 + 3 / 7)
    assert between(((1, 1.0), (8, 2.0), (64, 9.0)), 128) == pytest.approx(9 + 7 / 56 * 64)
    cfg = ModelConfig(dim=1024, n_layers=8, n_heads=16, vocab_size=4096)
    shape = shape_of(cfg, "fp32", "fp32", seq_len=1)
    profile = MachineProfile(machine="m", device="cpu", dtype="fp32", disk_gbps=1.0, h2d_gbps=10.0,
                             free_host_bytes=64 << 30)
    read_s = shape.block_bytes / 1e9
    rates = GenRates(decode=((1, read_s / 100), (64, read_s * 10)), rest=((1, 0.0),), prefill=((32, read_s / 10),))
    disk = phantom.Placement(offload="disk", prefetch=2)
    one = predict_generation(rates, profile, shape, disk, 1, 32, 16, 1)
    assert one.loads == 16 * cfg.n_layers  # three slots: none kept from one step to the next
    assert one.step_s == pytest.approx(cfg.n_layers * read_s, rel=0.05)  # read-bound
    many = predict_generation(rates, profile, shape, disk, 64, 32, 16, 64)
    assert many.loads == one.loads and many.step_s == pytest.approx(cfg.n_layers * read_s * 10, rel=0.05)
    assert many.tokens_per_s > 6 * one.tokens_per_s
    halves = predict_generation(rates, profile, shape, disk, 64, 32, 16, 32)
    assert halves.batches == 2 and halves.loads == 2 * one.loads
    ram = predict_generation(rates, profile, shape, phantom.Placement(offload="ram"), 1, 32, 16, 1)
    assert ram.loads == 0 and ram.step_s == pytest.approx(cfg.n_layers * read_s / 100)  # in place on a CPU


@pytest.mark.parametrize("name", ["llama-tied", "qwen3_5_moe"])
def test_a_prefill_in_groups_of_rows_gives_the_same_tokens(family_models, monkeypatch, name):
    """A CPU's prefill of many rows runs in groups of about CPU_CALL_TOKENS tokens (each group its rows of the
    cache, its rows' positions and mask), the block loaded once: here a group of one or two rows."""
    import phantom.stream.executor as executor
    model, store = family_models(name)
    ps = prompts()
    want = transformers_greedy(model, ps)
    monkeypatch.setattr(executor, "CPU_CALL_TOKENS", 32)
    with phantom.load(store, offload="disk", prefetch=1, lora=None) as pm:
        pm.scheduler.take_metrics()
        assert greedy(pm, ps) == want
        assert pm.scheduler.take_metrics()["loads"] <= NEW * pm.cfg.n_layers
