"""Full finetuning: the streamed step (AdamW fused into each block's backward, state in RAM or on
disk, blocks written back) equals torch.optim.AdamW on the resident model, with the documented
per-block clipping (phantom.stream.optim), over several steps and micro-batches, for every placement of
blocks and optimizer state a CPU has; a run killed during a block's update resumes bit for bit."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import phantom
from phantom.stream.optim import AdamWConfig, adamw_step, state_memory, state_tier
from phantom.files.store import BlockStore
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


def streamed_blocks_after(store, tmp_path, steps: int, max_norm, **load) -> list[dict]:
    model = phantom.load(store, prefetch=1, mode="full", work_dir=tmp_path,
                         optim=phantom.AdamWConfig(max_grad_norm=max_norm, **HP, state=load.pop("state")), **load)
    train_steps(model, steps, max_norm)
    model.save_full()
    model.close()
    trained = BlockStore(tmp_path / "store", verify="full")
    return [trained.load_block(i) for i in range(SMALL.n_layers)]


@pytest.mark.parametrize("offload,state", [("ram", "disk"), ("disk", "ram"), ("auto", "auto")])
def test_every_cpu_placement_of_blocks_and_state_equals_adamw(small_store, tmp_path, offload, state):
    """Blocks in RAM with the state in files, blocks on disk with the state in RAM, and a mixed RAM/disk
    placement (auto, a RAM budget of two blocks): 3 steps with weight decay and clipping."""
    steps, max_norm = 3, 0.05
    _, ref_blocks, _ = resident_steps(small_store, steps, max_norm)
    budget = dict(ram_budget=2 * BlockStore(small_store).block_nbytes) if offload == "auto" else {}
    got = streamed_blocks_after(small_store, tmp_path, steps, max_norm, offload=offload, state=state, **budget)
    for i, ref_block in enumerate(ref_blocks):
        for k, v in ref_block.items():
            assert max_rel_err(got[i][k], v) <= TOL, (i, k)
    assert any((tmp_path / "optim").glob("*.safetensors"))  # save_full wrote the held state too


def test_state_tier_choice_and_refusals():
    """auto: the device when the state fits half its free memory, else RAM likewise, else files."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert state_tier("auto", cpu, 10, None, 100) == "ram"
    assert state_tier("auto", cpu, 60, None, 100) == "disk"
    assert state_tier("auto", cuda, 10, 100, 100) == "device"
    assert state_tier("auto", cuda, 60, 100, 200) == "ram"
    assert state_tier("disk", cpu, 10, None, 100) == "disk"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        state_tier("device", cpu, 10, None, 100)
    with pytest.raises(ValueError, match="auto, ram, disk, device"):
        state_tier("gpu", cpu, 10, None, 100)


@pytest.mark.parametrize("coef", [1.0, 0.3])
def test_fused_step_equals_torch_adamw(coef):
    """adamw_step (torch's fused kernel, the clip folded into it) against torch.optim.AdamW's default
    for-loop on gradients multiplied by coef, 3 steps, weight decay on."""
    gen = torch.Generator().manual_seed(0)
    p0 = torch.randn(257, 33, generator=gen)
    ref = torch.nn.Parameter(p0.clone())
    opt = torch.optim.AdamW([ref], **HP)
    p, m, v = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0)
    for step in range(1, 4):
        g = torch.randn(p0.shape, generator=gen)
        ref.grad = g * coef
        opt.step()
        adamw_step([p], [g], [m], [v], step, AdamWConfig(**HP), HP["lr"], coef)
    assert max_rel_err(p, ref) <= 1e-6
    assert max_rel_err(m, opt.state[ref]["exp_avg"]) <= 1e-6
    assert max_rel_err(v, opt.state[ref]["exp_avg_sq"]) <= 1e-6


def test_block_updates_overlap_the_backward(small_store, tmp_path):
    """Block i's update runs on another thread while the training thread is still in the backward:
    the backward of block 0 (the last one) waits until the update of the last block has started,
    which times out if updates only ran after the backward."""
    model = phantom.load(small_store, offload="ram", prefetch=1, mode="full", work_dir=tmp_path,
                         optim=phantom.AdamWConfig(**HP))
    last = SMALL.n_layers - 1
    started, threads, last_started = [], set(), threading.Event()
    step_block, on_block_grads = model.block_optimizer.step_block, model.full_ft.on_block_grads

    def recording_step_block(i, *a, **kw):
        started.append(i)
        threads.add(threading.current_thread())
        if i == last:
            last_started.set()
        return step_block(i, *a, **kw)

    def waiting_on_block_grads(i, *a, **kw):
        if i == 0:
            assert last_started.wait(timeout=60), "no block update started during the backward"
        return on_block_grads(i, *a, **kw)
    model.block_optimizer.step_block, model.full_ft.on_block_grads = recording_step_block, waiting_on_block_grads
    tokens, targets = batch(SMALL)
    model(tokens, targets=targets).backward()
    model.finish_step()
    model.close()
    assert started == list(range(last, -1, -1))  # in the backward's order, the last block first
    assert threading.current_thread() not in threads  # beside the backward, not inside it
    rate = model.block_optimizer.take_rate()
    assert rate["optim_params"] == SMALL.n_layers * SMALL.block_params() and rate["optim_params_per_s"] > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA: device-placed state and pinned gradient copies")
