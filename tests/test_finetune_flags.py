"""Each documented flag (README.md, docs/) of scripts/finetune.py has its effect, not only an exit 0.

Runs are in process on the tiny model (4 blocks), a couple of steps each; most compare a run with the
flag against the same run without it and check what the flag must change, and what it must not.
"""
from __future__ import annotations

import functools
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import phantom
import phantom.data.batches
from phantom.files.store import BlockStore
from phantom.data.tokenizer import TINY_TEXT
from test_convert import load_script

# two steps, no evaluation, one checkpoint at the end; fixed placement (the tiers change what is read)
TINY = ["--model", "tiny", "--iters", "2", "--batch-size", "2", "--seq-len", "32", "--eval-every", "0",
        "--val-split", "0", "--save-every", "0", "--offload", "ram", "-q"]


@pytest.fixture(autouse=True)
def one_thread():
    """The tiny model's matmuls gain nothing from a second thread, and on a shared 2-core machine a
    busy core stalls every parallel op: one thread makes these runs several times faster there."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def cli():
    return load_script("finetune")


@pytest.fixture
def run(cli, tmp_path):
    """run(name, *flags) -> the --out folder of a finetune.py run (TINY, then the flags: later wins)."""
    def go(name: str, *flags) -> Path:
        out = tmp_path / name
        assert cli.main([*TINY, *map(str, flags), "--out", str(out)]) == 0
        return out
    return go


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def steps(out: Path) -> list[dict]:
    return [m for m in metrics(out) if "loss" in m]


def meta(out: Path) -> dict:
    return json.loads((out / "checkpoint" / "meta.json").read_text())


def trained(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "checkpoint" / "trainable.safetensors"))


def optimizer_state(out: Path) -> dict:
    return torch.load(out / "checkpoint" / "state.pt", weights_only=True)["optimizer"]


def block_bytes() -> int:
    return BlockStore(phantom.resolve_model("tiny"), verify="none").block_nbytes


# -- LoRA and optimizer -------------------------------------------------------------------------

def test_lora_alpha_is_written_and_scales_the_update(run):
    base, scaled = run("base"), run("alpha", "--lora-alpha", "64")
    cfg = json.loads((scaled / "adapter" / "adapter_config.json").read_text())
    assert cfg["lora_alpha"] == 64 and cfg["r"] == 8
    assert json.loads((base / "adapter" / "adapter_config.json").read_text())["lora_alpha"] == 16
    assert meta(scaled)["lora"]["alpha"] == 64
    a, b = steps(base), steps(scaled)
    assert a[0]["loss"] == b[0]["loss"]  # B starts at zero: the scale changes nothing before the first update
    assert a[1]["loss"] != b[1]["loss"]  # then the model runs with alpha / r = 8 instead of 2


def test_weight_decay_shrinks_lora_a_by_lr_times_decay(run):
    """Step 1: A has no gradient yet (B is zero), so AdamW's only change to it is the decay,
    A * (1 - lr * wd), with the step's lr as metrics.jsonl records it; B, starting at 0, is not decayed."""
    base, decayed = run("base", "--iters", "1"), run("wd", "--iters", "1", "--weight-decay", "0.5")
    assert optimizer_state(decayed)["param_groups"][0]["weight_decay"] == 0.5
    assert optimizer_state(base)["param_groups"][0]["weight_decay"] == 0.0
    lr = steps(decayed)[0]["lr"]
    a, b = trained(base), trained(decayed)
    assert any("lora_A" in k for k in a)
    for k in a:
        if "lora_A" in k:
            torch.testing.assert_close(b[k], a[k] * (1 - lr * 0.5), rtol=1e-6, atol=0)
            assert not torch.equal(a[k], b[k])
        else:
            assert torch.equal(a[k], b[k]), k


