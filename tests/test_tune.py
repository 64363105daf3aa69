"""The tuner: a profile measured on a few blocks plans any depth of that shape, profiles on disk,
`scripts/tune.py` for a model without weights (plan, --json round trip, what is missing), auto placement."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from phantom.plan import costinputs as ci, costmodel as cm, planner
from phantom.plan import profiles, tune
from phantom.arch.config import ModelConfig
from phantom.convert.synthetic import write_synthetic
from phantom.files.store import BlockStore

ROOT = Path(__file__).resolve().parent.parent
# 6 blocks: the probe measures 2 of them, the plan covers all 6
CFG = ModelConfig(dim=64, n_layers=6, n_heads=4, n_kv_heads=2, vocab_size=97, multiple_of=16, max_seq_len=64)
HF_CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 6,
             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 97, "intermediate_size": 176,
             "max_position_embeddings": 64}
FIXED = dict(free_device_bytes=None, free_host_bytes=8 << 30)  # free memory changes between calls: fix it


def script():
    spec = importlib.util.spec_from_file_location("tune_script", ROOT / "scripts" / "tune.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def no_measuring(*a, **k):
    raise AssertionError("measured again although a profile was saved")


def test_a_config_without_weights_plans_as_a_store_of_its_shape(tmp_path, monkeypatch):
    probed = dataclasses.replace(profiles.probe(CFG, "cpu", ci.Workload(2, 16, "fp32", "bf16"), tmp_path, quick=True), **FIXED)
    assert list(tmp_path.glob("probe-*")) == []  # the synthetic blocks are gone, the profile stays
    assert probed.measured_on.startswith(profiles.shape_key(CFG, "bf16"))
    store = BlockStore(write_synthetic(tmp_path / "s", CFG, torch.bfloat16, seed=1, progress=False))
    monkeypatch.setattr(profiles, "measure", no_measuring)  # same block shape: the same profile file
    stored = dataclasses.replace(profiles.profile_for(store, "cpu", "fp32", 2, 16, tmp_path), **FIXED)
    assert stored == probed
    from_cfg = tune.plan(probed, CFG, ci.Workload(2, 16, "fp32", "bf16"))
    from_store = tune.plan(stored, store.cfg, ci.Workload(2, 16, "fp32", store.manifest["dtype"]))
    assert from_cfg[0] == from_store[0] and from_cfg[2] == from_store[2]
    assert from_cfg[2].block_bytes == store.block_nbytes
    assert from_cfg[2].store_bytes == sum(e.nbytes for e in [store.embed, store.head, *store.blocks])
    # deeper model of the same shape: the same profile, twice the blocks to place
    deep = tune.plan(probed, dataclasses.replace(CFG, n_layers=12), ci.Workload(2, 16, "fp32", "bf16"))[0]
    assert len(deep.tiers) == 12 and deep.compute_s > from_cfg[0].compute_s


def test_measured_rates_are_sane(small_store):
    p = profiles.measure(BlockStore(small_store), "cpu", "fp32", batch_size=2, seq_len=16, quick=True)
    assert p.device == "cpu" and p.free_device_bytes is None and p.free_host_bytes > 0
    assert p.disk_gbps > 0 and p.h2d_gbps > 0 and p.fwd_flops > 0 and p.head_flops > 0
    assert 0.9 < p.keep_scale < 1.1  # the config's estimate of kept bytes, checked by autograd's count
    assert p.disk_request_s is None  # a dense model reads no experts apart


def test_the_read_jitter_is_the_spread_of_most_reads_not_of_one_stalled_read():
    """relative_spread: about the std / mean of normally spread reads (numpy's), and a dozen reads of which one
    is stalled 4x by other work stay near the rest's spread (pstdev / mean would be over 0.6)."""
    import numpy as np
    times = list(np.random.default_rng(0).normal(0.027, 0.0027, 4000))
    assert profiles.relative_spread(times) == pytest.approx(np.std(times) / np.mean(times), rel=0.05)
    stalled = [0.027, 0.0272, 0.0268, 0.0271, 0.0269, 0.0275, 0.0265, 0.027, 0.0273, 0.0267, 0.027, 0.108]
    assert profiles.relative_spread(stalled) < 0.02 < 0.6 < np.std(stalled) / np.mean(stalled)


def test_a_mixture_of_experts_profile_measures_its_routed_expert_reads(tmp_path):
    """A MoE store's profile has the seconds a routed read's request costs, 16-bit or quantized (its experts
    lie back to back too)."""
    from phantom.arch.presets import PRESETS
    from phantom.arch.quantformat import QuantFormat
    from phantom.convert.quantstore import quantize_store
    cfg = dataclasses.replace(PRESETS["qwen3-30B-A3B"], dim=64, n_layers=2, n_heads=2, n_kv_heads=1,
                              explicit_head_dim=32, expert_dim=32, n_experts=16, experts_per_token=2,
                              vocab_size=97, max_seq_len=64)
    store = BlockStore(write_synthetic(tmp_path / "moe", cfg, torch.float32, progress=False))
    assert profiles.measure_disk_requests(store, 2.0) >= 0
    quantize_store(store.path, tmp_path / "nf4", QuantFormat("nf4"), progress=False)
    assert profiles.measure_disk_requests(BlockStore(tmp_path / "nf4"), 2.0) >= 0


def test_profile_round_trip_and_a_stale_or_corrupt_file_is_ignored(tmp_path):
    p = ci.MachineProfile(machine="box", device="cuda", fwd_flops=3e14, free_device_bytes=80 << 30)
    path = tmp_path / "profiles" / "x.json"
    profiles.save_profile(p, path)
    assert profiles.load_profile(path) == p
    assert [f.name for f in path.parent.iterdir()] == ["x.json"]  # no temporary file left beside it
    path.write_text("{not json")
    assert profiles.load_profile(path) is None
    path.write_text(json.dumps({**p.to_dict(), "version": 1}))  # the per-model times of before
    assert profiles.load_profile(path) is None
    assert profiles.load_profile(tmp_path / "missing.json") is None


def test_script_plans_a_config_json_and_the_json_round_trips(tmp_path, capsys):
    cfg_file = tmp_path / "config.json"
    cfg_file.write_text(json.dumps(HF_CONFIG))
    common = ["--config", str(cfg_file), "--device", "cpu", "--batch-size", "2", "--seq-len", "16",
              "--profile-dir", str(tmp_path / "p"), "--quick"]
    assert script().main(common + ["--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    pred = cm.Prediction.from_dict(d)
    assert json.loads(json.dumps(pred.to_dict())) == {k: v for k, v in d.items() if k not in ("model", "profile")}
    assert len(pred.tiers) == 6 and pred.fits and pred.step_s > 0 and d["tokens_per_s"] == pred.tokens_per_s
    assert ci.MachineProfile.from_dict(d["profile"]).machine == profiles.machine_key("cpu")
    assert script().main(common) == 0
    text = capsys.readouterr().out
    for label in ("placement", "memory", "predicted", "tokens/s", "-bound"):
        assert label in text


def test_script_says_how_much_is_missing(tmp_path, capsys):
    cfg_file = tmp_path / "config.json"
    cfg_file.write_text(json.dumps(HF_CONFIG))
    store_bytes = ci.shape_of(ModelConfig(**{**dataclasses.asdict(CFG), "rope_scaling": None}), "bf16").store_bytes
    common = ["--config", str(cfg_file), "--device", "cpu", "--batch-size", "2", "--seq-len", "16",
              "--profile-dir", str(tmp_path / "p"), "--quick", "--disk-budget", "1000"]
    assert script().main(common) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no placement fits") and "more disk space" in err and len(err.splitlines()) == 1
    assert script().main(common + ["--json"]) == 2
    d = json.loads(capsys.readouterr().out)
    assert d["fits"] is False and d["missing"] == {"disk": store_bytes - 1000}


@pytest.mark.parametrize("argv,words", [(["--config", "/nonexistent/config.json"], "no config file"),
                                        (["--preset", "nope"], "unknown preset"),
                                        (["--preset", "tiny", "--seq-len", "0"], ">= 1")])
def test_script_bad_input_is_one_line(argv, words, capsys):
    assert script().main(argv + ["--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and words in err and len(err.splitlines()) == 1


def test_auto_placement_measures_once_then_reads_the_profile(small_store, tmp_path, monkeypatch):
    first = tune.auto_placement(small_store, "cpu", batch_size=4, seq_len=32, dtype="fp32", profile_dir=tmp_path)
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["quick"] is True
    assert first.fits and first.rows == 4 and first.step_s > 0 and first.offload == "auto"
    monkeypatch.setattr(profiles, "measure", no_measuring)
    again = tune.auto_placement(small_store, "cpu", batch_size=4, seq_len=32, dtype="fp32", profile_dir=tmp_path)
    assert again.rows == 4 and again.resident == 0  # a CPU has no device tier
    disk = tune.auto_placement(small_store, "cpu", 4, 32, "fp32", tmp_path,
                                planner.SearchSpace(offloads=("disk",), micro_batches=(2,)))
    assert disk.offload == "disk" and disk.split["disk"] == 4 and disk.activations.micro_batch == 2
    monkeypatch.setenv("PHANTOM_CACHE", str(tmp_path / "cache"))
    assert profiles.profile_path(BlockStore(small_store), "cpu", "fp32", 16).parent == tmp_path / "cache" / "profiles"
    # rows of about the same length share the profile; rows of another power of two of tokens measure their own
    again = tune.auto_placement(small_store, "cpu", batch_size=4, seq_len=40, dtype="fp32", profile_dir=tmp_path)
    assert again.seq_len == 40
    monkeypatch.undo()
    tune.auto_placement(small_store, "cpu", batch_size=4, seq_len=64, dtype="fp32", profile_dir=tmp_path)
    assert sorted(json.loads(f.read_text())["measured_on"].rsplit(" x ", 1)[1] for f in tmp_path.glob("*.json")) == \
        ["32 tokens", "64 tokens"]


def test_load_with_prefetch_auto_takes_the_tuners_placement(small_store, tmp_path, monkeypatch):
    """phantom.load(prefetch="auto") from Python: the tuner's plan for the workload given, as
    finetune.py --prefetch auto gets it, its chunk of tiled compute too unless one is given; the micro-batch and
    recompute stay the caller's."""
    import phantom
    monkeypatch.setenv("PHANTOM_CACHE", str(tmp_path / "cache"))
    best = tune.auto_placement(small_store, "cpu", 4, 32, "fp32", tmp_path / "cache" / "profiles",
                               planner.SearchSpace(offloads=("auto",)))  # measures and saves the profile
    monkeypatch.setattr(profiles, "measure", no_measuring)  # the load reads that profile
    with phantom.load(small_store, offload="auto", prefetch="auto", batch_size=4, seq_len=32, recompute="all",
                      micro_batch=2) as model:
        assert model.placement.prefetch == best.prefetch and model.placement.offload == best.offload
        assert model.scheduler.layout.tiers == best.tiers
        assert model.activations.recompute == "all" and model.activations.micro_batch == 2
        assert model.activations.mlp_chunk == best.activations.mlp_chunk == 2048  # rows of 32: the default
    monkeypatch.setattr(planner, "mlp_chunk", lambda *a: 16)  # as where the default does not fit
    for knobs, chunk in (({}, 16), ({"mlp_chunk": 8}, 8)):
        with phantom.load(small_store, offload="auto", prefetch="auto", batch_size=4, seq_len=32, **knobs) as model:
            assert model.activations.mlp_chunk == chunk and all(b.mlp_chunk == chunk for b in model.layers)
    with pytest.raises(ValueError, match="unknown option"):
        phantom.load(small_store, batch_size=4)  # only with prefetch="auto"


def test_check_prediction_speaks_only_beyond_20_percent():
    shape = ci.shape_of(CFG, "fp32", "fp32", 16)
    p = cm.predict(ci.MachineProfile(machine="t", device="cpu", fwd_flops=1e7), shape, cm.Placement(),
                   cm.Activations(), 4)
    assert p.step_s > 0.1
    assert planner.check_prediction(p, p.step_s * 1.15) is None and planner.check_prediction(p, p.step_s * 0.85) is None
    assert "+30%" in planner.check_prediction(p, p.step_s * 1.3)
    assert "-40%" in planner.check_prediction(p, p.step_s * 0.6)
    short = dataclasses.replace(p, step_s=0.008)
    assert planner.check_prediction(short, 0.05) is None  # both are Python-overhead-sized
    assert "+" in planner.describe_measured(p, p.step_s * 1.1)


def test_format_table_marks_the_choice():
    prof = ci.MachineProfile(machine="t", device="cuda", fwd_flops=1e9, free_device_bytes=1 << 30,
                             free_host_bytes=8 << 30)
    cands = planner.search(prof, ci.shape_of(CFG, "fp32", "fp32", 16), 4)
    text = tune.format_table(cands, top=5, chosen=planner.choose(cands))
    assert text.count("<- chosen") == 1 and len(text.splitlines()) <= 8


def test_scaled_placement_keeps_the_plans_fractions():
    shape = ci.shape_of(CFG, "bf16", "bf16", 16)
    gpu = ci.MachineProfile(machine="t", device="cuda", free_device_bytes=None, free_host_bytes=None)
    big = ci.shape_of(dataclasses.replace(CFG, n_layers=80), "bf16", "bf16", 16)
    small = ci.shape_of(dataclasses.replace(CFG, n_layers=8), "bf16", "bf16", 16)
    for split, scaled in (((28, 48, 4), (3, 4, 1)), ((0, 40, 40), (0, 4, 4)), ((0, 4, 76), (0, 1, 7))):
        full = cm.predict(gpu, big, cm.Placement(prefetch=2), cm.Activations(recompute="all"), 4,
                          tiers=sum(((t,) * k for t, k in zip(("device", "ram", "disk"), split)), ()))
        place, acts = tune.scaled_placement(full, shape, 8)
        pred = cm.predict(gpu, small, place, acts, 4)
        assert tuple(pred.split.values()) == scaled  # rounded; a tier the plan uses keeps a block
        assert place.prefetch == 2 and acts == full.activations


def test_script_check_runs_the_plan_on_a_scaled_store(tmp_path, capsys):
    cfg_file = tmp_path / "config.json"
    cfg_file.write_text(json.dumps(HF_CONFIG))
    argv = ["--config", str(cfg_file), "--device", "cpu", "--batch-size", "2", "--seq-len", "16", "--quick",
            "--profile-dir", str(tmp_path / "p"), "--ram-budget", "1K", "--check", "4", "--check-dir",
            str(tmp_path / "s4"), "--steps", "2", "--json"]
    assert script().main(argv) in (0, 1)  # 0: within 15%; steps of a few ms are too noisy to require it
    r = json.loads(capsys.readouterr().out)["check"]
    assert r["blocks"] == 4 and r["split"]["disk"] == 4 and r["tiers_match"]
    assert r["bytes_read_measured"] == [r["bytes_read_predicted"]] * 2 and len(r["steps_s"]) == 2
    assert BlockStore(tmp_path / "s4").n_blocks == 4


def test_free_memory_is_read_after_unreachable_cycles_are_collected():
    """A measured model's reference cycles held its buffers until the next collection (5 GB after a whole fp32
    70B block's measurement): the plan read them as used and placed otherwise. with_free_memory collects first."""
    import gc
    import weakref

    class Cycle:
        pass
    held = Cycle()
    held.self, held.buffer = held, torch.empty(1 << 20)
    gone = weakref.ref(held)
    gc.disable()
    try:
        del held
        assert gone() is not None  # only a collection frees a cycle
        profiles.with_free_memory(ci.MachineProfile(machine="t", device="cpu"), "cpu")
        assert gone() is None
    finally:
        gc.enable()


def test_a_dequantization_is_timed_as_the_mean_of_calls_sampled_for_long_enough():
    """A step adds up one dequantization per load: the profile takes the mean cost of a call (a median would
    miss a CPU's slow calls), over at least `repeats` calls and more while the sample is short."""
    import time as clock

    from phantom.plan import computetimer as ct
    calls = []

    def fn():
        calls.append(None)
        clock.sleep(0.02 if len(calls) % 4 == 0 else 0.0)  # every fourth call slow
    calls.clear()
    assert ct.timed_mean(fn, torch.device("cpu"), 3, 0.0, 20) >= 0 and len(calls) == 1 + 3  # warm-up + repeats
    calls.clear()
    mean = ct.timed_mean(fn, torch.device("cpu"), 3, 60.0, 9)
    assert len(calls) == 1 + 9  # sampled up to `most` calls while under sample_s
    assert 0.02 * 2 / 9 * 0.9 < mean < 0.02 * 3 / 9 + 0.005  # the slow calls (2 of the 9 timed) counted in


def test_script_plans_full_finetuning_with_either_optimizer(tmp_path, capsys):
    """--mode full: the block optimizer's state (master weights and moments) where it fits, the host memory
    and disk the run needs, and the step beside the LoRA plan's; 8-bit moments a quarter of fp32's."""
    cfg_file = tmp_path / "config.json"
    cfg_file.write_text(json.dumps(HF_CONFIG))
    common = ["--config", str(cfg_file), "--device", "cpu", "--batch-size", "2", "--seq-len", "16",
              "--profile-dir", str(tmp_path / "p"), "--quick", "--mode", "full", "--json"]
    full = {}
    for optim in ("adamw_torch", "adamw_8bit"):
        assert script().main(common + ["--optim", optim]) == 0
        plan = json.loads(capsys.readouterr().out)
        full[optim] = plan["full"]
    torch_, q = full["adamw_torch"], full["adamw_8bit"]
    block = CFG.block_params() * CFG.n_layers
    assert torch_["moment_bytes"] == 8 * block and torch_["state_bytes"] == 12 * block
    assert q["moment_bytes"] <= 0.27 * torch_["moment_bytes"] and q["state_tier"] == torch_["state_tier"] == "ram"
    assert q["fits"] and q["step_s"] > q["lora_step_s"] and q["host_bytes"] < torch_["host_bytes"]
    just_the_plan = str(int(plan["host_bytes"] / (1 - cm.MARGIN)) + 4096)  # no room left for the state in RAM
    assert script().main(common[:-1] + ["--optim", "adamw_8bit", "--host-memory", just_the_plan]) == 0
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("full")][0]
    assert "on disk" in line and "host memory" in line and "disk" in line
    assert script().main(common[:-1] + ["--quantize", "nf4"]) == 2
    assert "--mode full" in capsys.readouterr().err
