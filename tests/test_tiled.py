"""Tiled block compute (phantom.arch.tiled): a row longer than `mlp_chunk` runs each block's MLP and its norms a
chunk of tokens at a time, forward and backward. It computes what the untiled block computes: logits, loss and
every LoRA gradient of a dense model, a mixture of experts (LoRA on its experts too) and a latent-attention model
within 1e-5 of the same run untiled (fp32), streamed from disk and RAM, kept and recomputed; and against peft on
transformers' own model. Dropout is replayed chunk by chunk; full finetuning's weight gradients go through it.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

import phantom
from family_check import MLA_LORA, batch, lora_step, peft_step, rel_err
from phantom.arch.layers import TransformerBlock
from phantom.arch.ops import rope_table
from phantom.arch.presets import PRESETS
from phantom.arch.tiled import TiledCompute, tiled

CHUNK = 16  # rows of 40 tokens: chunks of 16, 16 and 8
EXPERTS = ("q", "k", "v", "o", "gate", "up", "down")
MODELS = [("llama-tied", EXPERTS), ("llama-tied", ("q", "v")), ("qwen3_moe", EXPERTS),
          ("deepseek_v3", MLA_LORA["lora_targets"] + ("gate", "up", "down")),
          ("llama-tied", ("o", "down"))]  # ("q", "v"): k has no trained path; ("o", "down"): no q, k, v has one
RUNS = [("disk", 1, "all"), ("disk", 0, "none"), ("ram", 2, "all"), ("ram", 0, "none"), ("none", 0, "all")]


def step(store, tokens, targets, lora_targets, dropout: float = 0.0, **knobs):
    """One LoRA step (B random, so A gets gradients): logits, loss, {name: gradient} of every LoRA tensor."""
    lora = phantom.LoraConfig(rank=4, alpha=8, targets=lora_targets, dropout=dropout)
    with phantom.load(store, lora=lora, loss_chunk=7, verify="none", **knobs) as pm:
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in pm.trainable_parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            logits = pm(tokens) if not dropout else None
        torch.manual_seed(3)
        loss = pm(tokens, targets=targets)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in pm.named_parameters() if p.requires_grad}
    assert grads and all(g.abs().max() > 0 for n, g in grads.items() if n.endswith("lora_B")), "B must train"
    return logits, loss.detach(), grads


def assert_same(got, ref, run):
    (logits, loss, grads), (ref_logits, ref_loss, ref_grads) = got, ref
    if ref_logits is not None:
        assert rel_err(logits, ref_logits) < 1e-5, run
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        assert rel_err(g, ref_grads[name]) < 1e-5, (run, name)


@pytest.mark.parametrize("name,lora_targets", MODELS)
def test_tiled_equals_untiled_streamed_every_way(family_models, name, lora_targets):
    _, store = family_models(name)
    tokens, targets = batch()
    ref = step(store, tokens, targets, lora_targets, offload="none", mlp_chunk=0)
    for offload, prefetch, recompute in RUNS:
        got = step(store, tokens, targets, lora_targets, offload=offload, prefetch=prefetch, recompute=recompute,
                   mlp_chunk=CHUNK)
        assert_same(got, ref, (name, offload, prefetch, recompute))


@pytest.mark.parametrize("name,lora_targets", [("llama-tied", EXPERTS), ("qwen3_moe", ("q", "k", "v", "o")),
                                               ("deepseek_v3", MLA_LORA["lora_targets"])])
def test_tiled_equals_peft_on_transformers_model(family_models, tmp_path, name, lora_targets):
    model, store = family_models(name)
    tokens, targets = batch()
    lora_step(store, tokens, targets, tmp_path / "adapter", lora_targets, offload="none", mlp_chunk=0)
    ref_logits, ref_loss, ref_grads = peft_step(model, tmp_path / "adapter", tokens, targets)
    for offload in ("disk", "ram"):
        logits, loss, grads = lora_step(store, tokens, targets, lora_targets=lora_targets, offload=offload,
                                        mlp_chunk=CHUNK)
        assert rel_err(logits, ref_logits) < 1e-5, offload
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
        assert grads.keys() == ref_grads.keys()
        for key, (ga, gb) in grads.items():
            assert rel_err(ga, ref_grads[key][0]) < 1e-4 and rel_err(gb, ref_grads[key][1]) < 1e-4, (offload, key)


def test_dropout_is_replayed_chunk_by_chunk(family_models):
    """With LoRA dropout the tiled run draws per chunk: kept, recomputed and resident runs draw the same."""
    _, store = family_models("llama-tied")
    tokens, targets = batch()
    ref = step(store, tokens, targets, EXPERTS, dropout=0.2, offload="none", mlp_chunk=CHUNK)
    for offload, prefetch, recompute in RUNS[:2]:
        assert_same(step(store, tokens, targets, EXPERTS, dropout=0.2, offload=offload, prefetch=prefetch,
                         recompute=recompute, mlp_chunk=CHUNK), ref, (offload, recompute))
    untiled = step(store, tokens, targets, EXPERTS, dropout=0.2, offload="none", mlp_chunk=0)
    assert not torch.equal(untiled[1], ref[1])  # it does draw: a row's mask is drawn per chunk, not at once


def test_a_tiled_block_gives_weight_and_input_gradients_through_autograd_grad():
    """Full finetuning's path: the block's weights as leaves, gradients taken with torch.autograd.grad over
    explicit inputs (as the executor takes them) equal the untiled block's; a short row is not tiled."""
    cfg = PRESETS["tiny"]
    torch.manual_seed(0)
    block = TransformerBlock(cfg, dtype=torch.float32)
    x = torch.randn(2, 40, cfg.dim, requires_grad=True)
    rope = rope_table(cfg, 40)
    weights = [p for p in block.parameters()]
    grads = []
    for chunk in (None, CHUNK):
        block.mlp_chunk = chunk
        out = block(x, rope)
        grads.append(torch.autograd.grad(out, [x] + weights, torch.ones_like(out)))
    for g, ref in zip(grads[1], grads[0]):
        assert rel_err(g, ref) < 1e-5
    seen = []
    block.mlp_chunk = 64
    hook = TiledCompute.apply
    try:
        TiledCompute.apply = lambda *a: seen.append(a) or hook(*a)
        block(x, rope).sum().backward()
    finally:
        TiledCompute.apply = hook
    assert not seen  # 40 tokens, chunks of 64: the block as it always ran


