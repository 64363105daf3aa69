"""A plan for a GPU that is not here (`scripts/tune.py --gpu NAME`): the profile derived from a card's datasheet
predicts a block's calls from the block's FLOPs counted from its shapes here, copies at the PCIe link's rate, the
disk measured on this machine; it is never saved or read back as measured; the two plans for a 24 GB card fit it."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest

from phantom.arch.presets import preset
from phantom.plan import costinputs as ci, costmodel as cm, gpusheets, profiles
from phantom.stream.placement import Activations

ROOT = Path(__file__).resolve().parent.parent
G = 1 << 30
DISK = gpusheets.DiskRates(gbps=1.5, jitter=0.05, request_s=None)


def script():
    spec = importlib.util.spec_from_file_location("tune_script", ROOT / "scripts" / "tune.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def block_flops(cfg, tokens: int) -> tuple[float, float]:
    """(matmul FLOPs, attention FLOPs) of one dense grouped-query block's forward over a row of `tokens`, counted
    from its projections' shapes: 2 x in x out per token for q, k, v, o, gate, up and down; causal attention's
    scores and weighted values, 2 x T x T / 2 x (heads x head width) each."""
    q, kv, d, f = cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.dim, cfg.hidden_dim
    weights = d * q + 2 * d * kv + q * d + 3 * d * f
    return 2 * tokens * weights, 2 * (tokens * tokens * q)


@pytest.mark.parametrize("name,card,tokens", [("70B", "rtx4090", 4096), ("7B", "h100-sxm", 1024),
                                              ("70B", "l4", 131072)])
def test_a_blocks_predicted_calls_are_its_flops_at_the_sheets_rate(name, card, tokens):
    """Forward (graph-building, kept) = the block's FLOPs / (dense bf16 rate x utilisation); its LoRA backward = the
    matmuls' FLOPs again (input gradients) and attention's at 2.5x its forward, at the same rate; no fixed cost."""
    cfg, sheet = preset(name), gpusheets.sheet(card)
    profile = gpusheets.derive(sheet, cfg, ci.Workload(1, tokens), DISK, 64 * G)
    shape = ci.shape_of(cfg, seq_len=tokens)
    cf, cb, _ = cm.block_compute(profile, shape, Activations(recompute="none", micro_batch=1), rows=1,
                                 keep=shape.n_blocks)
    rate = sheet.bf16_tflops * 1e12 * gpusheets.UTILISATION
    matmuls, attention = block_flops(cfg, tokens)
    assert cf[0] == pytest.approx((matmuls + attention) / rate, rel=1e-4)  # norms' weights: not matmuls
    assert cb[0] == pytest.approx((matmuls + 2.5 * attention) / rate, rel=1e-4)
    assert profile.device == "cuda" and profile.free_device_bytes == sheet.memory_gib * G


@pytest.mark.parametrize("card,link_gbps", [("rtx3090", 31.5), ("a100-80gb", 31.5), ("h100-pcie", 63.0)])
def test_copies_run_at_the_pcie_links_rate_and_the_disk_is_this_machines(card, link_gbps):
    """A block's host-to-device copy: its bytes / (16 lanes x 16 or 32 GT/s x 128/130 / 8 x LINK_SHARE); reads at
    the disk rate given (what profiles.probe_disk measured here)."""
    cfg = preset("70B")
    profile = gpusheets.derive(gpusheets.sheet(card), cfg, ci.Workload(4, 1024), DISK, 64 * G)
    shape = ci.shape_of(cfg, seq_len=1024)
    t = ci.LoadTimes.of_block(profile, shape, ("ram", "disk"), warm=False)
    assert t.link_s == pytest.approx(shape.block_bytes / (link_gbps * 1e9 * gpusheets.LINK_SHARE), rel=2e-3)
    assert t.read_s["disk"] == pytest.approx(shape.block_bytes / 1.5e9)
    assert (profile.disk_gbps, profile.disk_jitter, profile.disk_request_s) == (1.5, 0.05, None)


def test_a_quantized_load_dequantizes_at_the_memory_bandwidth():
    """Stored bytes read and bf16 bytes written at the sheet's bandwidth x utilisation."""
    cfg, sheet = preset("70B"), gpusheets.sheet("rtx4090")
    profile = gpusheets.derive(sheet, cfg, ci.Workload(4, 1024, quant="nf4"), DISK, 64 * G)
    shape = ci.shape_of(cfg, seq_len=1024, quant="nf4")
    seconds = ci.LoadTimes.of_block(profile, shape, ("ram",), warm=False).dequant_s
    assert seconds == pytest.approx((shape.block_bytes + 2 * cfg.block_params()) / (1008e9 * gpusheets.UTILISATION))


def test_the_disk_is_measured_here_on_a_few_blocks_and_they_are_removed(tmp_path):
    gbps, jitter, request_s = profiles.probe_disk(preset("tiny"), "bf16", tmp_path)
    assert gbps > 0 and jitter >= 0 and request_s is None
    assert list(tmp_path.iterdir()) == []