def test_weight_decay_reaches_the_block_optimizer_in_full_mode(run):
    """Full mode: blocks are updated by BlockAdamW inside backward, head and embedding by torch's AdamW.
    Same gradients at step 1, so the decayed run differs from the plain one by lr * wd * W0 everywhere."""
    full = ["--mode", "full", "--offload", "disk", "--iters", "1", "--lr", "1e-3", "--warmup", "0"]
    plain, decayed = run("plain", *full), run("wd", *full, "--weight-decay", "0.5")
    w0 = BlockStore(phantom.resolve_model("tiny"))
    p, d = BlockStore(plain / "store"), BlockStore(decayed / "store")
    for i in range(w0.n_blocks):
        for k, w in w0.load_block(i).items():
            torch.testing.assert_close(p.load_block(i)[k] - d.load_block(i)[k], 1e-3 * 0.5 * w,
                                       rtol=1e-3, atol=1e-7, msg=lambda m: f"block {i} {k}: {m}")
    torch.testing.assert_close(p.load_head()["output.weight"] - d.load_head()["output.weight"],
                               1e-3 * 0.5 * w0.load_head()["output.weight"], rtol=1e-3, atol=1e-7)


def test_grad_clip_clips_and_a_loose_one_changes_nothing(run):
    """grad_norm in metrics.jsonl is the norm before clipping. A clip far above it leaves the run bit
    for bit as with clipping off (0); one far below scales the gradients to where AdamW's eps dominates,
    so the first update of B (from 0) is much smaller."""
    off, loose, tight = run("off", "--grad-clip", "0"), run("loose", "--grad-clip", "1e9"), \
        run("tight", "--grad-clip", "1e-9")
    a, b, c = trained(off), trained(loose), trained(tight)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert steps(off)[0]["grad_norm"] == steps(tight)[0]["grad_norm"] > 1e-9  # the same gradients, then clipped
    moved = {name: sum(float(t[k].norm()) for k in t if "lora_B" in k) for name, t in (("off", a), ("tight", c))}
    assert 0 < moved["tight"] < 0.5 * moved["off"], moved


def test_grad_clip_clips_per_block_in_full_mode(run):
    full = ["--mode", "full", "--offload", "disk", "--iters", "1", "--lr", "1e-3", "--warmup", "0"]
    off, tight = run("off", *full, "--grad-clip", "0"), run("tight", *full, "--grad-clip", "1e-9")
    w0 = BlockStore(phantom.resolve_model("tiny")).load_block(0)
    moved = {name: sum(float((BlockStore(out / "store").load_block(0)[k] - w0[k]).norm()) for k in w0)
             for name, out in (("off", off), ("tight", tight))}
    assert 0 < moved["tight"] < 0.5 * moved["off"], moved


def test_min_lr_is_the_end_of_the_cosine(run):
    """lr of step k (0-based, recorded before the scheduler steps) = min + (lr - min) (1 + cos(pi k / N)) / 2
    with no warmup; after the last step the optimizer holds exactly min_lr (the checkpoint's state)."""
    n, lr, min_lr = 4, 1e-2, 3e-3  # not lr / 10, the default floor
    out = run("cos", "--iters", n, "--warmup", "0", "--lr", lr, "--min-lr", min_lr)
    want = [min_lr + (lr - min_lr) * 0.5 * (1 + math.cos(math.pi * k / n)) for k in range(n)]
    assert [m["lr"] for m in steps(out)] == pytest.approx(want, rel=1e-9)
    assert optimizer_state(out)["param_groups"][0]["lr"] == pytest.approx(min_lr, rel=1e-9)
    default = run("default", "--iters", n, "--warmup", "0", "--lr", lr)
    assert optimizer_state(default)["param_groups"][0]["lr"] == pytest.approx(lr / 10, rel=1e-9)


# -- activations and compute --------------------------------------------------------------------

