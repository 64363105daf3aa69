"""Full finetuning: the streamed step (AdamW fused into each block's backward, state in RAM or on
disk, blocks written back) equals torch.optim.AdamW on the resident model, with the documented
per-block clipping (phantom.optim), over several steps and micro-batches."""
from __future__ import annotations

import pytest
import torch

import phantom
from phantom.store import BlockStore
from conftest import SMALL, batch, max_rel_err

TOL = 1e-5
HP = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def train_steps(model, steps, max_norm):
    """`steps` AdamW steps on one batch (its loss must fall); the losses. The caller's optimizer
    covers model.trainable_parameters(): everything for the resident model, head and embedding for
    the streamed one (whose blocks are updated inside backward)."""
    opt = torch.optim.AdamW(model.trainable_parameters(), **HP)
    tokens, targets = batch(SMALL)
    losses = []
    for _ in range(steps):
        loss = model(tokens, targets=targets)
        loss.backward()
        model.clip_grad_norm_(max_norm)
        opt.step()
        opt.zero_grad()
        model.finish_step()
        losses.append(loss.item())
    return losses


def resident_steps(store, steps, max_norm, micro_batch=None):
    model = phantom.load(store, offload="none", mode="full", micro_batch=micro_batch)
    losses = train_steps(model, steps, max_norm)
    blocks = [{k: v.detach() for k, v in block.state_dict().items()} for block in model.layers]
    return losses, blocks, model


@pytest.mark.parametrize("offload", ["ram", "disk"])
@pytest.mark.parametrize("max_norm", [None, 0.05])
@pytest.mark.parametrize("micro_batch", [None, 2])
def test_streamed_full_finetune_equals_adamw_on_resident(small_store, tmp_path, offload, max_norm, micro_batch):
    steps = 3
    ref_losses, ref_blocks, ref = resident_steps(small_store, steps, max_norm, micro_batch)
    model = phantom.load(small_store, offload=offload, prefetch=1, mode="full", micro_batch=micro_batch, work_dir=tmp_path,
                         optim=phantom.AdamWConfig(max_grad_norm=max_norm, **HP))
    losses = train_steps(model, steps, max_norm)
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)) <= TOL
    assert losses[-1] < losses[0]
    model.save_full()
    store = BlockStore(tmp_path / "store", verify="full")  # checksums match what was written
    for i, ref_block in enumerate(ref_blocks):
        got = store.load_block(i)
        for k, v in ref_block.items():
            assert max_rel_err(got[k], v) <= TOL, (i, k)
    assert max_rel_err(store.load_head()["output.weight"], ref.output_weight) <= TOL
    assert max_rel_err(store.load_embed()["tok_embeddings.weight"], ref.embed_table) <= TOL
    if offload == "disk":
        assert len(list((tmp_path / "optim").glob("*.safetensors"))) == SMALL.n_layers
    model.close()
    # the original store is untouched (the working copy was hard-linked, then replaced per file)
    original = BlockStore(small_store, verify="full")
    assert torch.equal(original.load_block(0)["attention.wq.weight"],
                       BlockStore(small_store).load_block(0)["attention.wq.weight"])


def test_clipping_engages(small_store, tmp_path):
    """With a tiny max_norm the update differs from the unclipped one (the clip is not a no-op)."""
    _, unclipped, _ = resident_steps(small_store, 1, None)
    _, clipped, _ = resident_steps(small_store, 1, 1e-4)
    assert max_rel_err(clipped[0]["attention.wq.weight"], unclipped[0]["attention.wq.weight"]) > 1e-6


def test_full_mode_needs_a_work_dir_and_no_lora(small_store):
    with pytest.raises(ValueError, match="work_dir"):
        phantom.load(small_store, offload="disk", mode="full")
    with pytest.raises(ValueError, match="mode"):
        phantom.load(small_store, mode="half")
