"""8-bit AdamW (phantom.stream.adam8bit): the maps and the blockwise update against bitsandbytes'
(pinned; its CPU AdamW8bit), the codes against an exact nearest-code search, the streamed blocks'
8-bit state equal to the resident model's, and the state's bytes a quarter of fp32 AdamW's."""
from __future__ import annotations

import pytest
import torch

import phantom
from phantom.files.store import BlockStore
from phantom.stream import adam8bit as A
from conftest import SMALL, batch

bnb = pytest.importorskip("bitsandbytes")
HP = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8)


def test_maps_are_bitsandbytes_maps():
    from bitsandbytes.functional import create_dynamic_map
    assert torch.equal(A.dynamic_map(True), create_dynamic_map(True))
    assert torch.equal(A.dynamic_map(False), create_dynamic_map(False))


@pytest.mark.parametrize("signed", [True, False])
def test_codes_are_the_nearest_but_at_ties(signed):
    """Every value's code is the nearest code (a float64 search of all 256), except where two codes are
    equally near; values from 1e-9 to 1 of the block maximum, zeros and the maximum itself."""
    qmap = A.SIGNED if signed else A.UNSIGNED
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1 << 16, generator=gen) * torch.logspace(-9, 0, 1 << 16)
    x = x if signed else x.abs()
    x[:64] = 0
    mids = (qmap.code[:-1].double() + qmap.code[1:].double()) / 2  # exact ties, and the floats around them
    near = torch.cat([mids.float(), torch.nextafter(mids.float(), torch.tensor(2.0)),
                      torch.nextafter(mids.float(), torch.tensor(-2.0))])
    x = torch.cat([x, near[near.abs() <= 1] if signed else near[(near >= 0) & (near <= 1)]])
    codes, scale = A.quantize(x, qmap)
    scaled = x.double().view(-1)
    pad = -scaled.numel() % A.BLOCK
    blocks = torch.nn.functional.pad(scaled, (0, pad)).view(-1, A.BLOCK)
    scaled = (blocks / scale.double().clamp_min(1e-300)[:, None]).view(-1)[:x.numel()]
    assert torch.equal(scale, torch.nn.functional.pad(x, (0, pad)).view(-1, A.BLOCK).abs().amax(1))
    dist = (scaled[:, None] - qmap.code.double()[None, :]).abs()
    best = dist.min(1).values
    ties = (dist == best[:, None]).sum(1) > 1
    got = dist.gather(1, codes.long()[:, None]).squeeze(1)
    assert torch.equal(got[~ties], best[~ties])
    assert (got[ties] == best[ties]).all()  # a tie takes one of the nearest two
    bnb_codes, bnb_scale = torch.ops.bitsandbytes.quantize_blockwise(x, qmap.code, A.BLOCK)
    assert torch.equal(A.quantize(x, qmap, "bnb_cpu")[0], bnb_codes) and torch.equal(scale, bnb_scale)
    assert torch.equal(A.dequantize(codes, scale, qmap),
                       torch.ops.bitsandbytes.dequantize_blockwise(codes, scale, qmap.code, A.BLOCK, torch.float32))