@pytest.mark.cuda
@pytest.mark.parametrize("state", ["device", "ram"])
def test_cuda_full_finetune_equals_adamw(small_store, tmp_path, state):
    """On a GPU: state on the device (update there) or in RAM (gradients to pinned buffers on a copy
    stream) equals AdamW on the resident model."""
    steps, max_norm = 3, 0.05
    _, ref_blocks, _ = resident_steps(small_store, steps, max_norm)
    got = streamed_blocks_after(small_store, tmp_path, steps, max_norm, offload="ram", state=state, device="cuda")
    for i, ref_block in enumerate(ref_blocks):
        for k, v in ref_block.items():
            assert max_rel_err(got[i][k], v) <= TOL, (i, k)


# A kill inside a block's update (phantom.base.faults point "optim.update": the state stepped in memory,
# nothing written), then --resume: the run ends bit-identical to one never stopped, for blocks and
# state in RAM and on disk. The tiny model has 4 blocks: hit 14 is step 4's second update (the
# checkpoint of step 2 is the last one), hit 9 step 3's first.
KILL_POINTS = ["optim.update:9", "optim.update:14"]


def cli_args(offload: str) -> list[str]:
    from test_faults import COMMON
    return [*COMMON, "--mode", "full", "--offload", offload, "--lr", "1e-3", "--weight-decay", "0.1",
            "--eval-every", "0", "--val-split", "0"]


@pytest.fixture(scope="module")
def tiny_weights(tmp_path_factory):
    from phantom.convert.synthetic import ensure_tiny
    root = tmp_path_factory.mktemp("weights")
    ensure_tiny(root / "tiny")
    return root


@pytest.mark.parametrize("offload,optim,points", [("ram", "adamw_torch", KILL_POINTS),
                                                  ("disk", "adamw_torch", KILL_POINTS),
                                                  ("disk", "adamw_8bit", ["optim.update:17"])])
def test_kill_during_a_block_update_then_resume_is_bit_identical(tiny_weights, tmp_path, monkeypatch, capsys, offload,
                                                                 optim, points):
    """Killed in a block's update (adamw_8bit: in step 5's, after the checkpoint of step 4), resumed: the
    store, the checkpoint, the losses and the optimizer state (codes and scales) equal the straight run's."""
    from test_faults import finetune, killed, leftovers, same_store, steps_and_losses
    args = [*cli_args(offload), "--optim", optim]
    with ThreadPoolExecutor(len(points)) as pool:
        runs = {p: pool.submit(killed, p, tiny_weights, *args, "--out", tmp_path / p.replace(":", "-"))
                for p in points}
        runs = {p: r.result() for p, r in runs.items()}
    monkeypatch.setenv("PHANTOM_WEIGHTS", str(tiny_weights))
    reference = tmp_path / "reference"
    assert finetune(*args, "--out", reference) == 0
    for point, r in runs.items():
        out = tmp_path / point.replace(":", "-")
        assert r.returncode == -9, f"{point} was never reached (exit {r.returncode}): {r.stderr[-2000:]}"
        BlockStore(out / "checkpoint" / "store", verify="full")  # the last checkpoint is intact
        assert finetune(*args, "--out", out, "--resume") == 0
        same_store(reference / "store", out / "store")
        same_store(reference / "checkpoint" / "store", out / "checkpoint" / "store")
        assert steps_and_losses(out) == steps_and_losses(reference)
        assert same_state(reference / "checkpoint" / "optim", out / "checkpoint" / "optim")
        assert not leftovers(out), leftovers(out)
    BlockStore(tiny_weights / "tiny", verify="full")  # the original is never written
    if optim == "adamw_8bit":
        from safetensors.torch import load_file
        state = load_file(str(reference / "checkpoint" / "optim" / "000.safetensors"))
        assert any(t.dtype == torch.uint8 for t in state.values())  # codes, not fp32 moments
        other = [a if a != "adamw_8bit" else "adamw_torch" for a in args]
        capsys.readouterr()
        assert finetune(*other, "--out", reference, "--resume", "--iters", "10") == 2
        err = capsys.readouterr().err.strip()
        assert "holds adamw_8bit's optimizer state, this run asks adamw_torch" in err and "\n" not in err, err


def same_state(a, b) -> bool:
    """Two block-optimizer state folders hold the same bits (every block's master, moments, step)."""
    from safetensors.torch import load_file
    files = sorted(f.name for f in a.glob("*.safetensors"))
    if not files or files != sorted(f.name for f in b.glob("*.safetensors")):
        return False
    for name in files:
        x, y = load_file(str(a / name)), load_file(str(b / name))
        if x.keys() != y.keys() or not all(torch.equal(x[k].view(torch.uint8), y[k].view(torch.uint8)) for k in x):
            return False
    return True


def test_state_memory_model():
    """12 bytes a parameter of state where the tier puts it; 4 a parameter of gradients in flight."""
    P, n = 1000, 8
    assert state_memory("ram", P, n) == {"host": 12 * P * n + 8 * P, "device": 0, "disk": 0}
    assert state_memory("disk", P, n) == {"host": 12 * P + 8 * P, "device": 0, "disk": 12 * P * n}
    assert state_memory("device", P, n) == {"host": 0, "device": 12 * P * n + 8 * P, "disk": 0}
