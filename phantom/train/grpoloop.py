"""GRPO's rollouts and objective for the training loop (phantom.train.loop): each optimizer step's completions
sampled by batched streamed generation (phantom.model.generate), scored by the reward functions, turned into
group-relative advantages, and trained on with the clipped objective over each token's log-probability
(PhantomModel.token_logps), TRL's GRPOTrainer's computation (phantom.train.grpo; notes/grpo-trl.md).

A step's rows are its batch_size x grad_accum completions (TRL's per_device_train_batch_size x
gradient_accumulation_steps), num_generations of each of the step's prompts; they go through the model in one
call, each block over all of them while it is loaded (layer-major), the loss reduced per micro-batch of batch_size
rows as TRL reduces it. Each row is its prompt and completion from position 0, right-padded: attention is causal,
so a row computes what it computes alone. A batch of rollouts serves num_iterations steps: their old policy's
log-probabilities are computed once, before its first update, in a pass without autograd (beside the reference's
where the reference is the base model: one read of the weights for both).

The reference is the policy at the start of the run: the base model (adapters off), or with --init-adapter the
initial adapter kept frozen (as TRL's GRPOTrainer takes a PEFT model's): its log-probabilities come from a pass
with the initial adapter's weights put in and taken out again.

Sampling is seeded per rollout (the run's seed, the batch's index, the row): a resumed run samples what the run that
never stopped sampled; the rollouts a checkpoint falls within are saved with it.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from phantom.base import fileio
from phantom.base.safejson import read_records
from phantom.data import chat, showdata
from phantom.data.special_tokens import IGNORE_INDEX
from phantom.model.generate import Request, Sampling, generate_many
from phantom.train import grpo as G

log = logging.getLogger(__name__)

COMPLETIONS_FILE = "completions.jsonl"  # beside metrics.jsonl: each rollout batch's first rows, their rewards
LOGGED_ROWS = 8  # rows of each rollout batch written there


# -- prompts ------------------------------------------------------------------------------------------------------

@dataclass
class PromptData:
    """GRPO's training data: prompts (a string, or chat messages through the model's template), their ids with the
    generation prompt, the records' other columns (given to the reward functions as keywords), and with
    --completions the rollouts made elsewhere: each prompt's completions and rewards (None where not given)."""
    key: str
    fmt: str  # "prompt" or "chat"
    prompts: list
    ids: list[list[int]]
    columns: dict[str, list]
    completions: list[list[str]] | None = None
    rewards: list[list[float] | None] | None = None
    template: object = None  # the chat template the prompts went through

    def __len__(self) -> int:
        return len(self.prompts)


def load_prompts(path: str | Path, tok, template, grpo: G.GrpoConfig, max_seq_len: int) -> PromptData:
    """The prompts of a JSONL (or JSON list) file: {"prompt": str} or chat {"prompt"/"messages": [messages]}, other
    keys kept as columns; with grpo.completions, that file's lines instead ({"prompt", "completions": [G strings],
    "rewards"?: [G numbers]}).

    Raises:
        ValueError: no such file, a line that is not a prompt record, a group that is not num_generations long, a
            prompt too long for max_completion_length more tokens.
    """
    path = Path(grpo.completions or path)
    if not path.is_file():
        raise ValueError(f"{path}: no such file of {'completions' if grpo.completions else 'prompts'}")
    records = list(read_records(path))
    if not records:
        raise ValueError(f"{path}: no records")
    prompts, completions, rewards = [], [], []
    for n, r in records:
        prompt = r.get("prompt", r.get("messages")) if isinstance(r, dict) else None
        chat_prompt = isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt)
        if not (isinstance(prompt, str) or chat_prompt):
            raise ValueError(f"{path}:{n}: each line needs a \"prompt\" (text, or chat messages)")
        if grpo.completions:
            group = r.get("completions")
            if not isinstance(group, list) or len(group) != grpo.num_generations or \
                    not all(isinstance(c, str) for c in group):
                raise ValueError(f"{path}:{n}: \"completions\" must be a list of --num-generations "
                                 f"({grpo.num_generations}) strings")
            scores = r.get("rewards")
            if scores is not None and (not isinstance(scores, list) or len(scores) != len(group) or
                                       not all(isinstance(s, (int, float)) and not isinstance(s, bool) for s in scores)):
                raise ValueError(f"{path}:{n}: \"rewards\" must be a list of one number per completion")
            completions.append(group)
            rewards.append(scores)
        prompts.append(prompt)
    names = dict.fromkeys(k for _, r in records for k in r if k not in ("prompt", "messages", "completions", "rewards"))
    columns = {k: [r.get(k) for _, r in records] for k in names}  # None where a line has no such key
    fmt = "chat" if any(isinstance(p, list) for p in prompts) else "prompt"
    ids = [prompt_ids(tok, template, p) for p in prompts]
    for (n, _), i in zip(records, ids):
        if len(i) + grpo.max_completion_length > max_seq_len:
            raise ValueError(f"{path}:{n}: the prompt's {len(i)} tokens + --max-completion-length "
                             f"{grpo.max_completion_length} exceed the model's max_seq_len {max_seq_len}")
    key = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    return PromptData(key, fmt, prompts, ids, columns, completions if grpo.completions else None,
                      rewards if grpo.completions else None, template)