def train(model, opt, steps: int, seed: int = 0) -> list[float]:
    """`steps` steps on fresh batches (a row of tokens no batch reads stays unread)."""
    losses = []
    for s in range(steps):
        tokens, targets = batch(SMALL, seed=seed + s, t=16)
        tokens, targets = tokens % 64, targets % 64  # the embedding's rows 64.. are never read
        loss = model(tokens.to(model.device), targets=targets.to(model.device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        model.finish_step()
        losses.append(loss.item())
    return losses


def trained(model) -> dict[str, torch.Tensor]:
    """Every weight after training: the resident model's own, a streamed model's as save_full wrote them."""
    if model.scheduler is None:
        blocks = [b.state_dict() for b in model.layers]
    else:
        model.save_full()
        store = BlockStore(model.store.path, verify="full")
        blocks = [store.load_block(i) for i in range(store.n_blocks)]
    out = {f"layers.{i}.{k}": v.detach().cpu().clone() for i, b in enumerate(blocks) for k, v in b.items()}
    return out | {"output": model.output_weight.detach().cpu().clone(), "embed": model.embed_table.detach().cpu().clone()}


def resident_run(store, make_opt, steps: int):
    model = phantom.load(store, offload="none", mode="full")
    opt = make_opt(model.trainable_parameters())
    losses = train(model, opt, steps)
    return losses, trained(model), opt, model


def streamed_run(store, work, steps: int, rounding: str = "nearest", **hp):
    model = phantom.load(store, offload="ram", prefetch=1, mode="full", work_dir=work,
                         optim=phantom.AdamWConfig(**hp, optim="adamw_8bit", rounding=rounding))
    embed0 = model.embed_table.detach().clone()
    losses = train(model, A.AdamW8bit(model.trainable_parameters(), **hp, rounding=rounding), steps)
    got = trained(model)
    model.close()
    return losses, got, embed0


def distances(got, ref, fp32, rows) -> dict[str, float]:
    """Per tensor: |ours - bitsandbytes'| / |bitsandbytes' - fp32 AdamW's| (the embedding's `rows`)."""
    out = {}
    for name, want in ref.items():
        sel = rows if name == "embed" else slice(None)
        theirs = (want - fp32[name])[sel].norm()
        assert theirs > 0, name
        out[name] = float((got[name] - want)[sel].norm() / theirs)
    return out


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_full_finetune_against_bitsandbytes(small_store, tmp_path, weight_decay):
    """8 steps of the streamed model (blocks in RAM) with adamw_8bit, of the resident model with
    bitsandbytes' AdamW8bit and with torch's fp32 AdamW, on batches that never read the embedding's
    rows 64 and up.

    With bitsandbytes' CPU rounding (its lookup table), the update is bitsandbytes': losses within 1e-6,
    every tensor within a twentieth of the distance between its 8-bit run and fp32 AdamW. With the
    nearest code (the default): losses within 1e-4 relative, every tensor nearer bitsandbytes' run than
    that run is to fp32 AdamW (not a quarter: the lookup's bins of 3e-5 code every value under 1.5e-5
    of its block's maximum, a few percent of the second moment's, as 1.5e-5), and the unread rows moved
    by the weight decay alone, exactly (the lookup codes their zero moments as 1.5e-5 and moves them)."""
    steps, hp = 8, dict(HP, weight_decay=weight_decay)
    ref_losses, ref, _, _ = resident_run(small_store, lambda p: bnb.optim.AdamW8bit(p, **hp), steps)
    _, fp32, _, _ = resident_run(small_store, lambda p: torch.optim.AdamW(p, **hp), steps)
    read = torch.arange(SMALL.vocab_size) < 64
    losses, got, _ = streamed_run(small_store, tmp_path / "lut", steps, "bnb_cpu", **hp)
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)) <= 1e-6
    assert max(distances(got, ref, fp32, slice(None)).values()) <= 0.05
    losses, got, embed0 = streamed_run(small_store, tmp_path / "nearest", steps, **hp)
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)) <= 1e-4
    assert max(distances(got, ref, fp32, read).values()) < 1.0
    decayed = embed0[~read].clone()
    for _ in range(steps):
        decayed.mul_(1.0 - hp["lr"] * weight_decay)
    assert torch.equal(got["embed"][~read], decayed)


def block_state(folder) -> list[dict]:
    from safetensors.torch import load_file
    return [load_file(str(f)) for f in sorted(folder.glob("*.safetensors"))]


@pytest.mark.parametrize("offload", ["ram", "disk"])
def test_streamed_equals_resident_bit_for_bit(small_store, tmp_path, offload):
    """The blocks' 8-bit codes, scales and weights after 4 steps streamed from RAM and disk equal the
    resident model's under AdamW8bit (the same kernel on the same gradients), bit for bit."""
    steps, hp = 4, dict(HP, weight_decay=0.01)
    _, ref, ref_opt, ref_model = resident_run(small_store, lambda p: A.AdamW8bit(p, **hp), steps)
    model = phantom.load(small_store, offload=offload, prefetch=1, mode="full", work_dir=tmp_path,
                         optim=phantom.AdamWConfig(**hp, optim="adamw_8bit", state=offload))
    train(model, A.AdamW8bit(model.trainable_parameters(), **hp), steps)
    got = trained(model)
    for name, want in ref.items():
        assert torch.equal(got[name], want), name
    states = block_state(tmp_path / "optim")
    assert len(states) == SMALL.n_layers
    for i, (block, state) in enumerate(zip(ref_model.layers, states)):
        for k, p in block.named_parameters():
            mine = ref_opt.state[p]
            for name, t in mine.items():
                if name != "step":
                    assert torch.equal(state[f"{name}.{k}"].view(-1), t.view(-1)), (i, k, name)
    model.close()


