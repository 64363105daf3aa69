"""tests/grpo_reference.py runs TRL's own GRPOTrainer as it claims: the completions TRL scores are the forced ones,
its metrics carry the names phantom's GRPO reports, the adapter trains, and the loss, entropy, KL, gradient norm and
AdamW step of a run equal the formulas of notes/grpo-trl.md computed here on transformers + peft directly (each row
alone, unpadded: log_softmax(logits / temperature))."""
from __future__ import annotations

import pytest
import torch

from conftest import need, randomize_lora

transformers, peft, trl = need("transformers"), need("peft"), need("trl")

import phantom  # noqa: E402
from family_check import make, prepare  # noqa: E402
from grpo_reference import trl_grpo, trl_schedule  # noqa: E402

PROMPTS = ["The keeper", "A lamp"]
COMPLETIONS = [["kept the light", "went"], ["burned low", "was lit and kept"]]
EOS = 1


def reward_length(completions, **kwargs):
    return [float(len(c)) / 4 for c in completions]


def reward_keeps(completions, **kwargs):
    return [1.0 if "kept" in c else 0.0 for c in completions]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(HF folder, adapter folder): the tiny tied Llama (<|begin_of_text|> 0, <|end_of_text|> 1 as its bos / eos, so
    TRL's EOS ids are [1]) and a LoRA on q, v with A and B non-zero, saved by phantom in peft's layout."""
    root = tmp_path_factory.mktemp("grpo")
    store = prepare(make("llama-tied", bos_token_id=0, eos_token_id=1), root)
    with phantom.load(store, offload="none", lora=phantom.LoraConfig(rank=4, targets=("q", "v"))) as pm:
        randomize_lora(pm)
        pm.save_adapter(root / "adapter")
    return root / "hf", root / "adapter"


def peft_model(tiny, adapter=None):
    hf, adapter_dir = tiny
    base = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32, attn_implementation="eager")
    model = peft.PeftModel.from_pretrained(base, adapter_dir, is_trainable=True)
    if adapter is not None:
        peft.set_peft_model_state_dict(model, adapter)
    return model


def rows_tokens(tiny, prompts=PROMPTS):
    tok = transformers.AutoTokenizer.from_pretrained(tiny[0])
    return [tok(p)["input_ids"] for p in prompts]


def token_logps(model, prompt_ids, completion_ids, temperature=1.0):
    """The completion's per-token log-probabilities and entropies: the row alone, no padding."""
    ids = torch.tensor([prompt_ids + completion_ids])
    logits = model(ids).logits[0, len(prompt_ids) - 1:-1] / temperature
    logp = torch.log_softmax(logits.float(), -1)
    entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(-1, torch.tensor(completion_ids)[:, None])[:, 0], entropy


def advantages(rewards, G, scale="group"):
    r = torch.tensor(rewards).view(-1, G)
    a = r - r.mean(1, keepdim=True)
    if scale == "group":
        a = a / (r.std(1, keepdim=True) + 1e-4)
    elif scale == "batch":
        a = a / (r.std() + 1e-4)
    return a.flatten()


def hand_step(model, prompt_ids, micro_batches, gen, config, old=None, ref=None):
    """TRL's loss for one optimizer step of these micro-batches of the generation gen (the sum of the micro-batches'
    scaled losses, which Trainer logs), and the entropy / kl metrics (the mean over micro-batches of each one's token
    mean), computed from the formulas; the gradients land in model's adapter. old, ref: {(p, k): per-token logps}
    (None: the step is on-policy / beta 0)."""
    G, bs, GA = config["num_generations"], config["per_device_train_batch_size"], config["gradient_accumulation_steps"]
    spg = config.get("steps_per_generation") or GA
    eps_low, eps_high = config.get("epsilon", 0.2), config.get("epsilon_high") or config.get("epsilon", 0.2)
    beta, loss_type, T = config.get("beta", 0.0), config["loss_type"], config.get("temperature", 1.0)
    completion = dict(zip(gen["rows"], gen["completion_ids"]))
    adv = dict(zip(gen["rows"], gen["advantages"]))
    n_items = sum(len(ids) for ids in completion.values())  # num_items_in_batch: the generation batch's tokens
    loss, entropies, kls, clips = 0.0, [], [], []
    for mb in micro_batches:
        per_row, ent_sum, kl_sum, count, low, high, seq_low, seq_high = [], 0.0, 0.0, 0, 0, 0, [], []
        for p, k in mb:
            logp, entropy = token_logps(model, prompt_ids[p], completion[(p, k)], T)
            old_logp = old[(p, k)] if old is not None else logp.detach()
            coef_1 = torch.exp(logp - old_logp)
            coef_2 = coef_1.clamp(1 - eps_low, 1 + eps_high)
            a = adv[(p, k)]
            ptl = -torch.min(coef_1 * a, coef_2 * a)
            is_low, is_high = (coef_1 < 1 - eps_low) & (a < 0), (coef_1 > 1 + eps_high) & (a > 0)
            low, high = low + is_low.sum().item(), high + is_high.sum().item()
            seq_low.append(is_low.float().mean().item())
            seq_high.append(is_high.float().mean().item())
            if beta:
                d = ref[(p, k)] - logp
                kl = (torch.exp(d) - d - 1) * coef_1
                ptl = ptl + beta * kl
                kl_sum += kl.detach().sum().item()
            per_row.append(ptl)
            ent_sum += entropy.detach().sum().item()
            count += len(ptl)
        if loss_type == "grpo":
            mb_loss = torch.stack([r.mean() for r in per_row]).mean() / GA
        elif loss_type == "bnpo":
            mb_loss = torch.cat(per_row).sum() / count / GA
        elif loss_type == "dr_grpo":
            mb_loss = torch.cat(per_row).sum() / (len(mb) * config["max_completion_length"]) / GA
        elif loss_type == "dapo":
            mb_loss = torch.cat(per_row).sum() / (n_items * GA / spg)
        mb_loss.backward()
        loss += mb_loss.item()
        entropies.append(ent_sum / count)
        kls.append(kl_sum / count)
        clips.append((low / count, high / count, (low + high) / count, min(seq_low), max(seq_high)))
    grad_norm = torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None]).norm().item()
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    clip = {name: mean([c[i] for c in clips]) for i, name in enumerate(
        ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "clip_ratio/low_min",
         "clip_ratio/high_max"))}
    return dict(loss=loss, entropy=mean(entropies), kl=mean(kls), grad_norm=grad_norm, **clip)