def prompt_ids(tok, template, prompt) -> list[int]:
    """A prompt's ids: text as the tokenizer encodes it (BOS first), chat messages through the template with its
    generation prompt."""
    if isinstance(prompt, str):
        return tok.encode(prompt, bos=True)
    if template is None:
        raise ValueError("chat prompts need a chat template: the store has none; pass --chat-template FILE")
    return chat.messages_ids(tok, template, prompt)


# -- rollouts -----------------------------------------------------------------------------------------------------

@dataclass
class Rollout:
    """One batch of rollouts: rows x (N, T) and targets y (N, T) (-100 but on completion tokens), the loss's
    mask (N, T), advantages (N,), the old policy's and the reference's log-probabilities (N, T) where computed
    beforehand, the figures logged at the step that made it, and the rows written to completions.jsonl."""
    index: int
    x: torch.Tensor
    y: torch.Tensor
    mask: torch.Tensor
    adv: torch.Tensor
    old: torch.Tensor | None = None
    ref: torch.Tensor | None = None
    figures: dict = field(default_factory=dict)
    samples: list = field(default_factory=list)
    logged: bool = False  # its figures and samples are logged at the first step it serves

    def state(self) -> dict:
        """What a checkpoint keeps of it (tensors, numbers, strings: torch.load with weights_only reads them)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


class Rollouts:
    """The rollouts of each optimizer step (1-based `step`): a batch made at the first step of every
    num_iterations, served to that many steps."""

    def __init__(self, model, tok, data: PromptData, cfg, reference_adapter: dict | None = None):
        """cfg: the run's phantom.train.trainconfig.TrainConfig (its grpo, batch size, seed, order and steps);
        reference_adapter: the initial adapter's tensors where it is the reference (else the base model)."""
        self.model, self.tok, self.template, self.data, self.grpo = model, tok, data.template, data, cfg.grpo
        self.rows, self.iters, self.seed, self.shuffle = cfg.batch_size * cfg.grad_accum, cfg.iters, cfg.seed, \
            cfg.shuffle
        grpo, template = cfg.grpo, data.template
        if self.rows % grpo.num_generations:
            raise ValueError(f"--batch-size x --grad-accum ({self.rows} completions a step) must be a multiple of "
                             f"--num-generations ({grpo.num_generations})")
        self.prompts_per_batch = self.rows // grpo.num_generations
        self.rewards = [G.load_reward(spec) for spec in grpo.rewards]
        if not self.rewards and (data.rewards is None or any(r is None for r in data.rewards)):
            raise ValueError("give --reward FILE.py:FUNC (or \"rewards\" on every line of --completions)")
        weights = grpo.reward_weights or (1.0,) * max(len(self.rewards), 1)
        self.weights = torch.tensor(weights, dtype=torch.float32)
        if data.fmt == "chat" and template is not None:
            self.stop = frozenset(chat.end_of_turn_ids(tok, template))
        else:
            self.stop = frozenset(tok.stop_ids)
        self.pad = tok.pad_or_eos
        self.reference_adapter = reference_adapter
        self.current: Rollout | None = None

    def batch_index(self, step: int) -> int:
        return (step - 1) // self.grpo.num_iterations

    def for_step(self, step: int) -> Rollout:
        index = self.batch_index(step)
        if self.current is None or self.current.index != index:
            self.current = self.make(index, step)
        return self.current

    def prompts_of(self, index: int) -> list[int]:
        """The prompt indices of rollout batch `index`: in order (--completions, or --sequential), else each pass
        over the data a permutation drawn from the run's seed and the pass."""
        n, k = len(self.data), self.prompts_per_batch
        first = index * k
        if self.data.completions is not None or not self.shuffle:
            return [(first + j) % n for j in range(k)]
        out = []
        for pos in range(first, first + k):
            epoch, at = divmod(pos, n)
            order = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed * 1_000_003 + epoch))
            out.append(int(order[at]))
        return out

    @torch.no_grad()
    def make(self, index: int, step: int) -> Rollout:
        g, t0 = self.grpo, time.perf_counter()
        picks = self.prompts_of(index)
        rows = [(p, k) for p in picks for k in range(g.num_generations)]
        if self.data.completions is not None:
            ids = [self.completion_ids(self.data.completions[p][k]) for p, k in rows]
        else:
            ids = self.sample(rows, index)
        t_gen = time.perf_counter()
        ended = [len(i) > 0 and i[-1] in self.stop for i in ids]
        texts = [self.tok.decode([t for t in i if t not in self.stop]) for i in ids]
        completions = [[{"role": "assistant", "content": t}] for t in texts] if self.data.fmt == "chat" else texts
        per_func = self.score(rows, completions, ids, step)
        adv, figures = G.advantages(per_func, self.weights, g.num_generations, g.scale_rewards)
        t_score = time.perf_counter()
        x, y, mask = self.tensors(rows, ids, ended)
        rollout = Rollout(index, x, y, mask, adv)
        self.reference_passes(rollout)
        lengths = torch.tensor([float(len(i)) for i in ids])
        terminated = lengths[torch.tensor(ended)] if any(ended) else torch.zeros(0)
        names = [r.name for r in self.rewards] or ["rewards"]
        figures.update({f"rewards/{name}/mean": torch.nanmean(per_func[:, k]).item() for k, name in enumerate(names)})
        figures.update({f"rewards/{name}/std": G.nanstd(per_func[:, k]).item() for k, name in enumerate(names)})
        figures.update({
            "completions/mean_length": lengths.mean().item(), "completions/min_length": lengths.min().item(),
            "completions/max_length": lengths.max().item(),
            "completions/clipped_ratio": 1.0 - sum(ended) / len(ended),
            "completions/mean_terminated_length": terminated.mean().item() if len(terminated) else 0.0,
            "generation_s": t_gen - t0, "scoring_s": t_score - t_gen,
            "reference_s": time.perf_counter() - t_score})
        rollout.figures = figures
        rollout.samples = [{"step": step, "prompt": self.data.prompts[p], "completion": texts[n],
                            "rewards": {name: _finite(per_func[n, k]) for k, name in enumerate(names)},
                            "advantage": float(adv[n])} for n, (p, _) in enumerate(rows[:LOGGED_ROWS])]
        return rollout

    def sample(self, rows: list[tuple[int, int]], index: int) -> list[list[int]]:
        """Each row's completion ids sampled by batched generation, the stop id that ended it included (TRL's)."""
        g = self.grpo
        sampling = Sampling(g.temperature, g.top_k, g.top_p)
        seeds = [_seed(self.seed, index, n) for n in range(len(rows))]
        requests = [Request(list(self.data.ids[p]), g.max_completion_length, sampling, s, self.stop)
                    for (p, _), s in zip(rows, seeds)]
        was = self.model.training
        self.model.eval()
        try:
            done = generate_many(self.model, requests, self.tok)
        finally:
            self.model.train(was)
        return [c.ids + ([c.stop_id] if c.stop_id is not None else []) for c in done]

    def completion_ids(self, text: str) -> list[int]:
        return completion_ids(self.tok, text, self.grpo.max_completion_length, self.stop)

    def score(self, rows, completions, ids, step: int) -> torch.Tensor:
        """(N, functions) rewards: the functions' (the records' other columns as keywords), or the file's."""
        if not self.rewards:
            return torch.tensor([[float(self.data.rewards[p][k])] for p, k in rows])
        prompts = [self.data.prompts[p] for p, _ in rows]
        columns = {name: [values[p] for p, _ in rows] for name, values in self.data.columns.items()}
        return G.score(self.rewards, prompts, completions, ids, columns, step, self.iters)

    def tensors(self, rows, ids, ended) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each row its prompt and completion from position 0, right-padded; targets the completion's tokens;
        the loss's mask those targets (none of a truncated completion with mask_truncated_completions)."""
        seqs = [list(self.data.ids[p]) + list(i) for (p, _), i in zip(rows, ids)]
        T = max(len(s) for s in seqs) - 1
        x = torch.full((len(seqs), T), self.pad, dtype=torch.long)
        y = torch.full((len(seqs), T), IGNORE_INDEX, dtype=torch.long)
        for n, ((p, _), s) in enumerate(zip(rows, seqs)):
            x[n, :len(s) - 1] = torch.tensor(s[:-1])
            start = len(self.data.ids[p]) - 1
            y[n, start:len(s) - 1] = torch.tensor(s[start + 1:])
        mask = (y != IGNORE_INDEX).float()
        if self.grpo.mask_truncated_completions:
            mask = mask * torch.tensor([float(e) for e in ended])[:, None]
        return x, y, mask

    def reference_passes(self, rollout: Rollout) -> None:
        """The old policy's log-probabilities (several steps on these rollouts) and the reference's (a KL term)
        that the training pass cannot give: without autograd, before the first update."""
        g, model = self.grpo, self.model
        need_old, need_ref = g.num_iterations > 1, g.beta != 0.0
        if not (need_old or (need_ref and self.reference_adapter is not None)):
            return  # the reference, if any, is the base model: the training pass computes it beside the policy
        was = model.training
        model.eval()
        try:
            if need_old:
                base_ref = need_ref and self.reference_adapter is None
                old, _, ref = model.token_logps(rollout.x, rollout.y, g.temperature, reference=base_ref)
                rollout.old, rollout.ref = old.detach(), ref
            if need_ref and self.reference_adapter is not None:
                with initial_adapter(model, self.reference_adapter):
                    rollout.ref = model.token_logps(rollout.x, rollout.y, g.temperature)[0].detach()
        finally:
            model.train(was)


