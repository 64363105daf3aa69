"""`PhantomLM`: a phantom model as lm-evaluation-harness's model "phantom" (`@register_model`), so lm-eval's own
tasks, evaluator and output files run on a model whose blocks stream from disk or host RAM.

It mirrors lm-eval's `hf` model (HFLM) request for request: texts are tokenized as HFLM tokenizes them
(BOS added unless the text starts with it, special-token text read as the token), contexts cut to the
model's context as HFLM cuts them, rolling documents in windows of the config's max_position_embeddings
with BOS (else EOS) as the first window's prefix, generations stopped at EOS and the `until` strings and
cut at each of them. What differs is how the work is run: every log-likelihood request of a wave goes
through a block while it is loaded once (phantom.train.score), and generations run in batches that read
each block once per step (phantom.model.generate.generate_many). lm-eval 0.4.13's `hf` model scores a
continuation at the wrong positions when two requests share every token but the last and split context
from continuation differently (its logits cache); that is not reproduced here.

    import lm_eval, phantom.train.lmeval as pl
    with pl.PhantomLM("weights/7B", adapter="runs/7b/adapter") as lm:
        results = lm_eval.simple_evaluate(model=lm, tasks=["hellaswag"])
"""
from __future__ import annotations

import logging
from pathlib import Path

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

from phantom.data.tokenizer import Tokenizer
from phantom.model.adapterfiles import read_adapter_config
from phantom.model.generate import Request, Sampling, generate_many
from phantom.train import cli
from phantom.train import load as L
from phantom.train import score as S

log = logging.getLogger(__name__)

# what PhantomLM takes beside its named arguments (lm-eval's model_args spell them so)
OPTIONS = {"max_length": None, "max_gen_toks": 256, "add_bos_token": None, "prefix_token_id": None,
           "prefetch": None, "wave_bytes": None, "seed": 1234, "max_batch_size": None}


