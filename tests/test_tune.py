"""The tuner: the cost model on synthetic measurements, profiles on disk, auto placement end to end."""
from __future__ import annotations

import dataclasses
import json

import pytest

from phantom import tune
from phantom.tune import MachineProfile, check_prediction, choose, predict, search

GB = 10**9


def profile(**kw) -> MachineProfile:
    """A GPU box: 32 blocks of 0.4 GB, 1 ms + 2.5 ms/row forward per block, PCIe-like link."""
    base = dict(machine="box", model="m", device="cuda", dtype="bfloat16", quick=False, n_blocks=32,
                block_bytes=int(0.4 * GB), store_bytes=int(13 * GB), head_bytes=int(0.25 * GB), seq_len=512,
                act_bytes_per_row=512 * 4096 * 2, keep_bytes_per_row=40 * 512 * 4096 * 2,
                disk_warm_gbps=6.0, disk_cold_gbps=2.0, disk_jitter=0.2, h2d_gbps=25.0, d2h_gbps=25.0,
                zero_copy=False, fwd_call_s=1e-3, fwd_row_s=2.5e-3, fwd_grad_call_s=1e-3, fwd_grad_row_s=2.5e-3,
                bwd_call_s=2e-3, bwd_row_s=5e-3, head_row_s=2e-3, free_device_bytes=80 * GB,
                free_host_bytes=256 * GB)
    base.update(kw)
    return MachineProfile(**base)


def best(p: MachineProfile, rows: int = 8, **kw):
    return choose(search(p, rows, **kw))


def streamed(p: MachineProfile, **kw):
    """The best RAM-tier placement with recompute "all": placement of weights alone decides."""
    return best(p, offloads=("ram",), recompute=("all",), **kw)


def test_everything_fits_is_resident():
    c = best(profile())
    assert (c.resident, c.loads, c.bound) == (32, 0, "compute")
    # on a CPU the RAM tier is the device's own memory: blocks are used where they lie
    c = best(profile(device="cpu", zero_copy=True, free_host_bytes=512 * GB))
    assert (c.offload, c.zero_copy, c.loads, c.bound) == ("ram", True, 0, "compute")


def test_link_bound_goes_deeper_and_grows_the_batch():
    # 10 GB free on the device: ~20 blocks of 32, so some must stream
    compute_bound = profile(free_device_bytes=10 * GB, h2d_gbps=200.0)
    link_bound = profile(free_device_bytes=10 * GB, h2d_gbps=4.0)
    c, l = streamed(compute_bound), streamed(link_bound)
    assert c.bound == "compute" and l.bound == "link"
    assert l.prefetch > c.prefetch and l.prefetch >= 4
    # free to grow the step, a link-bound run takes more rows per load; a compute-bound one has no
    # reason to (no per-call costs here, so bigger calls gain nothing)
    no_call = dict(fwd_call_s=0.0, fwd_grad_call_s=0.0, bwd_call_s=0.0)
    c = streamed(dataclasses.replace(compute_bound, **no_call), max_batch_size=64)
    l = streamed(dataclasses.replace(link_bound, **no_call), max_batch_size=64)
    assert c.rows == 8 and l.rows > 8  # more rows per block load; the micro-batch is a memory choice
    assert l.step_s / l.rows < streamed(link_bound).step_s / 8


def test_per_call_costs_favour_the_largest_micro_batch_that_fits():
    gpu_like = dict(fwd_call_s=0.02, fwd_grad_call_s=0.02, bwd_call_s=0.04)  # small calls waste the device
    assert streamed(profile(**gpu_like), rows=32).micro_batch == 32
    tight = streamed(profile(**gpu_like, free_device_bytes=8 * GB), rows=32)
    assert tight.micro_batch < 32 and tight.fits


def test_memory_short_means_fewer_slots():
    ample = streamed(profile(free_device_bytes=10 * GB, h2d_gbps=4.0))
    short = streamed(profile(free_device_bytes=3 * GB, h2d_gbps=4.0))
    assert short.fits and short.prefetch + 1 + short.resident < ample.prefetch + 1 + ample.resident
    assert short.device_bytes <= 3 * GB * (1 - tune.MARGIN)
    assert tune.faster_if_more_memory(search(profile(free_device_bytes=3 * GB, h2d_gbps=4.0), 8), short) is not None
    # compute-bound only because keeping activations (no recompute) does not fit: memory is the bound
    assert best(profile(free_device_bytes=10 * GB, h2d_gbps=200.0)).bound == "memory"
    with pytest.raises(ValueError, match="no placement fits"):
        best(profile(free_device_bytes=int(0.5 * GB)))


def test_disk_tier_uses_cold_bandwidth_when_the_store_exceeds_the_page_cache():
    p = profile(free_device_bytes=10 * GB, h2d_gbps=100.0)
    warm = predict(p, "disk", 2, 0, 8, 1, cold=False)
    cold = predict(p, "disk", 2, 0, 8, 1, cold=True)
    assert cold.step_s > warm.step_s and cold.bound == "disk"
    assert predict(p, "disk", 2, 0, 8, 1).step_s == warm.step_s  # 13 GB store, 256 GB free host: warm
    small_host = dataclasses.replace(p, free_host_bytes=16 * GB)
    assert predict(small_host, "disk", 2, 0, 8, 1).step_s == cold.step_s


