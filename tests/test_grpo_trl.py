"""finetune.py --mode grpo against TRL's own GRPOTrainer (tests/grpo_reference.py: TRL 1.16 with the same completions
forced): the same tiny model saved by transformers, the same peft adapter with A and B non-zero (phantom's
--init-adapter, TRL's PEFT model), the same prompts, completions and reward functions, AdamW without warmup or
clipping. After one and after two steps every adapter tensor and the logged figures agree within 1e-4 (fp32), over
the loss types, beta 0 and 0.04, two iterations over the same rollouts with clipping active, two weighted reward
functions, resident and streamed from disk.
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import need, randomize_lora
from test_convert import load_script

transformers, peft, trl = need("transformers"), need("peft"), need("trl")

import phantom  # noqa: E402
from family_check import make, prepare  # noqa: E402
from grpo_reference import trl_grpo  # noqa: E402

PROMPTS = ["The keeper", "A lamp"]
COMPLETIONS = [["kept the light", "went"], ["burned low", "was lit and kept"]]
REWARDS = '''
def reward_length(completions, **kwargs):
    return [float(len(c)) / 4 for c in completions]


def reward_keeps(completions, **kwargs):
    return [1.0 if "kept" in c else 0.0 for c in completions]
'''
FIGURES = ("loss", "grad_norm", "reward", "reward_std", "frac_reward_zero_std", "entropy", "kl",
           "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "clip_ratio/low_min",
           "clip_ratio/high_max", "completions/mean_length", "completions/clipped_ratio",
           "rewards/reward_length/mean", "rewards/reward_length/std", "rewards/reward_keeps/mean",
           "rewards/reward_keeps/std")
# (TRL's GRPOConfig fields, phantom's flags, the placement)
CASES = {
    "dapo-beta-two-rewards-disk": (dict(loss_type="dapo", beta=0.04, reward_weights=[1.0, 0.5],
                                        per_device_train_batch_size=2, gradient_accumulation_steps=2),
                                   ["--loss-type", "dapo", "--beta", "0.04", "--reward-weights", "1.0", "0.5",
                                    "--batch-size", "2", "--grad-accum", "2"], "disk"),
    "grpo-resident": (dict(loss_type="grpo", per_device_train_batch_size=4),
                      ["--loss-type", "grpo", "--batch-size", "4"], "none"),
    "bnpo-two-iterations-clipped-disk": (dict(loss_type="bnpo", beta=0.04, num_iterations=2, epsilon=0.01,
                                              epsilon_high=0.02, per_device_train_batch_size=4),
                                         ["--loss-type", "bnpo", "--beta", "0.04", "--num-iterations", "2",
                                          "--epsilon", "0.01", "--epsilon-high", "0.02", "--batch-size", "4"], "disk"),
    "dr_grpo-temperature-ram": (dict(loss_type="dr_grpo", temperature=0.7, per_device_train_batch_size=2,
                                     gradient_accumulation_steps=2),
                                ["--loss-type", "dr_grpo", "--temperature", "0.7", "--batch-size", "2",
                                 "--grad-accum", "2"], "ram"),
}
LR = 1e-3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny Llama (BOS 0, EOS 1) saved by transformers and converted; a LoRA on q, v with A and B non-zero;
    the reward functions in a file; the rollouts as --completions lines."""
    root = tmp_path_factory.mktemp("grpo-trl")
    store = prepare(make("llama-tied", bos_token_id=0, eos_token_id=1), root)
    with phantom.load(store, offload="none", lora=phantom.LoraConfig(rank=4, targets=("q", "v"))) as pm:
        randomize_lora(pm)
        pm.save_adapter(root / "adapter")
    (root / "rewards.py").write_text(REWARDS)
    (root / "rollouts.jsonl").write_text("".join(json.dumps({"prompt": p, "completions": c}) + "\n"
                                                 for p, c in zip(PROMPTS, COMPLETIONS)))
    namespace = {}
    exec(REWARDS, namespace)
    return root, store, [namespace["reward_length"], namespace["reward_keeps"]]


def phantom_grpo(tiny, flags: list[str], offload: str, steps: int, out) -> tuple[dict, list[dict]]:
    root, store, _ = tiny
    argv = ["--model", str(store), "--mode", "grpo", "--completions", str(root / "rollouts.jsonl"),
            "--reward", f"{root / 'rewards.py'}:reward_length", "--reward", f"{root / 'rewards.py'}:reward_keeps",
            "--init-adapter", str(root / "adapter"), "--num-generations", "2", "--max-completion-length", "16",
            "--iters", str(steps), "--lr", str(LR), "--min-lr", str(LR), "--warmup", "0", "--grad-clip", "0",
            "--weight-decay", "0", "--offload", offload, "--device", "cpu", "--dtype", "fp32", "--out", str(out),
            "--save-every", "0", "--quiet", *flags]
    assert load_script("finetune").main(argv) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return load_file(str(out / "adapter" / "adapter_model.safetensors")), [r for r in records if r.get("step")]


@pytest.mark.parametrize("case", CASES)
def test_two_steps_equal_trls(tiny, tmp_path, case):
    trl_config, flags, offload = CASES[case]
    root, _, funcs = tiny
    want = trl_grpo(root / "hf", root / "adapter", PROMPTS, COMPLETIONS, funcs, 2, keep_order=True,
                    num_generations=2, max_completion_length=16, learning_rate=LR, adam_beta2=0.95, **trl_config)
    for steps in (1, 2):
        adapter, records = phantom_grpo(tiny, flags, offload, steps, tmp_path / f"run{steps}")
        ref = want[steps - 1]
        assert adapter.keys() == ref["adapter"].keys()
        for name, t in adapter.items():
            torch.testing.assert_close(t, ref["adapter"][name], rtol=0, atol=1e-4, msg=f"{case} step {steps} {name}")
        got = records[-1]
        for name in FIGURES:
            if name in ref["metrics"]:
                assert name in got, (case, steps, name)
                assert got[name] == pytest.approx(ref["metrics"][name], rel=1e-4, abs=1e-6), (case, steps, name)
