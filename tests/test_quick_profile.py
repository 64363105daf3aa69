"""A quick profile's bounded time (a block's compute timed on a slice of it, scaled by FLOPs) and bf16
emulated on a CPU told apart: the flags and oneDNN's ISA cap, faked here; the plan's warning with the
fp32 step beside it; `--dtype auto` on such a CPU.

The error of the scaling against full measurements is a benchmark, not a test: notes/quick-profile.md.
Fast: pure functions, and the tiny preset's profiles (a second or two each).
"""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from phantom.arch.presets import PRESETS, preset
from phantom.base import cpufeatures
from phantom.files.store import BlockStore
from phantom.convert.synthetic import write_synthetic
from phantom.plan import costinputs as ci
from phantom.plan import profiles, quickslice as qs
from phantom.train import cli
from test_convert import load_script

X86 = {"fpu", "avx2", "avx512f", "avx512bw", "avx512vl"}


def test_cpu_flags_are_read_from_x86_and_arm_cpuinfo(tmp_path):
    (tmp_path / "x86").write_text("processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512f avx512_bf16\n"
                                  "processor\t: 1\nflags\t\t: other\n")
    (tmp_path / "arm").write_text("processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n")
    assert cpufeatures.cpu_flags(str(tmp_path / "x86")) == {"fpu", "avx2", "avx512f", "avx512_bf16"}
    assert "bf16" in cpufeatures.cpu_flags(str(tmp_path / "arm"))
    assert cpufeatures.cpu_flags(str(tmp_path / "none")) is None


@pytest.mark.parametrize("flags, env, machine, emulated", [
    (X86 | {"avx512_bf16"}, {}, "x86_64", None),
    (X86 | {"amx_bf16"}, {}, "x86_64", None),
    (X86, {}, "x86_64", "no avx512_bf16 or amx_bf16"),  # AVX-512 without bf16: oneDNN emulates
    ({"avx2", "fma"}, {}, "x86_64", "no avx512_bf16 or amx_bf16"),  # an EPYC without AVX-512
    (X86 | {"avx512_bf16"}, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}, "x86_64", "ONEDNN_MAX_CPU_ISA=AVX512_CORE"),
    (X86 | {"avx512_bf16"}, {"DNNL_MAX_CPU_ISA": "avx2"}, "x86_64", "ONEDNN_MAX_CPU_ISA=AVX2"),
    (X86 | {"avx512_bf16"}, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}, "x86_64", None),
    (X86 | {"amx_bf16"}, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"}, "x86_64", None),
    ({"fp", "asimd", "bf16"}, {}, "aarch64", None),
    ({"fp", "asimd"}, {}, "aarch64", "no bf16 instructions"),
])
def test_bf16_is_emulated_without_the_instructions_or_with_onednn_kept_from_them(flags, env, machine, emulated):
    why = cpufeatures.bf16_emulated(flags, env, machine)
    assert why is None if emulated is None else emulated in why


def test_a_cpu_without_cpuinfo_is_not_second_guessed(monkeypatch):
    monkeypatch.setattr(cpufeatures, "cpu_flags", lambda cpuinfo="/proc/cpuinfo": None)  # macOS, Windows
    assert cpufeatures.bf16_emulated(env={}, machine="arm64") is None


def fake_cpu(monkeypatch, flags: set[str], cap: str | None = None) -> None:
    monkeypatch.setattr(cpufeatures, "cpu_flags", lambda cpuinfo="/proc/cpuinfo": flags)
    monkeypatch.setattr(cpufeatures.platform, "machine", lambda: "x86_64")
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    if cap is None:
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    else:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)


@pytest.mark.parametrize("flags, cap", [(X86, None), (X86 | {"avx512_bf16"}, "AVX512_CORE"),
                                        (X86 | {"avx512_bf16"}, None)])