def adamw_step(model, lr):
    params = [p for p in model.parameters() if p.requires_grad]
    torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0).step()
    return {k: v.detach().clone() for k, v in peft.get_peft_model_state_dict(model, adapter_name="default").items()}


@pytest.fixture(scope="module")
def two_steps(tiny):
    """beta 0.04, dapo, two steps of one prompt group each (the default batch: 2 rows, G 2)."""
    return trl_grpo(*tiny, PROMPTS, COMPLETIONS, [reward_length, reward_keeps], 2, beta=0.04,
                    reward_weights=[1.0, 0.5])


def test_the_completions_trl_scores_are_the_forced_ones(tiny, two_steps):
    tok = transformers.AutoTokenizer.from_pretrained(tiny[0])
    for step, p in zip(two_steps, (0, 1)):
        (gen,) = step["generated"]
        assert gen["rows"] == [(p, 0), (p, 1)] and gen["prompt"] == [PROMPTS[p]] * 2
        assert gen["completion"] == COMPLETIONS[p]  # TRL's decode of what it scored
        for (_, k), ids in zip(gen["rows"], gen["completion_ids"]):
            assert ids == tok(COMPLETIONS[p][k], add_special_tokens=False)["input_ids"] + [EOS]
        assert gen["rewards"] == {"reward_length": [len(c) / 4 for c in COMPLETIONS[p]],
                                  "reward_keeps": [float("kept" in c) for c in COMPLETIONS[p]]}
        lengths = [len(ids) for ids in gen["completion_ids"]]
        assert step["metrics"]["completions/mean_length"] == sum(lengths) / 2
        assert step["metrics"]["completions/clipped_ratio"] == 0.0
        assert sorted(sum(step["micro_batches"], [])) == gen["rows"]