def test_no_grad_runs_chunks_without_a_node():
    h = torch.randn(1, 10, 4)
    calls = []
    out = tiled(lambda c, a: calls.append((a, c.shape[1])) or (c * 2, c[..., :1] + a), h, 4, [])
    assert calls == [(0, 4), (4, 4), (8, 2)] and torch.equal(out[0], h * 2)
    assert torch.equal(out[1], h[..., :1] + torch.tensor([0] * 4 + [4] * 4 + [8] * 2)[None, :, None])


# attention's token-wise inputs are tiled too: every variant of them (fused projections, q/k norms, partial
# rotary, two RoPE bases, gates, sinks, windows, soft caps, a linear-attention layer beside)
VARIANTS = {"gemma2": ("q", "k", "v", "o"), "gemma3": ("q", "k", "v", "o"), "phi4-mini": ("q", "k", "v", "o"),
            "gpt_oss": ("q", "k", "v", "o"), "qwen3_next": ("q", "k", "v", "o"), "mistral": EXPERTS}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_tiled_attention_inputs_of_every_variant_equal_untiled(family_models, name):
    _, store = family_models(name)
    tokens, targets = batch()
    ref = step(store, tokens, targets, VARIANTS[name], offload="none", mlp_chunk=0)
    for offload, prefetch, recompute in RUNS[:2]:
        got = step(store, tokens, targets, VARIANTS[name], offload=offload, prefetch=prefetch, recompute=recompute,
                   mlp_chunk=CHUNK)
        assert_same(got, ref, (name, offload, prefetch, recompute))


def test_packed_rows_tile_with_their_own_positions(family_models):
    """Rows packing several examples (segment ids): each chunk reads its rows' positions."""
    _, store = family_models("llama-tied")
    tokens, targets = batch()
    segments = torch.tensor([[0] * 13 + [1] * 20 + [2] * 7, [0] * 30 + [1] * 10])
    out = []
    for chunk in (0, CHUNK):
        lora = phantom.LoraConfig(rank=4, alpha=8, targets=EXPERTS)
        with phantom.load(store, lora=lora, loss_chunk=7, verify="none", offload="disk", mlp_chunk=chunk) as pm:
            gen = torch.Generator().manual_seed(1)
            with torch.no_grad():
                for p in pm.trainable_parameters():
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            loss = pm(tokens, targets=targets, segments=segments)
            loss.backward()
            out.append((loss.detach(), [p.grad.clone() for p in pm.trainable_parameters()]))
    torch.testing.assert_close(out[1][0], out[0][0], rtol=1e-5, atol=0)
    for g, ref in zip(out[1][1], out[0][1]):
        assert rel_err(g, ref) < 1e-5


