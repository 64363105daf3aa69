"""Sampling text from a PhantomModel with a KV cache: the prompt is run once, then one token per step.

In streamed modes every block is read once per step (the cache keeps keys and values, not weights),
so this is for checking a finetune by eye, not for serving.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F

from phantom.arch.ops import KVCache
from phantom.data.chat import ChatTemplate, end_of_turn_ids, prompt_ids
from phantom.data.tokenizer import Tokenizer
from phantom.model.phantom_model import PhantomModel


def next_logits(model: PhantomModel, tokens: torch.Tensor, caches: list[KVCache], pos: int) -> torch.Tensor:
    """Logits (B, vocab) after tokens (B, T) at positions pos.., appending their keys/values to caches."""
    h = model.embed(tokens)  # (B, T, dim)
    rope = model.rope_for(pos + tokens.shape[1])[pos:pos + tokens.shape[1]]
    with torch.autocast(**model.autocast_args()):
        h = model.blocks(h, rope, caches=caches, start_pos=pos)
        return model.logits(h[:, -1])


def short_keys_cached(model: PhantomModel, pos: int, n_new: int) -> bool:
    """Whether the cache holds keys turned by longrope's short factors (positions < pos, all within its
    original context) while the next tokens reach past it: transformers' Phi-3 then computes the whole
    sequence again with the long factors, once (its prepare_inputs_for_generation), and so does this."""
    s = model.cfg.rope_scaling
    return model.rope_long is not None and 0 < pos <= s.original_max_seq_len < pos + n_new


def sample(logits: torch.Tensor, temperature: float, top_k: int | None, gen: torch.Generator) -> torch.Tensor:
    """(B,) token ids: argmax at temperature 0, else a draw from softmax(logits / T) over the top k."""
    if temperature <= 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(F.softmax(logits, -1).cpu(), 1, generator=gen)[:, 0].to(logits.device)


def generate(model: PhantomModel, prompt: list[int], max_new_tokens: int = 64, temperature: float = 0.8,
             top_k: int | None = 200, eos_id: int | set[int] | None = None, seed: int = 0) -> Iterator[int]:
    """An iterator of new token ids, one per step, stopping at eos_id (or any id of a set: a chat's end
    of turn) or after max_new_tokens.

    Raises:
        ValueError: an empty prompt, or prompt + max_new_tokens longer than the model's max_seq_len.
    """
    cfg = model.cfg
    if not prompt:
        raise ValueError("the prompt is empty")
    if any(cfg.linear(i) for i in range(cfg.n_layers)):
        raise ValueError("generation is not supported for models with linear-attention (Gated DeltaNet) layers: "
                         "phantom keeps no conv or recurrent state between steps; export the model (--format hf) "
                         "and generate with transformers")
    total = len(prompt) + max_new_tokens
    if total > cfg.max_seq_len:
        raise ValueError(f"prompt ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's "
                         f"max_seq_len {cfg.max_seq_len}; shorten the prompt or ask for fewer tokens")
    stop = eos_id if isinstance(eos_id, set) else {eos_id}
    return _sample_loop(model, prompt, max_new_tokens, temperature, top_k, stop, seed)  # checked now, not lazily


@torch.no_grad()
def _sample_loop(model, prompt, max_new_tokens, temperature, top_k, stop, seed) -> Iterator[int]:
    caches = [KVCache.empty(model.cfg, 1, len(prompt) + max_new_tokens, model.device, model.dtype)
              for _ in range(model.cfg.n_layers)]
    gen = torch.Generator().manual_seed(seed)
    tokens, pos, seen = torch.tensor([prompt], device=model.device), 0, list(prompt)
    for _ in range(max_new_tokens):
        if short_keys_cached(model, pos, tokens.shape[1]):
            tokens, pos = torch.tensor([seen], device=model.device), 0
        logits = next_logits(model, tokens, caches, pos)
        pos += tokens.shape[1]
        tokens = sample(logits, temperature, top_k, gen)[:, None]  # (1, 1)
        token = int(tokens[0, 0])
        seen.append(token)
        yield token
        if token in stop:
            return


def generate_text(model: PhantomModel, tokenizer: Tokenizer, prompt: str, **kwargs) -> Iterator[str]:
    """The completion of prompt as text pieces, yielded as they are sampled (kwargs: see generate)."""
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


def _pieces(tokenizer: Tokenizer, ids: list[int], tokens: Iterator[int], stop: set[int] | None = None
            ) -> Iterator[str]:
    stop = stop if stop is not None else set(tokenizer.stop_ids)
    text = tokenizer.decode(ids)
    for token in tokens:
        if token in stop:
            return
        ids.append(token)
        new = tokenizer.decode(ids)  # decode prompt + completion: pieces join with the right spacing
        yield new[len(text):]
        text = new
