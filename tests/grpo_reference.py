"""TRL's own GRPOTrainer, with the completions forced: the reference that phantom's GRPO is held to.

trl_grpo builds trl.GRPOTrainer on a transformers model saved in a folder (fp32, CPU) with a peft adapter loaded
from another (PeftModel.from_pretrained(..., is_trainable=True)) and runs it for a number of optimizer steps.
Nothing is sampled: the trainer's `_generate_single_turn` (the one method that calls `model.generate`) is replaced,
on this trainer instance only, by one that returns the completions the caller gave, so the prompt tokenization,
decoding, rewards, advantages, old and reference log-probs, loss, metrics and optimizer are all TRL's own code.

What it returns, per optimizer step: the adapter's tensors after the step (peft's names, the `default` adapter),
the metrics TRL logged for the step (logging_steps=1), which (prompt, completion) rows formed each micro-batch of the
step in order, and, at a step that generated, the rows in generation order with TRL's logged completions,
rewards and advantages. notes/grpo-trl.md is the written account of what TRL computes.

Pinned here (each can be overridden by a keyword; see DEFAULTS): AdamW as TrainingArguments builds it, learning rate
constant (no warmup), no gradient clipping (max_grad_norm=0: transformers then logs the norm without clipping),
seed 0, fp32 (TRL's GRPOConfig would turn bf16 on), no gradient checkpointing (TRL's default turns it on), the
dataset read in order (shuffle_dataset=False), one log per optimizer step, nothing reported or saved.
"""
from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from typing import Callable

import torch

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

DEFAULTS = dict(
    learning_rate=1e-3, lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=0.0, seed=0,
    bf16=False, fp16=False, gradient_checkpointing=False, use_cpu=True, shuffle_dataset=False,
    logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
    num_generations=2, per_device_train_batch_size=2, gradient_accumulation_steps=1, max_completion_length=16,
)


def completion_token_ids(tokenizer, completions, eos_token_ids: list[int], max_completion_length: int):
    """Each prompt's completions as the token ids TRL would have got back from generation: a string is tokenized
    without special tokens and the tokenizer's EOS appended; a list of ids is taken as is. Then, as generation ends
    them: cut after the first of TRL's EOS ids (kept), at most max_completion_length tokens (a completion cut there
    has no EOS: TRL counts it truncated)."""
    out = []
    for group in completions:
        rows = []
        for c in group:
            ids = (list(tokenizer(c, add_special_tokens=False)["input_ids"]) + [tokenizer.eos_token_id]
                   if isinstance(c, str) else [int(t) for t in c])
            if not ids:
                raise ValueError("an empty completion: generation gives at least one token")
            ends = [i for i, t in enumerate(ids) if t in eos_token_ids]
            if ends:
                ids = ids[:ends[0] + 1]
            rows.append(ids[:max_completion_length])
        out.append(rows)
    return out


