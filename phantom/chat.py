"""Chat data the way the model was trained: its own Jinja chat template, evaluated as transformers
evaluates it (sandboxed, trim/lstrip blocks, raise_exception, tojson, {% generation %}), records of
the common shapes turned into messages, and a conversation's token ids with loss labels on what the
assistant says. Imports only the tokenizer.
"""
from __future__ import annotations

import bisect
import functools
import hashlib
import json
import re
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from phantom.tokenizer import Tokenizer

IGNORE_INDEX = -100
TRAIN_ON = ("all", "last", "prompt-too")  # every assistant turn, the last one, or every token
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")

# The tiny model's own template (its 64-piece tokenizer knows the letters used here; text is one line, as
# the tokenizer folds line breaks into spaces). The assistant's words, the space before them (sentencepiece
# drops a prompt's trailing space, so the model writes it) and the end of turn (EOS) carry loss.
TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}Note: {{ message['content'] }} "
    "{% elif message['role'] == 'user' %}Reader: {{ message['content'] }} "
    "{% elif message['role'] == 'assistant' %}Writer:{% generation %} {{ message['content'] }}{{ eos_token }}"
    "{% endgeneration %}"
    "{% else %}{{ raise_exception('unknown role ' + message['role'] + ': use system, user or assistant') }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}Writer:{% endif %}")


@functools.lru_cache(maxsize=16)
def compile_template(source: str):
    """The template compiled in the environment transformers' apply_chat_template uses."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTracker(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}`: records the character span its body renders to."""
        tags = {"generation"}

        def __init__(self, environment):
            super().__init__(environment)
            environment.extend(track_generation=self.track)
            self.blocks = self.spans = None

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

        def _mark(self, caller):
            text = caller()
            if self.spans is not None:
                start = sum(map(len, self.blocks))
                self.spans.append((start, start + len(text)))
            return text

        @contextmanager
        def track(self, blocks: list, spans: list):
            self.blocks, self.spans = blocks, spans
            try:
                yield
            finally:
                self.blocks = self.spans = None

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTracker, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.now().strftime(f))
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ValueError(f"the chat template does not parse (line {e.lineno}: {e.message})") from None


@dataclass(frozen=True)
class ChatTemplate:
    """A chat template and the special-token strings it is rendered with (bos_token, eos_token, ...).

    Attributes:
        source: the Jinja text.
        special: {name: token text} passed to the template, as transformers passes special_tokens_map.
        origin: where it came from (for messages).
    """

    source: str
    special: dict
    origin: str = "chat template"

    @property
    def has_generation(self) -> bool:
        return GENERATION_TAG.search(self.source) is not None

    @property
    def fingerprint(self) -> str:
        ident = json.dumps([self.source, sorted(self.special.items())])
        return hashlib.sha256(ident.encode()).hexdigest()[:16]

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> tuple[str, list[tuple[int, int]]]:
        """The rendered text and the character spans of its {% generation %} blocks.

        Raises:
            ValueError: the template raised (raise_exception, or an error on this conversation).
        """
        import jinja2
        compiled = compile_template(self.source)
        blocks, spans = [], []
        try:
            with compiled.environment.track_generation(blocks, spans):
                for block in compiled.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                               tools=None, documents=None, **self.special):
                    blocks.append(block)
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"the chat template refused it: {e.message or e}") from None
        except (TypeError, KeyError, AttributeError, IndexError, ValueError) as e:
            raise ValueError(f"the chat template failed on it ({type(e).__name__}: {e})") from None
        return "".join(blocks), spans


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    return value.get("content") if isinstance(value, dict) else value


def read_template(folder: Path | str, tok: Tokenizer | None = None, path: Path | str | None = None
                  ) -> ChatTemplate | None:
    """The chat template of a model folder (a store, or a Hugging Face folder), or of the file `path`.

    Looks for chat_template.jinja, then tokenizer_config.json's "chat_template" (a string, or a list of
    named templates: "default"), then chat_template.json. Special tokens come from tokenizer_config.json,
    else from the tokenizer. None: the folder has no template.

    Raises:
        ValueError: a template file that cannot be read or parsed.
    """
    folder = Path(folder)
    config = {}
    if (folder / "tokenizer_config.json").is_file():
        try:
            config = json.loads((folder / "tokenizer_config.json").read_text())
        except ValueError as e:
            raise ValueError(f"{folder / 'tokenizer_config.json'}: not valid JSON ({e})") from None
    special = {k: t for k in SPECIAL_KEYS if (t := _token_text(config.get(k))) is not None}
    if tok is not None:
        special.setdefault("bos_token", tok.bos_token)
        special.setdefault("eos_token", tok.eos_token)
    source, origin = _template_source(folder, config, path)
    if source is None:
        return None
    compile_template(source)  # a template that does not parse is refused now, not at the first record
    return ChatTemplate(source, {k: v for k, v in special.items() if v is not None}, origin)


def _template_source(folder: Path, config: dict, path) -> tuple[str | None, str]:
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"chat template {path} not found; pass a Jinja file to --chat-template")
        return path.read_text(encoding="utf-8"), str(path)
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8"), str(folder / "chat_template.jinja")
    source = config.get("chat_template")
    if source is None and (folder / "chat_template.json").is_file():
        source = json.loads((folder / "chat_template.json").read_text()).get("chat_template")
    if isinstance(source, list):  # named templates: the default one
        source = next((t.get("template") for t in source if t.get("name") == "default"), None)
    return source, str(folder / "tokenizer_config.json")


