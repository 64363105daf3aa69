"""phantom.train.loop: the loss falls, the schedule, accumulation, bit-exact resume, NaN stops, bad resumes."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import phantom
from phantom.data import dataset as D
from phantom.data.tokenizer import Tokenizer
from phantom.train.checkpoint import trainable_state
from phantom.train.loop import train
from phantom.train.step import sample
from phantom.train.trainconfig import TrainConfig, lr_factor
from conftest import randomize_lora


def tiny(dropout=0.0, micro_batch=4, offload="disk"):
    return phantom.load("tiny", offload=offload, micro_batch=micro_batch,
                        lora=phantom.LoraConfig(rank=8, alpha=16, dropout=dropout))


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(phantom.BlockStore(phantom.resolve_model("tiny")).tokenizer_path)


@pytest.fixture(scope="module")
def text(tok):
    return D.split(D.load(None, tok), 0.1)


def cfg(out, **kw):
    base = dict(iters=12, batch_size=4, seq_len=64, lr=1e-2, warmup=3, eval_every=0, eval_iters=2, save_every=0,
                workers=0, progress=False, out=str(out))
    return TrainConfig(**{**base, **kw})


def metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_lora_finetune_of_tiny_lowers_the_loss(tok, text, tmp_path):
    with tiny() as model:
        s = train(model, *text, cfg(tmp_path, iters=40, warmup=5, eval_every=20), tok)
        trained = trainable_state(model)
    recs = metrics(tmp_path)
    losses = [r["loss"] for r in recs if "loss" in r]
    assert s["status"] == "done" and s["steps"] == 40 and len(losses) == 40
    assert losses[0] == pytest.approx(4.6389, abs=2e-3)  # golden: LoRA B starts at 0, so the base model's loss
    assert sum(losses[-10:]) / 10 < sum(losses[:3]) / 3 - 0.15
    vals = [r["val_loss"] for r in recs if "val_loss" in r]
    assert [r["step"] for r in recs if "val_loss" in r] == [0, 20, 40] and vals[1] < vals[0] - 0.1
    for key in ("step", "loss", "lr", "tokens_per_s", "stall_frac", "bytes_read", "grad_norm"):
        assert key in recs[1]
    assert recs[1]["tokens"] == 4 * 64 and recs[1]["bytes_read"] > 0
    # the PEFT adapter holds the trained weights: a fresh model that loads it has the same loss
    with tiny() as fresh:
        fresh.load_adapter(tmp_path / "adapter")
        assert all(torch.equal(p, trained[n]) for n, p in fresh.named_parameters() if p.requires_grad)
    assert s["adapter"] == str(tmp_path / "adapter") and (tmp_path / "checkpoint" / "state.pt").is_file()


def test_lr_warms_up_then_decays_to_min_lr():
    c = TrainConfig(iters=110, lr=1.0, min_lr=0.1, warmup=10)
    assert [lr_factor(s, c) for s in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])
    assert lr_factor(60, c) == pytest.approx(0.55)  # halfway through the cosine
    assert lr_factor(110, c) == pytest.approx(0.1) and lr_factor(500, c) == pytest.approx(0.1)


def test_grad_accum_is_one_layer_major_call_per_step(text, tmp_path):
    calls = []
    with tiny(micro_batch=2) as model:
        forward = model.forward
        model.forward = lambda x, targets=None: (torch.is_grad_enabled() and calls.append(tuple(x.shape))) or \
            forward(x, targets=targets)
        train(model, *text, cfg(tmp_path / "a", iters=2, batch_size=2, grad_accum=2))
    assert calls == [(4, 64)] * 2


def one_sgd_step(micro_batch: int, x, y, lr: float):
    """(loss, gradients, weights after a plain SGD step) of one step over rows x, y."""
    with tiny(micro_batch=micro_batch) as model:
        randomize_lora(model)  # B = 0 would leave every A gradient zero
        loss = model(x, targets=y)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        torch.optim.SGD(model.trainable_parameters(), lr=lr).step()
        return loss.item(), grads, trainable_state(model)


def test_grad_accum_gives_one_steps_gradients_and_sgd_step():
    """Two micro-batches of 2 rows give the gradients of one micro-batch of 4 up to the order of the
    sums. The gradient sums over the step's n = 4 x 64 tokens; a sum of n terms taken in another
    order differs by at most n * u * sum|terms| (u = 2^-24, fp32's unit roundoff), so the norm-wise
    bound n * u (1.5e-5) holds with room; the SGD step adds lr times that and one rounding of each
    weight. Nothing after an AdamW step is compared: its 1 / sqrt(v) grows the rounding of a
    near-zero gradient into the step."""
    gen = torch.Generator().manual_seed(0)
    vocab = phantom.BlockStore(phantom.resolve_model("tiny")).cfg.vocab_size
    x, y = torch.randint(0, vocab, (4, 64), generator=gen), torch.randint(0, vocab, (4, 64), generator=gen)
    lr, u = 1e-2, 2.0 ** -24
    loss_a, grads_a, after_a = one_sgd_step(2, x, y, lr)
    loss_w, grads_w, after_w = one_sgd_step(4, x, y, lr)
    tol = x.numel() * u
    assert loss_a == pytest.approx(loss_w, rel=tol)
    assert grads_a.keys() == grads_w.keys() and all(g.norm() > 0 for g in grads_w.values())
    for n, g in grads_w.items():
        assert (grads_a[n] - g).norm() <= tol * g.norm(), n
        bound = lr * tol * g.norm() + 2 * u * after_w[n].norm()
        assert (after_a[n] - after_w[n]).norm() <= bound, n


class Crash(Exception):
    pass


def fail_at(model, step: int, nan: bool = False):
    """Make the model's `step`-th training forward crash (or return NaN)."""
    forward, seen = model.forward, [0]

    def patched(x, targets=None):
        if torch.is_grad_enabled():
            seen[0] += 1
            if seen[0] == step:
                if not nan:
                    raise Crash
                return forward(x, targets=targets) * float("nan")
        return forward(x, targets=targets)
    model.forward = patched


def test_resume_after_a_crash_is_bit_identical(text, tmp_path):
    c = dict(iters=12, save_every=4, eval_every=4)
    with tiny(dropout=0.1) as model:  # dropout: the RNG state must be restored too
        train(model, *text, cfg(tmp_path / "ref", **c))
        ref = trainable_state(model)
    with tiny(dropout=0.1) as model:
        fail_at(model, 10)
        with pytest.raises(Crash):
            train(model, *text, cfg(tmp_path / "run", **c))
    assert json.loads((tmp_path / "run" / "checkpoint" / "meta.json").read_text())["step"] == 8
    with tiny(dropout=0.1) as model:
        s = train(model, *text, cfg(tmp_path / "run", resume=True, **c))
        got = trainable_state(model)
    assert s["status"] == "done" and s["steps"] == 12
    assert all(torch.equal(got[n], ref[n]) for n in ref)
    assert (tmp_path / "run/adapter/adapter_model.safetensors").read_bytes() == \
        (tmp_path / "ref/adapter/adapter_model.safetensors").read_bytes()
    strip = lambda recs: [{k: v for k, v in r.items() if k in ("step", "loss", "lr", "val_loss")} for r in recs]
    assert strip(metrics(tmp_path / "run")) == strip(metrics(tmp_path / "ref"))


def test_nan_stops_the_run_and_keeps_the_last_good_checkpoint(text, tmp_path):
    with tiny() as model:
        fail_at(model, 7, nan=True)
        s = train(model, *text, cfg(tmp_path, iters=12, save_every=5))
        weights = trainable_state(model)
    assert s["status"] == "nan" and s["steps"] == 7 and s["adapter"] is None
    assert not (tmp_path / "adapter").exists()
    assert json.loads((tmp_path / "checkpoint" / "meta.json").read_text())["step"] == 5
    saved = load_file(str(tmp_path / "checkpoint" / "trainable.safetensors"))
    # steps 6 was good but not saved; step 7 was skipped: weights are finite and the checkpoint is step 5's
    assert all(torch.isfinite(w).all() for w in weights.values())
    assert all(torch.isfinite(w).all() for w in saved.values()) and set(saved) == set(weights)
    last = metrics(tmp_path)[-1]
    assert last["step"] == 7 and last["loss"] is None


def test_resume_checks_the_run(text, tmp_path):
    with tiny() as model:
        train(model, *text, cfg(tmp_path, iters=2))
        with pytest.raises(ValueError, match=r"different run \(seq_len: 64 here 32\)"):
            train(model, *text, cfg(tmp_path, iters=4, seq_len=32, resume=True))
        with pytest.raises(FileNotFoundError, match="no checkpoint"):
            train(model, *text, cfg(tmp_path / "empty", resume=True))
    with phantom.load("tiny", micro_batch=4, lora=phantom.LoraConfig(rank=4)) as other:
        with pytest.raises(ValueError, match="different run.*lora"):
            train(other, *text, cfg(tmp_path, iters=4, resume=True))


def test_sample_is_greedy_and_deterministic(tok):
    with tiny(offload="ram") as model:
        a, b = sample(model, tok, "The keeper", 8), sample(model, tok, "The keeper", 8)
    assert isinstance(a, str) and a == b and len(tok.encode(a, bos=False)) <= 8 + 2


def test_train_config_rejects_bad_values():
    with pytest.raises(ValueError, match="--iters must be >= 1"):
        TrainConfig(iters=0)
    with pytest.raises(ValueError, match="min_lr"):
        TrainConfig(lr=1e-3, min_lr=1e-2)
    with pytest.raises(ValueError, match="--mode"):
        TrainConfig(mode="half")
