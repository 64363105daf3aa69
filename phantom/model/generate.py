"""Batched generation from a PhantomModel: many prompts advance together, so a streamed model reads each block
once per decode step for all of them (and once for their whole prefill), not once per prompt and token.

Prompts of different lengths are left-padded in one KV cache: every sequence writes the same cache column at
each step, its positions start at 0 at its own first token (as transformers computes them from the attention
mask) and no real token sees a pad. A pad query sees only itself, so no row of the softmax is empty. A
Gated DeltaNet layer's cache is its conv and recurrent state (phantom.arch.ops.KVCache), its pads zeroed.
A sequence that ends (an end-of-sequence or end-of-turn id, a stop string, its max_new_tokens) is dropped
from the cache and from later steps. Sampling draws each sequence's tokens from its own generator, seeded by
its request: a completion does not depend on the batch it ran in.

Longrope (Phi-3): keys turned by the short factors are recomputed with the long ones once a sequence passes
the original context, as transformers does; such a request runs in a batch of its own.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from tqdm import tqdm

from phantom.arch.ops import KVCache
from phantom.data.chat import ChatTemplate, end_of_turn_ids, prompt_ids
from phantom.data.tokenizer import Tokenizer
from phantom.model.phantom_model import PhantomModel
from phantom.stream.kvcache import CacheSet
from phantom.stream.memory import free_compute_bytes, free_device_bytes

MAX_BATCH = 256  # sequences per batch at most when the batch size is chosen from memory
CACHE_SHARE = 0.5  # of the memory free when generation starts, what the chosen batch's caches may take


@dataclass(frozen=True)
class Sampling:
    """How each next token is chosen: the argmax at temperature 0, else a draw from softmax(logits / T) over the
    top_k most likely tokens and the smallest set whose probability reaches top_p (transformers' order)."""
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float = 1.0

    def __post_init__(self):
        if self.temperature < 0 or not 0 < self.top_p <= 1 or (self.top_k is not None and self.top_k < 1):
            raise ValueError(f"sampling needs temperature >= 0, 0 < top_p <= 1 and top_k >= 1, got {self}")


@dataclass(frozen=True)
class Request:
    """One sequence to continue: its prompt's ids, at most max_new_tokens, the ids and strings that end it."""
    prompt: list[int]
    max_new_tokens: int
    sampling: Sampling = Sampling()
    seed: int = 0
    stop_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()


@dataclass
class Completion:
    """The new tokens (without the stop id that ended them), their text (special tokens skipped, cut before a
    stop string; None without a tokenizer) and why they ended: "stop", "stop_string" or "length"."""
    ids: list[int] = field(default_factory=list)
    text: str | None = None
    finish: str = "length"
    stop_id: int | None = None  # the stop id that ended it (finish "stop")


def check(model: PhantomModel, requests: list[Request]) -> None:
    """Raises ValueError for a request no batch can run: an empty prompt, too long a sequence, bad ids; any request
    of a model whose attention keeps no cache (DeepSeek-V4's compressed attention)."""
    if model.cfg.hc_mult:
        raise ValueError("DeepSeek-V4's compressed attention keeps no cache: generation is not supported (scoring, "
                         "which needs none, is)")
    for n, r in enumerate(requests):
        if not r.prompt:
            raise ValueError(f"request {n}: the prompt is empty")
        if r.max_new_tokens < 1:
            raise ValueError(f"request {n}: max_new_tokens must be >= 1, got {r.max_new_tokens}")
        if len(r.prompt) + r.max_new_tokens > model.cfg.max_seq_len:
            raise ValueError(f"request {n}: prompt ({len(r.prompt)} tokens) + max_new_tokens ({r.max_new_tokens}) "
                             f"exceeds the model's max_seq_len {model.cfg.max_seq_len}; shorten the prompt or ask "
                             f"for fewer tokens")
        if min(r.prompt) < 0 or max(r.prompt) >= model.cfg.vocab_size:
            raise ValueError(f"request {n}: token ids must be in [0, {model.cfg.vocab_size})")
        if model.cfg.index_topk and len(r.prompt) + r.max_new_tokens > model.cfg.index_topk:
            raise ValueError(f"request {n}: prompt + max_new_tokens ({len(r.prompt) + r.max_new_tokens}) exceeds "
                             f"index_topk ({model.cfg.index_topk}): generating past DeepSeek Sparse Attention's top-k "
                             f"needs its indexer's key cache, which is not kept")


def cache_bytes(model: PhantomModel, max_len: int) -> int:
    """Bytes of one sequence's cache over every block for up to max_len tokens."""
    return sum(KVCache.nbytes(model.cfg, 1, max_len, model.dtype, i) for i in range(model.cfg.n_layers))


def sequence_bytes(model: PhantomModel, requests: list[Request]) -> int:
    """Memory one sequence of these requests needs at most: its cache over every block, and a block's working
    set over the longest prompt in the prefill (the head sees one token a sequence)."""
    cfg, size = model.cfg, model.dtype.itemsize
    prompt = max(len(r.prompt) for r in requests)
    longest = max(len(r.prompt) + r.max_new_tokens for r in requests)
    return cache_bytes(model, longest) + prompt * (4 * cfg.dim + 3 * cfg.token_hidden_dim) * size


def auto_batch_size(model: PhantomModel, requests: list[Request], free: int | None = None) -> int:
    """The most sequences whose sequence_bytes fit in CACHE_SHARE of the memory free on the device (the host's
    on a CPU; or `free` bytes), at most MAX_BATCH and the number of requests."""
    if not requests:
        return 1
    if free is None:
        free = free_compute_bytes(model.device) or 0
    fit = int(free * CACHE_SHARE) // sequence_bytes(model, requests)
    return max(1, min(MAX_BATCH, len(requests), fit))


def _crosses_longrope(model: PhantomModel, r: Request) -> bool:
    s = model.cfg.rope_scaling
    return model.rope_long is not None and len(r.prompt) + r.max_new_tokens > s.original_max_seq_len


@torch.no_grad()
def generate_many(model: PhantomModel, requests: list[Request], tokenizer: Tokenizer | None = None,
                  batch_size: int | None = None, progress: bool = False,
                  cache_budget: int | None | str = "auto") -> list[Completion]:
    """Every request's completion, in input order: batches of `batch_size` sequences (None: auto_batch_size)
    of similar prompt lengths, each block read once per step of a batch. A tokenizer decodes the texts and
    finds stop strings (required for them). progress: a bar of new tokens per second. cache_budget: device
    bytes the caches may take, the rest in host memory (phantom.stream.kvcache); "auto": CACHE_SHARE of what
    a GPU has free, all of it elsewhere (a CPU's device is the host; `mps` shares it).

    Raises:
        ValueError: a request check() refuses, or stop strings without a tokenizer.
    """
    check(model, requests)
    if tokenizer is None and any(r.stop_strings for r in requests):
        raise ValueError("stop strings need a tokenizer to find them")
    batch_size = batch_size or auto_batch_size(model, requests)
    order = sorted(range(len(requests)), key=lambda n: -len(requests[n].prompt))  # little padding in a batch
    alone = [n for n in order if _crosses_longrope(model, requests[n])]
    together = [n for n in order if not _crosses_longrope(model, requests[n])]
    batches = [together[i:i + batch_size] for i in range(0, len(together), batch_size)] + [[n] for n in alone]
    out: list[Completion | None] = [None] * len(requests)
    with tqdm(total=sum(r.max_new_tokens for r in requests), unit="tok", disable=not progress,
              desc="generate", dynamic_ncols=True) as bar:
        for batch in batches:
            for n, completion in zip(batch, run_batch(model, [requests[n] for n in batch], tokenizer, bar,
                                                      cache_budget)):
                out[n] = completion
    return out


def run_batch(model: PhantomModel, requests: list[Request], tokenizer: Tokenizer | None = None,
              bar: tqdm | None = None, cache_budget: int | None | str = "auto") -> list[Completion]:
    """One batch of requests to the end: the prefill of every prompt, then one token per live sequence a step."""
    cfg, device = model.cfg, model.device
    B, P = len(requests), max(len(r.prompt) for r in requests)
    max_len = max(len(r.prompt) + r.max_new_tokens for r in requests)
    pads = torch.tensor([P - len(r.prompt) for r in requests])
    tokens = torch.tensor([[0] * (P - len(r.prompt)) + list(r.prompt) for r in requests])
    if cache_budget == "auto":
        free = free_device_bytes(device) if device.type == "cuda" else None
        cache_budget = None if free is None else int(free * CACHE_SHARE)
    caches = CacheSet(cfg, B, max_len, device, model.dtype, cache_budget)
    gens = [torch.Generator().manual_seed(r.seed) for r in requests]
    done = [Completion() for _ in requests]
    live, pos = list(range(B)), 0  # the requests still running, in the caches' row order; the next cache column
    while live:
        if B == 1 and _short_keys_cached(model, pos, tokens.shape[1]):  # Phi-3: once past the original context
            tokens, pos = torch.tensor([requests[0].prompt + done[0].ids]), 0
        logits = next_logits(model, tokens, caches, pos, pads)
        pos += tokens.shape[1]
        picked = pick(logits, [requests[n].sampling for n in live], [gens[n] for n in live])
        kept = [j for j, n in enumerate(live) if not _advance(requests[n], done[n], int(picked[j]), tokenizer)]
        if bar is not None:  # a sequence that ends early takes its tokens off the bar's total
            bar.total -= sum(requests[n].max_new_tokens - len(done[n].ids) - (done[n].finish == "stop")
                             for j, n in enumerate(live) if j not in kept)
            bar.update(len(live))
        if not kept:
            break
        if len(kept) < len(live):
            caches.keep(torch.tensor(kept, dtype=torch.long, device=device))
            pads, live = pads[kept], [live[j] for j in kept]
        tokens = picked[kept][:, None].cpu()
    for r, c in zip(requests, done):
        if tokenizer is not None and c.text is None:
            c.text = tokenizer.decode(c.ids)
    return done


def _advance(request: Request, c: Completion, token: int, tokenizer: Tokenizer | None) -> bool:
    """Adds token to the completion; True where that ends it."""
    if token in request.stop_ids:
        c.finish, c.stop_id = "stop", token
        return True
    c.ids.append(token)
    if request.stop_strings:
        text = tokenizer.decode(c.ids)
        cut = min((i for i in (text.find(s) for s in request.stop_strings) if i >= 0), default=-1)
        if cut >= 0:
            c.text, c.finish = text[:cut], "stop_string"
            return True
    return len(c.ids) >= request.max_new_tokens


def _short_keys_cached(model: PhantomModel, pos: int, n_new: int) -> bool:
    """Whether the cache holds keys turned by longrope's short factors (positions < pos, all within its
    original context) while the next tokens reach past it: transformers' Phi-3 then computes the whole
    sequence again with the long factors, once (its prepare_inputs_for_generation), and so does this."""
    s = model.cfg.rope_scaling
    return model.rope_long is not None and 0 < pos <= s.original_max_seq_len < pos + n_new


def next_logits(model: PhantomModel, tokens: torch.Tensor, caches: CacheSet | list[KVCache], pos: int,
                pads: torch.Tensor | None = None) -> torch.Tensor:
    """Logits (B, vocab) after tokens (B, T) written at cache columns pos.., appending their keys and values
    (or states) to caches; pads (B,): each row's left pads (its positions start after them)."""
    B, T = tokens.shape
    h = model.embed(tokens)
    table = model.rope_for(pos + T)
    if pads is None or not bool(pads.any()):
        rope, mask = table[pos:pos + T], None
    else:
        rope, mask = padded_layout(table, pads.to(model.device), pos, T)
    with torch.autocast(**model.autocast_args()):
        h = model.blocks(h, rope, caches=caches, start_pos=pos, mask=mask)
        return model.logits(h[:, -1])


def padded_layout(table: torch.Tensor, pads: torch.Tensor, pos: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE rows (B, T, ..) and mask (B, 1, T, pos + T) of left-padded rows at cache columns pos..pos+T-1:
    a row's positions count from its first real token; a real query sees the real keys up to itself, a pad
    query only itself (a finite softmax, a value nothing reads)."""
    cols = torch.arange(pos, pos + T, device=pads.device)
    keys = torch.arange(pos + T, device=pads.device)
    rope = table[(cols[None, :] - pads[:, None]).clamp(min=0)]
    real = keys[None, None, :] >= pads[:, None, None]  # (B, 1, S)
    seen = (keys[None, :] <= cols[:, None])[None] & real | (keys[None, :] == cols[:, None])[None]
    return rope, seen[:, None]


def pick(logits: torch.Tensor, sampling: list[Sampling], gens: list[torch.Generator]) -> torch.Tensor:
    """(B,) next ids: row b's argmax, or its draw from its own generator (so a row's draws do not depend on
    the others in its batch)."""
    out = logits.argmax(-1).cpu()
    for b, (s, gen) in enumerate(zip(sampling, gens)):
        if s.temperature > 0:
            out[b] = sample(logits[b:b + 1], s.temperature, s.top_k, gen, s.top_p)[0]
    return out


def sample(logits: torch.Tensor, temperature: float, top_k: int | None, gen: torch.Generator,
           top_p: float = 1.0) -> torch.Tensor:
    """(B,) token ids: argmax at temperature 0, else a draw from softmax(logits / T) over the top k, then
    over the smallest set of tokens whose probability reaches top_p (transformers' TopPLogitsWarper)."""
    if temperature <= 0:
        return logits.argmax(-1)
    logits = logits.float().cpu() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        ordered, idx = torch.sort(logits, descending=False)
        drop = ordered.softmax(-1).cumsum(-1) <= 1 - top_p
        drop[:, -1] = False  # the most likely token always stays
        logits = logits.masked_fill(drop.scatter(1, idx, drop), float("-inf"))
    return torch.multinomial(F.softmax(logits, -1), 1, generator=gen)[:, 0]


# -- one prompt, as text ------------------------------------------------------------------------------------------

def generate(model: PhantomModel, prompt: list[int], max_new_tokens: int = 64, temperature: float = 0.8,
             top_k: int | None = 200, eos_id: int | set[int] | None = None, seed: int = 0,
             top_p: float = 1.0) -> list[int]:
    """The new token ids of one prompt, ending with the eos_id (or any id of a set: a chat's end of turn)
    that stopped it, or after max_new_tokens.

    Raises:
        ValueError: an empty prompt, or prompt + max_new_tokens longer than the model's max_seq_len.
    """
    stop = eos_id if isinstance(eos_id, set) else {eos_id} - {None}
    request = Request(list(prompt), max_new_tokens, Sampling(temperature, top_k, top_p), seed, frozenset(stop))
    c = generate_many(model, [request], batch_size=1)[0]
    return c.ids + ([c.stop_id] if c.stop_id is not None else [])


def generate_text(model: PhantomModel, tokenizer: Tokenizer, prompt: str, **kwargs) -> Iterator[str]:
    """The completion of prompt as text pieces (kwargs: see generate)."""
    ids = tokenizer.encode(prompt, bos=True)
    stop = set(tokenizer.stop_ids)  # generation_config.json's eos_token_id, else EOS
    return _pieces(tokenizer, ids, generate(model, list(ids), eos_id=stop, **kwargs), stop)


def generate_chat(model: PhantomModel, tokenizer: Tokenizer, template: ChatTemplate, prompt: str,
                  system: str | None = None, **kwargs) -> Iterator[str]:
    """The assistant's answer to prompt, rendered through the chat template with its generation prompt,
    as text pieces; it ends at the template's end of turn (kwargs: see generate)."""
    ids = prompt_ids(tokenizer, template, prompt, system)
    stop = end_of_turn_ids(tokenizer, template)
    return _pieces(tokenizer, ids, generate(model, list(ids), eos_id=stop, **kwargs), stop)


def _pieces(tokenizer: Tokenizer, ids: list[int], tokens, stop: set[int] | None = None) -> Iterator[str]:
    stop = stop if stop is not None else set(tokenizer.stop_ids)
    text = tokenizer.decode(ids)
    for token in tokens:
        if token in stop:
            return
        ids.append(token)
        new = tokenizer.decode(ids)  # decode prompt + completion: pieces join with the right spacing
        yield new[len(text):]
        text = new