def test_dtype_auto_is_fp32_on_a_cpu_and_bf16_given_is_flagged_where_emulated(monkeypatch, flags, cap):
    fake_cpu(monkeypatch, flags, cap)
    cpu = torch.device("cpu")
    assert cli.resolve_dtype("auto", cpu) == "fp32"
    assert cli.emulated_bf16("fp32", cpu) is None
    native = "avx512_bf16" in flags and cap is None
    assert (cli.emulated_bf16("bf16", cpu) is None) == native
    assert cli.emulated_bf16("bf16", torch.device("cuda")) is None  # a GPU's bf16 is its own


def test_a_slice_keeps_the_width_and_scales_the_flops():
    cfg = PRESETS["70B"]
    for k in (2, 8, 64):
        s = qs.slice_config(cfg, k)
        assert (s.dim, s.head_dim, s.n_layers) == (cfg.dim, cfg.head_dim, cfg.n_layers)
        assert s.n_heads % s.kv_heads == 0 and s.hidden_dim == cfg.hidden_dim // k
        full, part = ci.shape_of(cfg, seq_len=128), ci.shape_of(s, seq_len=128)
        assert part.flops_per_row == pytest.approx(full.flops_per_row / k, rel=0.15)  # k and v: at least 1 head
        assert part.head_flops_per_row == pytest.approx(full.head_flops_per_row / k, rel=0.01)
    assert qs.slice_config(cfg, 1) is cfg
    moe = qs.slice_config(PRESETS["qwen3-30B-A3B"], 4)
    assert moe.expert_dim == PRESETS["qwen3-30B-A3B"].expert_dim // 4 and moe.n_experts == 128


@pytest.mark.parametrize("name, rate, rows", [("70B", 30e9, 1), ("70B", 30e9, 4), ("70B", 130e9, 4),
                                               ("7B", 60e9, 4), ("70B", 400e12, 4), ("tiny", 1e9, 4)])
