"""The cost model at long rows: activations counted as tiled block compute holds them (phantom.arch.tiled), the
chunk chosen from the memory left, and a profile timed at a short row for a long one."""
from __future__ import annotations

import dataclasses

import pytest

from phantom.arch.presets import preset
from phantom.plan import costinputs as ci, costmodel as cm, planner, profiles
from phantom.stream.placement import Activations, Placement

GiB = 1 << 30
CPU = ci.MachineProfile(machine="t", device="cpu", dtype="fp32", fwd_flops=1e11, free_host_bytes=None)


def host_bytes(cfg, t: int, chunk: int, recompute: str = "all") -> int:
    shape = ci.shape_of(cfg, "fp32", "fp32", t)
    return cm.predict(CPU, shape, Placement(offload="disk"), Activations(recompute=recompute, mlp_chunk=chunk),
                      1).host_bytes


def test_a_tiled_row_grows_by_what_stays_at_full_length():
    """Untiled, a block's whole graph and its gradients grow with the row; tiled, what stays at full length (the
    stored inputs, the gradient coming in, into which the MLP's input's gradient is written, q, k, v, attention's
    output) does, and one chunk's graph is a constant."""
    cfg = preset("7B").first_layers(2)
    dim, hidden = cfg.dim, cfg.token_hidden_dim
    per_token = {c: (host_bytes(cfg, 16384, c) - host_bytes(cfg, 4096, c)) / 12288 / 4 for c in (0, 2048)}
    row = 2 + 5 + 4  # 2 blocks' stored inputs; q, k, v, out (MHA), the gradient in (the MLP's input's); 4 grads
    assert per_token[2048] == pytest.approx(row * dim, rel=1e-3)
    untiled = 2 + 2 + (8.5 + 2 + 1) + (3 + 2) * hidden / dim  # and the graph's and its gradients' estimates
    assert per_token[0] == pytest.approx(untiled * dim, rel=1e-2)
    assert host_bytes(cfg, 2048, 0) == host_bytes(cfg, 2048, 2048)  # a row no longer than the chunk is not tiled


def test_a_kept_tiled_block_holds_no_chunk_graph():
    """recompute none at a long row: each kept block holds its full-length tensors, not its MLP's hidden ones."""
    cfg = preset("7B").first_layers(4)
    shape = ci.shape_of(cfg, "fp32", "fp32", 16384)
    assert cm.kept_row_bytes(shape, CPU, 2048) == 16384 * shape.row_bytes_per_token
    assert cm.kept_row_bytes(shape, CPU, 0) == shape.keep_bytes_per_row
    assert host_bytes(cfg, 16384, 2048, "none") < host_bytes(cfg, 16384, 0, "none") / 2


def test_the_planner_keeps_the_default_chunk_where_it_fits_and_halves_it_where_it_does_not():
    cfg = preset("7B").first_layers(2)
    shape = ci.shape_of(cfg, "fp32", "fp32", 32768)
    need = {c: host_bytes(cfg, 32768, c) for c in (2048, 1024, 512)}
    assert need[2048] > need[1024] > need[512]
    room = lambda c: (need[c] + (1 << 20)) / (1 - cm.MARGIN)  # noqa: E731  the free memory that holds need[c]
    for free, chunk in ((None, 2048), (room(2048), 2048), (room(1024), 1024), (room(512), 512)):
        profile = dataclasses.replace(CPU, free_host_bytes=None if free is None else int(free))
        space = planner.SearchSpace(offloads=("disk",), recompute=("all",), prefetch=(2,))  # need's placement
        best = planner.choose(planner.search(profile, shape, 1, space))
        assert best.activations.mlp_chunk == chunk, free
        assert f"--mlp-chunk {chunk}" in best.describe()


def test_a_long_row_is_profiled_at_a_short_one(tmp_path):
    """Rows longer than MEASURED_TOKENS share the profile timed at it; shorter rows keep their own length's."""
    cfg = preset("70B")
    path = lambda t: profiles.profile_path(cfg, "cpu", "fp32", t, tmp_path)  # noqa: E731
    assert path(131072) == path(profiles.MEASURED_TOKENS) != path(512)
    assert profiles.measured_tokens(131072) == profiles.MEASURED_TOKENS and profiles.measured_tokens(100) == 100


def test_a_70b_at_128k_tokens_a_row_fits_with_the_host_memory_it_needs():
    """The plan's host memory at 131072 tokens: the 80 block inputs at full length dominate, and no O(T^2) term or
    full-length MLP intermediates are counted."""
    cfg = preset("70B")
    shape = ci.shape_of(cfg, "bf16", "bf16", 131072)
    profile = dataclasses.replace(CPU, dtype="bf16", free_host_bytes=400 * GiB, free_disk_bytes=None)
    space = planner.SearchSpace(offloads=("disk",), recompute=("all",))
    best = planner.choose(planner.search(profile, shape, 1, space))
    inputs = cfg.n_layers * 131072 * cfg.dim * 2
    assert best.fits and best.activations.mlp_chunk == 2048
    assert inputs < best.host_bytes < inputs + 40 * GiB


def test_a_70b_at_128k_tokens_a_row_fits_a_24gb_card_with_its_inputs_in_host_memory():
    """On CUDA the recomputed blocks' inputs of a tiled row wait in pinned host memory (phantom.stream.hostinputs):
    the device holds one block's input and one block's backward, so a 70B at 131072 tokens fits a 24 GiB card; the
    host holds the 80 inputs beside the RAM tier, which yields to them where the host is short."""
    cfg = preset("70B")
    shape = ci.shape_of(cfg, "bf16", "bf16", 131072)
    inputs = cfg.n_layers * 131072 * cfg.dim * 2
    for host, in_ram in ((512 * GiB, 80), (200 * GiB, 4)):
        gpu = ci.MachineProfile(machine="t", device="cuda", dtype="bf16", fwd_flops=1.5e14, h2d_gbps=25.0,
                                free_device_bytes=24 * GiB, free_host_bytes=host, free_disk_bytes=None)
        best = planner.choose(planner.search(gpu, shape, 1, planner.SearchSpace(budgets=Placement(
            device_budget=24 * GiB))))
        assert best.fits and best.activations.mlp_chunk == 2048 and best.split["ram"] == in_ram
        assert best.device_bytes <= 24 * GiB * (1 - cm.MARGIN) < inputs
        assert best.pinned_bytes >= inputs and best.host_bytes <= host * (1 - cm.MARGIN)
        assert "the recomputed blocks' inputs 160.0 GiB" in planner.describe_plan(best, shape, gpu, "70B")
    untiled = cm.predict(gpu, shape, best.placement, dataclasses.replace(best.activations, mlp_chunk=0), 1)
    assert "device" in untiled.short_of  # whole rows: the inputs stay on the device, with the untiled block's graph
