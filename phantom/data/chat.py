"""Chat data the way the model was trained: its own Jinja chat template, evaluated as transformers
evaluates it (sandboxed, trim/lstrip blocks, raise_exception, tojson, {% generation %}), records of
the common shapes turned into messages, and a conversation's token ids with loss labels on what the
assistant says. Imports only the tokenizer.
"""
from __future__ import annotations

import functools
import hashlib
import json
import re
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np

from phantom.base import safejson
from phantom.data.special_tokens import IGNORE_INDEX
from phantom.data.tokenizer import Tokenizer

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


@functools.lru_cache(maxsize=1)
def _sandbox():
    """transformers' sandbox (ImmutableSandboxedEnvironment), its verdict on an attribute kept per (type,
    name): every one of its checks (a private name, an interpreter internal, a method that mutates a known
    container) depends on the object's type alone. A long conversation asks thousands of times."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Sandbox(ImmutableSandboxedEnvironment):
        def __init__(self, **kw):
            super().__init__(**kw)
            self.verdicts = {}

        def is_safe_attribute(self, obj, attr, value):
            key = (type(obj), attr)
            if key not in self.verdicts:
                self.verdicts[key] = super().is_safe_attribute(obj, attr, value)
            return self.verdicts[key]

    return Sandbox


@functools.lru_cache(maxsize=16)
def compile_template(source: str):
    """The template compiled in the environment transformers' apply_chat_template uses."""
    import jinja2
    import jinja2.ext

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
                start = self.blocks.length
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

    env = _sandbox()(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTracker, jinja2.ext.loopcontrols])
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
        blocks, spans = _Blocks(), []
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


class _Blocks(list):
    """The rendered pieces so far and their total length (a {% generation %} block's start, in O(1))."""

    length = 0

    def append(self, piece: str) -> None:
        super().append(piece)
        self.length += len(piece)


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
        config = safejson.load(folder / "tokenizer_config.json")
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
        source = safejson.load(folder / "chat_template.json").get("chat_template")
    if isinstance(source, list):  # named templates: the default one
        source = next((t.get("template") for t in source if t.get("name") == "default"), None)
    return source, str(folder / "tokenizer_config.json")


# -- records to messages ----------------------------------------------------------------------------

def _refuse_parts(parts: list) -> None:
    """A content given as parts (OpenAI's multimodal messages): an image, audio or video part is refused as
    such (phantom trains a checkpoint's text model; a vision-language checkpoint's vision tower is kept as
    shipped, untrained), text parts asked as one string (templates render a list of parts in their own way)."""
    kinds = sorted({str(part.get("type")) if isinstance(part, dict) else type(part).__name__ for part in parts})
    if other := [k for k in kinds if k != "text"]:
        raise ValueError(f"a message has {', '.join(other)} parts: phantom trains the text model only (a "
                         f"vision-language checkpoint's vision tower is kept as shipped, not trained); give "
                         f"text-only rows")
    raise ValueError("a message's content is a list of text parts: give it as one string")


def to_messages(record: dict, fmt: str) -> list[dict]:
    """The conversation a record holds, as [{"role", "content"}] (OpenAI's messages).

    fmt: "chat" (messages), "sharegpt" (conversations of {"from": human/gpt/system, "value"}),
    "alpaca" (instruction, optional input, output) or "prompt" (prompt, response).
    """
    if fmt == "chat":
        messages = record["messages"]
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ValueError("messages must be a list of {\"role\", \"content\"} objects")
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]  # as transformers drops them
        for m in messages:
            if isinstance(m.get("content"), list):
                _refuse_parts(m["content"])
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

def assistant_spans(template: ChatTemplate, messages: list[dict]) -> tuple[str, list[tuple[int, int]], bool]:
    """The rendered conversation, the character spans of what the assistant says, and whether those
    spans are the template's own {% generation %} blocks (which then decide what is trained).

    Without generation blocks the conversation is rendered once more with each assistant content
    replaced by a unique marker; the text between the markers must then equal the real rendering
    around each content (as written, or with the whitespace the template trims), which gives each
    content's span exactly, whatever the template does with the other turns.

    Raises:
        ValueError: the template refused the conversation, or renders it so that the assistant's
            words cannot be located exactly (it rewrites them, or its text depends on them).
    """
    text, spans = template.render(messages)
    if template.has_generation:
        return text, spans, True
    nonce = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:12]
    marks = {k: f"PHANTOM{nonce}M{k}E" for k, m in enumerate(messages) if m["role"] == "assistant"}
    marked = template.render([{**m, "content": marks[k]} if k in marks else m for k, m in enumerate(messages)])[0]
    found = list(re.finditer(f"PHANTOM{nonce}M(\\d+)E", marked))
    literals = [marked[a.end() if a else 0:b.start() if b else len(marked)]
                for a, b in zip([None, *found], [*found, None])]
    if not text.startswith(literals[0]):
        raise _unmapped(template, "the text before the first answer differs")
    at, spans = len(literals[0]), []
    for mark, after in zip(found, literals[1:]):
        content = messages[int(mark.group(1))]["content"]
        for shown in dict.fromkeys((content, content.strip(), content.lstrip(), content.rstrip(), content.strip("\n"),
                                    content.lstrip("\n"), content.rstrip("\n"))):  # as written, or trimmed
            if text.startswith(shown + after, at):
                spans.append((at, at + len(shown)))
                at += len(shown) + len(after)
                break
        else:
            raise _unmapped(template, f"message {int(mark.group(1))}'s words do not appear as written")
    if at != len(text):
        raise _unmapped(template, "the rendering differs after the last answer")
    return text, spans, False