def trl_schedule(n_prompts: int, steps: int, *, num_generations: int, per_device_train_batch_size: int,
                 gradient_accumulation_steps: int = 1, steps_per_generation: int | None = None,
                 generation_batch_size: int | None = None, num_iterations: int = 1, shuffle_dataset: bool = False,
                 seed: int = 0, keep_order: bool = False) -> list[dict]:
    """The rows (prompt index, completion index) of every micro-batch of every optimizer step as trl_grpo's
    GRPOTrainer runs them (one process), computed without TRL: the order notes/grpo-trl.md describes.

    A generation batch holds generation_batch_size // num_generations prompts of the dataset (read in order, or in
    RepeatSampler's permutation from its own generator seeded with `seed` when shuffle_dataset; a new permutation
    each epoch; the prompts left over from the last whole batch are skipped), each repeated num_generations times in
    a row. Its rows are shuffled by torch.randperm on the global generator, which Trainer seeds (seed) and which
    draws one int64 as each epoch's DataLoader iterator starts (torch's base seed) and nothing else when no dropout
    runs and nothing is sampled; then cut into steps_per_generation micro-batches of per_device_train_batch_size
    rows, replayed num_iterations times. Returns per optimizer step {"micro_batches": [[(p, k)]], "generated":
    [the rows of each generation made during the step, in generation order], "accumulation": its micro-batch count
    (Trainer's current_gradient_accumulation_steps: the last step of an epoch may have fewer)}.
    """
    G, bs, GA = num_generations, per_device_train_batch_size, gradient_accumulation_steps
    if generation_batch_size is None:
        spg = steps_per_generation or GA
        gbs = bs * spg
    else:
        gbs, spg = generation_batch_size, generation_batch_size // bs
    unique = gbs // G
    per_epoch = (n_prompts // unique) * num_iterations * spg  # dataloader batches (micro-steps) in an epoch
    if per_epoch == 0:
        raise ValueError("fewer prompts than one generation batch needs")
    sampler = torch.Generator().manual_seed(seed)
    world = torch.Generator().manual_seed(seed)  # the global generator, as Trainer leaves it
    out, micro_step, buffer = [], 0, None
    while len(out) < steps:
        order = torch.randperm(n_prompts, generator=sampler).tolist() if shuffle_dataset else list(range(n_prompts))
        chunks = [order[i:i + unique] for i in range(0, n_prompts - unique + 1, unique)]
        batches = [chunk for chunk in chunks for _ in range(num_iterations * spg)]
        torch.empty((), dtype=torch.int64).random_(generator=world)  # the DataLoader iterator's base seed
        for start in range(0, per_epoch, GA):
            if len(out) == steps:
                break
            step = {"micro_batches": [], "generated": [], "accumulation": min(GA, per_epoch - start)}
            for chunk in batches[start:start + GA]:
                if micro_step % (spg * num_iterations) == 0:
                    rows = [(p, k) for p in chunk for k in range(G)]
                    perm = list(range(gbs)) if keep_order else torch.randperm(gbs, generator=world).tolist()
                    shuffled = [rows[i] for i in perm]
                    buffer = [shuffled[j * bs:(j + 1) * bs] for j in range(spg)]
                    step["generated"].append(rows)
                step["micro_batches"].append(buffer[micro_step % spg])
                micro_step += 1
            out.append(step)
    return out


@contextmanager
def _recorded_shuffle(grpo_module, permutations: list, keep_order: bool):
    """TRL shuffles each generation batch's rows (shuffle_sequence_dict, torch.randperm on the global generator)
    before cutting it into micro-batches. Record each permutation (drawn from the same generator state TRL then
    draws from), or with keep_order leave the rows in generation order."""
    original = grpo_module.shuffle_sequence_dict

    def shuffle(seq_dict):
        n = len(next(v for v in seq_dict.values() if v is not None))
        if keep_order:
            permutations.append(list(range(n)))
            return seq_dict
        state = torch.random.get_rng_state()
        permutation = torch.randperm(n).tolist()
        torch.random.set_rng_state(state)
        out = original(seq_dict)
        assert torch.equal(out["completion_ids"], seq_dict["completion_ids"][permutation]), "shuffle not pinned"
        permutations.append(permutation)
        return out

    grpo_module.shuffle_sequence_dict = shuffle
    try:
        yield
    finally:
        grpo_module.shuffle_sequence_dict = original


def trl_grpo(model_dir, adapter_dir, prompts: list[str], completions: list[list[str]] | list[list[list[int]]],
             reward_funcs: list[Callable], steps: int, *, attn_implementation: str = "eager",
             keep_order: bool = False, output_dir=None, **grpo_config) -> list[dict]:
    """Run TRL's GRPOTrainer for `steps` optimizer steps with forced completions.

    prompts: distinct plain-text prompts (the dataset, `{"prompt": str}` records, read in order unless
        shuffle_dataset=True). completions[p]: prompt p's num_generations completions (strings or token ids; see
        completion_token_ids). reward_funcs: TRL reward functions (`f(prompts, completions, completion_ids,
        **kwargs) -> list[float | None]`). grpo_config: GRPOConfig fields over DEFAULTS (loss_type, beta, epsilon,
        epsilon_high, num_iterations, reward_weights, scale_rewards, mask_truncated_completions,
        max_completion_length, num_generations, per_device_train_batch_size, gradient_accumulation_steps,
        steps_per_generation, temperature, ...). keep_order: leave each generation batch's rows unshuffled (not
        TRL's behaviour; by default TRL shuffles them and the permutation is recorded).

    Returns one dict per optimizer step:
        step: 1, 2, ...
        adapter: {peft name: tensor} of the trained (`default`) adapter after the step
        metrics: what TRL logged for the step (loss, grad_norm, learning_rate, reward, reward_std,
            rewards/<func>/mean|std, kl (beta != 0), entropy, clip_ratio/*, completions/*, frac_reward_zero_std, ...)
        micro_batches: per micro-batch of the step, in order, its rows as (prompt index, completion index)
        accumulation: the step's micro-batch count as TRL's losses divide by it (current_gradient_accumulation_steps)
        generated: the generations made during the step (usually one at its first micro-batch, or none while
            buffered rollouts are replayed): each {"rows": [(p, k)] in generation order, "completion_ids": the forced
            ids per row, "permutation": the generation row of each shuffled row (micro-batch j holds shuffled rows
            j*bs ... j*bs+bs-1), "at": the index of its micro-batch in the run, and TRL's logged table of it, in
            generation order: "prompt", "completion" (decoded), "advantages", "rewards" ({func name: list})}
    """
    import peft
    import transformers
    from datasets import Dataset
    import trl
    from trl.trainer import grpo_trainer

    if len(set(prompts)) != len(prompts):
        raise ValueError("prompts must be distinct: each row's completions are found by its prompt")
    config = {**DEFAULTS, **grpo_config, "max_steps": steps}
    G = config["num_generations"]
    if any(len(group) != G for group in completions) or len(completions) != len(prompts):
        raise ValueError(f"completions: one list of num_generations={G} per prompt")

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                             attn_implementation=attn_implementation)
    model = peft.PeftModel.from_pretrained(base, adapter_dir, is_trainable=True)
    tmp = None
    if output_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="trl-grpo-")
        output_dir = tmp.name
    args = trl.GRPOConfig(output_dir=str(output_dir), **config)
    trainer = trl.GRPOTrainer(model=model, reward_funcs=reward_funcs, args=args,
                              train_dataset=Dataset.from_dict({"prompt": list(prompts)}), processing_class=tokenizer)

    forced = completion_token_ids(tokenizer, completions, trainer.eos_token_ids, args.max_completion_length)
    prompt_index = {tuple(ids): p for p, ids in enumerate(trainer.processing_class(text=list(prompts))["input_ids"])}
    if len(prompt_index) != len(prompts):
        raise ValueError("two prompts tokenize alike")

    record = dict(generations=[], permutations=[], micro=[], steps=[], logs={})

    def generate_single_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        seen, rows = {}, []
        for ids in prompt_ids:
            p = prompt_index[tuple(ids)]
            k = seen.get(p, 0)
            seen[p] = k + 1
            rows.append((p, k % num_generations))
        record["generations"].append({"rows": rows, "completion_ids": [list(forced[p][k]) for p, k in rows],
                                      "at": len(record["micro"])})
        return [list(forced[p][k]) for p, k in rows], None

    generate_and_score = trainer._generate_and_score_completions

    def generate_and_score_completions(inputs):
        out = generate_and_score(inputs)
        logs = trainer._logs
        record["generations"][-1].update(prompt=list(logs["prompt"]), completion=list(logs["completion"]),
                                         advantages=list(logs["advantages"]),
                                         rewards={k: list(v) for k, v in logs["rewards"].items()})
        return out

    prepare_inputs = trainer._prepare_inputs

    def prepare(generation_batch):
        chunk = trainer._step % args.steps_per_generation
        out = prepare_inputs(generation_batch)
        if trainer.model.training:
            record["micro"].append((len(record["generations"]) - 1, chunk))
            record["accumulation"] = trainer.current_gradient_accumulation_steps
        return out

    class Capture(transformers.TrainerCallback):
        def on_step_end(self, _args, state, control, model=None, **kwargs):
            adapter = peft.get_peft_model_state_dict(model, adapter_name="default")
            record["steps"].append((state.global_step, len(record["micro"]), record["accumulation"],
                                    {k: v.detach().clone() for k, v in adapter.items()}))

        def on_log(self, _args, state, control, logs=None, **kwargs):
            if "train_runtime" not in (logs or {}):  # not the summary train() logs at its end
                record["logs"].setdefault(state.global_step, dict(logs))

    trainer._generate_single_turn = generate_single_turn
    trainer._generate_and_score_completions = generate_and_score_completions
    trainer._prepare_inputs = prepare
    trainer.add_callback(Capture())
    trainer.remove_callback(transformers.trainer_callback.PrinterCallback)
    try:
        with _recorded_shuffle(grpo_trainer, record["permutations"], keep_order):
            trainer.train()
    finally:
        if tmp is not None:
            tmp.cleanup()

    bs = args.per_device_train_batch_size
    out, done = [], 0
    for step, n_micro, accumulation, adapter in record["steps"]:
        micro = record["micro"][done:n_micro]
        micro_batches = [[record["generations"][g]["rows"][record["permutations"][g][i]]
                          for i in range(chunk * bs, (chunk + 1) * bs)] for g, chunk in micro]
        generated = [{**gen, "permutation": record["permutations"][g]}
                     for g, gen in enumerate(record["generations"]) if done <= gen["at"] < n_micro]
        done = n_micro
        out.append(dict(step=step, adapter=adapter, metrics=record["logs"].get(step, {}),
                        micro_batches=micro_batches, accumulation=accumulation, generated=generated))
    return out
