"""Long rows on CUDA: each recomputed block's input waits in page-locked host memory (phantom.stream.hostinputs).

Without a GPU, tests/fake_cuda.py records the streams, events and copies the real code asks for while it runs on
host memory: each input goes out on the side stream after an event of the compute stream, comes back on the side
stream, and the compute stream waits for it before the block's recompute reads it; the step's loss and gradients
are the CPU's. The `cuda`-marked test runs the same step on a real GPU against the untiled run.
"""
from __future__ import annotations

import gc

import pytest
import torch

import phantom
from conftest import SMALL, batch, max_rel_err, randomize_lora
from fake_cuda import fake_cuda
from phantom.plan import costinputs as ci, costmodel as cm
from phantom.stream.executor import BlockExecutor, StreamedBlock
from phantom.stream.placement import Activations, Placement

CHUNK = 8  # rows of 24 tokens: tiled in chunks of 8


def step(store, device: str, mlp_chunk: int):
    model = phantom.load(store, device=device, offload="disk", prefetch=1, compile=False, recompute="all",
                         mlp_chunk=mlp_chunk, lora=phantom.LoraConfig(rank=4, alpha=8, targets=("q", "v")))
    try:
        randomize_lora(model, 0)
        tokens, targets = batch(SMALL, b=2, t=24)
        loss = model(tokens, targets=targets)
        loss.backward()
        return loss.detach().cpu(), [p.grad.detach().cpu() for p in model.trainable_parameters()], model.executor
    finally:
        model.close()


def input_copies(fc, start: int = 0) -> tuple[list, list]:
    """(copies to host, copies back) of (rows, T, dim) activations in fc's log from `start`."""
    copies = [(k, e) for k, e in enumerate(fc.log) if k >= start and e[0] == "copy" and e[1].dim() == 3
              and e[1].shape[-1] == SMALL.dim]
    out = [(k, e) for k, e in copies if fc.on_cuda(e[2]) and not fc.on_cuda(e[1])]
    back = [(k, e) for k, e in copies if fc.on_cuda(e[1]) and not fc.on_cuda(e[2])]
    return out, back


def backward_on_fake_cuda(fc, monkeypatch):
    """Each block's backward under fc's mode too: autograd's engine does not carry a TorchFunctionMode into the
    backward, where the inputs come back."""
    backward = StreamedBlock.backward

    def under_mode(ctx, *grads):
        with fc.tensors_to_host():
            return backward(ctx, *grads)
    monkeypatch.setattr(StreamedBlock, "backward", staticmethod(under_mode))
    run_block = BlockExecutor.run_block

    def logged(ex, i, x, *args, **kw):  # where a block reads its input, in the log's order
        fc.log.append(("run_block", x.untyped_storage().data_ptr()))  # not x: it would hold the graph
        return run_block(ex, i, x, *args, **kw)
    monkeypatch.setattr(BlockExecutor, "run_block", logged)


def test_a_long_row_s_block_inputs_go_to_host_memory_and_back_in_order(monkeypatch, small_store):
    ref_loss, ref_grads, _ = step(small_store, "cpu", CHUNK)
    fc = fake_cuda(monkeypatch)
    backward_on_fake_cuda(fc, monkeypatch)
    with fc.tensors_to_host():
        loss, grads, ex = step(small_store, "cuda", CHUNK)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    for g, ref in zip(grads, ref_grads):
        assert max_rel_err(g, ref) < 1e-5
    side = ex.host_inputs.stream
    out, back = input_copies(fc)
    assert len(out) == len(back) == SMALL.n_layers  # every block's input, out once and back once
    for k, (_, dst, src, non_blocking, stream) in out:
        assert stream is side and non_blocking and not fc.on_cuda(dst)
        made = [e for e in fc.log[:k] if e[0] == "record" and e[2] is fc.default]
        assert made and any(e[0] == "wait_event" and e[1] is side and e[2] is made[-1][1] for e in fc.log[:k]), \
            "the copy out does not wait for the forward that made its source"
        assert any(e[0] == "record_stream" and e[1] is src and e[2] is side for e in fc.log[k:]), \
            "the source's memory could be handed out while the copy reads it"
    for k, (_, dst, src, non_blocking, stream) in back:
        assert stream is side and non_blocking
        arrived = next(e[1] for e in fc.log[k:] if e[0] == "record" and e[2] is side)
        waited = next(j for j, e in enumerate(fc.log) if j > k and e[0] == "wait_event" and e[1] is fc.default
                      and e[2] is arrived)
        read = next(j for j, e in enumerate(fc.log) if j > k and e[0] == "run_block"
                    and e[1] == dst.untyped_storage().data_ptr())
        assert waited < read, "the recompute reads its input before the copy back is waited for"
        assert any(e[0] == "record_stream" and e[1] is dst and e[2] is fc.default for e in fc.log[k:])
    assert fc.unordered() == []
    # the backward reads block n-1's input first: each later one was on its way before its block's backward began
    assert [src.shape for _, (_, _, src, _, _) in back] == [(2, 24, SMALL.dim)] * SMALL.n_layers
    out = back = None
    fc.log.clear()  # its entries hold the block inputs, and through them the step's graph
    gc.collect()
    assert len(ex.host_inputs.pool) == SMALL.n_layers  # every buffer back in the pool for the next step


def test_a_row_the_blocks_do_not_tile_keeps_its_inputs_on_the_device(monkeypatch, small_store):
    fc = fake_cuda(monkeypatch)
    backward_on_fake_cuda(fc, monkeypatch)
    with fc.tensors_to_host():
        step(small_store, "cuda", 0)
        step(small_store, "cuda", 64)
    assert input_copies(fc) == ([], [])


def test_the_cost_model_counts_the_inputs_in_host_memory_on_cuda_only_where_rows_are_tiled():
    """A 70B at 131072 tokens a row on a 24 GB card: the 80 inputs (2 GiB each in bf16) are in pinned host memory,
    the device holds one block's; rows the blocks do not tile keep them on the device as before."""
    cfg = phantom.arch.presets.PRESETS["70B"]
    profile = ci.MachineProfile(machine="t", device="cuda", free_device_bytes=24 << 30, free_host_bytes=1 << 40)
    vector = 131072 * cfg.dim * 2
    for chunk, on_host in ((2048, True), (0, False)):
        shape = ci.shape_of(cfg, "bf16", "bf16", 131072)
        acts = Activations(recompute="all", mlp_chunk=chunk)
        p = cm.predict(profile, shape, Placement(offload="disk", prefetch=0), acts, 1)
        inputs = cfg.n_layers * vector
        assert (p.pinned_bytes >= inputs) == on_host and (p.host_bytes >= inputs) == on_host
        assert (p.device_bytes < inputs) == on_host
        assert p.bytes_inputs == (inputs if on_host else 0)  # out after each forward, back before each backward


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_inputs_in_host_memory_give_the_untiled_step(small_store):
    ref_loss, ref_grads, _ = step(small_store, "cuda", 0)
    torch.cuda.reset_peak_memory_stats()
    loss, grads, ex = step(small_store, "cuda", CHUNK)
    assert ex.host_inputs is not None and len(ex.host_inputs.pool) == SMALL.n_layers
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    for g, ref in zip(grads, ref_grads):
        assert max_rel_err(g, ref) < 1e-5
