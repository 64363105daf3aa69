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
from phantom.arch.ops import document_mask, document_spans, packed_layout, rope_table
from phantom.arch.tiled import by_documents
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
    rope, first = packed_layout(table, seg)
    assert torch.equal(rope[0], table[[0, 1, 2, 0, 1, 0, 1, 2]]) and torch.equal(rope[1], table)
    assert first.tolist() == [[0, 0, 0, 3, 3, 5, 5, 5], [0] * 8]  # each token's example's first position
    assert document_spans(first) == [(0, 0, 3), (0, 3, 5), (0, 5, 8), (1, 0, 8)]
    mask = document_mask(first)  # the dense mask it stands for
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


LATENT = dict(kv_lora_rank=16, qk_nope_head_dim=8, v_head_dim=12, explicit_head_dim=16, rotary_dim=8,
              rope_interleave=False, family="deepseek_v3", n_experts=4, experts_per_token=2,
              expert_dim=16)  # DeepSeek-V3's latent attention (phantom.arch.mla) as HF ships it, its experts


@pytest.mark.parametrize("attention", [{"n_kv_heads": 1}, LATENT], ids=["grouped", "latent"])
def test_a_long_packed_row_makes_no_t_by_t_tensor(tmp_path, attention):
    """At 4096 tokens a packed row's examples travel as (B, T) (packed_layout) and attention runs each example
    alone (phantom.arch.tiled.by_documents): no tensor of the row's T x T is made, forward or backward (the dense
    mask alone would be 16.8M), and the packed row's loss is what its examples give alone; with grouped heads and
    with latent attention (there one example's scores are the largest tensor)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    T, lengths = 4096, (1500, 1300, 1296)
    cfg = ModelConfig(dim=32, n_layers=2, n_heads=2, vocab_size=97, multiple_of=16, max_seq_len=T, **attention)
    path = write_synthetic(tmp_path / "long", cfg, torch.float32, seed=1, progress=False, init="fan_in")
    x = torch.randint(1, cfg.vocab_size, (1, T))
    seg = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    # SDPA's CPU flash kernel keeps no scores; where v is narrower than q and k (latent attention) its math path makes
    # one example's (heads, L, L) scores at a time, never the row's
    bound = T * T // 16 if "n_kv_heads" in attention else cfg.n_heads * max(lengths) ** 2 + 1

    class Largest(TorchDispatchMode):
        most = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.most = max(self.most, t.numel())
            return out
    targets = x[:, 1:].clone()
    ends = torch.tensor(lengths).cumsum(0)[:-1] - 1
    targets[0, ends] = D.IGNORE_INDEX  # a last token's next one is the next example's first
    with phantom.load(path, offload="disk", lora=phantom.LoraConfig(rank=4, targets=("q", "v"))) as model:
        randomize_lora(model)
        with Largest() as seen:
            loss = model(x[:, :-1], targets=targets, segments=seg[:, :-1])
            loss.backward()
        assert 0 < seen.most < bound < T * T, seen.most
        with torch.no_grad():
            at, alone = 0, 0.0
            for n in lengths:
                logits = model(x[:, at:at + n - 1])[0]
                alone += F.cross_entropy(logits, x[0, at + 1:at + n], reduction="sum")
                at += n
    assert abs(float(loss) - float(alone) / (T - len(lengths))) <= TOL * float(loss)


@pytest.mark.parametrize("variant", [{}, {"sliding_window": 5}, {"attn_softcap": 20.0, "query_pre_attn_scalar": 12.0},
                                     {"attn_sinks": True},
                                     {"attn_chunk": 6, "layer_types": ("chunked_attention",), "rope_theta": 500000.0}])
def test_each_example_alone_equals_the_dense_document_mask(variant):
    """The attention of packed rows run example by example (by_documents) equals the whole row under the dense
    mask the examples stand for (document_mask), outputs and the gradients of q, k, v and the sinks: windows,
    soft caps, sinks and Llama 4's chunks counted within each example from its own first position."""
    import dataclasses
    from phantom.arch.layers import Attention
    from phantom.arch.ops import document_mask
    cfg = dataclasses.replace(CFG, **variant)
    torch.manual_seed(0)
    att = Attention(cfg, dtype=torch.float32)
    if att.sinks is not None:
        torch.nn.init.normal_(att.sinks)
    seg = torch.tensor([[0] * 9 + [1] * 14 + [2] * 9, [0] * 20 + [1] * 12])
    rope, first = packed_layout(rope_table(cfg, 32), seg)
    B, H, KV, Dh = 2, cfg.n_heads, cfg.kv_heads, cfg.head_dim
    q, k, v = (torch.randn(B, n, 32, Dh, requires_grad=True) for n in (H, KV, KV))
    g = torch.randn(B, H, 32, Dh)
    outs = []
    for mask in (first, document_mask(first)):
        if mask.dim() == 2:
            out = by_documents(att.alone, q, k, v, document_spans(mask), [att.sinks] if att.sinks is not None else [])
        else:
            out = att.attend_row(q, k, v, rope, None, 0, mask)
        wrt = [q, k, v] + ([att.sinks] if att.sinks is not None else [])
        outs.append((out, torch.autograd.grad(out, wrt, g)))
    (got, got_grads), (ref, ref_grads) = outs
    assert max_rel_err(got, ref) <= TOL
    for a, b in zip(got_grads, ref_grads):
        assert max_rel_err(a, b) <= TOL