def test_token_completions_are_cut_as_generation_cuts_them(tiny):
    """Token ids past max_completion_length are dropped (no EOS: truncated), ids after the first EOS too; with
    mask_truncated_completions the truncated row leaves the loss and the token means."""
    completions = [[[5, 6, 7, 8, 9, 10, 11], [12, EOS, 13, 14]]]
    (step,) = trl_grpo(*tiny, PROMPTS[:1], completions, [reward_length], 1, max_completion_length=5,
                       mask_truncated_completions=True, loss_type="bnpo")
    (gen,) = step["generated"]
    assert gen["completion_ids"] == [[5, 6, 7, 8, 9], [12, EOS]]
    m = step["metrics"]
    assert m["completions/clipped_ratio"] == 0.5 and m["completions/mean_length"] == 3.5
    assert m["completions/mean_terminated_length"] == 2.0
    model = peft_model(tiny)
    _, entropy = token_logps(model, rows_tokens(tiny)[0], [12, EOS])
    assert m["entropy"] == pytest.approx(entropy.mean().item(), rel=1e-5)  # the truncated row's tokens left out


def test_metrics_carry_the_names(two_steps):
    for step in two_steps:
        names = set(step["metrics"])
        assert {"loss", "grad_norm", "learning_rate", "reward", "reward_std", "rewards/reward_length/mean",
                "rewards/reward_length/std", "rewards/reward_keeps/mean", "rewards/reward_keeps/std", "kl", "entropy",
                "clip_ratio/low_mean", "clip_ratio/low_min", "clip_ratio/high_mean", "clip_ratio/high_max",
                "clip_ratio/region_mean", "completions/mean_length", "completions/min_length",
                "completions/max_length", "completions/clipped_ratio", "completions/mean_terminated_length",
                "frac_reward_zero_std", "num_tokens"} <= names
        assert step["metrics"]["learning_rate"] == 1e-3  # constant, no warmup


def test_the_adapter_trains_and_the_reference_is_the_initial_adapter(tiny, two_steps):
    initial = peft.get_peft_model_state_dict(peft_model(tiny), adapter_name="default")
    after = [s["adapter"] for s in two_steps]
    assert set(after[0]) == set(initial) and all(".ref." not in k for k in after[0])
    for a, b in ((initial, after[0]), (after[0], after[1])):
        assert all(not torch.equal(a[k], b[k]) for k in a)
    # step 1 is on-policy against a reference equal to the policy: KL 0 (the base model would give a positive one)
    assert two_steps[0]["metrics"]["kl"] == 0.0 and two_steps[1]["metrics"]["kl"] > 0


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_step_one_is_the_formula(tiny, loss_type):
    """Two prompts (G 2) in one generation, two micro-batches of 2 rows (shuffled by TRL: at seed 1 each micro-batch
    holds a row of each group; the recorded order), beta 0.04, two reward functions weighted, rewards scaled per
    group, temperature 0.7: TRL's logged loss, entropy, gradient norm and the adapter after its AdamW step equal the
    hand computation."""
    config = dict(loss_type=loss_type, beta=0.04, num_generations=2, per_device_train_batch_size=2,
                  gradient_accumulation_steps=2, max_completion_length=12, reward_weights=[1.0, 0.5],
                  temperature=0.7, seed=1)
    (step,) = trl_grpo(*tiny, PROMPTS, COMPLETIONS, [reward_length, reward_keeps], 1, **config)
    (gen,) = step["generated"]
    assert gen["rows"] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert step["micro_batches"] == [[(0, 0), (1, 1)], [(0, 1), (1, 0)]]
    text = [COMPLETIONS[p][k] for p, k in gen["rows"]]
    rewards = [len(c) / 4 + 0.5 * ("kept" in c) for c in text]
    adv = advantages(rewards, 2)
    assert gen["advantages"] == pytest.approx(adv.tolist(), abs=1e-6)
    model = peft_model(tiny)
    prompt_ids = rows_tokens(tiny)
    with torch.no_grad():
        ref = {r: token_logps(model, prompt_ids[r[0]], ids, 0.7)[0] for r, ids in zip(gen["rows"],
                                                                                   gen["completion_ids"])}
    got = hand_step(model, prompt_ids, step["micro_batches"], gen, config, ref=ref)
    m = step["metrics"]
    assert m["loss"] == pytest.approx(got["loss"], abs=1e-6)
    assert m["entropy"] == pytest.approx(got["entropy"], rel=1e-5)
    assert m["kl"] == 0.0
    assert m["grad_norm"] == pytest.approx(got["grad_norm"], rel=1e-4)
    assert m["reward"] == pytest.approx(sum(rewards) / 4, rel=1e-6)
    adapter = adamw_step(model, 1e-3)
    for k, v in step["adapter"].items():
        torch.testing.assert_close(v, adapter[k], rtol=0, atol=2e-6)


