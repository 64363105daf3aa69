"""The streamed model against the resident reference built from the same store (fp32, tight)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import phantom
from conftest import SMALL, batch, max_rel_err, randomize_lora

TOL = 1e-5


def run(store, offload, lora=phantom.LoraConfig(rank=4, targets=("q", "k", "v", "o", "gate", "up", "down")),
        seed_before_forward=123, prepare=None, **kw):
    """Logits, loss and every LoRA gradient of one forward/backward (prepare(model) runs first)."""
    model = phantom.load(store, offload=offload, lora=lora, **kw)
    if prepare is not None:
        prepare(model)
    randomize_lora(model)
    tokens, targets = batch(SMALL)
    with torch.no_grad():
        logits = model(tokens)
    torch.manual_seed(seed_before_forward)  # dropout masks: same draws in both models
    loss = model(tokens, targets=targets)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.close()
    return logits, loss.detach(), grads


@pytest.fixture(scope="module")
def reference(small_store):
    return run(small_store, "none")


@pytest.mark.parametrize("offload", ["ram", "disk"])
@pytest.mark.parametrize("prefetch", [0, 1, 2, 3, 4])
def test_streamed_matches_resident(small_store, reference, offload, prefetch):
    logits, loss, grads = run(small_store, offload, prefetch=prefetch)
    ref_logits, ref_loss, ref_grads = reference
    assert max_rel_err(logits, ref_logits) <= TOL
    assert max_rel_err(loss, ref_loss) <= TOL
    assert grads.keys() == ref_grads.keys() and len(grads) == 2 * 7 * SMALL.n_layers
    for name in ref_grads:
        assert ref_grads[name].abs().max() > 0, name  # a gradient that is zero would prove nothing
        assert max_rel_err(grads[name], ref_grads[name]) <= TOL, name


@pytest.mark.parametrize("offload", ["none", "ram", "disk"])
def test_chunked_loss_matches_full_cross_entropy(small_store, offload):
    model = phantom.load(small_store, offload=offload, lora=None)
    model.loss_chunk = 7  # chunks that do not divide the token count
    tokens, targets = batch(SMALL)
    with torch.no_grad():
        logits = model(tokens)
        loss = model(tokens, targets=targets)
    ref = F.cross_entropy(logits.view(-1, SMALL.vocab_size), targets.view(-1), ignore_index=-100)
    assert max_rel_err(loss, ref) <= TOL
    model.close()


@pytest.mark.parametrize("offload", ["ram", "disk"])
def test_dropout_is_replayed_in_the_recompute(small_store, offload):
    lora = phantom.LoraConfig(rank=4, dropout=0.3, targets=("q", "v", "down"))
    _, ref_loss, ref_grads = run(small_store, "none", lora=lora)
    _, loss, grads = run(small_store, offload, lora=lora)
    assert max_rel_err(loss, ref_loss) <= TOL
    for name in ref_grads:
        assert max_rel_err(grads[name], ref_grads[name]) <= TOL, name
    # and the masks really differ from no dropout: a different seed gives different gradients
    _, _, other = run(small_store, offload, lora=lora, seed_before_forward=7)
    assert any(max_rel_err(other[n], ref_grads[n]) > 1e-3 for n in ref_grads)


@pytest.mark.parametrize("offload", ["none", "disk"])
def test_micro_batches_equal_one_batch(small_store, reference, offload):
    """Layer-major accumulation: K micro-batches through each loaded block == the batch at once."""
    ref_logits, ref_loss, ref_grads = reference
    logits, loss, grads = run(small_store, offload, micro_batch=1)
    assert max_rel_err(loss, ref_loss) <= TOL
    for name in ref_grads:
        assert max_rel_err(grads[name], ref_grads[name]) <= TOL, name


def test_block_loads_per_step_do_not_grow_with_micro_batches(small_store):
    counts = []
    for micro in (None, 1):
        model = phantom.load(small_store, offload="disk", prefetch=1, micro_batch=micro)
        tokens, targets = batch(SMALL, b=4)
        model.scheduler.take_metrics()
        model(tokens, targets=targets).backward()
        counts.append(model.scheduler.take_metrics()["loads"])
        model.close()
    n = SMALL.n_layers
    assert counts[0] == counts[1] <= 2 * n - 1  # the last block is reused at the turn (LIFO)


def test_adapter_round_trip(small_store, tmp_path):
    model = phantom.load(small_store, offload="disk")
    randomize_lora(model, seed=5)
    model.save_adapter(tmp_path / "adapter")
    other = phantom.load(small_store, offload="ram")
    other.load_adapter(tmp_path / "adapter")
    for (n, p), (m, q) in zip(model.named_parameters(), other.named_parameters()):
        if p.requires_grad:
            assert n == m and torch.equal(p, q)
    tokens, _ = batch(SMALL)
    with torch.no_grad():
        assert torch.equal(model(tokens), other(tokens))
    model.close(), other.close()


def test_peft_key_names(small_store, tmp_path):
    from safetensors.torch import load_file
    import json
    model = phantom.load(small_store, offload="disk", lora=phantom.LoraConfig(targets=("q", "v", "gate")))
    model.save_adapter(tmp_path)
    keys = set(load_file(str(tmp_path / "adapter_model.safetensors")))
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys
    assert "base_model.model.model.layers.3.mlp.gate_proj.lora_B.weight" in keys
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 8 and sorted(cfg["target_modules"]) == ["gate_proj", "q_proj", "v_proj"]
    model.close()


def test_bad_arguments_are_value_errors(small_store):
    with pytest.raises(ValueError, match="offload"):
        phantom.load(small_store, offload="tape")
    with pytest.raises(ValueError, match="LoRA targets"):
        phantom.LoraConfig(targets=("qq",))
    model = phantom.load(small_store, offload="disk")
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, SMALL.max_seq_len + 1, dtype=torch.long))
    with pytest.raises(ValueError, match="token ids"):
        model(torch.full((1, 4), SMALL.vocab_size))
    model.close()


@pytest.mark.parametrize("offload", ["ram", "disk"])
@pytest.mark.parametrize("micro_batch", [None, 2])
def test_keep_policy_matches_recompute_and_reference(small_store, reference, offload, micro_batch):
    """`keep` skips the rerun; with one slot every block is overwritten between forward and backward,
    so gradients would be wrong if the kept graph held the weights instead of handles."""
    _, ref_loss, ref_grads = reference
    model = phantom.load(small_store, offload=offload, prefetch=0, recompute="none", micro_batch=micro_batch,
                         lora=phantom.LoraConfig(rank=4, targets=("q", "k", "v", "o", "gate", "up", "down")))
    randomize_lora(model)
    tokens, targets = batch(SMALL)
    loss = model(tokens, targets=targets)
    assert model.executor.weight_handles > 0 and model.executor.kept_bytes > 0
    if model.scheduler.slots:
        assert all(s.users == 0 for s in model.scheduler.slots)  # no block is held between the passes
    loss.backward()
    assert max_rel_err(loss, ref_loss) <= TOL
    for n, p in model.named_parameters():
        if p.requires_grad:
            assert max_rel_err(p.grad, ref_grads[n]) <= TOL, n
    model.close()


def test_keep_policy_with_dropout(small_store):
    lora = phantom.LoraConfig(rank=4, dropout=0.3, targets=("q", "v", "down"))
    _, ref_loss, ref_grads = run(small_store, "none", lora=lora)
    for policy in ("none", "auto"):
        _, loss, grads = run(small_store, "disk", lora=lora, recompute=policy)
        assert max_rel_err(loss, ref_loss) <= TOL
        for n in ref_grads:
            assert max_rel_err(grads[n], ref_grads[n]) <= TOL, n


def test_auto_policy_keeps_what_fits_the_budget(small_store):
    model = phantom.load(small_store, offload="disk", recompute="auto")
    tokens, targets = batch(SMALL)
    model(tokens, targets=targets).backward()
    per_block = model.executor.kept_per_block
    model.executor.keep_budget = 2 * per_block  # room for two blocks
    model(tokens, targets=targets).backward()
    assert model.executor.kept_blocks == 2 and model.executor.kept_bytes <= model.executor.keep_budget
    model.close()


@pytest.mark.parametrize("offload,recompute", [("none", "all"), ("disk", "all"), ("disk", "none")])
def test_inner_checkpointing_matches_reference(small_store, reference, offload, recompute):
    _, ref_loss, ref_grads = reference
    _, loss, grads = run(small_store, offload, checkpoint_inner=True, recompute=recompute)
    assert max_rel_err(loss, ref_loss) <= TOL
    for n in ref_grads:
        assert max_rel_err(grads[n], ref_grads[n]) <= TOL, n


def test_inner_checkpointing_with_sequence_slices_of_the_mlp(small_store, reference):
    def slice_mlp(model):
        for block in model.layers:
            block.mlp_chunk = 5  # 24 tokens -> slices of 5, 5, 5, 5, 4

    _, ref_loss, ref_grads = reference
    _, loss, grads = run(small_store, "disk", checkpoint_inner=True, prepare=slice_mlp)
    assert max_rel_err(loss, ref_loss) <= TOL
    for n in ref_grads:
        assert max_rel_err(grads[n], ref_grads[n]) <= TOL, n


def test_accumulation_of_four_micro_batches_equals_one_batch_of_four(small_store):
    """--grad-accum 4 is one call of 4 rows with micro_batch=1 (layer-major): == the batch of 4 at once."""
    results = []
    for micro in (None, 1):
        model = phantom.load(small_store, offload="disk", micro_batch=micro)
        randomize_lora(model)
        tokens, targets = batch(SMALL, b=4)
        loss = model(tokens, targets=targets)
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.trainable_parameters()]))
        model.close()
    (ref_loss, ref_grads), (loss, grads) = results
    assert max_rel_err(loss, ref_loss) <= TOL
    assert all(max_rel_err(g, r) <= TOL for g, r in zip(grads, ref_grads))


def test_projections_run_fused_and_equal_an_unfused_store(small_store, tmp_path, monkeypatch):
    """Stores lay q,k,v and gate,up back to back, so each group runs as one matmul over a view of the
    slot; a store in the older name order (no adjacent groups) runs unfused and gives the same model."""
    import phantom.files.tensorfile as store_mod
    from phantom.convert.synthetic import write_synthetic
    from phantom.arch.layers import fuse_adjacent

    fused = {"attention.wqkv", "feed_forward.w13"}
    def block0_views(path):
        s = phantom.BlockStore(path)
        buf = torch.empty(s.block_nbytes, dtype=torch.uint8)
        s.read_block_into(0, buf)
        return s.block_views(buf)

    assert fused <= fuse_adjacent(block0_views(small_store)).keys()
    monkeypatch.setattr(store_mod, "_GROUP_RANK", {})  # the order stores were written in before fusion
    old = write_synthetic(tmp_path / "old", SMALL, torch.float32, seed=1, progress=False)
    monkeypatch.undo()
    assert not fused & fuse_adjacent(block0_views(old)).keys()

    calls = []
    def spy(model):
        for block in model.layers:
            block.attention.register_forward_pre_hook(lambda m, a: calls.append(m.wqkv is not None))
    for offload in ("none", "disk"):
        calls.clear()
        logits, loss, grads = run(small_store, offload, prepare=spy)
        assert calls and all(calls), offload
        calls.clear()
        old_logits, old_loss, old_grads = run(old, offload, prepare=spy)
        assert calls and not any(calls), offload
        assert max_rel_err(logits, old_logits) <= TOL and max_rel_err(loss, old_loss) <= TOL
        for name in grads:
            assert max_rel_err(grads[name], old_grads[name]) <= TOL, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_keep_and_recompute_are_bit_identical(tmp_path, dtype):
    """recompute="auto" may keep a different set of blocks on another machine or after --resume (it
    depends on free memory): that is safe only because keeping and recomputing give the same bits,
    dropout included (the recompute replays the forward's RNG)."""
    from phantom.convert.synthetic import write_synthetic
    store = write_synthetic(tmp_path / "s", SMALL, dtype, seed=1, progress=False)
    lora = phantom.LoraConfig(rank=4, dropout=0.1, targets=("q", "k", "v", "gate"))
    outs = {}
    for recompute in ("none", "all"):
        model = phantom.load(store, offload="disk", dtype=dtype, recompute=recompute, lora=lora)
        randomize_lora(model)
        tokens, targets = batch(SMALL)
        torch.manual_seed(5)
        loss = model(tokens, targets=targets)
        loss.backward()
        outs[recompute] = [loss.detach()] + [p.grad for p in model.trainable_parameters()]
        model.close()
    assert all(torch.equal(a, b) for a, b in zip(outs["none"], outs["all"]))



def test_weight_handles_are_relative_to_the_block_not_the_storage():
    """Under keep, weights autograd saved are handles rebuilt on whichever slot holds the block in
    backward. Slot buffers are aligned views at different offsets of their allocations, so a handle
    must be relative to the block's buffer (else backward reads shifted bytes: seen as garbage
    gradients when a block came back in another slot)."""
    from phantom.stream.executor import WeightHandles
    from phantom.files.tensorfile import packed_empty
    like = {"a": torch.empty(3, 5), "b": torch.empty(7)}

    def block_at(page: int) -> dict[str, torch.Tensor]:  # the same block, `page` pages into an allocation
        raw = torch.zeros(page * 1024 + 64)
        views = packed_empty(like, torch.float32, "cpu")
        flat = raw[page * 1024: page * 1024 + 22]
        out = {"a": flat[:15].view(3, 5), "b": flat[15:]}
        torch.manual_seed(0)
        for k in out:
            out[k].copy_(torch.randn(views[k].shape))
        return out

    forward, backward = block_at(0), block_at(3)
    hooks = WeightHandles(forward)
    packed = [hooks.pack(forward["a"].t()), hooks.pack(forward["b"][2:5])]
    assert all(isinstance(p, tuple) for p in packed) and hooks.weight_handles == 2
    hooks.bind(backward)
    assert torch.equal(hooks.unpack(packed[0]), backward["a"].t())
    assert torch.equal(hooks.unpack(packed[1]), backward["b"][2:5])