# -- records to messages ----------------------------------------------------------------------------

def to_messages(record: dict, fmt: str) -> list[dict]:
    """The conversation a record holds, as [{"role", "content"}] (OpenAI's messages).

    fmt: "chat" (messages), "sharegpt" (conversations of {"from": human/gpt/system, "value"}),
    "alpaca" (instruction, optional input, output) or "prompt" (prompt, response).
    """
    if fmt == "chat":
        messages = record["messages"]
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ValueError("messages must be a list of {\"role\", \"content\"} objects")
        for m in messages:
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"a message needs a role and a string content, got {sorted(m)}")
        return messages
    if fmt == "sharegpt":
        turns = record["conversations"]
        if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
            raise ValueError("conversations must be a list of {\"from\", \"value\"} objects")
        out = []
        for t in turns:  # {"from", "value"}, or the {"role", "content"} some ShareGPT exports write
            speaker, value = t.get("from", t.get("role")), t.get("value", t.get("content"))
            if speaker not in SHAREGPT_ROLES:
                raise ValueError(f"unknown ShareGPT speaker {speaker!r}; use {', '.join(SHAREGPT_ROLES)}")
            out.append({"role": SHAREGPT_ROLES[speaker], "content": value})
        return to_messages({"messages": out}, "chat")
    if fmt == "alpaca":
        user = record["instruction"] + (f"\n\n{record['input']}" if record.get("input") else "")
        return to_messages({"messages": [{"role": "user", "content": user},
                                         {"role": "assistant", "content": record["output"]}]}, "chat")
    if fmt == "prompt":
        return to_messages({"messages": [{"role": "user", "content": record["prompt"]},
                                         {"role": "assistant", "content": record["response"]}]}, "chat")
    raise ValueError(f"{fmt} records are not conversations")


# -- a conversation to ids and labels ---------------------------------------------------------------

def assistant_spans(template: ChatTemplate, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of the assistant's turns.

    With {% generation %} markers the spans are theirs (as transformers' return_assistant_tokens_mask);
    else each assistant turn i spans from the end of messages[:i] rendered with the generation prompt
    to the end of messages[:i+1] (its content and end of turn), where each agrees with the whole.
    """
    text, spans = template.render(messages)
    if template.has_generation:
        return text, spans
    spans = []
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            before = template.render(messages[:i], add_generation_prompt=True)[0]
            through = template.render(messages[:i + 1])[0]
            start, end = common_prefix(before, text), common_prefix(through, text)
            if end > start:
                spans.append((start, end))
    return text, spans


def common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = next((k for k in range(n) if a[k] != b[k]), n)
    return i


def token_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[bool]:
    """Tokens covering the spans, as transformers maps generation indices with char_to_token."""
    starts = [s for s, _ in offsets]
    mask = [False] * len(offsets)

    def char_to_token(c: int) -> int | None:
        k = bisect.bisect_right(starts, c) - 1
        while k >= 0 and offsets[k][0] <= c:
            if c < offsets[k][1]:
                return k
            k -= 1
        return None

    for a, b in spans:
        first, last = char_to_token(a), char_to_token(b - 1)
        if first is None:
            break
        for t in range(first, last + 1 if last else len(mask)):
            mask[t] = True
    return mask


def encode_chat(tok: Tokenizer, template: ChatTemplate, messages: list[dict], train_on: str = "all"
                ) -> tuple[list[int], list[int]]:
    """Token ids and labels (-100 where nothing is trained) of one conversation through its template.

    train_on: "all" assistant turns, the "last" one, or "prompt-too" (every token).

    Raises:
        ValueError: no assistant turn, or the template refused the conversation.
    """
    if train_on not in TRAIN_ON:
        raise ValueError(f"--train-on must be one of {', '.join(TRAIN_ON)}, not {train_on!r}")
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError("a chat needs at least one assistant message to train on")
    text, spans = assistant_spans(template, messages)
    ids, offsets = tok.encode_rendered(text)
    if train_on == "prompt-too":
        trained = [True] * len(ids)
    else:
        trained = token_mask(offsets, spans[-1:] if train_on == "last" else spans)
    labels = [i if t else IGNORE_INDEX for i, t in zip(ids, trained)]
    if labels:
        labels[0] = IGNORE_INDEX  # the first token is never a target
    return ids, labels


def prompt_ids(tok: Tokenizer, template: ChatTemplate, prompt: str, system: str | None = None) -> list[int]:
    """The ids of a one-question chat, ending with the template's generation prompt (generate --chat)."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    return tok.encode_rendered(template.render(messages, add_generation_prompt=True)[0])[0]


def end_of_turn_ids(tok: Tokenizer, template: ChatTemplate) -> set[int]:
    """The token the template writes after an assistant's words (its end of turn), and EOS."""
    probe = "Fine."
    text, _ = template.render([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": probe}])
    at = text.rfind(probe) + len(probe)
    ids, offsets = tok.encode_rendered(text)
    after = [i for i, (s, _) in zip(ids, offsets) if s >= at]
    eos = template.special.get("eos_token")
    eos_ids = tok.encode_rendered(eos)[0] if eos else [tok.eos_id]
    return {*after[:1], *eos_ids[:1]}