def test_recompute_and_checkpoint_inner_change_what_is_kept_not_the_numbers(run):
    """kept_bytes (metrics.jsonl) is what the blocks kept for backward: all of it with --recompute none,
    nothing with all, a fraction with none + --checkpoint-inner (attention and MLP checkpointed). The
    checkpoint records each choice (a --resume reuses it). Recomputing reruns the same ops: the same
    bits; the MLP run in chunks of 8 tokens (--mlp-chunk) differs in the last bits only."""
    none, every, inner = (run("none", "--recompute", "none"), run("all", "--recompute", "all"),
                          run("inner", "--recompute", "none", "--checkpoint-inner", "--mlp-chunk", "8"))
    kept = {name: [m["kept_bytes"] for m in steps(out)] for name, out in (("none", none), ("all", every),
                                                                          ("inner", inner))}
    assert kept["all"] == [0, 0] and all(k > 0 for k in kept["none"] + kept["inner"])
    assert max(kept["inner"]) < 0.5 * min(kept["none"]), kept
    assert meta(none)["activations"] == {"recompute": "none", "compile": False, "checkpoint_inner": False,
                                         "mlp_chunk": 2048}
    assert meta(every)["activations"]["recompute"] == "all"
    assert meta(inner)["activations"] == {"recompute": "none", "compile": False, "checkpoint_inner": True,
                                          "mlp_chunk": 8}
    ref = trained(none)
    assert [m["loss"] for m in steps(every)] == [m["loss"] for m in steps(none)]
    assert all(torch.equal(ref[k], trained(every)[k]) for k in ref)
    for key in ("loss", "grad_norm"):
        assert per_step(inner, key) == pytest.approx(per_step(none, key), rel=1e-5)


def test_prefetch_auto_sets_the_chunk_a_resume_keeps_it_and_an_older_checkpoint_resumes(run, monkeypatch):
    """--prefetch auto takes the tuner's chunk of tiled compute (it chose it beside the blocks it placed), unless
    --mlp-chunk is given; the checkpoint records it and --resume reuses it. A checkpoint written before the chunk
    was recorded resumes with the run's own."""
    from phantom.plan import planner
    from phantom.train import checkpoint
    monkeypatch.setattr(planner, "mlp_chunk", lambda *a: 16)  # as where the default does not fit
    tuned = run("tuned", "--prefetch", "auto", "--offload", "disk")
    assert meta(tuned)["activations"]["mlp_chunk"] == 16
    assert meta(run("given", "--prefetch", "auto", "--offload", "disk", "--mlp-chunk", "8"))["activations"][
        "mlp_chunk"] == 8
    monkeypatch.setattr(planner, "mlp_chunk", lambda *a: 2048)
    run("tuned", "--prefetch", "auto", "--offload", "disk", "--iters", "3", "--resume")
    assert meta(tuned)["activations"]["mlp_chunk"] == 16 and meta(tuned)["step"] == 3
    monkeypatch.setattr(checkpoint, "ACTIVATION_KEYS", ("recompute", "compile", "checkpoint_inner"))  # as before
    old = run("old", "--mlp-chunk", "8")
    monkeypatch.undo()
    assert "mlp_chunk" not in meta(old)["activations"]
    run("old", "--iters", "3", "--resume")
    assert meta(old)["step"] == 3 and meta(old)["activations"]["mlp_chunk"] == 2048


def test_compile_flag_compiles_the_blocks(run, monkeypatch, capsys, request):
    """--compile reaches the blocks: dynamo captures their graphs and the checkpoint records it; --no-compile
    runs eagerly. Dynamo's eager backend stands in for inductor, whose C++ build takes a minute here (the
    real compiler is checked in test_reference_train.py)."""
    from torch._dynamo.utils import counters
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    torch._dynamo.reset()
    counters.clear()
    request.addfinalizer(torch._dynamo.reset)  # no graph of these runs is reused by a later test
    eager = run("eager", "--no-compile")
    assert counters["stats"]["unique_graphs"] == 0 and meta(eager)["activations"]["compile"] is False
    compiled = run("compiled", "--compile")
    assert counters["stats"]["unique_graphs"] >= 1
    assert meta(compiled)["activations"]["compile"] is True
    assert "torch.compile failed" not in capsys.readouterr().err
    torch.testing.assert_close(torch.tensor([m["loss"] for m in steps(compiled)]),
                               torch.tensor([m["loss"] for m in steps(eager)]), rtol=1e-5, atol=0)


