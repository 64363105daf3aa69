"""GRPO (group-relative policy optimization) as TRL's GRPOTrainer computes it: rewards from Python functions of
TRL's signature, group-relative advantages, and the clipped policy objective with TRL's loss types and its KL to
the reference. Pure functions over tensors; the rollouts (phantom.model.generate) and the streamed log-probabilities
(PhantomModel.token_logps) are the caller's (phantom.train.grpoloop).
"""
from __future__ import annotations

import importlib.util
import inspect
import math
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from phantom.stream.placement import knob
from phantom.train.preference import GRPO_LOSS_TYPES

LOSS_TYPES = GRPO_LOSS_TYPES
SCALE_REWARDS = ("group", "batch", "none")
STD_EPS = 1e-4  # TRL's: advantages / (std + 1e-4)


@dataclass(frozen=True)
class GrpoConfig:
    """How GRPO trains (TRL's GRPOConfig names and defaults): num_generations completions a prompt, sampled at
    temperature / top_p / top_k up to max_completion_length tokens; rewards summed with reward_weights (None: 1
    each); advantages scaled per group, per batch or not; the loss type's clipped objective (epsilon below,
    epsilon_high above: None means epsilon), beta times the KL to the reference; each batch of rollouts serves
    num_iterations optimizer steps; truncated completions masked out of the loss where asked. loss_type and beta
    are set by --loss-type and --beta, which DPO's PreferenceConfig shares (their defaults differ by mode)."""
    num_generations: int = knob(8, "grpo: completions sampled for each prompt (a group)")
    max_completion_length: int = knob(512, "grpo: tokens a completion at most")
    temperature: float = knob(1.0, "grpo: sampling temperature of the rollouts (and of their log-probabilities)")
    top_p: float = knob(1.0, "grpo: sample among the most likely tokens whose probability reaches p")
    top_k: int | None = knob(None, "grpo: sample among the k most likely tokens (default: all)")
    loss_type: str = knob("dapo", "", cli=False)  # --loss-type (shared with dpo)
    epsilon: float = knob(0.2, "grpo: the clip range below 1 (and above, unless --epsilon-high)")
    epsilon_high: float | None = knob(None, "grpo: the clip range above 1 (default: --epsilon)")
    beta: float = knob(0.0, "", cli=False)  # --beta (shared with dpo)
    num_iterations: int = knob(1, "grpo: optimizer steps each batch of rollouts serves")
    scale_rewards: str = knob("group", "grpo: advantages divided by the std of their group, of the batch, or not",
                              choices=SCALE_REWARDS)
    mask_truncated_completions: bool = knob(False, "grpo: completions cut at --max-completion-length carry no loss")
    rewards: tuple[str, ...] = knob((), "grpo: a reward function, TRL's signature (repeat for several; metrics "
                                        "named after each)", flag="reward", action="append", metavar="FILE.py:FUNC")
    reward_weights: tuple[float, ...] | None = knob(None, "grpo: one weight per --reward (default: 1 each)",
                                                    nargs="+", item=float, metavar="W")
    completions: str | None = knob(None, "grpo: train on rollouts made elsewhere, in order: a JSONL of {prompt, "
                                         "completions: [G strings], rewards?} lines", metavar="FILE.jsonl")

    def __post_init__(self):
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"--loss-type must be one of {', '.join(LOSS_TYPES)}, not {self.loss_type!r}")
        if self.scale_rewards not in SCALE_REWARDS:
            raise ValueError(f"--scale-rewards must be one of {', '.join(SCALE_REWARDS)}, not {self.scale_rewards!r}")
        if self.num_generations < 2:
            raise ValueError(f"--num-generations must be at least 2 (a group's advantages are relative), "
                             f"not {self.num_generations}")
        if self.num_iterations < 1 or self.max_completion_length < 1:
            raise ValueError("--num-iterations and --max-completion-length must be at least 1")
        if self.epsilon < 0 or (self.epsilon_high is not None and self.epsilon_high < 0) or self.beta < 0:
            raise ValueError("--epsilon, --epsilon-high and --beta must not be negative")
        if self.reward_weights is not None and len(self.reward_weights) != len(self.rewards):
            raise ValueError(f"--reward-weights gives {len(self.reward_weights)} numbers for {len(self.rewards)} "
                             f"--reward functions: one each")

    @property
    def epsilon_low(self) -> float:
        return self.epsilon

    @property
    def epsilon_up(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


# -- rewards ----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Reward:
    name: str
    fn: object


def load_reward(spec: str) -> Reward:
    """FILE.py:FUNC as a reward function (TRL's signature: prompts, completions, completion_ids and the data's
    other columns as keywords, returning one float or None per completion).

    Raises:
        ValueError: a spec without FILE.py:FUNC, a file that is not there or does not import, no such function,
            or one that cannot take TRL's keywords.
    """
    path, sep, name = spec.rpartition(":")
    if not sep or not path or not name:
        raise ValueError(f"--reward {spec!r}: give FILE.py:FUNC")
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--reward {spec!r}: {file} does not exist")
    module_spec = importlib.util.spec_from_file_location(f"phantom_reward_{file.stem}", file)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - the user's file: its error is the message
        raise ValueError(f"--reward {spec!r}: importing {file} failed: {type(e).__name__}: {e}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"--reward {spec!r}: {file} has no function {name}")
    try:
        inspect.signature(fn).bind(prompts=[], completions=[], completion_ids=[], trainer_state=None)
    except (TypeError, ValueError):
        raise ValueError(f"--reward {spec!r}: {name} must take the keywords TRL passes (prompts, completions, "
                         f"completion_ids, the data's columns, trainer_state): def {name}(completions, **kwargs)"
                         ) from None
    return Reward(name, fn)


def score(rewards: list[Reward], prompts: list, completions: list, completion_ids: list[list[int]],
          columns: dict[str, list], step: int = 0, steps: int = 0) -> torch.Tensor:
    """(N, functions) rewards, NaN where a function returned None (TRL's _calculate_rewards: the data's other
    columns as keywords, and trainer_state with its global_step and max_steps).

    Raises:
        ValueError: a function that returned the wrong number of rewards or something not a number.
    """
    out = torch.zeros(len(completions), len(rewards))
    for k, r in enumerate(rewards):
        state = SimpleNamespace(global_step=step, max_steps=steps)
        got = r.fn(prompts=prompts, completions=completions, completion_ids=completion_ids, trainer_state=state,
                   **columns)
        if not isinstance(got, (list, tuple)) or len(got) != len(completions):
            raise ValueError(f"the reward function {r.name} returned {len(got) if hasattr(got, '__len__') else got!r} "
                             f"rewards for {len(completions)} completions: one each")
        for n, v in enumerate(got):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                raise ValueError(f"the reward function {r.name} returned {v!r}: a number or None each")
            out[n, k] = math.nan if v is None else float(v)
    return out


def nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The standard deviation over the values that are not NaN, with Bessel's correction (TRL's nanstd)."""
    mean = torch.nanmean(x, dim=dim, keepdim=dim is not None)
    var = torch.nanmean((x - mean) ** 2, dim=dim)
    count = (~torch.isnan(x)).sum(dim=dim) if dim is not None else (~torch.isnan(x)).sum()
    return torch.sqrt(var * count / (count - 1))


def advantages(per_func: torch.Tensor, weights: torch.Tensor, group: int, scale: str
               ) -> tuple[torch.Tensor, dict[str, float]]:
    """Each completion's advantage (N,) from its rewards (N, functions), completions in groups of `group`
    consecutive ones (a prompt's), and the step's reward figures: TRL's sum-then-normalize (a completion every
    function left None is excluded from its group's baseline and gets no advantage)."""
    unscorable = torch.isnan(per_func).all(dim=1)
    rewards = (per_func * weights[None]).nansum(dim=1)
    rewards[unscorable] = math.nan
    grouped = rewards.view(-1, group)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(group)
    if scale == "batch":
        std = nanstd(rewards).expand_as(rewards)
    else:
        std = nanstd(grouped, dim=1).repeat_interleave(group)
    adv = rewards - mean
    if scale != "none":
        adv = adv / (std + STD_EPS)
    figures = {"reward": torch.nanmean(rewards).item(), "reward_std": nanstd(rewards).item(),
               "frac_reward_zero_std": torch.isclose(std, torch.zeros_like(std)).float().mean().item()}
    return torch.nan_to_num(adv, nan=0.0), figures


# -- the objective ----------------------------------------------------------------------------------------------

def per_token_loss(logps: torch.Tensor, old: torch.Tensor, ref: torch.Tensor | None, adv: torch.Tensor,
                   cfg: GrpoConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(B, T) loss terms: -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) + beta KL, r = exp(logps - old) per
    token; the KL TRL's estimator exp(ref - logps) - (ref - logps) - 1 times r (its bias correction); and the
    (B, T) masks of clipped tokens and the KL, for the figures."""
    ratio = torch.exp(logps - old)
    a = adv[:, None]
    clipped = torch.clamp(ratio, 1 - cfg.epsilon_low, 1 + cfg.epsilon_up)
    loss = -torch.min(ratio * a, clipped * a)
    parts = {"low": ((ratio < 1 - cfg.epsilon_low) & (a < 0)).float(),
             "high": ((ratio > 1 + cfg.epsilon_up) & (a > 0)).float()}
    parts["region"] = ((parts["low"] + parts["high"]) > 0).float()
    if cfg.beta != 0.0:
        kl = (torch.exp(ref - logps) - (ref - logps) - 1) * ratio
        loss = loss + cfg.beta * kl
        parts["kl"] = kl.detach()
    return loss, parts


def reduce(loss: torch.Tensor, mask: torch.Tensor, cfg: GrpoConfig, micro_batches: int, step_tokens: float
           ) -> torch.Tensor:
    """One micro-batch's share of the step's loss (its gradient accumulates over the step's `micro_batches`):
    grpo the mean over sequences of each one's token mean, bnpo the micro-batch's token mean, dr_grpo its sum
    over rows x max_completion_length, each over micro_batches; dapo the sum over all of the step's completion
    tokens (`step_tokens`)."""
    if cfg.loss_type == "grpo":
        return ((loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / micro_batches
    if cfg.loss_type == "bnpo":
        return (loss * mask).sum() / mask.sum().clamp(min=1.0) / micro_batches
    if cfg.loss_type == "dr_grpo":
        return (loss * mask).sum() / (loss.shape[0] * cfg.max_completion_length) / micro_batches
    return (loss * mask).sum() / max(step_tokens, 1.0)
