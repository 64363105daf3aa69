"""Several adapters in one pass over the weights (phantom.train.sweep): each adapter ends where its own
run ends (adapter tensors, AdamW moments, loss records), resident and streamed, LoRA and DPO; the
weights are read once a step whatever the number of adapters; a NaN stops its adapter alone."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import phantom
from phantom.data import dataset as D
from phantom.data.tokenizer import TINY_TEXT, Tokenizer
from phantom.train import preference
from phantom.train.checkpoint import read_state
from phantom.train.loop import train
from phantom.train.sweep import Job, train_adapters
from phantom.train.trainconfig import TrainConfig

# three adapters: other learning rates, ranks, targets, seeds, dropout and data
ADAPTERS = {
    "a": (phantom.LoraConfig(rank=4, alpha=8, targets=("q", "v"), dropout=0.1), dict(lr=1e-2, seed=1), "text"),
    "b": (phantom.LoraConfig(rank=8, alpha=8, targets=("q", "k", "v", "o", "down")), dict(lr=3e-3, seed=2), "text"),
    "c": (phantom.LoraConfig(rank=2, alpha=4, targets=("gate", "up"), dropout=0.2), dict(lr=2e-2, seed=3,
                                                                                       warmup=1), "other"),
}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These tiny steps run fastest on one thread (two spin against each other on a busy machine); the
    numbers compared are computed under the same setting either way."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(phantom.BlockStore(phantom.resolve_model("tiny")).tokenizer_path)


@pytest.fixture(scope="module")
def data(tok, tmp_path_factory):
    """Two data sets: the shipped text, and another text (its lines in reverse order)."""
    other = tmp_path_factory.mktemp("data") / "other.txt"
    text = D.load(None, tok)
    other.write_text("\n".join(reversed(TINY_TEXT.read_text().splitlines())))
    return {"text": D.split(text, 0.1), "other": D.split(D.load(str(other), tok), 0.1)}


def cfg(out, mode="lora", **kw):
    base = dict(iters=5, batch_size=2, grad_accum=2, seq_len=32, warmup=2, eval_every=2, eval_iters=2,
                save_every=0, workers=0, progress=False, out=str(out), mode=mode)
    return TrainConfig(**{**base, **kw})


def lora_of(name: str, seed: int) -> phantom.LoraConfig:
    import dataclasses
    return dataclasses.replace(ADAPTERS[name][0], seed=seed)


def load(offload: str, lora, micro_batch: int):
    return phantom.load("tiny", offload=offload, micro_batch=micro_batch, lora=lora, recompute="all")


def metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def moments(out) -> list[torch.Tensor]:
    state = read_state(out / "checkpoint" / "state.pt")["optimizer"]["state"]
    return [t for k in sorted(state) for t in (state[k]["exp_avg"], state[k]["exp_avg_sq"])]


def assert_same_run(got_out, ref_out):
    """Adapter tensors (fp32, as the checkpoint keeps them), AdamW moments and loss records within 1e-5."""
    got, ref = (load_file(str(o / "checkpoint" / "trainable.safetensors")) for o in (got_out, ref_out))
    assert got.keys() == ref.keys()
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], atol=1e-5, rtol=0)
    for a, b in zip(moments(got_out), moments(ref_out), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    keys = ("step", "loss", "lr", "val_loss", "grad_norm")
    strip = lambda recs: [{k: r[k] for k in keys if k in r} for r in recs]  # noqa: E731
    for r, q in zip(strip(metrics(got_out)), strip(metrics(ref_out)), strict=True):
        assert r.keys() == q.keys() and r["step"] == q["step"]
        for k in r:
            assert r[k] == pytest.approx(q[k], abs=1e-5), (r["step"], k)


def single(root, data, tok, name, mode="lora", offload="none", **kw):
    """The adapter's own run (resident: the streamed sweeps are held to it too)."""
    lora, opts, source = ADAPTERS[name]
    c = cfg(root / name, mode, **{**opts, **kw})
    with load(offload, lora_of(name, c.seed), c.batch_size * (2 if mode == "dpo" else 1)) as model:
        return train(model, *data[source], c, tok)