def test_num_iterations_two_replays_the_rollouts_against_the_old_policy(tiny):
    """num_iterations 2: step 2 trains on step 1's rollouts (no generation), its ratio is to the policy that generated
    them (the old log-probs, computed once), its KL to the initial adapter; clipping at a tight epsilon."""
    config = dict(loss_type="grpo", beta=0.04, num_iterations=2, epsilon=0.01, epsilon_high=0.015,
                  num_generations=2, per_device_train_batch_size=2, gradient_accumulation_steps=1,
                  max_completion_length=12, scale_rewards="batch")
    steps = trl_grpo(*tiny, PROMPTS[:1], COMPLETIONS[:1], [reward_length, reward_keeps], 2, **config)
    (gen,) = steps[0]["generated"]
    assert steps[1]["generated"] == [] and steps[1]["micro_batches"] == steps[0]["micro_batches"]
    rewards = [len(c) / 4 + ("kept" in c) for c in COMPLETIONS[0]]
    adv = advantages(rewards, 2, scale="batch")
    assert gen["advantages"] == pytest.approx(adv.tolist(), abs=1e-6)
    prompt_ids = rows_tokens(tiny)
    initial = peft_model(tiny)
    with torch.no_grad():
        old = {r: token_logps(initial, prompt_ids[r[0]], ids)[0] for r, ids in zip(gen["rows"], gen["completion_ids"])}
    model = peft_model(tiny, steps[0]["adapter"])
    got = hand_step(model, prompt_ids, steps[1]["micro_batches"], gen, config, old=old, ref=old)
    m = steps[1]["metrics"]
    assert m["loss"] == pytest.approx(got["loss"], rel=1e-4)
    assert m["kl"] == pytest.approx(got["kl"], rel=1e-4) and m["kl"] > 0
    assert m["entropy"] == pytest.approx(got["entropy"], rel=1e-5)
    assert m["grad_norm"] == pytest.approx(got["grad_norm"], rel=1e-4)
    assert 0 < m["clip_ratio/region_mean"] < 1  # the tight epsilon clips some tokens
    for name in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "clip_ratio/low_min",
                 "clip_ratio/high_max"):
        assert m[name] == pytest.approx(got[name], abs=1e-6), name
    # the base model (adapter disabled) is not the reference: its KL differs
    with torch.no_grad(), model.disable_adapter():
        base = {r: token_logps(model, prompt_ids[r[0]], ids)[0] for r, ids in zip(gen["rows"], gen["completion_ids"])}
    assert any(not torch.allclose(base[r], old[r], atol=1e-3) for r in base)