def completion_ids(tok, text: str, max_len: int, stop: frozenset) -> list[int]:
    """A completion of --completions as generation would give it: its text tokenized without special tokens, the
    end-of-sequence id appended, cut to max_len (a cut one has none: truncated)."""
    eos = tok.eos_id if tok.eos_id is not None else min(stop)
    return (tok.encode(text, bos=False) + [eos])[:max_len]


def show_rollouts(data: PromptData, tok, grpo: G.GrpoConfig, n: int, ids: bool = False) -> str:
    """--show-data for GRPO: the first n rows as the model sees them, the prompt with its generation prompt and,
    with --completions, each completion as it is trained on (inside [[ ]])."""
    per = grpo.num_generations if data.completions is not None else 1
    lines = []
    for i in range(min(n, len(data) * per)):
        p, k = divmod(i, per)
        comp = completion_ids(tok, data.completions[p][k], grpo.max_completion_length, frozenset(tok.stop_ids)) \
            if data.completions is not None else []
        row = list(data.ids[p]) + comp
        lines.append(f"-- row {i}: prompt {p}" + (f", completion {k}: {len(comp)} tokens" if comp else
                                                    " (completions are sampled)"))
        lines.append("   " + showdata.marked(tok, row, [False] * len(data.ids[p]) + [True] * len(comp), ids))
    return "\n".join(lines)