def test_a_datasheet_profile_is_never_saved_or_read_back_as_measured(tmp_path):
    profile = gpusheets.derive(gpusheets.sheet("l4"), preset("tiny"), ci.Workload(1, 64), DISK, G)
    assert profile.datasheet == "NVIDIA L4"
    with pytest.raises(ValueError, match="not measured"):
        profiles.save_profile(profile, tmp_path / "p.json")
    assert not (tmp_path / "p.json").exists()
    (tmp_path / "p.json").write_text(json.dumps({"version": profiles.PROFILE_VERSION, **profile.to_dict()}))
    assert profiles.load_profile(tmp_path / "p.json") is None  # a hand-saved one: ignored, measured again
    measured = dataclasses.replace(profile, datasheet="")
    profiles.save_profile(measured, tmp_path / "m.json")
    assert profiles.load_profile(tmp_path / "m.json") == measured


def plan(capsys, monkeypatch, tmp_path, argv) -> tuple[dict, str]:
    """The --json plan and the printed one of `scripts/tune.py argv` (the disk's rate given: its measurement is
    the test above's)."""
    monkeypatch.setattr(profiles, "probe_disk", lambda *a, **k: (1.5, 0.05, None))
    tune = script()
    argv = [*argv, "--profile-dir", str(tmp_path)]
    assert tune.main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert tune.main(argv) == 0
    return out, capsys.readouterr().out


def test_deepseek_v4_flash_as_shipped_fits_a_24_gb_card(capsys, monkeypatch, tmp_path):
    out, text = plan(capsys, monkeypatch, tmp_path, [
        "--preset", "deepseek-v4-flash-284B", "--quantize", "fp8-mxfp4", "--host-memory", "256G",
        "--device-budget", "24G", "--gpu", "rtx4090", "--disk-budget", "1T"])
    assert out["fits"] and out["profile"]["datasheet"] == "NVIDIA GeForce RTX 4090"
    assert out["device_bytes"] <= 24 * G * (1 - cm.MARGIN)
    shape = ci.shape_of(preset("deepseek-v4-flash-284B"), "bf16", "bf16", 128, "fp8-mxfp4")
    slots = out["layout"]["slots"]  # each holds a block as stored and its dequantized copy
    assert out["device_bytes"] >= slots * (shape.block_bytes + shape.dequant_bytes) + shape.head_bytes
    assert "from the datasheet of NVIDIA GeForce RTX 4090, not measured: run on the GPU to measure" in text
    assert "datasheet  NVIDIA GeForce RTX 4090: 24 GB, 165.2 TFLOP/s dense bf16" in text


def test_a_70b_at_131072_tokens_fits_a_24_gb_card_with_its_inputs_in_host_memory(capsys, monkeypatch, tmp_path):
    """The device holds a block's tiled backward; the recomputed blocks' inputs at the row's length (80 x 131072 x
    8192 x 2 bytes, 160 GiB) wait in pinned host memory and are copied each way."""
    out, text = plan(capsys, monkeypatch, tmp_path, [
        "--preset", "70B", "--seq-len", "131072", "--device-budget", "24G", "--gpu", "rtx4090", "--batch-size",
        "1", "--host-memory", "512G", "--disk-budget", "1T"])
    assert out["fits"] and out["device_bytes"] <= 24 * G * (1 - cm.MARGIN)
    inputs = (80 - out["kept_blocks"]) * 131072 * 8192 * 2
    assert out["bytes_inputs"] == inputs and inputs >= 79 * 2 * G
    assert out["host_bytes"] >= inputs + out["split"]["ram"] * ci.shape_of(preset("70B")).block_bytes
    assert "the recomputed blocks' inputs" in text and "not measured" in text


def test_without_the_host_memory_it_says_what_is_missing(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(profiles, "probe_disk", lambda *a, **k: (1.5, 0.05, None))
    assert script().main(["--preset", "70B", "--seq-len", "131072", "--device-budget", "24G", "--gpu", "rtx4090",
                          "--host-memory", "64G", "--disk-budget", "1T", "--profile-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: no placement fits") and "more host memory" in err and "\n" not in err


@pytest.mark.parametrize("argv,words", [
    (["--gpu", "rtx9999"], ["no datasheet for a GPU named 'rtx9999'", *gpusheets.SHEETS]),
    (["--gpu", "l4", "--dtype", "fp32"], ["--dtype bf16 or fp16"]),
    (["--gpu", "l4", "--device", "cpu"], ["not with --device cpu"]),
    (["--gpu", "l4", "--check", "2"], ["--check and --mode full"]),
])
def test_bad_gpu_flags_are_one_line_and_exit_2(argv, words, capsys, tmp_path):
    assert script().main(["--preset", "tiny", "--profile-dir", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and all(w in err for w in words)
    assert list(tmp_path.iterdir()) == []  # nothing measured


def test_names_match_whatever_their_case_and_dashes():
    assert gpusheets.sheet("RTX 4090") is gpusheets.sheet("rtx-4090") is gpusheets.SHEETS["rtx4090"]
    assert gpusheets.sheet("A100_80GB") is gpusheets.SHEETS["a100-80gb"]


def test_help_lists_the_flag_and_the_cards(capsys):
    with pytest.raises(SystemExit):
        script().parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--gpu NAME" in out and "datasheet, not measured" in out and all(n in out for n in gpusheets.SHEETS)