def test_steps_per_generation_two_splits_one_generation_over_two_steps(tiny):
    """steps_per_generation 2 with no accumulation: step 1 generates for both prompts, each step trains on half of
    the shuffled rows; the old log-probs are those of the generating policy, DAPO's normalizer the generation's token
    count halved; step 2 logs no reward metrics (nothing generated during it)."""
    config = dict(loss_type="dapo", beta=0.0, steps_per_generation=2, num_generations=2, per_device_train_batch_size=2,
                  gradient_accumulation_steps=1, max_completion_length=12)
    steps = trl_grpo(*tiny, PROMPTS, COMPLETIONS, [reward_length, reward_keeps], 2, **config)
    (gen,) = steps[0]["generated"]
    assert steps[1]["generated"] == [] and len(gen["rows"]) == 4
    assert sorted(steps[0]["micro_batches"][0] + steps[1]["micro_batches"][0]) == gen["rows"]
    assert "reward" in steps[0]["metrics"] and "reward" not in steps[1]["metrics"]
    prompt_ids = rows_tokens(tiny)
    initial = peft_model(tiny)
    with torch.no_grad():
        old = {r: token_logps(initial, prompt_ids[r[0]], ids)[0] for r, ids in zip(gen["rows"], gen["completion_ids"])}
    got1 = hand_step(initial, prompt_ids, steps[0]["micro_batches"], gen, config, old=old)
    model = peft_model(tiny, steps[0]["adapter"])
    got2 = hand_step(model, prompt_ids, steps[1]["micro_batches"], gen, config, old=old)
    for got, step in ((got1, steps[0]), (got2, steps[1])):
        assert step["metrics"]["loss"] == pytest.approx(got["loss"], rel=1e-4)
        assert step["metrics"]["grad_norm"] == pytest.approx(got["grad_norm"], rel=1e-4)


def test_a_reward_of_none_is_left_out(tiny):
    """None -> NaN: the weighted sum skips it (nansum); a row no function scores is left out of its group's mean and
    std (nanmean, nanstd) and gets advantage 0."""
    def length(completions, **kwargs):
        return [None if c == "went" else len(c) / 4 for c in completions]

    def keeps(completions, **kwargs):
        return [1.0 if c == "kept the light" else None for c in completions]

    (step,) = trl_grpo(*tiny, PROMPTS[:1], [["kept the light", "went", "kept"]], [length, keeps], 1,
                       num_generations=3, per_device_train_batch_size=3, reward_weights=[1.0, 2.0])
    (gen,) = step["generated"]
    rewards = torch.tensor([14 / 4 + 2.0, 4 / 4])  # rows 0 and 2; row 1 unscored
    a = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
    assert gen["advantages"] == pytest.approx([a[0].item(), 0.0, a[1].item()], abs=1e-6)
    m = step["metrics"]
    assert m["reward"] == pytest.approx(rewards.mean().item())
    assert m["reward_std"] == pytest.approx(rewards.std().item())
    assert m["rewards/keeps/mean"] == 1.0 and m["rewards/length/mean"] == pytest.approx(18 / 8)


@pytest.mark.parametrize("knobs", [
    dict(per_device_train_batch_size=4, gradient_accumulation_steps=1),
    dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, shuffle_dataset=True, seed=3),
    dict(per_device_train_batch_size=2, gradient_accumulation_steps=1, steps_per_generation=2, num_iterations=2),
    dict(per_device_train_batch_size=2, gradient_accumulation_steps=3, steps_per_generation=2, shuffle_dataset=True),
    dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, keep_order=True, num_iterations=2),
], ids=["plain", "accumulate-shuffled", "spg2-iterations2", "ga3-spg2", "kept-order"])
def test_the_schedule_is_trls(tiny, knobs):
    """trl_schedule (the order written down, no TRL) gives the micro-batches TRL ran, across epochs (5 prompts in
    generation batches of 2: the fifth is skipped each epoch) and the knobs that move rows between steps."""
    prompts = ["a b", "c d", "e f", "g h", "i j"]
    steps = trl_grpo(*tiny, prompts, [["x", "y z"]] * 5, [reward_length], 7, num_generations=2, **knobs)
    schedule = trl_schedule(5, 7, num_generations=2, **knobs)
    assert [s["micro_batches"] for s in steps] == [s["micro_batches"] for s in schedule]
    assert [[g["rows"] for g in s["generated"]] for s in steps] == [s["generated"] for s in schedule]
    assert [s["accumulation"] for s in steps] == [s["accumulation"] for s in schedule]
