"""Scoring many sequences (phantom.train.score): every request of a wave through a block while it is loaded
once, the waves predicted by phantom.plan.costscore, padded micro-batches exact against each request run
alone, rolling windows as lm-eval cuts them."""
from __future__ import annotations

import random

import pytest
import torch

import phantom
from phantom.plan import costscore
from phantom.train import score as S
from conftest import SMALL, need


def requests(n: int, seed: int = 0, longest: int = 40):
    rng = random.Random(seed)
    return [([rng.randrange(SMALL.vocab_size) for _ in range(rng.randint(1, longest))],
             [rng.randrange(SMALL.vocab_size) for _ in range(rng.randint(1, 6))]) for _ in range(n)]


def alone(model, context, continuation):
    """The request run by itself through the model's forward: its log-probability and greedy match."""
    inp, cont = S.window(context, continuation, model.cfg.max_seq_len)
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([inp])), -1)[0, -len(cont):]
    return float(logp.gather(1, torch.tensor(cont)[:, None]).sum()), bool((logp.argmax(-1) == torch.tensor(cont)).all())


def test_plan_sorts_longest_first_and_bounds_micro_batches_and_waves():
    b = costscore.ScoreBudget(token_bytes=10, wave_bytes=10 * 100, micro_tokens=60, max_rows=3)
    plan = costscore.plan_scoring([5, 30, 20, 20, 7, 50, 1], b)
    assert plan.micro_batches == ((5,), (1, 2), (3, 4, 0), (6,))  # 2 x 30 <= 60; 3 x 20 <= 60; 3 rows at most
    assert plan.padded == (50, 60, 60, 1)
    assert plan.waves == ((0,), (1,), (2, 3))  # 50 + 60 > 100, 60 + 60 > 100, 60 + 1 <= 100
    one = costscore.plan_scoring([100], b)  # larger than any bound: alone, still run
    assert one.micro_batches == ((0,),) and one.waves == ((0,),)
    split = costscore.plan_scoring([20, 18, 17, 16], costscore.ScoreBudget(10, 10**6, 100, boundary=17))
    assert split.micro_batches == ((0, 1), (2, 3))  # longrope: no micro-batch on both sides of 17 tokens


@pytest.mark.parametrize("offload", ["none", "disk"])
def test_scores_equal_each_request_run_alone(small_store, offload):
    reqs = requests(9)
    with phantom.load(small_store, offload=offload, prefetch=1, lora=None) as model:
        got = S.score(model, reqs, batch_size=4, wave_bytes=3 * 40 * model.cfg.dim * 4 * 2)
        for (logp, greedy), (ctx, cont) in zip(got, reqs):
            ref_logp, ref_greedy = alone(model, ctx, cont)
            assert logp == pytest.approx(ref_logp, abs=1e-4) and greedy == ref_greedy


def test_a_wave_reads_each_block_once(small_store):
    """R requests in W waves (the cost model's count) acquire each block W times and read it W times from
    disk with one slot: R requests cost W passes over the weights, not R."""
    reqs = requests(12, seed=1)
    with phantom.load(small_store, offload="disk", prefetch=0, lora=None) as model:
        wave_bytes = costscore.token_bytes(model.cfg, 4) * 60
        plan, _ = S.plan_for(model, [len(S.window(c, x, 64)[0]) for c, x in reqs], 2, wave_bytes)
        assert len(plan.waves) > 2
        acquired = []
        real = model.scheduler.acquire
        model.scheduler.acquire = lambda i: acquired.append(i) or real(i)
        model.scheduler.take_metrics()
        S.score(model, reqs, batch_size=2, wave_bytes=wave_bytes)
        loads = model.scheduler.take_metrics()["loads"]
    n = SMALL.n_layers
    assert acquired == list(range(n)) * len(plan.waves)
    assert loads == n * len(plan.waves)


def test_rolling_windows_are_lm_evals():
    utils = need("lm_eval.utils")
    rng = random.Random(0)
    for length in (0, 1, 5, 63, 64, 65, 127, 128, 129, 300):
        tokens = [rng.randrange(1000) for _ in range(length)]
        for max_len in (1, 2, 16, 64):
            ref = [utils.make_disjoint_window(w) for w in
                   utils.get_rolling_token_windows(tokens, prefix_token=7, max_seq_len=max_len, context_len=1)]
            assert S.rolling_windows(tokens, 7, max_len) == [(list(a), list(b)) for a, b in ref], (length, max_len)


