"""Preference training: one read of the weights per step, the pair data and its bad inputs."""
from __future__ import annotations

import json
import logging

import pytest
import torch

import phantom
from conftest import SMALL, randomize_lora
from phantom.data import chat
from phantom.train.preference import (PairRows, Preference, PreferenceConfig, fit, load_pairs, pair_encoder,
                                preference_loss, split_pairs)
from phantom.data.tokenizer import Tokenizer
from phantom.convert.synthetic import ensure_tiny


def random_pairs(p: int = 4, t: int = 16, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, SMALL.vocab_size, (p, 2, t), generator=gen)
    y = torch.randint(0, SMALL.vocab_size, (p, 2, t), generator=gen)
    y[:, :, :5] = -100
    return x, y


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_dpo_step_reads_the_bytes_of_an_sft_step_over_the_same_rows(small_store, prefetch):
    """The reference runs beside the policy while each block is held: no block is read again."""
    x, y = random_pairs()
    read = {}
    with phantom.load(small_store, offload="disk", prefetch=prefetch, micro_batch=4) as pm:
        randomize_lora(pm)
        pm.scheduler.take_metrics()
        for kind in ("first", "sft", "dpo", "sft-again"):  # the first step also reads the cold start
            if kind == "dpo":
                loss = Preference(PreferenceConfig())(pm, x, y)
            else:
                loss = pm(x.reshape(-1, x.shape[-1]), targets=y.reshape(-1, y.shape[-1]))
            loss.backward()
            m = pm.scheduler.take_metrics()
            read[kind] = (m["bytes_read"], m["loads"])
    assert read["sft"][0] > 0 and read["dpo"] == read["sft"] == read["sft-again"]
    assert read["first"][0] > read["sft"][0]  # so the comparison is of warm steps


def test_the_reference_is_the_base_model(small_store):
    """With the adapters at zero the policy is the reference: every margin is 0 and the loss log 2."""
    x, y = random_pairs()
    with phantom.load(small_store, offload="disk", prefetch=1, micro_batch=4) as pm:
        tokens, targets = x.reshape(-1, 16), y.reshape(-1, 16)
        with torch.no_grad():
            for m in pm.trainable_parameters():
                m.zero_()
            policy, ref = pm.sequence_logps(tokens, targets, reference=True)
            assert torch.equal(policy, ref)
            randomize_lora(pm)
            policy2, ref2 = pm.sequence_logps(tokens, targets, reference=True)
        assert torch.equal(ref2, ref) and not torch.allclose(policy2, ref)
        loss = Preference(PreferenceConfig())(pm, x, y)
        assert loss.item() != pytest.approx(0.6931, abs=1e-3)


# -- pair data ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return ensure_tiny(tmp_path_factory.mktemp("w") / "tiny")


@pytest.fixture(scope="module")
def tok(tiny):
    return Tokenizer(tiny / "tokenizer.model")


def test_chat_pairs_go_through_the_models_template(tmp_path, tiny, tok):
    """A pair of chat messages is trained as phantom.data.chat trains the same conversation in SFT: each
    row's trained tokens are those encode_chat labels for the last assistant turn."""
    template = chat.read_template(tiny, tok)
    assert template is not None
    prompt = [{"role": "user", "content": "Who kept the light?"}]
    f = write_jsonl(tmp_path / "p.jsonl", [{"prompt": prompt, "chosen": "The keeper.",
                                            "rejected": [{"role": "assistant", "content": "The terns."}]}])
    pairs = load_pairs(f, tok, encode=pair_encoder(template))
    x, y, _ = PairRows(pairs, 64, pad_id=tok.eos_id)[0]
    for row, answer in ((0, "The keeper."), (1, "The terns.")):
        ids, labels = chat.encode_chat(tok, template, prompt + [{"role": "assistant", "content": answer}], "last")
        n = len(ids)
        assert x[row, :n].tolist() == ids
        assert [t for t in y[row].tolist() if t != -100] == [t for t in labels[1:] if t != -100]
    assert load_pairs(f, tok).prompts[0].tolist() != pairs.prompts[0].tolist()  # plain rendering differs


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_pairs_become_two_rows_with_the_loss_on_the_responses(tmp_path, tok):
    f = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "The keeper", "chosen": " lit the lamp", "rejected": " the lamp lit"},
                                           {"prompt": [{"role": "user", "content": "Hi"}], "chosen": "Hello",
                                            "rejected": [{"role": "assistant", "content": "Go"}]}])
    pairs = load_pairs(f, tok)
    assert len(pairs) == 2
    x, y, ref = PairRows(pairs, 32, pad_id=tok.eos_id)[0]
    assert x.shape == y.shape == (2, 32) and torch.isnan(ref).all()
    prompt = [tok.bos_id] + tok.encode("The keeper", bos=False)
    chosen = tok.encode(" lit the lamp", bos=False) + [tok.eos_id]
    assert x[0, :len(prompt)].tolist() == prompt and x[1, :len(prompt)].tolist() == prompt
    trained = y[0][y[0] != -100].tolist()
    assert trained == chosen  # the response and its EOS, nothing of the prompt or the padding
    assert (y[0, :len(prompt) - 1] == -100).all()


