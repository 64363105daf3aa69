"""Packing that does not leak: a packed row's logits and each example's loss (and its LoRA gradient)
equal those of the example run alone, in the resident model and the streamed one (disk tier,
prefetch 2), fp32 within 1e-5."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import phantom
from phantom.data import batches as B, dataset as D
from phantom.arch.config import ModelConfig
from phantom.convert.synthetic import write_synthetic
from phantom.arch.ops import packed_layout, rope_table
from conftest import max_rel_err, randomize_lora

CFG = ModelConfig(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=97, multiple_of=16, max_seq_len=64)
LENGTHS = (7, 12, 5)  # three examples packed into one row of 32 (the rest is padding)
SEQ = 32
TOL = 1e-5


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return write_synthetic(tmp_path_factory.mktemp("pack") / "s", CFG, torch.float32, seed=1, progress=False,
                           init="fan_in")


@pytest.fixture(scope="module")
def packed():
    """One Packed row of three examples, each BOS-led with prompt tokens masked, and the examples alone."""
    g = np.random.default_rng(0)
    tokens, labels, starts = [], [], []
    for n in LENGTHS:
        starts.append(len(tokens))
        t = [1] + g.integers(3, CFG.vocab_size, n - 1).tolist()
        tokens += t
        labels += [D.IGNORE_INDEX] * 3 + t[3:]
    data = D.TokenData(np.array(tokens, np.uint16), np.array(labels, np.int32), np.array(starts), "prompt", "k")
    ds = B.rows(data, SEQ, pad_id=0, segments=True)
    assert len(ds) == 1
    x, y, seg = ds[0]
    alone = [(torch.tensor(tokens[s:s + n][:-1]), torch.tensor(labels[s:s + n][1:])) for s, n in zip(starts, LENGTHS)]
    return x[None], y[None], seg[None], starts, alone


def test_segments_and_layout():
    seg = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2], [0] * 8])
    table = rope_table(CFG, 8)
    rope, mask = packed_layout(table, seg)
    assert torch.equal(rope[0], table[[0, 1, 2, 0, 1, 0, 1, 2]]) and torch.equal(rope[1], table)
    assert mask.shape == (2, 1, 8, 8) and mask[0, 0, 4].tolist() == [False] * 3 + [True] * 2 + [False] * 3
    assert torch.equal(mask[1, 0], torch.ones(8, 8, dtype=torch.bool).tril())
    rope, mask = packed_layout(table, seg[1:])
    assert mask is None and torch.equal(rope, table)  # no packed row: SDPA's causal kernel


@pytest.mark.parametrize("offload, prefetch", [("none", 2), ("disk", 2)])
def test_packed_row_equals_examples_alone(store, packed, offload, prefetch):
    x, y, seg, starts, alone = packed
    with phantom.load(store, offload=offload, prefetch=prefetch, dtype=torch.float32,
                      lora=phantom.LoraConfig(rank=4, targets=("q", "k", "v", "o"))) as model:
        randomize_lora(model)
        with torch.no_grad():
            logits = model(x, segments=seg)[0]
            leaky = model(x)[0]
            at = 0
            for (xa, _), n in zip(alone, LENGTHS):
                ref = model(xa[None])[0]
                assert max_rel_err(logits[at:at + n - 1], ref) <= TOL
                at += n
            assert max_rel_err(leaky[LENGTHS[0]:LENGTHS[0] + LENGTHS[1] - 1], model(alone[1][0][None])[0]) > 1e-3
        for k, ((xa, ya), n) in enumerate(zip(alone, LENGTHS)):  # each example's loss and gradient, packed vs alone
            only = torch.full_like(y, D.IGNORE_INDEX)
            s = sum(LENGTHS[:k])
            only[0, s:s + n - 1] = y[0, s:s + n - 1]
            packed_loss, packed_grads = loss_and_grads(model, x, only, seg)
            ref_loss, ref_grads = loss_and_grads(model, xa[None], ya[None], None)
            assert abs(packed_loss - ref_loss) <= TOL * abs(ref_loss)
            ref_from_logits = F.cross_entropy(logits[s:s + n - 1], ya, ignore_index=D.IGNORE_INDEX)
            assert abs(packed_loss - float(ref_from_logits)) <= TOL * abs(ref_loss)
            for name in ref_grads:
                assert max_rel_err(packed_grads[name], ref_grads[name]) <= TOL, name


def loss_and_grads(model, x, y, seg) -> tuple[float, dict]:
    model.zero_grad(set_to_none=True)
    loss = model(x, targets=y, **({"segments": seg} if seg is not None else {}))
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
