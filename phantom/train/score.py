"""Log-likelihoods of many sequences at once: (context, continuation) requests and whole documents rolled
over windows of the model's context, as lm-evaluation-harness asks for them (phantom.train.lmeval).

Every request of a wave goes through a block while the block is loaded once (the backend's
run_micro_batches), so a streamed model reads its store once a wave, not once a request: the waves are
phantom.plan.costscore's, bounded by the memory their hidden states take. Within a wave, requests of
similar lengths share a micro-batch, right-padded: attention is causal, so a real token never sees a pad
and positions start at 0 in every row, which makes a padded row compute exactly what it computes alone.
The head runs only on the positions that predict continuation tokens, a chunk of tokens at a time, so no
(tokens x vocabulary) tensor is ever whole.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence

import torch
from tqdm import tqdm

from phantom.plan import costscore
from phantom.stream.memory import free_compute_bytes

log = logging.getLogger(__name__)


def window(context: Sequence[int], continuation: Sequence[int], max_len: int) -> tuple[list[int], list[int]]:
    """The model's input for one request and the continuation it scores, as lm-eval's `hf` model cuts them:
    (context + continuation)[-(max_len + 1):][:-1], the continuation predicted by its last positions.

    Raises:
        ValueError: an empty context or continuation, or a continuation longer than max_len.
    """
    if not context or not continuation:
        raise ValueError(f"a request needs a context and a continuation, got {len(context)} and "
                         f"{len(continuation)} tokens")
    if len(continuation) > max_len:
        raise ValueError(f"a continuation of {len(continuation)} tokens is longer than the model's context "
                         f"({max_len} tokens)")
    return (list(context) + list(continuation))[-(max_len + 1):][:-1], list(continuation)


def rolling_windows(tokens: Sequence[int], prefix: int, max_len: int) -> list[tuple[list[int], list[int]]]:
    """A document as disjoint (context, continuation) requests that predict each of its tokens once, each
    with as much of what precedes it as the context holds: lm-eval's get_rolling_token_windows (context_len
    1) followed by make_disjoint_window. `prefix` (BOS, or EOS) conditions the first token."""
    tokens, out = list(tokens), []
    if not tokens:
        return out
    first = min(max_len, len(tokens))
    out.append(([prefix] + tokens[:first - 1], tokens[:first]))
    done = first
    while done < len(tokens):
        n = min(len(tokens) - done, max_len)
        end = done + n
        out.append((tokens[max(0, end - max_len - 1):end - 1], tokens[end - n:end]))
        done = end
    return [(ctx[:len(ctx) - (len(cont) - 1)], cont) for ctx, cont in out]


def plan_for(model, lengths: list[int], batch_size: int | None = None,
             wave_bytes: int | None = None) -> tuple[costscore.ScorePlan, costscore.ScoreBudget]:
    """The waves and micro-batches for inputs of these lengths on this model, from the memory free now on
    its device (the host's on a CPU): batch_size caps a micro-batch's rows, wave_bytes the waves' hidden
    states (both None: by memory)."""
    free = free_compute_bytes(model.device)
    b = costscore.budget(model.cfg, torch.finfo(model.weight_dtype).bits // 8, free, batch_size, wave_bytes,
                         cpu=model.device.type == "cpu")
    return costscore.plan_scoring(lengths, b), b


@contextlib.contextmanager
def evaluating(model):
    """The model in eval mode (no dropout) and without autograd, as it was afterwards."""
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was)


def score(model, requests: Sequence[tuple[Sequence[int], Sequence[int]]], batch_size: int | None = None,
          wave_bytes: int | None = None, progress: bool = False, max_len: int | None = None
          ) -> list[tuple[float, bool]]:
    """(sum of the continuation's log-probabilities, whether greedy decoding gives the continuation) of each
    (context ids, continuation ids) request, in input order: lm-eval's `loglikelihood` on token ids.

    Args:
        model: a PhantomModel (its adapters, if any, applied).
        requests: token ids; cut to the model's context as `window` says.
        batch_size: rows of a micro-batch at most (None: by memory).
        wave_bytes: the hidden states a wave may hold (None: a share of free memory); each wave reads the
            model's blocks once.
        progress: a bar of requests scored.
        max_len: the context requests are cut to (default and at most the model's max_seq_len).

    Raises:
        ValueError: an empty context or continuation, one longer than the context, ids outside the vocabulary.
    """
    max_len = model.cfg.max_seq_len if max_len is None else max_len
    if not 0 < max_len <= model.cfg.max_seq_len:
        raise ValueError(f"a context of {max_len} tokens: the model's is 1 to {model.cfg.max_seq_len}")
    cut = [window(c, x, max_len) for c, x in requests]
    carriers, carrier_of = shared_inputs([inp for inp, _ in cut])
    riders: dict[int, list[int]] = {}
    for i, k in enumerate(carrier_of):
        riders.setdefault(k, []).append(i)
    plan, b = plan_for(model, [len(carriers[k]) for k in range(len(carriers))], batch_size, wave_bytes)
    log.info(costscore.describe(plan, len(carriers), b))
    out: list[tuple[float, bool] | None] = [None] * len(cut)
    with evaluating(model), torch.autocast(**model.autocast_args()), \
            tqdm(total=len(cut), disable=not progress, desc="score", unit="req", dynamic_ncols=True) as bar:
        for wave in plan.waves:
            batches = [plan.micro_batches[k] for k in wave]
            hs = model.backend.run_micro_batches([_embedded(model, [carriers[k] for k in rows]) for rows in batches])
            hs = hs if model.hc_head is None else [model.hc_head(h) for h in hs]  # DeepSeek-V4's streams mixed
            for rows, h in zip(batches, hs):
                scored = [(r, i) for r, k in enumerate(rows) for i in riders[k]]
                for (_, i), result in zip(scored, _head(model, h, [(r, *cut[i]) for r, i in scored])):
                    out[i] = result
                bar.update(len(scored))
    return out


def shared_inputs(inputs: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """The inputs the model must run (`carriers`) and which one serves each input: one that equals it or starts
    with it, whose positions up to its length compute what it computes alone (attention is causal). A multiple
    choice's requests often repeat (the same question and answer in two documents) and a rolling document's
    windows never do; what repeats runs once. Sorted, an input that starts another starts the one right after it,
    so one pass from the end finds every input's longest carrier."""
    order = sorted(range(len(inputs)), key=lambda i: inputs[i])
    carrier = {}
    for n in range(len(order) - 1, -1, -1):
        i = order[n]
        nxt = order[n + 1] if n + 1 < len(order) else None
        starts = nxt is not None and inputs[nxt][:len(inputs[i])] == inputs[i]
        carrier[i] = carrier[nxt] if starts else i
    kept = sorted(set(carrier.values()))
    index = {i: k for k, i in enumerate(kept)}
    return [inputs[i] for i in kept], [index[carrier[i]] for i in range(len(inputs))]


def score_documents(model, documents: Sequence[Sequence[int]], prefix: int, batch_size: int | None = None,
                    wave_bytes: int | None = None, progress: bool = False) -> list[float]:
    """Each document's log-likelihood (lm-eval's `loglikelihood_rolling` on token ids): the sum over its
    rolling_windows of the model's context, all documents' windows scored together."""
    windows = [rolling_windows(doc, prefix, model.cfg.max_seq_len) for doc in documents]
    scores = iter(score(model, [w for ws in windows for w in ws], batch_size, wave_bytes, progress))
    return [sum(next(scores)[0] for _ in ws) for ws in windows]


def _embedded(model, inputs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hidden states, rope, token ids) of a micro-batch: its rows right-padded to the first (longest) one's
    length."""
    T = len(inputs[0])
    tokens = torch.tensor([inp + [0] * (T - len(inp)) for inp in inputs])
    h = model.embed(tokens)
    return h, model.rope_for(T)[:T], tokens.to(h.device)


def _head(model, h: torch.Tensor, rows: list[tuple[int, list[int], list[int]]]) -> list[tuple[float, bool]]:
    """Each (row of h, input, continuation)'s continuation log-probability and greedy match from the hidden states
    h (B, T, dim) at the positions of its row that predict its continuation (several inputs may share a row:
    shared_inputs), the head over at most model.loss_chunk tokens at a time."""
    picks = [(r, p) for r, inp, cont in rows for p in range(len(inp) - len(cont), len(inp))]
    targets = torch.tensor([t for _, _, cont in rows for t in cont], device=h.device)
    hidden = h[torch.tensor([r for r, _ in picks]), torch.tensor([p for _, p in picks])]  # (tokens, dim)
    logps, greedy = [], []
    for s in range(0, len(picks), model.loss_chunk):
        logits = model.logits(hidden[s:s + model.loss_chunk])  # (chunk, vocab) fp32
        t = targets[s:s + model.loss_chunk]
        logps.append(torch.log_softmax(logits, -1).gather(1, t[:, None])[:, 0])
        greedy.append(logits.argmax(-1) == t)
    logp, match = torch.cat(logps).double().cpu(), torch.cat(greedy).cpu()
    out, at = [], 0
    for _, _, cont in rows:
        n = len(cont)
        out.append((float(logp[at:at + n].sum()), bool(match[at:at + n].all())))
        at += n
    return out