def test_documents_sum_their_windows(small_store):
    rng = random.Random(2)
    docs = [[rng.randrange(SMALL.vocab_size) for _ in range(k)] for k in (3, 64, 150)]
    with phantom.load(small_store, offload="none", lora=None) as model:
        got = S.score_documents(model, docs, prefix=1, batch_size=2)
        for doc, total in zip(docs, got):
            windows = S.rolling_windows(doc, 1, model.cfg.max_seq_len)
            assert total == pytest.approx(sum(alone(model, c, x)[0] for c, x in windows), abs=1e-3)


def test_bad_requests_are_refused(small_store):
    with phantom.load(small_store, offload="none", lora=None) as model:
        with pytest.raises(ValueError, match="a context and a continuation"):
            S.score(model, [([], [1])])
        with pytest.raises(ValueError, match="longer than the model's context"):
            S.score(model, [([1], [2] * 65)])


@pytest.mark.parametrize("name", ["phi4-mini", "qwen3_next"])
def test_scores_equal_transformers_row_by_row(family_models, name):
    """Padded micro-batches of a streamed model against each request run alone by its transformers model: longrope
    past its original context of 16 (Phi-4-mini's shape) on both sides of it, and Gated DeltaNet layers with a
    mixture of experts (Qwen3-Next's), where pads follow every real token through the recurrence and the routers."""
    hf, store = family_models(name)
    rng = random.Random(3)
    reqs = [([rng.randrange(400) for _ in range(n)], [rng.randrange(400) for _ in range(k)])
            for n, k in ((3, 2), (12, 3), (14, 2), (15, 5), (30, 4), (9, 1), (40, 6), (17, 4), (16, 1))]
    with phantom.load(store, offload="disk", prefetch=1, lora=None) as model:
        got = S.score(model, reqs, batch_size=3)
    for (ctx, cont), (logp, greedy) in zip(reqs, got):
        inp, cont = S.window(ctx, cont, model.cfg.max_seq_len)
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([inp])).logits.float(), -1)[0, -len(cont):]
        assert logp == pytest.approx(float(ref.gather(1, torch.tensor(cont)[:, None]).sum()), abs=1e-4)
        assert greedy == bool((ref.argmax(-1) == torch.tensor(cont)).all())


def test_repeated_and_prefix_inputs_run_once_and_score_as_alone(small_store):
    """A request repeated, one whose input starts another's, and one that splits the same tokens into context and
    continuation elsewhere (what lm-eval 0.4.13's logits cache scores at the wrong positions) ride on one row
    each: fewer rows run, every score equals the request run alone."""
    rng = random.Random(5)
    ctx = [rng.randrange(SMALL.vocab_size) for _ in range(12)]
    cont = [rng.randrange(SMALL.vocab_size) for _ in range(4)]
    reqs = [(ctx, cont), (ctx, cont), (ctx, cont + [7, 9]), (ctx + cont[:2], cont[2:]), (ctx[:5], ctx[5:9])] + \
        requests(3, seed=6)
    carriers, carrier_of = S.shared_inputs([S.window(c, x, 64)[0] for c, x in reqs])
    assert len(carriers) == 4 and len(set(carrier_of[:5])) == 1  # the first five ride on (ctx, cont + [7, 9])
    with phantom.load(small_store, offload="disk", prefetch=1, lora=None) as model:
        rows = []
        real = model.backend.run_micro_batches
        model.backend.run_micro_batches = lambda batches: rows.extend(h.shape[0] for h, *_ in batches) or real(batches)
        got = S.score(model, reqs)
        assert sum(rows) == 4
        for (logp, greedy), (c, x) in zip(got, reqs):
            ref_logp, ref_greedy = alone(model, c, x)
            assert logp == pytest.approx(ref_logp, abs=1e-4) and greedy == ref_greedy


def test_a_micro_batch_carries_its_token_ids_on_the_hidden_states_device():
    """What scoring asks of a GPU: each micro-batch's token ids (DeepSeek-V4's hashed layers route by them) on the
    device of its hidden states, rows right-padded with 0 as the hidden states are (a fake device: meta)."""
    class Model:
        def embed(self, tokens):
            return torch.empty(*tokens.shape, 8, device="meta")

        def rope_for(self, n):
            return torch.zeros(n, 2)
    h, rope, ids = S._embedded(Model(), [[5, 6, 7], [9]])
    assert ids.device == h.device == torch.device("meta") and ids.shape == (2, 3) and rope.shape[0] == 3
    class OnCpu(Model):
        def embed(self, tokens):
            return torch.empty(*tokens.shape, 8)
    assert S._embedded(OnCpu(), [[5, 6, 7], [9]])[2].tolist() == [[5, 6, 7], [9, 0, 0]]