@register_model("phantom")
class PhantomLM(TemplateLM):
    """A PhantomModel (loaded here from `pretrained`, or one given) and its tokenizer, as lm-eval's model.

    Args:
        pretrained: a preset name, a store folder, a Hub id in the local cache, or a PhantomModel (kept open:
            its owner closes it).
        adapter: a LoRA adapter folder (peft's layout) applied to a model loaded here.
        tokenizer: the tokenizer file, or a phantom Tokenizer (default: the store's).
        batch_size: rows of a scoring micro-batch and sequences of a generation batch; "auto": by memory.
        device, dtype, offload: as generate.py's flags (a model loaded here).
        **options: max_length (the model's context, default max_position_embeddings), max_gen_toks (256),
            add_bos_token, prefix_token_id (HFLM's), prefetch, wave_bytes (phantom.train.score), seed (of
            sampled generations), max_batch_size (accepted, unused).

    Raises:
        ValueError: an option it does not take, or what phantom.load refuses. FileNotFoundError: no model,
            adapter or tokenizer there.
    """

    def __init__(self, pretrained="tiny", adapter: str | None = None, tokenizer=None, batch_size: int | str = 1,
                 device: str = "auto", dtype: str = "auto", offload: str | None = None, **options):
        super().__init__()
        if unknown := sorted(set(options) - set(OPTIONS)):
            raise ValueError(f"the phantom model takes no {', '.join(unknown)}; it takes pretrained, adapter, "
                             f"tokenizer, batch_size, device, dtype, offload, {', '.join(OPTIONS)}")
        self.options = {**OPTIONS, **{k: v for k, v in options.items() if v is not None}}
        self.owned = not hasattr(pretrained, "backend")
        self.model = open_model(pretrained, adapter, device, dtype, offload, self.options["prefetch"]) \
            if self.owned else pretrained
        try:
            self.tok = tokenizer if isinstance(tokenizer, Tokenizer) else open_tokenizer(self.model, tokenizer)
        except BaseException:
            self.close()
            raise
        self.batch = None if str(batch_size).startswith("auto") else int(batch_size)
        if self.max_length > self.model.cfg.max_seq_len:
            self.close()
            raise ValueError(f"max_length {self.max_length} exceeds the model's context ({self.model.cfg.max_seq_len})")
        self._device = self.model.device

    # -- what lm-eval asks of a model ---------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        """EOS (HFLM's end of text), else the first generation stop id."""
        return self.tok.eos_id if self.tok.eos_id is not None else self.tok.stop_ids[0]

    @property
    def prefix_token_id(self) -> int:
        """What conditions a text's first token: the prefix_token_id asked for, BOS, else EOS."""
        for i in (self.options["prefix_token_id"], self.tok.bos_id):
            if i is not None:
                return int(i)
        return self.eot_token_id

    @property
    def max_length(self) -> int:
        return int(self.options["max_length"] or self.model.cfg.max_seq_len)

    @property
    def max_gen_toks(self) -> int:
        return int(self.options["max_gen_toks"])

    @property
    def tokenizer_name(self) -> str:
        return str(self.tok.path)

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """HFLM's: with the tokenizer's BOS (and what else its post-processor adds) unless add_special_tokens
        is False, or None and the text starts with BOS's text; special-token text is its token."""
        add = add_special_tokens if add_special_tokens is not None else self.options["add_bos_token"]
        if add_special_tokens is None and string.startswith(self.tok.decode([self.prefix_token_id], specials=True)):
            add = False
        ids = self.tok.encode_rendered(string)[0]
        return self.tok.prefix + ids + self.tok.suffix if add is None or add else ids

    def tok_decode(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(tokens), specials=not skip_special_tokens)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """lm-eval's tokenized (strings, context ids, continuation ids) requests, all scored together."""
        long = sum(len(c) + len(x) > self.max_length + 1 for _, c, x in requests)
        if long:
            log.warning("%d requests are longer than the model's context (%d tokens): their contexts are cut from "
                        "the left", long, self.max_length)
        results = self._score([(c, x) for _, c, x in requests], disable_tqdm)
        for (strings, _, _), answer in zip(requests, results):
            if strings is not None:
                self.cache_hook.add_partial("loglikelihood", strings, answer)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text's log-likelihood over disjoint windows of max_length tokens (HFLM's windows)."""
        texts = [req.args[0] for req in requests]
        windows = [S.rolling_windows(self.tok_encode(t), self.prefix_token_id, self.max_length) for t in texts]
        scores = iter(self._score([w for ws in windows for w in ws], disable_tqdm))
        totals = [sum(next(scores)[0] for _ in ws) for ws in windows]
        for text, total in zip(texts, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each (context, gen_kwargs) continued until EOS, a stop string or max_gen_toks, cut at the stop
        strings, as HFLM does; all of them in batches (each block read once a step for every sequence)."""
        asks = [self._request(n, *req.args) for n, req in enumerate(requests)]
        with S.evaluating(self.model):
            done = generate_many(self.model, [r for r, _ in asks], self.tok, self.batch, progress=not disable_tqdm)
        out = []
        for req, (_, until), c in zip(requests, asks, done):
            text = self.tok.decode(c.ids + ([c.stop_id] if c.stop_id is not None else []))  # HF keeps a stop id
            text = postprocess_generated_text(text, until, None)
            self.cache_hook.add_partial("generate_until", req.args, text)
            out.append(text)
        return out

    # -- the work ----------------------------------------------------------------------------------

    def _score(self, pairs: list, disable_tqdm: bool) -> list[tuple[float, bool]]:
        return S.score(self.model, pairs, self.batch, self.options["wave_bytes"], not disable_tqdm, self.max_length)

    def _request(self, n: int, context: str, gen_kwargs: dict) -> tuple[Request, list[str]]:
        """The generation request of one (context, gen_kwargs) and its stop strings (EOS's text among them)."""
        kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
        until = handle_stop_sequences(kwargs.pop("until", None), eos=self.tok_decode([self.eot_token_id], False))
        new = int(kwargs.pop("max_gen_toks"))
        if new >= self.max_length:
            raise ValueError(f"max_gen_toks {new} leaves no room for a prompt in the model's context "
                             f"({self.max_length} tokens)")
        prompt = self.tok_encode(context)[-(self.max_length - new):]  # HFLM's left_truncate_len
        temperature = float(kwargs.get("temperature") or 0.0)
        sampling = Sampling(temperature, kwargs.get("top_k", 50), float(kwargs.get("top_p") or 1.0)) \
            if kwargs.get("do_sample") and temperature > 0 else Sampling()  # top_k: transformers' default
        stops = frozenset(self.tok.stop_ids) | {self.eot_token_id}
        return Request(prompt, new, sampling, self.options["seed"] + n, stops, tuple(u for u in until if u)), until

    def close(self) -> None:
        """Close the model if it was loaded here."""
        if self.owned and getattr(self, "model", None) is not None:
            self.model.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def open_model(pretrained, adapter: str | None, device: str, dtype: str, offload: str | None, prefetch=None):
    """phantom.load of a model (and its adapter) for evaluation: no LoRA without an adapter."""
    lora = read_adapter_config(Path(adapter)) if adapter else None
    device = L.resolve_device(device)
    knobs = {k: v for k, v in (("offload", offload), ("prefetch", prefetch)) if v is not None}
    model = L.load(pretrained, device=device, dtype=cli.resolve_dtype(dtype, device), lora=lora, **knobs)
    if adapter:
        try:
            model.load_adapter(Path(adapter))
        except BaseException:
            model.close()
            raise
    return model


def open_tokenizer(model, path) -> Tokenizer:
    path = path or model.store.tokenizer_path
    if path is None:
        raise FileNotFoundError(f"{model.store.path} has no tokenizer; pass tokenizer=FILE")
    return Tokenizer(path)