def test_predict_matches_the_formula_and_the_schedulers_load_count():
    # no per-call costs, no jitter: the step is hand-computable
    p = profile(n_blocks=4, fwd_call_s=0, fwd_grad_call_s=0, bwd_call_s=0, fwd_row_s=0.01, fwd_grad_row_s=0.01,
                bwd_row_s=0.02, head_row_s=0.0, disk_jitter=0.0, block_bytes=GB, h2d_gbps=10.0)
    cf, cb, X = 0.08, 0.08 + 0.16, 0.1  # 8 rows; "all" recomputes the forward in backward
    serial = predict(p, "ram", 0, 0, 8, 1)
    assert serial.step_s == pytest.approx(cf + 3 * (cf + X) + cb + 3 * (cb + X))
    k1 = predict(p, "ram", 1, 0, 4, 2)  # same rows in two micro-batches: same time without call costs
    assert k1.step_s == pytest.approx(max(4 * cf, 2 * cf + 2 * X) + max(4 * cb, 2 * cb + 2 * X))
    # scheduler test: a step loads 2n - 2 * min(K + 1, n) blocks
    assert [predict(p, "ram", k, 0, 8, 1).loads for k in range(4)] == [6, 4, 2, 0]
    assert predict(p, "ram", 0, 4, 8, 1).loads == 0
    # twice the tokens per row: twice the compute
    assert predict(p, "ram", 3, 0, 8, 1, seq_len=1024).step_s == pytest.approx(
        2 * predict(p, "ram", 3, 0, 8, 1).step_s)


def test_contention_slows_only_overlapped_work():
    p = profile(n_blocks=8, disk_jitter=0.0, free_device_bytes=4 * GB)
    busy = dataclasses.replace(p, busy_compute_slowdown=1.3, busy_read_slowdown=1.5)
    assert predict(busy, "disk", 0, 0, 8, 1).step_s == predict(p, "disk", 0, 0, 8, 1).step_s  # serial: no overlap
    assert predict(busy, "disk", 2, 0, 8, 1).step_s > predict(p, "disk", 2, 0, 8, 1).step_s
    assert predict(busy, "disk", 7, 0, 8, 1).step_s == predict(p, "disk", 7, 0, 8, 1).step_s  # nothing streams


def test_recompute_none_is_faster_but_keeps_more():
    p = profile(n_blocks=4)
    rc_all, rc_none = predict(p, "ram", 3, 0, 8, 1, "all"), predict(p, "ram", 3, 0, 8, 1, "none")
    assert rc_none.step_s < rc_all.step_s and rc_none.device_bytes > rc_all.device_bytes


def test_check_prediction_speaks_only_beyond_20_percent():
    c = predict(profile(), "ram", 2, 0, 8, 1)
    assert check_prediction(c, c.step_s * 1.15) is None
    assert check_prediction(c, c.step_s * 0.85) is None
    assert "+30%" in check_prediction(c, c.step_s * 1.3)
    assert "-40%" in check_prediction(c, c.step_s * 0.6)


def test_profile_round_trip_and_a_corrupt_file_is_ignored(tmp_path):
    p = profile()
    path = tmp_path / "profiles" / "x.json"
    tune.save_profile(p, path)
    assert tune.load_profile(path) == p
    path.write_text("{not json")
    assert tune.load_profile(path) is None
    path.write_text(json.dumps({**p.to_dict(), "version": 0}))
    assert tune.load_profile(path) is None
    assert tune.load_profile(tmp_path / "missing.json") is None


def test_format_table_marks_the_choice():
    cands = search(profile(n_blocks=4), 8)
    text = tune.format_table(cands, top=5, chosen=choose(cands))
    assert text.count("<- chosen") == 1 and len(text.splitlines()) <= 8


def test_auto_placement_measures_once_then_reads_the_profile(small_store, tmp_path, monkeypatch):
    first = tune.auto_placement(small_store, "cpu", batch_size=4, seq_len=32, dtype="fp32", profile_dir=tmp_path)
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["quick"] is True
    assert first.fits and first.rows == 4 and first.step_s > 0

    def no_measuring(*a, **k):
        raise AssertionError("measured again although a profile was saved")
    monkeypatch.setattr(tune, "measure", no_measuring)
    again = tune.auto_placement(small_store, "cpu", batch_size=4, seq_len=32, dtype="fp32", profile_dir=tmp_path)
    assert (again.offload, again.rows) == (first.offload, 4)
    assert tune.auto_placement(small_store, "cpu", 4, 32, "fp32", tmp_path, offloads=("disk",)).offload == "disk"
    monkeypatch.setenv("PHANTOM_CACHE", str(tmp_path / "cache"))
    from phantom.store import BlockStore
    assert tune.profile_path(BlockStore(small_store), "cpu", "fp32").parent == tmp_path / "cache" / "profiles"


def test_check_prediction_ignores_steps_too_short_to_model():
    c = dataclasses.replace(predict(profile(), "ram", 2, 0, 8, 1), step_s=0.008)
    assert check_prediction(c, 0.05) is None  # +525%, but both are Python-overhead-sized
    assert "+" in check_prediction(c, 0.2)