def test_dtype_bf16_trains_in_bf16(run):
    fp32, bf16 = run("fp32", "--dtype", "fp32"), run("bf16", "--dtype", "bf16")
    assert meta(fp32)["dtype"] == "torch.float32" and meta(bf16)["dtype"] == "torch.bfloat16"
    a, b = [m["loss"] for m in steps(fp32)], [m["loss"] for m in steps(bf16)]
    assert all(math.isfinite(x) for x in b) and b != a  # computed in bf16: not fp32's bits
    assert b == pytest.approx(a, rel=2e-2)  # but the same model
    weights = trained(bf16)
    assert any(float(w.abs().max()) > 0 for k, w in weights.items() if "lora_B" in k)


# -- placement ----------------------------------------------------------------------------------

def per_step(out: Path, key: str) -> list[int]:
    return [m[key] for m in steps(out)]


def test_ram_budget_decides_which_blocks_are_read_from_disk(run, capsys):
    """--offload auto on a CPU: blocks in the RAM budget are used in place (bytes_ram), the rest read
    from disk at each use (bytes_read); a budget under one block gives no RAM tier and a warning."""
    nb, flags = block_bytes(), ["--offload", "auto", "--iters", "3", "--prefetch", "2"]
    none = run("none", *flags, "--ram-budget", "1")
    assert "RAM budget of 0.0 MiB is smaller than one block" in capsys.readouterr().err
    two = run("two", *flags, "--ram-budget", 2 * nb)
    every = run("all", *flags, "--ram-budget", "1G")
    assert per_step(none, "bytes_ram") == [0, 0, 0]
    # 4 disk blocks, 3 slots: after the first step the last 3 of the forward are reused by the backward
    # and the first 3 of the backward by the next forward: 2 reads a step
    assert per_step(none, "bytes_read")[1:] == [2 * nb, 2 * nb]
    assert per_step(two, "bytes_ram") == [4 * nb] * 3  # 2 blocks, forward and backward
    assert per_step(two, "bytes_read")[0] == 2 * nb and per_step(two, "bytes_read")[1:] == [0, 0]
    assert per_step(every, "bytes_read") == [0, 0, 0] and per_step(every, "bytes_ram") == [8 * nb] * 3
    losses = [per_step(out, "loss") for out in (none, two, every)]
    assert losses[0] == losses[1] == losses[2]  # where a block waits does not change the numbers


def test_device_budget_does_nothing_on_a_cpu(run, capsys):
    """docs/placement.md: on a CPU there is no separate device tier. A device budget large enough for every block
    leaves the run reading from disk what the RAM budget leaves there."""
    nb, flags = block_bytes(), ["--offload", "auto", "--prefetch", "2", "--ram-budget", "1", "--iters", "3"]
    without = run("without", *flags)
    capsys.readouterr()
    with_budget = run("with", *flags, "--device-budget", "1G")
    assert per_step(with_budget, "bytes_read") == per_step(without, "bytes_read")
    assert per_step(with_budget, "bytes_read")[1:] == [2 * nb, 2 * nb]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_budget_keeps_blocks_resident_on_cuda(cli, tmp_path, capsys):
    """Room for the 3 slots and 2 blocks: 2 resident, 2 read from disk (no RAM tier); 0: all 4 from disk."""
    nb = block_bytes()
    flags = [*TINY, "--device", "cuda", "--dtype", "fp32", "--offload", "auto", "--prefetch", "2",
             "--ram-budget", "1", "--iters", "2"]
    flags.remove("-q")
    read = {}
    for name, budget in (("two", 5 * nb), ("zero", 0)):
        assert cli.main([*flags, "--device-budget", str(budget), "--out", str(tmp_path / name)]) == 0
        err = capsys.readouterr().err
        resident = 2 if name == "two" else 0
        assert f"placement: {resident} blocks on the device, 0 in RAM" in err, err
        read[name] = per_step(tmp_path / name, "bytes_read")
    assert read["two"][0] == 2 * nb < read["zero"][0]


# -- data ---------------------------------------------------------------------------------------