def test_state_bytes_are_a_quarter(small_store, tmp_path):
    """The moments of a checkpointed block optimizer (masters aside) and of a step's reads and writes:
    at most 0.27x fp32 AdamW's on a model whose tensors are 8-bit sized."""
    sizes = [4096 * 11008, 4096 * 4096, 4096]
    assert sum(A.state_bytes(n) for n in sizes) <= 0.27 * sum(8 * n for n in sizes)
    moments = {}
    for optim in ("adamw_torch", "adamw_8bit"):
        work = tmp_path / optim
        model = phantom.load(small_store, offload="disk", prefetch=1, mode="full", work_dir=work,
                             optim=phantom.AdamWConfig(**HP, optim=optim, state="disk"))
        train(model, torch.optim.AdamW(model.trainable_parameters(), **HP), 1)
        model.save_full()
        model.close()
        moments[optim] = sum(t.numel() * t.element_size() for s in block_state(work / "optim")
                             for k, t in s.items() if not k.startswith(("master.", "step")))
    numels = [s.shape.numel() if isinstance(s.shape, torch.Size) else torch.Size(s.shape).numel()
              for b in BlockStore(small_store).blocks for s in b.specs]
    shape_ratio = sum(A.state_bytes(n) for n in numels) / sum(8 * n for n in numels)
    assert moments["adamw_8bit"] / moments["adamw_torch"] == pytest.approx(shape_ratio)


def test_a_state_file_of_the_other_optimizer_is_refused(small_store, tmp_path):
    model = phantom.load(small_store, offload="disk", prefetch=1, mode="full", work_dir=tmp_path,
                         optim=phantom.AdamWConfig(**HP, optim="adamw_torch", state="disk"))
    train(model, torch.optim.AdamW(model.trainable_parameters(), **HP), 1)
    model.close()
    model = phantom.load(tmp_path / "store", offload="disk", prefetch=1, mode="full", work_dir=tmp_path / "again",
                         optim=phantom.AdamWConfig(**HP, optim="adamw_8bit", state="disk"))
    optimizer = model.block_optimizer
    optimizer.state_dir = tmp_path / "optim"
    with pytest.raises(ValueError, match="holds adamw_torch's optimizer state, not adamw_8bit's"):
        optimizer.load_state(0, lambda: {})
    model.close()
    with pytest.raises(ValueError, match="--optim must be one of"):
        phantom.AdamWConfig(optim="adam8")


def test_lora_run_with_8bit_states_resumes_and_refuses_the_other(tmp_path, monkeypatch, capsys):
    """finetune.py --optim adamw_8bit on a LoRA: the checkpoint's optimizer state (read with weights_only)
    holds codes and scales for the tensors of 4096 elements and more; --resume continues it, and a
    resume under adamw_torch is refused in one line."""
    from test_faults import load_script
    from phantom.convert.synthetic import ensure_tiny
    finetune = lambda *a: load_script("finetune").main([*map(str, a)])  # noqa: E731
    from phantom.train.checkpoint import read_state
    ensure_tiny(tmp_path / "weights" / "tiny")
    monkeypatch.setenv("PHANTOM_WEIGHTS", str(tmp_path / "weights"))
    out = tmp_path / "out"
    args = ["--iters", "2", "--batch-size", "2", "--seq-len", "32", "-q", "--eval-every", "0", "--val-split", "0",
            "--lora-rank", "64", "--out", out]
    assert finetune(*args, "--optim", "adamw_8bit") == 0
    state = read_state(out / "checkpoint" / "state.pt")["optimizer"]["state"]
    assert any("exp_avg_q" in s and s["exp_avg_q"].dtype == torch.uint8 for s in state.values())
    capsys.readouterr()
    assert finetune(*args[:-2], "--out", out, "--resume", "--iters", "3", "--optim", "adamw_torch") == 2
    err = capsys.readouterr().err.strip()
    assert "holds adamw_8bit's optimizer state" in err and "\n" not in err
    assert finetune(*args[:-2], "--out", out, "--resume", "--iters", "3", "--optim", "adamw_8bit") == 0
    resumed = read_state(out / "checkpoint" / "state.pt")["optimizer"]["state"]  # the codes went on as codes
    assert all(s["exp_avg_q"].dtype == torch.uint8 for s in resumed.values() if "exp_avg_q" in s)


