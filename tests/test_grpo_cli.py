"""finetune.py --mode grpo end to end on the tiny model: a reward a small LoRA can learn rises with sampled rollouts
streamed from disk; SIGKILLed within a batch of rollouts and resumed, the run ends where one that never stopped ends;
bad reward files and rollouts are one line and exit 2, nothing written.
"""
from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from test_convert import load_script
from test_finetune_cli import killed_at, metrics, run

PROMPTS = ["The keeper", "Once upon a time", "The lamp was", "In the morning", "A ship", "The night"]
REWARD = "def e_rate(completions, **kwargs):\n    return [c.count('e') / max(len(c), 1) for c in completions]\n"
GRPO = ["--mode", "grpo", "--num-generations", "4", "--batch-size", "8", "--max-completion-length", "12",
        "--offload", "disk", "--save-every", "0", "--top-p", "0.95", "-q"]


@pytest.fixture
def files(tmp_path):
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    (tmp_path / "reward.py").write_text(REWARD)
    return tmp_path


def grpo_args(files, *more):
    return ["--data", files / "prompts.jsonl", "--reward", f"{files / 'reward.py'}:e_rate", *GRPO, *more]


def test_a_learnable_reward_rises_over_thirty_steps_from_disk(files):
    main = load_script("finetune").main
    assert main([str(a) for a in grpo_args(files, "--iters", "30", "--out", files / "out")]) == 0
    rewards = [m["reward"] for m in metrics(files / "out") if "reward" in m]
    assert len(rewards) == 30
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.15, rewards
    samples = [json.loads(line) for line in (files / "out" / "completions.jsonl").read_text().splitlines()]
    assert {s["step"] for s in samples} == set(range(1, 31)) and all("e_rate" in s["rewards"] for s in samples)
    rec = metrics(files / "out")[-1]
    assert {"generation_s", "scoring_s", "train_s", "entropy", "completions/mean_length"} <= set(rec)
    card = (files / "out" / "README.md").read_text()
    assert f"| rollouts | reward {rewards[0]:.4f} at step 1, {rewards[-1]:.4f} at step 30; a step's mean: generation" \
        in card
    from phantom.train.records import preference_postfix
    assert set(preference_postfix(rec)) == {"reward", "gen_s", "train_s"}  # what the bar shows


def test_sigkill_within_a_batch_of_rollouts_then_resume_ends_bit_identical(files):
    """Two steps a batch of rollouts: the checkpoint of step 3 falls within the second batch (its rollouts and old
    log-probabilities are saved with it); killed after step 4 was logged, --resume ends as the straight run."""
    args = grpo_args(files, "--iters", "6", "--num-iterations", "2", "--save-every", "3", "--beta", "0.04")
    assert run(*args, "--out", files / "ref").returncode == 0
    out = files / "run"
    killed_at("metrics.write:4", *args, "--out", out)
    assert json.loads((out / "checkpoint" / "meta.json").read_text())["step"] == 3
    r = run(*args, "--out", out, "--resume")
    assert r.returncode == 0, r.stderr
    a, b = (load_file(str(d / "adapter" / "adapter_model.safetensors")) for d in (files / "ref", out))
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    timing = ("tokens_per_s", "stall_frac", "bytes", "loads")  # the resumed step loads what the other kept in slots
    strip = lambda ms: [{k: v for k, v in m.items() if not k.endswith("_s") and not k.startswith(timing)}  # noqa: E731
                        for m in ms if "loss" in m]
    assert strip(metrics(out)) == strip(metrics(files / "ref"))
    lines = [(d / "completions.jsonl").read_text() for d in (out, files / "ref")]
    assert lines[0] == lines[1]


@pytest.mark.parametrize("change,says", [
    (lambda f: ["--reward", f"{f / 'missing.py'}:e_rate"], "does not exist"),
    (lambda f: ["--reward", f"{f / 'reward.py'}:nothing"], "has no function nothing"),
    (lambda f: ["--reward", f"{f / 'bad.py'}:two"], "must take the keywords"),
    (lambda f: ["--reward", f"{f / 'reward.py'}", "--iters", "1"], "FILE.py:FUNC"),
    (lambda f: ["--completions", str(f / "short.jsonl")], "--num-generations (4) strings"),
    (lambda f: ["--batch-size", "6"], "multiple of --num-generations"),
    (lambda f: ["--reward-weights", "1", "2"], "one each"),
    (lambda f: ["--reference", "precompute"], "DPO's"),
])
def test_bad_grpo_input_is_one_line_exit_2_nothing_written(files, capsys, change, says):
    (files / "bad.py").write_text("def two(a, b):\n    return [0.0]\n")
    (files / "short.jsonl").write_text(json.dumps({"prompt": "x", "completions": ["a", "b"]}) + "\n")
    main = load_script("finetune").main
    out = files / "out"
    code = main([str(a) for a in [*grpo_args(files, "--iters", "2"), *change(files), "--out", out]])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: ") and says in err, err
    assert not any((out / name).exists() for name in ("metrics.jsonl", "adapter", "checkpoint", "completions.jsonl"))


def test_grpo_flags_reach_the_run_and_its_config(files):
    """--loss-type and --beta are GRPO's in --mode grpo (OUT/config.yaml records them so: --config repeats the run);
    --scale-rewards, --mask-truncated-completions and --top-k shape the step."""
    main = load_script("finetune").main
    out = files / "out"
    args = grpo_args(files, "--iters", "2", "--loss-type", "bnpo", "--beta", "0.02", "--scale-rewards", "batch",
                     "--mask-truncated-completions", "--top-k", "20", "--out", out)
    assert main([str(a) for a in args]) == 0
    config = (out / "config.yaml").read_text()
    assert "loss-type: bnpo" in config and "beta: 0.02" in config and "scale-rewards: batch" in config
    assert all("kl" in m and "reward" in m for m in metrics(out) if m.get("step"))
    assert main(["--config", str(out / "config.yaml"), "--out", str(files / "again"), "-q"]) == 0
    a, b = (load_file(str(d / "adapter" / "adapter_model.safetensors")) for d in (out, files / "again"))
    assert all((a[k] == b[k]).all() for k in a)  # the recorded run is the same run


def test_show_data_shows_the_rollout_rows(files, capsys):
    """--show-data N with --completions: each row's prompt, then its completion as trained (inside [[ ]])."""
    (files / "rollouts.jsonl").write_text(json.dumps({"prompt": "The keeper", "completions": ["kept", "a light",
                                                                                             "went", "lit it"]}) + "\n")
    main = load_script("finetune").main
    assert main([str(a) for a in grpo_args(files, "--completions", files / "rollouts.jsonl", "--show-data", "2",
                                           "--out", files / "out")]) == 0
    shown = capsys.readouterr().out
    assert "-- row 0: prompt 0, completion 0" in shown and "-- row 1: prompt 0, completion 1" in shown
    assert "The keeper[[ kept" in shown and "The keeper[[ a light" in shown
    assert not (files / "out" / "metrics.jsonl").exists()