@pytest.fixture
def token_file(tmp_path) -> tuple[Path, np.ndarray]:
    """Token ids 0, 1, 2, ... (mod the tiny vocabulary): a window's first id says where it starts."""
    ids = (np.arange(3000) % phantom.preset("tiny").vocab_size).astype(np.uint16)
    ids.tofile(tmp_path / "ids.bin")
    return tmp_path / "ids.bin", ids


@pytest.fixture
def batches(monkeypatch) -> list[torch.Tensor]:
    """The input batches the run's DataLoader gave, in order."""
    seen, real = [], phantom.data.batches.loader

    def tapped(*args, **kwargs):
        for x, y in real(*args, **kwargs):
            seen.append(x.clone())
            yield x, y

    monkeypatch.setattr(phantom.data.batches, "loader", tapped)
    return seen


def test_sequential_reads_windows_in_order(run, token_file, batches):
    path, ids = token_file
    seq = run("seq", "--data", path, "--sequential", "--iters", "3")
    assert meta(seq)["shuffle"] is False
    t, b = 32, 2
    for step, x in enumerate(batches[:3]):
        want = [ids[(step * b + r) * t:(step * b + r + 1) * t] for r in range(b)]
        assert x.tolist() == [w.tolist() for w in want], step
    del batches[:]
    shuffled = run("random", "--data", path, "--iters", "3")
    starts = [int(row[0]) for x in batches[:3] for row in x]
    assert meta(shuffled)["shuffle"] is True
    assert any(s % t for s in starts), starts  # random windows start anywhere, not at multiples of seq_len


def test_workers_prepare_batches_in_other_processes(run, token_file, batches, tmp_path, monkeypatch):
    """--workers N: the batches come from N DataLoader processes (0: the training process), and they are
    the same batches (the order is a pure function of seed and step)."""
    path, _ = token_file
    log = tmp_path / "getitem.pids"
    real = phantom.data.batches.Windows.__getitem__

    def logged(self, i):
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        return real(self, i)

    monkeypatch.setattr(phantom.data.batches.Windows, "__getitem__", logged)
    pids, got = {}, {}
    for n in (0, 2):
        log.write_text("")
        del batches[:]
        out = run(f"w{n}", "--data", path, "--workers", n, "--iters", "4")
        pids[n], got[n] = set(map(int, log.read_text().split())), ([x.tolist() for x in batches[:4]], steps(out))
    assert pids[0] == {os.getpid()}
    assert len(pids[2]) == 2 and os.getpid() not in pids[2], pids
    assert got[0][0] == got[2][0]
    assert [m["loss"] for m in got[0][1]] == [m["loss"] for m in got[2][1]]


def test_val_data_is_what_the_evaluation_reads(run, tmp_path):
    """The step-0 evaluation (before any update) depends on --val-data only: the same file gives the
    same loss whatever --data is, another file another loss; and --val-split is then ignored (all of
    --data trains)."""
    text = TINY_TEXT.read_text()
    half = len(text) // 2
    (tmp_path / "v1.txt").write_text(text[:half])
    (tmp_path / "v2.txt").write_text(text[half:])
    (tmp_path / "d.txt").write_text(text[half // 2:])
    ev = ["--eval-every", "1", "--eval-iters", "2", "--iters", "1"]
    one = run("one", *ev, "--val-data", tmp_path / "v1.txt", "--val-split", "0.3")
    same = run("same", *ev, "--val-data", tmp_path / "v1.txt", "--data", tmp_path / "d.txt")
    other = run("other", *ev, "--val-data", tmp_path / "v2.txt")
    val0 = {name: metrics(out)[0] for name, out in (("one", one), ("same", same), ("other", other))}
    assert all(m["step"] == 0 for m in val0.values())
    assert val0["one"]["val_loss"] == val0["same"]["val_loss"] != val0["other"]["val_loss"]
    no_val = run("no_val", "--iters", "1")  # TINY: --val-split 0, the whole shipped text trains
    assert meta(one)["data"] == meta(no_val)["data"]
    split = run("split", "--iters", "1", "--val-split", "0.3")
    assert meta(split)["data"] != meta(no_val)["data"]