def c_and_torch(n: int, rounding: str, steps: int = 3):
    """The C loop's and the torch form's weights and states after `steps` updates of the same n elements
    (zero gradients in places, a last partial block)."""
    gen = torch.Generator().manual_seed(n)
    p = torch.randn(n, generator=gen)
    g = torch.randn(n, generator=gen) * 1e-3
    g[:50] = 0
    g[1000:1300] = 0
    maps = (*A.tables(p.device, rounding), rounding == "bnb_cpu")
    out = []
    for form in ("c", "torch"):
        w, state = p.clone(), A.new_state(p.shape, p.device)
        for t in range(1, steps + 1):
            h = A.hyper(1e-3, (0.9, 0.999), 1e-8, 0.01, t, 0.7, p.device)
            if form == "c":
                A.update(w, g * t, state, h, rounding)
            else:
                A.torch_update(w, g * t, tuple(state[k].view(-1) for k in ("exp_avg_q", "exp_avg_scale", "exp_avg_sq_q",
                                                                          "exp_avg_sq_scale")), h, maps)
        out.append((w, state))
    return out


@pytest.mark.parametrize("rounding", ["nearest", "bnb_cpu"])
def test_the_c_loop_equals_the_torch_form_bit_for_bit(rounding):
    from phantom.stream import cpukernel
    if cpukernel.load() is None:
        pytest.skip("no C compiler here: the torch form is the only one")
    for n in (4096 * 3 + 17, 1 << 18):
        (w1, s1), (w2, s2) = c_and_torch(n, rounding)
        assert torch.equal(w1, w2) and all(torch.equal(s1[k], s2[k]) for k in s1), (n, rounding)


def test_without_a_compiler_the_update_runs_in_torch(tmp_path, monkeypatch, caplog):
    from phantom.stream import cpukernel
    monkeypatch.setattr(cpukernel, "_lib", [])
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("PHANTOM_CACHE", str(tmp_path / "cache"))
    assert cpukernel.load() is None
    assert "no-such-cc" in caplog.text or "compiling its CPU update failed" in caplog.text
    w, state = torch.ones(4096), A.new_state((4096,), torch.device("cpu"))
    A.update(w, torch.full((4096,), 1e-3), state, A.hyper(1e-3, (0.9, 0.999), 1e-8, 0.0, 1, 1.0, w.device))
    assert torch.allclose(w, torch.full((4096,), 1 - 1e-3), atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA: 8-bit state on the device, or in RAM beside pinned "
                                                          "gradient copies")
@pytest.mark.cuda
@pytest.mark.parametrize("state", ["device", "ram"])
def test_cuda_8bit_full_finetune_equals_the_cpu_run(small_store, tmp_path, state):
    """On a GPU, 3 steps with the blocks' 8-bit state on the device (the update compiled for it) or in RAM (the
    C loop on the host): every weight within 1e-3 (by norm) of the CPU run's (the GPU's matmuls round
    otherwise, so a code may differ)."""
    hp = dict(HP, weight_decay=0.01)
    _, cpu, _ = streamed_run(small_store, tmp_path / "cpu", 3, **hp)
    model = phantom.load(small_store, device="cuda", offload="ram", prefetch=1, mode="full", work_dir=tmp_path / "gpu",
                         optim=phantom.AdamWConfig(**hp, optim="adamw_8bit", state=state))
    train(model, A.AdamW8bit(model.trainable_parameters(), **hp), 3)
    got = trained(model)
    model.close()
    for name, want in cpu.items():
        assert (got[name].cpu() - want).norm() <= 1e-3 * want.norm(), name


def test_a_nonzero_second_moment_is_never_coded_zero():
    """The second moment's zero-point: the nearest code, except that a nonzero value whose nearest code is
    zero takes the least nonzero code (its weight's update would otherwise be m / eps); zero stays zero."""
    v = torch.tensor([[0.0, 1e-12, 1e-9, 1e-7, 1e-3, 1.0] + [0.5] * (A.BLOCK - 6)])
    scale = v.abs().amax(1)
    table, above = A.UNSIGNED.rounding("nearest")
    plain = A.requantize(v, scale, table, above, False, 0)
    floored = A.requantize(v, scale, table, above, False, 1)
    assert plain[0, :4].tolist() == [0, 0, 0, 0] and floored[0, :4].tolist() == [0, 1, 1, 1]
    assert torch.equal(floored[0, 4:], plain[0, 4:]) and A.UNSIGNED.code[1] > 0