class initial_adapter:
    """The model's trainable tensors set to the initial adapter's for a pass, then back."""

    def __init__(self, model, tensors: dict[str, torch.Tensor]):
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self.tensors = tensors

    def __enter__(self):
        self.saved = {n: p.detach().clone() for n, p in self.params.items()}
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(self.tensors[n])

    def __exit__(self, *exc):
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(self.saved[n])
        return False


def tensors_fingerprint(tensors: dict[str, torch.Tensor]) -> str:
    """A sha256 over named tensors' bytes (an initial adapter's, in a cache key)."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def _seed(seed: int, index: int, row: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{index}:{row}".encode()).digest()[:8], "little") >> 1


def _finite(v: torch.Tensor) -> float | None:
    return None if math.isnan(float(v)) else float(v)


# -- the objective ------------------------------------------------------------------------------------------------

class GrpoObjective:
    """The loss of a step's rollout for phantom.train.loop (its `objective`; the rollout comes as `ref`), its
    figures kept in `figures` as TRL logs them (each micro-batch's token means, averaged over the step's)."""

    def __init__(self, grpo: G.GrpoConfig, batch_size: int, base_reference: bool):
        self.grpo, self.batch_size, self.base_reference, self.figures = grpo, batch_size, base_reference, {}

    def __call__(self, model, x: torch.Tensor, y: torch.Tensor, ref: Rollout) -> torch.Tensor:
        g, rollout = self.grpo, ref
        want_ref = g.beta != 0.0 and rollout.ref is None and self.base_reference
        logps, entropy, ref_logps = model.token_logps(x, y, g.temperature, reference=want_ref)
        old = rollout.old.to(logps.device) if rollout.old is not None else logps.detach()
        reference = rollout.ref.to(logps.device) if rollout.ref is not None else ref_logps
        adv, mask = rollout.adv.to(logps.device), rollout.mask.to(logps.device)
        per_token, parts = G.per_token_loss(logps, old, reference, adv, g)
        groups = list(range(0, x.shape[0], self.batch_size))
        step_tokens = float(mask.sum())
        loss = sum(G.reduce(per_token[a:a + self.batch_size], mask[a:a + self.batch_size], g, len(groups),
                            step_tokens) for a in groups)
        self.figures = micro_means(entropy, parts, mask, groups, self.batch_size)
        if not rollout.logged:  # the rollouts' own figures at the step that made them, as TRL logs them
            self.figures.update(rollout.figures)
        return loss


def micro_means(entropy: torch.Tensor, parts: dict, mask: torch.Tensor, groups: list[int], size: int) -> dict:
    """entropy, kl and the clip ratios as TRL logs them: each micro-batch's mean over its loss tokens (low_min and
    high_max: the least and the most of its rows' own means, rows with no loss token left out), averaged over the
    step's micro-batches."""
    out: dict[str, list[float]] = {}

    def add(name: str, values: torch.Tensor, m: torch.Tensor):
        out.setdefault(name, []).append(float((values * m).sum() / m.sum().clamp(min=1.0)))
    for a in groups:
        m = mask[a:a + size]
        add("entropy", entropy[a:a + size], m)
        if "kl" in parts:
            add("kl", parts["kl"][a:a + size], m)
        for kind in ("low", "high", "region"):
            add(f"clip_ratio/{kind}_mean", parts[kind][a:a + size], m)
        rows = m.sum(-1) > 0
        per_row = {k: (parts[k][a:a + size] * m).sum(-1)[rows] / m.sum(-1)[rows] for k in ("low", "high")}
        out.setdefault("clip_ratio/low_min", []).append(float(per_row["low"].min()) if rows.any() else math.nan)
        out.setdefault("clip_ratio/high_max", []).append(float(per_row["high"].max()) if rows.any() else math.nan)
    return {k: _nanmean(v) for k, v in out.items()}


def _nanmean(values: list[float]) -> float:
    kept = [v for v in values if not math.isnan(v)]
    return sum(kept) / len(kept) if kept else math.nan


def log_samples(out: Path, rollout: Rollout) -> None:
    """The rollout batch's first rows, their rewards and advantages, appended to out/completions.jsonl (once)."""
    if rollout.logged:
        return
    with fileio.RecordLog(out / COMPLETIONS_FILE) as f:
        for sample in rollout.samples:
            f.append(json.dumps(sample, ensure_ascii=False, allow_nan=False))
    rollout.logged = True


def keep_samples(out: Path, upto: int) -> None:
    """completions.jsonl cut back to the rows of steps up to `upto` (a resumed run writes the rest again)."""
    path = out / COMPLETIONS_FILE
    if path.exists():
        rows = [r for r in fileio.read_records(path) if isinstance(r, dict) and r.get("step", 0) <= upto]
        fileio.atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def restored(state: dict | None) -> Rollout | None:
    """A rollout saved with a checkpoint (Rollout.state), or None."""
    return Rollout(**state) if state else None