def test_long_pairs_keep_bos_and_the_prompts_end():
    prompt, response = torch.arange(100, 120).numpy(), torch.arange(1, 9).numpy()
    p, r = fit(prompt, response, 16)
    assert p[0] == 100 and p[-1] == 119 and len(p) + len(r) == 16 and list(r) == list(range(1, 9))
    p, r = fit(prompt[:3], torch.arange(1, 40).numpy(), 16)
    assert list(p) == [100, 101, 102] and len(r) == 13


@pytest.mark.parametrize("record,message", [
    ({"prompt": "a", "chosen": "b"}, "no 'rejected'"),
    ({"chosen": "b", "rejected": "c"}, "no 'prompt'"),
    ({"prompt": "a", "chosen": "", "rejected": "c"}, "chosen response is empty"),
    ({"prompt": "a", "chosen": "b", "rejected": 3}, "rejected must be a string"),
])
def test_bad_pairs_name_their_line(tmp_path, tok, record, message):
    f = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c"}, record])
    with pytest.raises(ValueError, match=f"p.jsonl:2: .*{message}"):
        load_pairs(f, tok)


def test_identical_responses_are_counted_in_a_warning(tmp_path, tok, caplog):
    f = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "b"},
                                           {"prompt": "a", "chosen": "b", "rejected": "c"},
                                           {"prompt": "x", "chosen": "y", "rejected": "y"}])
    with caplog.at_level(logging.WARNING):
        pairs = load_pairs(f, tok)
    assert len(pairs) == 3 and "2 of 3 pairs have identical chosen and rejected" in caplog.text
    train, val = split_pairs(pairs, 0.34)
    assert (len(train), len(val)) == (2, 1)


def test_reward_figures_are_trls_summed_log_ratios_for_every_loss():
    """TRL logs rewards as beta * (summed policy - reference log-probabilities) whatever the loss;
    IPO averages over each response for its loss alone. Here the averaged ratios would flip the
    accuracy (chosen 0.1/10 > rejected 1.5/30 per token, 1.0 < 1.5 summed)."""
    p, r, n = torch.tensor([[-10.0, -10.5]]), torch.tensor([[-11.0, -12.0]]), torch.tensor([[10.0, 30.0]])
    beta = 0.1
    trl = {"rewards_chosen": beta * (-10 - -11), "rewards_rejected": beta * (-10.5 - -12),
           "reward_margin": beta * ((-10 - -11) - (-10.5 - -12)), "reward_accuracy": 0.0}
    figures = {loss: preference_loss(p, r, PreferenceConfig(loss=loss, beta=beta), n)[1] for loss in ("sigmoid", "ipo")}
    for loss, got in figures.items():
        assert got == pytest.approx(trl, rel=1e-6), loss
    ipo_loss, _ = preference_loss(p, r, PreferenceConfig(loss="ipo", beta=beta), n)
    margin = (-10 / 10 - -10.5 / 30) - (-11 / 10 - -12 / 30)  # the loss still averages per token
    assert ipo_loss.item() == pytest.approx((margin - 1 / (2 * beta)) ** 2, rel=1e-6)
