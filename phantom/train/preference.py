"""Preference training (DPO, IPO) on LoRA: pairs of a prompt with a chosen and a rejected response.

The reference model is the base with the adapters off, so the model computes it beside the policy
while each block is loaded (PhantomModel.sequence_logps(reference=True)), or once for the whole set
(`reference="precompute"`, cached in a checked file). Holds the losses, the pair data and its rows.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from safetensors.torch import save
from torch.utils.data import Dataset

from phantom.arch.layers import lora_disabled
from phantom.base import fileio
from phantom.base.safejson import read_records
from phantom.data import chat, recordformats
from phantom.data import dataset as D
from phantom.data.tokenizer import TINY_TEXT, Tokenizer
from phantom.stream.placement import knob

log = logging.getLogger(__name__)

LOSSES = ("sigmoid", "ipo")
GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")  # --loss-type's choices in --mode grpo (phantom.train.grpo)
REFERENCES = ("together", "precompute")
FIELDS = ("prompt", "chosen", "rejected")
REFERENCE_FILE = "reference_logps.safetensors"


@dataclass(frozen=True)
class PreferenceConfig:
    """The preference objective.

    Args:
        loss: "sigmoid" (DPO: -log sigmoid(beta * margin), smoothed by label_smoothing) or "ipo"
            ((margin - 1 / (2 beta))^2 on log-probabilities averaged over each response's tokens).
        beta: how far the policy may move from the reference (the KL weight).
        label_smoothing: the assumed fraction of pairs labelled the wrong way (sigmoid only; cDPO).
        reference: "together" computes the reference beside the policy in every step (no extra read
            of the weights); "precompute" computes it once before training into a cached file (one
            extra read of the weights in all, then none per step; for many epochs).
    """

    # shared flags: --loss-type and --beta are GRPO's too (phantom.train.grpo), None: the mode's default
    loss: str | None = knob(None, "dpo: sigmoid (DPO) or ipo (default sigmoid); grpo: grpo, bnpo, dr_grpo or dapo "
                                  "(default dapo)", choices=LOSSES + GRPO_LOSS_TYPES, flag="loss-type", by_mode=True)
    beta: float | None = knob(None, "dpo: how far the policy may move from the reference (default 0.1); grpo: the "
                                    "weight of the KL to the reference (default 0: none)", by_mode=True)
    label_smoothing: float = knob(0.0, "dpo: assumed fraction of pairs labelled the wrong way, sigmoid loss only")
    reference: str = knob("together", "dpo: together (the reference beside the policy in each loaded block: no "
                                      "extra reads) or precompute (once before training, cached in --out: one extra "
                                      "read of the weights in all)", choices=REFERENCES)

    def __post_init__(self):
        object.__setattr__(self, "loss", "sigmoid" if self.loss is None else self.loss)
        object.__setattr__(self, "beta", 0.1 if self.beta is None else self.beta)
        if self.loss not in LOSSES:
            raise ValueError(f"--loss-type {self.loss} is GRPO's; dpo takes {' or '.join(LOSSES)}"
                             if self.loss in GRPO_LOSS_TYPES else
                             f"--loss must be one of {', '.join(LOSSES)}, not {self.loss!r}")
        if self.reference not in REFERENCES:
            raise ValueError(f"--reference must be one of {', '.join(REFERENCES)}, not {self.reference!r}")
        if not self.beta > 0:
            raise ValueError(f"--beta must be > 0, got {self.beta}")
        if not 0 <= self.label_smoothing < 0.5:
            raise ValueError(f"--label-smoothing must be in [0, 0.5), got {self.label_smoothing}")


# -- the losses -----------------------------------------------------------------------------------

def preference_loss(policy: torch.Tensor, reference: torch.Tensor, cfg: PreferenceConfig,
                    lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """The mean loss over pairs and the preference figures of a batch.

    Args:
        policy, reference: (P, 2) summed log-probabilities of each pair's chosen (column 0) and
            rejected (column 1) response under the policy (with autograd) and the reference.
        cfg: the loss and its knobs.
        lengths: (P, 2) response tokens, needed by IPO (which averages over them).

    Returns:
        (loss, {"rewards_chosen", "rewards_rejected", "reward_margin", "reward_accuracy"}), the
        rewards being beta * (policy - reference) of the summed log-probabilities whatever the loss
        (as TRL logs them: IPO's averaging is the loss's, not the reward's), means over the pairs.
    """
    rewards = cfg.beta * (policy - reference.to(policy.dtype)).detach()
    if cfg.loss == "ipo":
        policy, reference = policy / lengths, reference / lengths
    margin = (policy[:, 0] - policy[:, 1]) - (reference[:, 0] - reference[:, 1]).to(policy.dtype)
    if cfg.loss == "sigmoid":
        losses = -F.logsigmoid(cfg.beta * margin) * (1 - cfg.label_smoothing) \
            - F.logsigmoid(-cfg.beta * margin) * cfg.label_smoothing
    else:
        losses = (margin - 1 / (2 * cfg.beta)) ** 2
    figures = {"rewards_chosen": rewards[:, 0].mean().item(), "rewards_rejected": rewards[:, 1].mean().item(),
               "reward_margin": (rewards[:, 0] - rewards[:, 1]).mean().item(),
               "reward_accuracy": (rewards[:, 0] > rewards[:, 1]).float().mean().item()}
    return losses.mean(), figures


# -- pair data ------------------------------------------------------------------------------------

Encoder = Callable[[dict, Tokenizer], tuple[list[int], list[int], list[int]]]


def encode_pair(record: dict, tok: Tokenizer) -> tuple[list[int], list[int], list[int]]:
    """(BOS + prompt, chosen + EOS, rejected + EOS) token ids of a record.

    Plain strings are encoded as they are (as phantom.data.recordformats reads prompt/response records); chat
    messages (a prompt list of {"role", "content"}, responses as a string or an assistant message
    list) are rendered as phantom.data.recordformats renders chats. A model's chat template plugs in as another
    encoder (load_pairs(encode=...)).
    """
    missing = [k for k in FIELDS if k not in record]
    if missing:
        raise ValueError(f"a preference pair needs {', '.join(FIELDS)}; this record has no {missing[0]!r}")
    prompt = record["prompt"]
    if isinstance(prompt, list):
        chat_turns = {"messages": prompt + [{"role": "assistant", "content": ""}]}
        prompt = " ".join(p for p, _ in recordformats.segments(chat_turns, "chat") if p)
    out = [tok.encode(_text(prompt, "prompt"), bos=True)]
    for side in ("chosen", "rejected"):
        ids = tok.encode(_text(record[side], side), bos=False)
        if not ids:
            raise ValueError(f"the {side} response is empty; every pair needs two non-empty responses")
        out.append(ids + tok.encode("", bos=False, eos=True))
    return out[0], out[1], out[2]


def pair_encoder(template: chat.ChatTemplate | None) -> Encoder:
    """The encoder of pairs for a model: through its chat template where it has one (chat_pair),
    else encode_pair."""
    return encode_pair if template is None else functools.partial(chat_pair, template=template)


def chat_pair(record: dict, tok: Tokenizer, template: chat.ChatTemplate) -> tuple[list[int], list[int], list[int]]:
    """A pair through the model's chat template: the prompt (a string is one user message) and each
    response as the assistant's turn, rendered and masked as phantom.data.chat does for SFT. The prompt
    is the chosen conversation's tokens before its first trained one; each response runs to its last
    trained token (the end of turn included where the template trains it)."""
    missing = [k for k in FIELDS if k not in record]
    if missing:
        raise ValueError(f"a preference pair needs {', '.join(FIELDS)}; this record has no {missing[0]!r}")
    prompt = record["prompt"]
    messages = [{"role": "user", "content": _text(prompt, "prompt")}] if not isinstance(prompt, list) else prompt
    out = []
    for side in ("chosen", "rejected"):
        text = _text(record[side], side)
        if not text:
            raise ValueError(f"the {side} response is empty; every pair needs two non-empty responses")
        ids, labels = chat.encode_chat(tok, template, messages + [{"role": "assistant", "content": text}], "last")
        trained = [k for k, lab in enumerate(labels) if lab != chat.IGNORE_INDEX]
        if not trained:
            raise ValueError(f"the chat template trains nothing of the {side} response")
        out.append((ids[:trained[0]], ids[trained[0]:trained[-1] + 1]))
    return out[0][0], out[0][1], out[1][1]


def _text(value, field: str) -> str:
    """A field as text: a string, or the content of a list holding one assistant message."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], dict) and "content" in value[0]:
        value = value[0]["content"]
    if not isinstance(value, str):
        raise ValueError(f"{field} must be a string (or a chat message list), got {type(value).__name__}")
    return value


@dataclass
class PairData:
    """Tokenized pairs: prompt, chosen and rejected token ids of each pair, and where they came from."""

    prompts: list[np.ndarray]
    chosen: list[np.ndarray]
    rejected: list[np.ndarray]
    key: str
    fmt: str = "pairs"

    def __len__(self) -> int:
        return len(self.prompts)

    def slice(self, a: int, b: int) -> "PairData":
        return PairData(self.prompts[a:b], self.chosen[a:b], self.rejected[a:b], f"{self.key}[{a}:{b}]")


def load_pairs(path: Path | str | None, tok: Tokenizer, encode: Encoder = encode_pair) -> PairData:
    """Preference pairs from a JSONL (or .json list) file of {"prompt", "chosen", "rejected"}
    records; None: pairs generated from the shipped tiny text (tiny_pairs).

    Raises:
        FileNotFoundError: no such file. ValueError: a record without a field, with an empty
            response or not an object (naming its line), or no records.
    """
    if path is None:  # text continuations, not chats: encoded as plain text whatever the model's template
        records, key, encode = enumerate(tiny_pairs(), 1), f"tiny-pairs|{tok.fingerprint}", encode_pair
        where = "the generated pairs"
    else:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"data file {path} not found; pass --data FILE.jsonl with prompt/chosen/rejected "
                                    f"records")
        template = getattr(encode, "keywords", {}).get("template")  # how chats are rendered is part of the key
        key = f"{D.cache_key(path, tok)}|{template.fingerprint if template is not None else 'plain'}"
        records, where = read_records(path), str(path)
    prompts, chosen, rejected, same = [], [], [], 0
    for n, record in records:
        try:
            if not isinstance(record, dict):
                raise ValueError(f"expected a JSON object, got {type(record).__name__}")
            p, c, r = encode(record, tok)
        except ValueError as e:
            raise ValueError(f"{where}:{n}: {e}") from None
        same += c == r
        prompts.append(np.asarray(p, np.int32))
        chosen.append(np.asarray(c, np.int32))
        rejected.append(np.asarray(r, np.int32))
    if not prompts:
        raise ValueError(f"{where} holds no pairs; give one JSON object per line with {', '.join(FIELDS)}")
    if same:
        log.warning("%s: %d of %d pairs have identical chosen and rejected responses; they teach nothing", where,
                    same, len(prompts))
    return PairData(prompts, chosen, rejected, key)


def split_pairs(pairs: PairData, fraction: float) -> tuple[PairData, PairData | None]:
    """(train, held-out): the last `fraction` of the pairs."""
    if not 0 <= fraction < 1:
        raise ValueError(f"--val-split must be in [0, 1), got {fraction}")
    if fraction == 0:
        return pairs, None
    k = len(pairs) - max(1, round(len(pairs) * fraction))
    if k < 1:
        raise ValueError(f"{len(pairs)} pairs are too few to hold some out; add pairs or use --val-split 0")
    return pairs.slice(0, k), pairs.slice(k, len(pairs))


def tiny_pairs(n: int = 600, seed: int = 0, text: Path = TINY_TEXT, words_out: int = 8) -> list[dict]:
    """A preference set made from the shipped text: the prompt is a stretch of it, chosen is the
    next few words as written, rejected the same words shuffled (never in their own order)."""
    words = Path(text).read_text().split()
    rng, out = random.Random(seed), []
    while len(out) < n:
        at = rng.randrange(6, len(words) - words_out)
        cont = words[at:at + words_out]
        shuffled = cont[:]
        while shuffled == cont and len(set(cont)) > 1:
            rng.shuffle(shuffled)
        if shuffled != cont:
            out.append({"prompt": " ".join(words[at - 6:at]), "chosen": " " + " ".join(cont),
                        "rejected": " " + " ".join(shuffled)})
    return out


# -- rows -----------------------------------------------------------------------------------------

def fit(prompt: np.ndarray, response: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """prompt + response cut to n tokens: the prompt loses its start (BOS kept), down to half the
    row, then the response its end."""
    if len(prompt) + len(response) <= n:
        return prompt, response
    keep = min(len(prompt), max(n // 2, n - len(response)))
    prompt = np.concatenate([prompt[:1], prompt[len(prompt) - keep + 1:]]) if keep > 1 else prompt[:1]
    return prompt, response[:n - len(prompt)]


class PairRows(Dataset):
    """Item i: pair i as (x, y) of shape (2, seq_len), chosen then rejected, one response per row
    (padded; -100 targets on the prompt and the padding), and the (2,) reference log-probabilities
    when they were precomputed (NaN when they are computed with the step)."""

    def __init__(self, pairs: PairData, seq_len: int, pad_id: int = 0, reference: torch.Tensor | None = None):
        if seq_len < 2:
            raise ValueError(f"--seq-len must be >= 2 for preference pairs, got {seq_len}")
        self.pairs, self.seq_len, self.pad_id, self.reference = pairs, seq_len, pad_id, reference
        self.n = self.n_sequential = len(pairs)
        cut = sum(len(p) + max(len(c), len(r)) > seq_len + 1
                  for p, c, r in zip(pairs.prompts, pairs.chosen, pairs.rejected))
        if cut:
            log.warning("%d of %d pairs are longer than --seq-len %d + 1 and were truncated", cut, self.n, seq_len)

    def __len__(self) -> int:
        return self.n

    def row(self, prompt: np.ndarray, response: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        prompt, response = fit(prompt, response, self.seq_len + 1)
        toks = np.full(self.seq_len + 1, self.pad_id, np.int64)
        labs = np.full(self.seq_len + 1, D.IGNORE_INDEX, np.int64)
        k = len(prompt) + len(response)
        toks[:len(prompt)], toks[len(prompt):k] = prompt, response
        labs[len(prompt):k] = response
        return toks[:-1], labs[1:]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        p = self.pairs
        (xc, yc), (xr, yr) = self.row(p.prompts[i], p.chosen[i]), self.row(p.prompts[i], p.rejected[i])
        ref = self.reference[i] if self.reference is not None else torch.full((2,), float("nan"))
        return torch.from_numpy(np.stack([xc, xr])), torch.from_numpy(np.stack([yc, yr])), ref


def as_rows(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(P, 2, T) pairs as (2P, T) rows, each pair's chosen and rejected side by side, so any
    micro-batch of an even number of rows holds whole pairs."""
    return x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1])


# -- the objective --------------------------------------------------------------------------------

def pair_logps(model, x: torch.Tensor, y: torch.Tensor, ref: torch.Tensor | None):
    """(policy (P, 2), reference (P, 2), response lengths (P, 2)) of a (P, 2, T) batch; the
    reference is computed beside the policy unless `ref` holds it (precomputed)."""
    tokens, targets = as_rows(x, y)
    together = ref is None or bool(torch.isnan(ref).any())
    policy, reference = model.sequence_logps(tokens, targets, reference=together)
    ref = reference.view(-1, 2) if together else ref.to(policy.device, torch.float32)
    lengths = (y != D.IGNORE_INDEX).sum(-1).to(policy.device, torch.float32)
    return policy.view(-1, 2), ref, lengths


def lane_pair_logps(model, batches: list, lanes: list) -> list[tuple]:
    """pair_logps of each lane's (x, y, ref) pairs (phantom.stream.lanes), every lane's rows in one pass; a
    lane whose reference was precomputed takes it, as its own run does."""
    rows = [as_rows(x, y) for x, y, _ in batches]
    mine = [ref is not None and not bool(torch.isnan(ref).any()) for *_, ref in batches]
    out = model.sequence_logps(torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows]),
                               reference=not all(mine), lanes=lanes)
    result = []
    for (x, y, ref), own, (policy, reference) in zip(batches, mine, out):
        ref = ref.to(policy.device, torch.float32) if own else reference.view(-1, 2)
        result.append((policy.view(-1, 2), ref, (y != D.IGNORE_INDEX).sum(-1).to(policy.device, torch.float32)))
    return result


class Preference:
    """The preference objective for phantom.train.loop: the loss of a step's pairs, with its figures
    kept in `figures` for the metrics; held-out evaluation."""

    def __init__(self, cfg: PreferenceConfig):
        self.cfg, self.figures = cfg, {}

    def __call__(self, model, x: torch.Tensor, y: torch.Tensor, ref: torch.Tensor | None = None) -> torch.Tensor:
        return self.loss(*pair_logps(model, x, y, ref))

    def loss(self, policy: torch.Tensor, reference: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """The loss of pairs' log-probabilities (pair_logps'); their figures kept in `figures`."""
        loss, self.figures = preference_loss(policy, reference, self.cfg, lengths)
        return loss

    @torch.no_grad()
    def evaluate(self, model, ds: PairRows, pairs_per_batch: int, iters: int) -> dict:
        """Held-out loss and reward figures over the first `iters` batches of `ds`, in order."""
        was_training = model.training
        model.eval()
        policy, reference, lengths = [], [], []
        n = min(len(ds), pairs_per_batch * iters)
        for i in range(0, n, pairs_per_batch):
            x, y, ref = (torch.stack(t) for t in zip(*(ds[j] for j in range(i, min(i + pairs_per_batch, n)))))
            for acc, t in zip((policy, reference, lengths), pair_logps(model, x, y, ref)):
                acc.append(t.float().cpu())
        model.train(was_training)
        loss, figures = preference_loss(torch.cat(policy), torch.cat(reference), self.cfg, torch.cat(lengths))
        return {"val_loss": loss.item(), **{f"val_{k}": v for k, v in figures.items()}}


# -- the reference, once --------------------------------------------------------------------------

def reference_key(model, pairs: list[PairData], seq_len: int, weights: str | None) -> str:
    """What the precomputed reference depends on: the base weights, the pairs, the rows, the dtype."""
    ident = json.dumps([weights, [p.key for p in pairs], [len(p) for p in pairs], seq_len, str(model.dtype),
                        str(model.device.type)])
    return hashlib.sha256(ident.encode()).hexdigest()


@torch.no_grad()
def compute_reference(model, datasets: list[PairRows], rows_per_pass: int, adapters: bool = False
                      ) -> list[torch.Tensor]:
    """Each data set's (N, 2) reference log-probabilities: the model with its adapters off (or on, `adapters`: an
    initial adapter as the reference), every pair of every set through each block while it is loaded,
    `rows_per_pass` rows a pass (one pass, one read of the weights, when they all fit)."""
    items = [(k, i) for k, ds in enumerate(datasets) for i in range(len(ds))]
    out = [torch.empty(len(ds), 2) for ds in datasets]
    was_training = model.training
    model.eval()
    with contextlib.nullcontext() if adapters else lora_disabled(model.layers):
        for s in range(0, len(items), max(1, rows_per_pass // 2)):
            part = items[s:s + max(1, rows_per_pass // 2)]
            x, y = (torch.stack(t) for t in zip(*(datasets[k][i][:2] for k, i in part)))
            logps, _ = model.sequence_logps(*as_rows(x, y))
            for (k, i), v in zip(part, logps.view(-1, 2).float().cpu()):
                out[k][i] = v
    model.train(was_training)
    return out


def cached_reference(path: Path, key: str, compute: Callable[[], list[torch.Tensor]]) -> list[torch.Tensor]:
    """The reference log-probabilities cached in `path` (safetensors; its metadata holds `key` and
    the sha256 of the values) when they are for `key` and the checksum holds; else computed and
    written there atomically. A stale or damaged file is computed again, with a warning."""
    if path.is_file():
        try:
            with safe_open(str(path), "pt") as f:
                meta = f.metadata() or {}
                tensors = {k: f.get_tensor(k) for k in f.keys()}
            if meta.get("key") == key and meta.get("sha256") == _digest(tensors):
                log.info("using the reference log-probabilities cached in %s", path)
                return [tensors[str(k)] for k in range(len(tensors))]
            log.warning("%s holds reference log-probabilities of other weights, data or settings (or is damaged); "
                        "computing them again", path)
        except (OSError, ValueError, SafetensorError) as e:
            log.warning("%s cannot be read (%s); computing it again", path, e)
    log.info("computing the reference log-probabilities (adapters off) once, into %s", path)
    sets = compute()
    tensors = {str(k): t.float().contiguous() for k, t in enumerate(sets)}
    fileio.atomic_write(path, save(tensors, metadata={"key": key, "sha256": _digest(tensors)}))
    return sets


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for k in sorted(tensors):
        h.update(k.encode() + tensors[k].float().numpy().tobytes())
    return h.hexdigest()
