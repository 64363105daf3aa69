"""Data parallel over torch.distributed (gloo, 2 CPU processes): the weights after a few steps equal
a single process that trains on the same global batch (LoRA, and full finetuning with the per-block
all-reduce overlapped with backward).

Two ranks sum each gradient in another order than one process does (fp32 rounding, ~1e-7). SGD with
momentum carries that through unchanged, so LoRA weights are compared at 1e-5. AdamW divides by
sqrt(v) + eps: where a gradient is near zero that magnifies its rounding without bound (with eps 1e-8
the weights agreed to ~3e-5 of their largest entry here, and another machine's rounding may do worse),
so full finetuning runs its AdamW with eps 1.0, above every |gradient|: the step is then linear in the
gradient (momentum, bias correction and decay still run) and the weights agree to ~2e-7, compared at
1e-5, 100x below the change the steps made (which the test also checks).
"""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import phantom
from phantom.train.dist import average_gradients, block_grad_sync
from conftest import SMALL, batch, max_rel_err

STEPS, GLOBAL_BATCH = 3, 4
HP = dict(lr=0.1, weight_decay=0.1, eps=1.0)  # eps above every |gradient|: the step is linear in it (see above)


def train(store, rank, world, mode, work_dir):
    kw = dict(offload="ram", shared_ram=True) if mode == "lora" else dict(
        offload="disk", mode="full", work_dir=work_dir, optim=phantom.AdamWConfig(**HP))
    model = phantom.load(store, prefetch=1, lora=phantom.LoraConfig(rank=4, targets=("q", "v", "down")), **kw)
    opt = (torch.optim.SGD(model.trainable_parameters(), momentum=0.9, lr=0.5, weight_decay=0.1) if mode == "lora"
           else torch.optim.AdamW(model.trainable_parameters(), **HP))
    rows = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
    n_tokens = None
    if world > 1 and mode == "full":
        model.grad_sync = block_grad_sync(lambda: n_tokens)
    for step in range(STEPS):
        tokens, targets = batch(SMALL, b=GLOBAL_BATCH, seed=step, ignore_frac=0.3)
        tokens, targets = tokens[rows], targets[rows]
        n_tokens = float((targets != -100).sum())  # ranks see different numbers of target tokens
        loss = model(tokens, targets=targets)
        loss.backward()
        if world > 1:
            average_gradients(model.trainable_parameters(), n_tokens)
        opt.step()
        opt.zero_grad()
        model.finish_step()
    if mode == "full":
        model.save_full()
        out = {f"{i}.{k}": v.clone() for i in range(SMALL.n_layers) for k, v in model.store.load_block(i).items()}
    else:
        out = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    model.close()
    return out


def worker(rank, world, store, init_file, mode, work_dir, result_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        out = train(store, rank, world, mode, f"{work_dir}/rank{rank}")
        if rank == 0:
            torch.save(out, result_file)
        dist.barrier()  # both ranks done before either tears gloo down (one abort seen once in a full run)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_two_ranks_equal_one_process_with_the_global_batch(small_store, tmp_path, mode):
    single = train(small_store, 0, 1, mode, tmp_path / "single")
    mp.spawn(worker, args=(2, str(small_store), str(tmp_path / "rdv"), mode, str(tmp_path), str(tmp_path / "r.pt")),
             nprocs=2, join=True)
    ranked = torch.load(tmp_path / "r.pt", weights_only=True)
    assert ranked.keys() == single.keys()
    tol = 1e-5
    for k in single:
        assert max_rel_err(ranked[k], single[k]) <= tol, k
    if mode == "full":  # training moved the weights far more than the ranks disagree
        base = phantom.load(small_store, offload="none", lora=None).layers[0].attention.wq.weight
        assert max_rel_err(single["0.attention.wq.weight"], base) > 100 * tol
    else:
        assert all(single[k].abs().max() > 0 for k in single if "lora_B" in k)


def nan_worker(rank, world, store, init_file, out, result_file):
    """Trains with phantom.train.loop on two ranks; rank 1's loss turns NaN at its third step."""
    import datetime
    import json

    import numpy as np

    from phantom.data import dataset as D
    from phantom.train.loop import train as train_loop
    from phantom.train.trainconfig import TrainConfig
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))  # a hang fails the test, not CI
    try:
        model = phantom.load(store, offload="ram", prefetch=1, micro_batch=2, lora=phantom.LoraConfig(rank=4))
        forward, calls = model.forward, [0]

        def forward_nan_on_rank1(x, targets=None):
            calls[0] += 1
            loss = forward(x, targets=targets)
            return loss * float("nan") if rank == 1 and calls[0] == 3 else loss
        model.forward = forward_nan_on_rank1
        tokens = np.random.default_rng(0).integers(0, SMALL.vocab_size, 4096).astype(np.int64)
        data = D.TokenData(tokens, tokens.copy(), np.array([0]), "text", "synthetic")
        cfg = TrainConfig(iters=6, batch_size=2, seq_len=16, warmup=1, eval_every=0, save_every=0, workers=0,
                          progress=False, out=f"{out}/rank{rank}")
        summary = train_loop(model, data, None, cfg)
        model.close()
        with open(f"{result_file}.{rank}", "w") as f:
            json.dump({"status": summary["status"], "steps": summary["steps"]}, f)
        dist.barrier()  # both ranks done before either tears gloo down (an abort in teardown seen in CI)
    finally:
        dist.destroy_process_group()


def test_a_nan_on_one_rank_stops_every_rank(small_store, tmp_path):
    """The ranks agree on finiteness before any of them skips or stops: a NaN loss on rank 1 stops both
    at the same step, instead of rank 0 waiting in an all-reduce rank 1 never joins."""
    import json
    ctx = mp.spawn(nan_worker, args=(2, str(small_store), str(tmp_path / "rdv"), str(tmp_path), str(tmp_path / "r")),
                   nprocs=2, join=False)
    deadline = time.monotonic() + 300
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("the ranks still run after 300 s: one waits in a collective the other left")
    got = [json.loads((tmp_path / f"r.{rank}").read_text()) for rank in range(2)]
    assert got == [{"status": "nan", "steps": 3}] * 2