def test_the_slice_is_the_smallest_that_measures_within_the_budget(name, rate, rows):
    cfg, work = preset(name), ci.Workload(rows, 128, "bf16")
    k = qs.slice_factor(cfg, work, rate)

    def est(k):
        return qs.estimate_s(ci.shape_of(qs.slice_config(cfg, k), "bf16", "bf16", 128), rows, rate)
    lever = qs.lever_slice(cfg, k)
    assert est(k) <= qs.QUICK_COMPUTE_S or not qs.can_slice(cfg, 2 * k) or lever is not None
    assert k == 1 or est(k // 2) > qs.QUICK_COMPUTE_S  # no narrower than it must be
    assert lever is not None or qs.lever_slice(cfg, max(1, k // 4)) is None  # a lever beside it where one fits
    if name == "70B" and rate < 1e12:
        assert k > 1  # a whole 70B block measures for minutes on a CPU
    if rate > 1e14:
        assert k == 1  # a GPU times the whole block


def test_the_whole_blocks_times_are_on_the_line_through_two_slices():
    """What a slice does not shrink (a fixed part) is counted once: times a + b * FLOPs are recovered
    exactly; one slice (or a line sloping down: noise) scales by FLOPs alone."""
    cfg = PRESETS["70B"]
    assert qs.lever_slice(cfg, 16) == 64 and qs.lever_slice(cfg, 32) is None and qs.lever_slice(PRESETS["7B"], 4) is None
    whole, s1, s2 = (ci.shape_of(qs.slice_config(cfg, k), seq_len=128) for k in (1, 8, 64))

    def times(shape, a=0.4, b=1e-11):
        t = {n: a + b * shape.flops_per_row for n in ("fwd_row_s", "fwd_grad_row_s", "bwd_row_s")}
        return dict(t, head_row_s=0.01 + b * shape.head_flops_per_row, fwd_call_s=0.0, keep_bytes_per_row=1000)
    got = qs.scaled_times([(times(s1), s1), (times(s2), s2)], whole)
    for name in ("fwd_row_s", "fwd_grad_row_s", "bwd_row_s", "head_row_s"):
        assert got[name] == pytest.approx(times(whole)[name], rel=1e-9), name
    # kept bytes on the line in the config's estimate: 70B fp32's measured slices 1/4 and 1/64, its whole block
    kept = {4: (39413760, 46931968), 64: (26921472, 36478976), 1: (79767552, 80748544)}  # (measured, estimate)
    shapes = {k: dataclasses.replace(ci.shape_of(qs.slice_config(cfg, k), seq_len=128), keep_bytes_per_row=e)
              for k, (_, e) in kept.items()}
    line = qs.scaled_times([(dict(times(shapes[k]), keep_bytes_per_row=kept[k][0]), shapes[k]) for k in (4, 64)],
                           shapes[1])
    assert line["keep_bytes_per_row"] == pytest.approx(kept[1][0], rel=2e-3)  # scaled from 1/4 alone: 0.85x
    alone = qs.scaled_times([(times(s1), s1)], whole)
    assert alone["keep_bytes_per_row"] == pytest.approx(1000 * whole.keep_bytes_per_row / s1.keep_bytes_per_row)
    assert alone["fwd_row_s"] == pytest.approx(times(s1)["fwd_row_s"] * whole.flops_per_row / s1.flops_per_row)
    down = qs.scaled_times([(times(s1), s1), (times(s2, a=5.0), s2)], whole)  # the narrower one slower: noise
    assert down["bwd_row_s"] == alone["bwd_row_s"]
    assert qs.scaled_times([(times(whole), whole)], whole)["fwd_row_s"] == times(whole)["fwd_row_s"]


def test_slicing_stops_where_the_widths_would_not_be_whole():
    cfg = dataclasses.replace(PRESETS["tiny"], intermediate_size=192)  # 192 = 3 x 64
    assert qs.can_slice(cfg, 1) and not qs.can_slice(cfg, 2)
    assert qs.slice_factor(cfg, ci.Workload(4, 64), rate=1.0) == 1


def test_a_quick_profile_of_a_store_times_compute_on_a_slice(tmp_path, monkeypatch):
    """The profile keeps rates (per FLOP) measured on the slice; the disk is read from the store itself."""
    cfg = dataclasses.replace(preset("tiny"), dim=256, n_heads=8, n_kv_heads=4, intermediate_size=1024, n_layers=2)
    store = BlockStore(write_synthetic(tmp_path / "s", cfg, torch.float32, progress=False), verify="none")
    monkeypatch.setattr(qs, "QUICK_COMPUTE_S", 1e-9)  # any block is too large: the narrowest slice
    p = profiles.measure(store, "cpu", "fp32", 2, 32, quick=True)
    k = qs.slice_factor(cfg, ci.Workload(2, 32, "fp32", "fp32"), 1.0)
    assert k == 2 and qs.lever_slice(cfg, k) == 8 and p.quick  # 1/8 is the narrowest: 1/2 beside it
    assert p.measured_on.startswith("d256-f1024-h8-kv4-")
    assert p.measured_on.endswith("(compute timed on f512-h4 and f128-h1)")
    assert p.fwd_flops > 0 and p.head_flops > 0 and p.disk_gbps > 0 and p.keep_scale > 0


def test_where_bf16_is_emulated_the_whole_block_is_timed_over_shorter_rows():
    """Emulated bf16 matmuls slow down as they narrow, so no slice predicts the whole block: its two points are
    the whole block over a quarter and an eighth of the row, where that times within SHORT_ROWS_S; else (a
    block too large, rows too short to shorten) the slices as where bf16 is native. The line through two
    lengths recovers times a + b * FLOPs exactly, as through two slices."""
    cfg, work = PRESETS["70B"], ci.Workload(1, 128, "bf16")
    assert qs.points(cfg, work, 60e9, emulated=True) == [(1, 32), (1, 16)]
    assert qs.points(cfg, work, 60e9) == [(k, 128) for k in (8, 64)]
    assert qs.points(cfg, work, 1e9, emulated=True) == qs.points(cfg, work, 1e9)  # the whole block too slow
    assert qs.points(cfg, ci.Workload(1, 32, "bf16"), 60e9, emulated=True) == \
        qs.points(cfg, ci.Workload(1, 32, "bf16"), 60e9)  # 4 tokens: too short
    assert qs.points(PRESETS["tiny"], work, 1e12, emulated=True) == [(1, 128)]  # times whole, at its own length
    whole, t32, t16 = (ci.shape_of(cfg, seq_len=t) for t in (128, 32, 16))

    def times(shape, a=0.3, b=1.5e-11):
        t = {n: a + b * shape.flops_per_row for n in ("fwd_row_s", "fwd_grad_row_s", "bwd_row_s")}
        return dict(t, head_row_s=0.2 + b * shape.head_flops_per_row, fwd_call_s=0.0, keep_bytes_per_row=1000)
    got = qs.scaled_times([(times(t32), t32), (times(t16), t16)], whole)
    assert all(got[n] == pytest.approx(times(whole)[n], rel=1e-9) for n in ("fwd_row_s", "bwd_row_s", "head_row_s"))


def test_an_emulated_quick_profile_times_the_whole_block_over_shorter_rows(tmp_path, monkeypatch):
    cfg = dataclasses.replace(preset("tiny"), dim=256, n_heads=8, n_kv_heads=4, intermediate_size=1024, n_layers=2)
    store = BlockStore(write_synthetic(tmp_path / "s", cfg, torch.bfloat16, progress=False), verify="none")
    monkeypatch.setattr(qs, "QUICK_COMPUTE_S", 1e-9)  # any block is too large to time whole at its length
    fake_cpu(monkeypatch, X86 | {"avx512_bf16"}, "AVX512_CORE")
    p = profiles.measure(store, "cpu", "bf16", 2, 64, quick=True)
    assert p.measured_on.endswith("(compute timed on f1024-h8 x 16 tokens and f1024-h8 x 8 tokens)")
    assert p.fwd_flops > 0 and p.head_flops > 0 and p.keep_scale > 0
    fake_cpu(monkeypatch, X86 | {"avx512_bf16"})
    assert profiles.measure(store, "cpu", "bf16", 2, 64, quick=True).measured_on.endswith("f512-h4 and f128-h1)")


def test_a_tiled_store_has_the_shapes_and_scale_of_a_normal_one_in_one_repeated_pattern(tmp_path):
    from phantom.convert.synthetic import TILE
    cfg = dataclasses.replace(preset("tiny"), dim=256, intermediate_size=1024, n_layers=1)
    normal, tiled = (BlockStore(write_synthetic(tmp_path / i, cfg, torch.float32, progress=False, init=i))
                     for i in ("normal", "tiled"))
    a, b = normal.load_block(0), tiled.load_block(0)
    assert {k: v.shape for k, v in a.items()} == {k: v.shape for k, v in b.items()}
    w = b["feed_forward.w1.weight"].reshape(-1)
    assert torch.equal(w[:TILE], w[TILE:2 * TILE]) and 0.018 < float(w.std()) < 0.022
    assert float(a["feed_forward.w1.weight"].std()) == pytest.approx(float(w.std()), rel=0.1)


def test_the_plan_on_an_emulated_cpu_says_so_with_the_fp32_step_beside(tmp_path, monkeypatch, capsys):
    tune = load_script("tune")
    base = ["--preset", "tiny", "--device", "cpu", "--dtype", "bf16", "--quick", "--seq-len", "32",
            "--batch-size", "2", "--profile-dir", str(tmp_path)]
    fake_cpu(monkeypatch, X86 | {"avx512_bf16"}, "AVX512_CORE")
    assert tune.main(base) == 0
    out = capsys.readouterr().out
    assert "warning    bf16 is emulated on this CPU (ONEDNN_MAX_CPU_ISA=AVX512_CORE keeps oneDNN" in out
    assert "fp32 predicted" in out and "--dtype fp32 (what --dtype auto chooses on a CPU)" in out
    assert tune.main(base + ["--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["profile"]["dtype"] == "bfloat16" and plan["fp32_step_s"] > 0 and "ONEDNN_MAX_CPU_ISA" in plan["bf16_emulated"]
    fake_cpu(monkeypatch, X86 | {"avx512_bf16"})
    assert tune.main(base) == 0
    assert "emulated" not in capsys.readouterr().out