def _unmapped(template: ChatTemplate, why: str) -> ValueError:
    return ValueError(f"the chat template {template.origin} cannot be mapped exactly ({why}); phantom does not "
                      f"guess which tokens to train: add {{% generation %}} markers around the assistant's turns "
                      f"(--chat-template FILE)")


def with_end_of_turn(tok: Tokenizer, template: ChatTemplate, text: str, ids: np.ndarray, starts: np.ndarray,
                     ends: np.ndarray, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Each span carried through the template's end-of-turn token where one follows the content (past
    whitespace only): EOS, a generation stop id, or the special token the template writes after an
    answer. Not the newline or the next turn's header after it."""
    eot, out = end_of_turn_ids(tok, template), []
    after = np.searchsorted(starts, np.array([b for _, b in spans], starts.dtype)).tolist()  # one call: no casts
    for (a, b), k in zip(spans, after):
        while k < len(ids) and int(ids[k]) not in eot and not tok.is_special(int(ids[k])) \
                and not text[starts[k]:ends[k]].strip():
            k += 1
        out.append((a, max(b, int(ends[k])) if k < len(ids) and int(ids[k]) in eot else b))
    return out


def token_mask(offsets, spans: list[tuple[int, int]]) -> np.ndarray:
    """Tokens any of whose characters lies in a span, as transformers' return_assistant_tokens_mask marks
    them (char_to_token over the span). offsets: (start, end) pairs, or the arrays (starts, ends)."""
    starts, ends = offsets if isinstance(offsets, tuple) else np.array(offsets, np.int64).reshape(-1, 2).T
    spans = np.array([(a, b) for a, b in spans if b > a], ends.dtype).reshape(-1, 2)
    first = np.searchsorted(ends, spans[:, 0], "right")  # tokens ending after a span's start ...
    last = np.searchsorted(starts, spans[:, 1], "left")  # ... and starting before its end (offsets run left to right)
    mask = np.zeros(len(starts) + 1, np.int32)  # +1 at each run's first token, -1 past its last
    np.add.at(mask, first, 1)
    np.add.at(mask, last, -1)
    return (np.cumsum(mask[:-1]) > 0) & (ends > starts)


def encode_chat_arrays(tok: Tokenizer, template: ChatTemplate, messages: list[dict], train_on: str = "all"
                       ) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and labels (-100 where nothing is trained) of one conversation through its template, as
    int32 arrays (a long conversation stays compact).

    Trained: each assistant content and the end-of-turn token after it (see with_end_of_turn), or what
    the template's {% generation %} blocks enclose; a token is trained when any of its characters is.
    train_on: "all" assistant turns, the "last" one, or "prompt-too" (every token).

    Raises:
        ValueError: no assistant turn, or the template refused the conversation or cannot be mapped.
    """
    if train_on not in TRAIN_ON:
        raise ValueError(f"--train-on must be one of {', '.join(TRAIN_ON)}, not {train_on!r}")
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError("a chat needs at least one assistant message to train on")
    text, spans, marked = assistant_spans(template, messages)
    ids, starts, ends = tok.encode_arrays(text)
    if train_on == "prompt-too":
        trained = np.ones(len(ids), bool)
    else:
        if not marked:
            spans = with_end_of_turn(tok, template, text, ids, starts, ends, spans)
        trained = token_mask((starts, ends), spans[-1:] if train_on == "last" else spans)
    labels = np.where(trained, ids, IGNORE_INDEX).astype(np.int32)
    labels[:1] = IGNORE_INDEX  # the first token is never a target
    return ids, labels


def encode_chat(tok: Tokenizer, template: ChatTemplate, messages: list[dict], train_on: str = "all"
                ) -> tuple[list[int], list[int]]:
    """encode_chat_arrays as lists."""
    ids, labels = encode_chat_arrays(tok, template, messages, train_on)
    return ids.tolist(), labels.tolist()


def prompt_ids(tok: Tokenizer, template: ChatTemplate, prompt: str, system: str | None = None) -> list[int]:
    """The ids of a one-question chat, ending with the template's generation prompt (generate --chat)."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    return messages_ids(tok, template, messages)


def messages_ids(tok: Tokenizer, template: ChatTemplate, messages: list[dict]) -> list[int]:
    """The ids of a conversation for the assistant to answer: rendered with the template's generation prompt."""
    return list(tok.encode_rendered(template.render(messages, add_generation_prompt=True)[0])[0])


_END_OF_TURN: dict[tuple, frozenset] = {}


def end_of_turn_ids(tok: Tokenizer, template: ChatTemplate) -> set[int]:
    """The ids that end an assistant's turn: the special token the template writes right after an
    answer (in a conversation that goes on after it), EOS and the generation stop ids."""
    key = (tok.fingerprint, template.fingerprint)
    if key not in _END_OF_TURN:
        probe, after = "Fine.", []
        for tail in ([{"role": "user", "content": "Thanks"}], []):
            try:
                text, _ = template.render([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": probe},
                                           *tail])
            except ValueError:
                continue
            at = text.rfind(probe) + len(probe)
            ids, offsets = tok.encode_rendered(text)
            after = [i for i, (s, _) in zip(ids, offsets) if s >= at][:1]
            break
        _END_OF_TURN[key] = frozenset([i for i in after if tok.is_special(i)] + tok.stop_ids +
                                      ([tok.eos_id] if tok.eos_id is not None else []))
    return set(_END_OF_TURN[key])