def test_a_recompute_only_backpropagated_computes_the_residual_part_once():
    """A residual part (h + fn(h), the MLP) equals h + fn(h) computed at once. Under outputs_unused (the executor's
    recompute in a block's backward) its forward computes no chunk (one token, for the output's dtype) and its
    output holds one value, not the row; its backward every chunk: the same gradients as at once."""
    from phantom.arch.tiled import outputs_unused
    lin = torch.nn.Linear(4, 4)
    h = torch.randn(2, 10, 4, requires_grad=True)
    g_out = torch.randn(2, 10, 4)
    ref_out = h + torch.tanh(lin(h))
    ref = torch.autograd.grad(ref_out, [h, lin.weight, lin.bias], g_out)
    calls = []

    def fn(c, a):
        calls.append((a, c.shape[1]))
        return torch.tanh(lin(c))
    for unused in (False, True):
        calls.clear()
        with outputs_unused() if unused else contextlib.nullcontext():
            out = tiled(fn, h, 4, [lin], residual=True)
        if unused:
            assert out.untyped_storage().nbytes() == out.element_size() and out.shape == h.shape
        else:
            assert rel_err(out, ref_out) < 1e-6
        forward = [(0, 1)] if unused else [(0, 4), (4, 4), (8, 2)]
        grads = torch.autograd.grad(out, [h, lin.weight, lin.bias], g_out)
        assert calls == forward + [(0, 4), (4, 4), (8, 2)]
        for g, r in zip(grads, ref):
            assert rel_err(g, r) < 1e-6


def test_a_given_up_gradient_takes_the_residual_parts_input_gradient():
    """Under consumed(g) (a streamed block's backward gives up its incoming gradient) a residual part writes its
    input's gradient into g's memory, chunk by chunk: the same values as h + fn(h) at once, and no row-sized tensor
    beside g. Without it, or where g is expanded (its elements share memory), g is left as it was."""
    from phantom.arch.tiled import consumed
    lin = torch.nn.Linear(4, 4)
    h = torch.randn(2, 10, 4, requires_grad=True)
    g_out = torch.randn(2, 10, 4)
    ref = torch.autograd.grad(h + torch.tanh(lin(h)), [h, lin.weight], g_out)
    for given, g in ((False, g_out.clone()), (True, g_out.clone()), (True, g_out[:, :1].expand(2, 10, 4))):
        before = g.clone()
        out = tiled(lambda c, a: torch.tanh(lin(c)), h, 4, [lin], residual=True)
        with consumed(g) if given else contextlib.nullcontext():
            dh, dw = torch.autograd.grad(out, [h, lin.weight], g)
        written = given and g.is_contiguous()
        assert (dh.data_ptr() == g.data_ptr()) == written
        assert torch.equal(g, before) != written
        if g.is_contiguous():
            assert rel_err(dh, ref[0]) < 1e-6 and rel_err(dw, ref[1]) < 1e-6


def test_a_streamed_tiled_block_writes_its_input_gradient_into_the_one_coming_in(family_models, monkeypatch):
    """Each streamed block gives up its incoming gradient (consumed): every tiled block's residual part, kept or
    recomputed, from disk or RAM, writes the row's gradient there (the engine hands it on as it is). Resident blocks
    (offload none) are one autograd graph with nothing given up: there the part writes a tensor of its own."""
    import phantom.arch.tiled as T
    real, seen = T._writable, []
    monkeypatch.setattr(T, "_writable", lambda g, h: seen.append(real(g, h)) or seen[-1])
    _, store = family_models("llama-tied")
    tokens, targets = batch()
    for offload, prefetch, recompute in RUNS:
        seen.clear()
        step(store, tokens, targets, ("q", "v"), offload=offload, prefetch=prefetch, recompute=recompute,
             mlp_chunk=CHUNK)
        assert seen and all(seen) == (offload != "none"), (offload, recompute, seen)