@pytest.fixture(scope="module")
def singles(data, tok, tmp_path_factory):
    root = tmp_path_factory.mktemp("single")
    return root, {name: single(root, data, tok, name) for name in ADAPTERS}


def jobs(tmp_path, data, mode="lora", names=tuple(ADAPTERS), **kw):
    out = []
    for name in names:
        lora, opts, source = ADAPTERS[name]
        c = cfg(tmp_path / "sweep" / name, mode, **{**opts, **kw})
        out.append(Job(name, lora_of(name, c.seed), c, *data[source]))
    return out


@pytest.mark.parametrize("offload", ["none", "disk", "ram"])
def test_each_adapter_of_a_sweep_ends_as_its_own_run(offload, data, singles, tmp_path):
    root, refs = singles
    with load(offload, None, 2) as model:
        summaries = train_adapters(model, jobs(tmp_path, data))
    assert [s["status"] for s in summaries] == ["done"] * 3
    for name, s in zip(ADAPTERS, summaries):
        assert s["final_loss"] == pytest.approx(refs[name]["final_loss"], abs=1e-5)
        assert_same_run(tmp_path / "sweep" / name, root / name)
        assert (tmp_path / "sweep" / name / "adapter" / "adapter_model.safetensors").is_file()


def test_three_adapters_read_the_weights_of_one(data, tmp_path):
    """Bytes and block loads per step from the disk tier (the scheduler's counters) with three adapters
    equal those of one adapter's run."""
    root = tmp_path / "one"
    single(root, data, None, "a", offload="disk")
    with load("disk", None, 2) as model:
        train_adapters(model, jobs(tmp_path, data))
    one, three = metrics(root / "a"), metrics(tmp_path / "sweep" / "a")
    steps = [r for r in one if r["step"] > 0]
    assert len(steps) == 5 and all(r["bytes_read"] > 0 and r["loads"] > 0 for r in steps)
    for r, q in zip(steps, [r for r in three if r["step"] > 0], strict=True):
        assert (q["bytes_read"], q["loads"], q["adapters"]) == (r["bytes_read"], r["loads"], 3)


def test_an_adapter_driven_to_nan_stops_alone(data, singles, tmp_path):
    root, refs = singles
    js = jobs(tmp_path, data)
    # b's first update is not finite on any machine (an infinite learning rate: no overflow threshold to cross, which
    # a finite one like 1e12 crosses on one CPU and not another); a and c go on
    js[1].cfg = cfg(tmp_path / "sweep" / "b", lr=float("inf"), warmup=0, seed=2)
    with load("ram", None, 2) as model:
        a, b, c = train_adapters(model, js)
    assert (a["status"], b["status"], c["status"]) == ("done", "nan", "done")
    assert b["steps"] < 5 and b["adapter"] is None and not (tmp_path / "sweep" / "b" / "adapter").exists()
    assert metrics(tmp_path / "sweep" / "b")[-1]["step"] == b["steps"]
    for name in "ac":
        assert_same_run(tmp_path / "sweep" / name, root / name)


def test_dpo_adapters_end_as_their_own_runs(tok, tmp_path):
    pairs = preference.split_pairs(preference.load_pairs(None, tok), 0.1)
    kw = dict(iters=3, seq_len=48, eval_every=0, grad_accum=1)
    data = {"text": pairs, "other": pairs}
    with load("disk", None, 4) as model:
        assert [s["status"] for s in train_adapters(model, jobs(tmp_path, data, "dpo", ("a", "b"), **kw))] == \
            ["done"] * 2
    for name in "ab":
        single(tmp_path / "single", data, tok, name, "dpo", **kw)
        assert_same_run(tmp_path / "sweep" / name, tmp_path / "single" / name)
