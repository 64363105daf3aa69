"""`TrainConfig` (how to train, frozen) and the learning rate it gives each step: AdamW, linear warmup,
cosine decay. Apart from the loop so the run's config (phantom.train.runconfig) and the step read the
settings without the loop's threads, files and progress bar.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from phantom.stream.adam8bit import OPTIMIZERS, AdamW8bit
from phantom.stream.placement import knob
from phantom.train.grpo import GrpoConfig
from phantom.train.preference import PreferenceConfig

MODES = ("lora", "full", "dpo", "grpo")


@dataclass(frozen=True)
class TrainConfig:
    """How to train (the model and data are given to `train` separately).

    Args:
        iters: optimizer steps.
        batch_size: rows per micro-batch (the model's micro_batch).
        grad_accum: micro-batches per step; the step's K * B rows go through the model in one call,
            which runs each block over all of them while it is loaded (layer-major).
        seq_len: tokens per row.
        lr, min_lr: peak learning rate and the floor of the cosine decay (None: lr / 10).
        warmup: steps of linear warmup from 0.
        weight_decay, betas: AdamW's.
        optim: "adamw_torch" (fp32 moments) or "adamw_8bit" (moments as 8-bit codes with a scale per 256:
            phantom.stream.adam8bit), for the streamed blocks of full finetuning and every other trained tensor.
        grad_clip: max gradient norm (0: no clipping): the global norm of the LoRA weights; in full mode
            each block (and the embedding, norm and head together) is clipped to grad_clip * sqrt(its
            share of the parameters) as its gradients arrive (phantom.stream.optim.clip_coefficient), since
            a streamed block is updated before the global norm could be known.
        eval_every, eval_iters: evaluate the held-out set every N steps (0: only at the end), on at
            most this many batches.
        eval_tasks, eval_tasks_every, eval_limit: lm-evaluation-harness tasks run on the model being trained
            at the end and every N steps (0: only at the end), at most this many documents each
            (phantom.train.evaltasks); their metrics go into the step's record.
        save_every: checkpoint every N steps (0: only at the end or on Ctrl-C).
        sample_every, prompt, max_new_tokens: a greedy sample from `prompt` every N steps (0: off).
        seed: seeds the torch/numpy/python RNGs and the batch order.
        shuffle: random windows / shuffled rows; False: in order.
        out: the output folder (adapter/, checkpoint/, metrics.jsonl, trace.json).
        resume: continue from out/checkpoint.
        mode: "lora", "full" (what the model trains; recorded in checkpoints) or "dpo": a LoRA trained on
            preference pairs (train_data a phantom.train.preference.PairData; batch_size pairs a micro-batch,
            so the model's micro_batch is 2 * batch_size rows).
        preference: the preference loss and where its reference comes from (mode "dpo").
        grpo: the rollouts, rewards and clipped objective of mode "grpo" (phantom.train.grpo), whose --batch-size
            counts completions (TRL's per_device_train_batch_size).
        workers: DataLoader worker processes.
        trace: write the scheduler's Chrome trace to out/trace.json at the end.
        progress: show a tqdm bar.
    """

    # knob(): the flag of scripts/finetune.py and the run-file section each field is (phantom.train.runconfig)
    iters: int = knob(200, "optimizer steps", section="optim")
    batch_size: int = knob(8, "rows per micro-batch", section="data")
    grad_accum: int = knob(1, "micro-batches per step, layer-major", section="data")
    seq_len: int = knob(128, "tokens per row", section="data")
    lr: float = knob(1e-2, "", cli=False)  # RunConfig.lr: None picks it by the model's size
    min_lr: float | None = knob(None, "end of the cosine decay (default: lr / 10)", section="optim")
    warmup: int = knob(10, "linear warmup steps", section="optim")
    weight_decay: float = knob(0.0, "AdamW weight decay", section="optim")
    betas: tuple[float, float] = knob((0.9, 0.95), "", cli=False)
    grad_clip: float = knob(1.0, "max gradient norm, 0: off", section="optim")
    optim: str = knob("adamw_torch", "the optimizer: AdamW with fp32 moments, or 8-bit moments (a quarter of the "
                                     "state's bytes; bitsandbytes' AdamW8bit)", section="optim", choices=OPTIMIZERS)
    eval_every: int = knob(50, "evaluate every N steps, 0: at the end only", section="output")
    eval_iters: int = knob(8, "batches per evaluation", section="output")
    eval_tasks: tuple[str, ...] = knob((), "lm-evaluation-harness tasks (names or task YAML files) run on the adapter "
                                           "being trained at the end (and every --eval-tasks-every steps), their "
                                           "metrics in metrics.jsonl (needs phantom[eval]; default: none)",
                                       section="output",
                                       type="csv", metavar="T1,T2")
    eval_tasks_every: int = knob(0, "run --eval-tasks every N steps too, 0: at the end only", section="output")
    eval_limit: int | None = knob(None, "documents per task of --eval-tasks at most", section="output", metavar="N")
    save_every: int = knob(100, "checkpoint every N steps, 0: at the end only", section="output")
    sample_every: int = knob(0, "", cli=False)  # RunConfig.sample_every: None is the tiny demo's rule
    prompt: str = knob("", "prompt of the samples", section="output")
    max_new_tokens: int = knob(32, "", cli=False)
    seed: int = knob(0, "seed of the LoRA init, batch order and dropout", section="optim")
    shuffle: bool = knob(True, "read the data in order instead of random windows/rows", section="data",
                         flag="sequential", invert=True)
    out: str = knob("out/finetune", "output folder", section="output")
    resume: bool = knob(False, "continue from --out/checkpoint", section="output")
    mode: str = knob("lora", "train a LoRA, all weights, a LoRA on preference pairs (dpo: --data with "
                             "prompt/chosen/rejected), or a LoRA by reinforcement learning on its own samples (grpo: "
                             "--data with prompts, --reward functions)", section="model", choices=MODES)
    preference: PreferenceConfig = knob(PreferenceConfig(), "", section="optim")
    grpo: GrpoConfig = knob(GrpoConfig(), "", section="optim")
    init_adapter: str | None = knob(None, "start from this PEFT adapter (its rank, alpha and targets) instead of a new "
                                          "LoRA; grpo keeps it frozen as its reference", section="model",
                                    flag="init-adapter", metavar="DIR")
    workers: int = knob(1, "DataLoader worker processes", section="data")
    trace: bool = knob(False, "write --out/trace.json (Chrome trace of the scheduler)", section="output")
    progress: bool = knob(True, "no progress bar or log lines", section="output", flag="quiet", short="-q",
                          invert=True)
    check_step: object = knob(None, "", cli=False)  # f(median step s of steps 2-4) -> warning or None (the tuner's prediction check)

    def __post_init__(self):
        for name in ("iters", "batch_size", "grad_accum", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("warmup", "eval_every", "eval_iters", "save_every", "sample_every", "workers",
                     "weight_decay", "grad_clip", "max_new_tokens", "eval_tasks_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if self.eval_limit is not None and self.eval_limit < 1:
            raise ValueError(f"--eval-limit must be >= 1, got {self.eval_limit}")
        if not self.lr > 0 or (self.min_lr is not None and not 0 <= self.min_lr <= self.lr):
            raise ValueError(f"need lr > 0 and 0 <= min_lr <= lr, got lr={self.lr}, min_lr={self.min_lr}")
        if self.mode not in MODES:
            raise ValueError(f"--mode must be one of {', '.join(MODES)}, not {self.mode!r}")
        if self.mode == "grpo" and self.preference.reference != "together":
            raise ValueError("--reference precompute is DPO's: --mode grpo's reference comes with each batch of "
                             "rollouts (docs/grpo.md)")


def make_optimizer(model, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW (cfg.optim's) over the trainable parameters (the one place a model-provided optimizer would
    plug in)."""
    params = model.trainable_parameters()
    if not params:
        raise ValueError("the model has nothing to train; load it with a LoRA (or --mode full)")
    kind = AdamW8bit if cfg.optim == "adamw_8bit" else torch.optim.AdamW
    return kind(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Multiplier of cfg.lr at 0-based `step`: linear warmup, then cosine down to min_lr."""
    if step < cfg.warmup:
        return (step + 1) / cfg.warmup
    floor = (cfg.min_lr if cfg.min_lr is not None else cfg.lr / 10) / cfg.lr
    t = min(1.0, (step - cfg.warmup) / max(1, cfg.iters - cfg.warmup))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t))


def make_scheduler(opt: torch.optim.Optimizer, cfg: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_factor(step, cfg))
