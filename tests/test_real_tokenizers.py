"""phantom's Tokenizer and chat masks against transformers on the tokenizers and chat templates published
with Llama-2, Llama-3.1, Qwen3, Gemma-3 and gpt-oss (their tokenizer.json and tokenizer_config.json, fetched once
by conftest.real_tokenizer; gpt-oss's o200k vocabulary and its harmony chat_template.jinja, as llama.cpp keeps
it): ids of real strings, special-token and stop ids, chat ids of the common record
shapes, and assistant masks against return_assistant_tokens_mask on each template with {% generation %}
markers added around each answer and its end of turn (and the published template, unmarked, trains the
same tokens)."""
from __future__ import annotations

import functools
import json
import shutil

import pytest

from conftest import real_tokenizer
from phantom.data import chat
from phantom.data.special_tokens import SideFiles
from phantom.data.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

NAMES = ("llama2", "llama3_1", "qwen3", "gemma3", "gptoss")
CHAT_NAMES = ("llama3_1", "qwen3", "gemma3", "gptoss")  # Llama-2's files carry no chat template

BASE = [
    "Hello world", "Hello  world", " leading space", "trailing space ", "  two leading", "\n", "\n\n\n", "\t\tTabs\t",
    "   ", "a\r\nb\r\n", "line one\nline two\n\nline four", "ends with newline\n", "mixed \t \n whitespace \n\t ",
    "Numbers 12345 and 3.14159; 1,000,000 and 0x1F", "3486784401 59049177147 007", "It's they'll WE'RE i'd",
    "café naïve résumé Ångström", "東京は日本の首都です。", "北京欢迎你，你好！", "한국어 텍스트입니다", "Здравствуй, мир",
    "مرحبا بالعالم", "שלום עולם", "नमस्ते दुनिया", "ελληνικά γράμματα", "🚀 emoji 🎉 and 👩‍👩‍👧 family",
    "🙂🙂🙂", "flags 🇯🇵🇫🇷", "zero\u200bwidth\u200bspace", "combining e\u0301 and a\u0308", "ﬁ ligature ½ ①",
    "def f(x):\n    return x ** 2  # square\n", "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "SELECT * FROM users WHERE id = 42;", "<div class=\"a\">&nbsp;</div>", "{\"key\": [1, 2, {\"n\": null}]}",
    "https://example.com/path?q=1&r=two#frag", "user@example.com", "C:\\Windows\\System32", "$HOME/.cache && ls -la",
    "    indented code\n        more", "```python\nprint('hi')\n```", "x" * 50, "ab" * 30, "-" * 40, "=" * 17,
    "<s> as text", "</s> as text", "<|begin_of_text|>text", "<|im_start|>user\nhi<|im_end|>", "<bos><eos>",
    "<start_of_turn>model", "<|eot_id|><|end_of_text|>", "<unk> <pad>", "[INST] hi [/INST]",
]


def strings() -> list[str]:
    """Over 200 strings: the base ones, each with a leading space and a leading newline, and joined pairs."""
    out = list(BASE)
    out += [" " + s for s in BASE] + ["\n" + s for s in BASE]
    out += [a + " " + b for a, b in zip(BASE[::2], BASE[1::2])] + [a + b for a, b in zip(BASE[::3], BASE[1::3])]
    return out


@functools.lru_cache(maxsize=None)
def ours(name: str) -> Tokenizer:
    """phantom's Tokenizer of a real tokenizer, loaded once for the module (a 262k vocabulary takes seconds)."""
    return Tokenizer(real_tokenizer(name) / "tokenizer.json")


@functools.lru_cache(maxsize=None)
def theirs_of(name: str):
    return transformers.AutoTokenizer.from_pretrained(real_tokenizer(name))


@pytest.fixture(scope="module", params=NAMES)
def pair(request):
    return request.param, ours(request.param), theirs_of(request.param)


def test_encode_equals_auto_tokenizer(pair):
    name, ours, theirs = pair
    texts = strings()
    assert len(texts) >= 200
    for text in texts:
        assert ours.encode(text) == theirs(text)["input_ids"], (name, text)
    assert ours.vocab_size == len(theirs) or name == "llama2"


def test_special_token_ids_equal(pair, tmp_path):
    name, ours, theirs = pair
    assert (ours.bos_id, ours.eos_id, ours.pad_id, ours.unk_id) == \
        (theirs.bos_token_id, theirs.eos_token_id, theirs.pad_token_id, theirs.unk_token_id)
    if name == "qwen3":
        assert ours.bos_id is None and ours.prefix == []  # the old guess: "<s>" (id 128245), an ordinary word
    if name == "gemma3":
        assert ours.prefix == [2] and ours.bos_token == "<bos>"
    assert ours.stop_ids == [ours.eos_id]  # no generation_config.json: EOS
    # generation_config.json's stop ids, as GenerationConfig reads them (the models' own lists)
    stops = {"llama2": 2, "llama3_1": [128001, 128008, 128009], "qwen3": [151645, 151643], "gemma3": [1, 106],
             "gptoss": [200002, 199999, 200012]}[name]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": stops}))
    want = transformers.GenerationConfig.from_pretrained(tmp_path).eos_token_id
    assert SideFiles.read(tmp_path).stop_ids() == (want if isinstance(want, list) else [want])
    if name == "llama2":  # read beside the tokenizer file
        shutil.copytree(ours.path.parent, tmp_path / name)
        (tmp_path / name / "generation_config.json").write_text(json.dumps({"eos_token_id": stops}))
        assert Tokenizer(tmp_path / name / "tokenizer.json").stop_ids == [2]


# -- chats ------------------------------------------------------------------------------------------

# {% generation %} around each answer and its end-of-turn token, not the header before it or the newline after
MARKS = {
    "llama3_1": [("{{ content }}", "{% if message['role'] == 'assistant' %}"
                  "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}{% generation %}"
                  "{{ message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}"
                  "{% else %}{{ content }}{% endif %}")],
    "qwen3": [("'\\n</think>\\n\\n' + content.lstrip('\\n') }}",
               "'\\n</think>\\n\\n' }}{% generation %}{{- content.lstrip('\\n') }}{% endgeneration %}"),
              ("{{- '<|im_start|>' + message.role + '\\n' + content }}",
               "{{- '<|im_start|>' + message.role + '\\n' }}{% generation %}{{- content }}{% endgeneration %}"),
              ("{{- '<|im_end|>\\n' }}\n    {%- elif message.role == \"tool\" %}",
               "{% generation %}{{- '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}\n"
               "    {%- elif message.role == \"tool\" %}")],
    "gemma3": [("{%- if message['content'] is string -%}\n        {{ message['content'] | trim }}",
                "{%- if message['content'] is string and role == 'model' -%}{% generation %}"
                "{{ message['content'] | trim }}{{ '<end_of_turn>' }}{% endgeneration %}"
                "{%- elif message['content'] is string -%}\n        {{ message['content'] | trim }}"),
               ("{{ '<end_of_turn>\n' }}",
                "{{ '\n' if role == 'model' and message['content'] is string else '<end_of_turn>\n' }}")],
    # harmony: an answer ends with <|end|>, the conversation's last with <|return|> (its EOS); the header and
    # channel before it are not trained
    "gptoss": [(f'{{{{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|{end}|>" }}}}',
                f'{{{{- "<|start|>assistant<|channel|>final<|message|>" }}}}{{% generation %}}'
                f'{{{{- message.content + "<|{end}|>" }}}}{{% endgeneration %}}') for end in ("return", "end")],
}

SYSTEM = {"role": "system", "content": "You answer briefly."}
TURNS = [{"role": "user", "content": "Which bird nests on the cliff? 🐦"},
         {"role": "assistant", "content": "🙂 A tern, and gulls below it."},
         {"role": "user", "content": "When does the tide turn?\n"},
         {"role": "assistant", "content": "  東京 at dusk, past the rocks.  "}]
RECORDS = {
    "multi": {"messages": TURNS},
    "system": {"messages": [SYSTEM] + TURNS},
    "sharegpt": {"conversations": [{"from": {"system": "system", "user": "human", "assistant": "gpt"}[m["role"]],
                                    "value": m["content"]} for m in [SYSTEM] + TURNS[:2]]},
    "alpaca": {"instruction": "Name a sea bird.", "input": "One word.", "output": "Tern"},
    "nulls": {"messages": [{"role": "user", "content": "Hi", "name": None},
                           {"role": "assistant", "content": "Hello!", "tool_calls": None}]},
    "indented": {"messages": [{"role": "user", "content": "Hi"},  # Qwen3 strips a last answer's leading newlines
                              {"role": "assistant", "content": "\n  indented answer\n"}]},
}
FORMAT = {"multi": "chat", "system": "chat", "sharegpt": "sharegpt", "alpaca": "alpaca", "nulls": "chat",
          "indented": "chat"}


@pytest.fixture(scope="module", params=CHAT_NAMES)
def chat_pair(request):
    folder = real_tokenizer(request.param)
    tok = ours(request.param)
    published = chat.read_template(folder, tok)
    marked = published.source
    for old, new in MARKS[request.param]:
        assert old in marked, (request.param, old)
        marked = marked.replace(old, new)
    return request.param, tok, published, theirs_of(request.param), marked


@pytest.mark.parametrize("record", RECORDS)
def test_chat_ids_and_masks_equal_transformers(chat_pair, record):
    name, tok, published, theirs, marked = chat_pair
    messages = chat.to_messages(RECORDS[record], FORMAT[record])
    want = theirs.apply_chat_template(RECORDS[record].get("messages", messages), tokenize=True, return_dict=True)
    ids, labels = chat.encode_chat(tok, published, messages)
    assert ids == want["input_ids"], (name, record)
    ref = theirs.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
                                     chat_template=marked)
    assert ref["input_ids"] == ids
    mask = [int(label != chat.IGNORE_INDEX) for label in labels]
    assert mask == ref["assistant_masks"], (name, record)  # the published template: content + end of turn
    ours_marked = chat.ChatTemplate(marked, published.special, "marked")
    assert chat.encode_chat(tok, ours_marked, messages) == (ids, labels)  # the markers decide, the same tokens
    trained = [i for i, label in zip(ids, labels) if label != chat.IGNORE_INDEX]
    assert trained[-1] == tok.eos_id  # every one of these templates ends a turn with its EOS
    if record == "multi":  # generate --chat: the prompt ends with the generation prompt, the answer at EOS
        question = [{"role": "user", "content": "Who lit the lamp?"}]
        assert chat.prompt_ids(tok, published, "Who lit the lamp?") == theirs.apply_chat_template(
            question, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        assert tok.eos_id in chat.end_of_turn_ids(tok, published)


def test_first_bytes_of_a_multibyte_answer_are_trained(chat_pair):
    """An answer that starts with an emoji: its first byte tokens share the character's offsets."""
    name, tok, published, theirs, marked = chat_pair
    mask = chat.token_mask([(0, 5), (5, 6), (5, 6), (5, 6), (6, 7)], [(5, 7)])
    assert mask.tolist() == [False, True, True, True, True]
    messages = [{"role": "user", "content": "Smile?"}, {"role": "assistant", "content": "🙂🙂 yes"}]
    ids, labels = chat.encode_chat(tok, published, messages)
    ref = theirs.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
                                     chat_template=marked)
    assert [int(label != chat.IGNORE_INDEX) for label in labels] == ref["assistant_masks"]
    assert tok.decode([i for i, label in zip(ids, labels) if label != chat.IGNORE_INDEX]).startswith("🙂🙂")


def test_long_conversation_encoded_in_pieces(chat_pair):
    """A long conversation, its text encoded in pieces cut where a special token begins (here every few
    hundred characters): the ids and masks of the whole, as transformers computes them."""
    name, tok, published, theirs, marked = chat_pair
    messages = [m for k in range(300) for m in ({"role": "user", "content": f"Question {k}? 🐦 <b>x</b>"},
                                                {"role": "assistant", "content": f" Answer {k}.\n\n  code()  "})]
    tok.chunk_chars = 300
    try:
        assert len(tok._cuts(published.render(messages)[0])) > 100
        ids, labels = chat.encode_chat(tok, published, messages)
    finally:
        del tok.chunk_chars  # back to the class's
    ref = theirs.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
                                     chat_template=marked)
    assert ids == ref["input_ids"]
    assert [int(label != chat.IGNORE_INDEX) for label in labels] == ref["assistant_masks"]


def test_plain_text_rows_begin_with_bos_where_the_model_has_one(tmp_path):
    from phantom.data import batches, dataset as data, showdata
    path = tmp_path / "doc.txt"
    path.write_text("The keeper lit the lamp.\nThe ships passed.\n")
    for name, first in (("qwen3", None), ("gemma3", "<bos>")):
        tok = ours(name)
        d = data.load(path, tok, cache=False)
        tokens = d.tokens.tolist()
        assert (tokens[0] == tok.bos_id) == (first is not None) and tokens[-1] == tok.eos_id
        shown = showdata.show_rows(batches.rows(d, len(tokens) - 1), tok, 1)
        assert shown.splitlines()[1].strip().startswith(first or "The[[ keeper")  # the first token is no target
        assert shown.rstrip().endswith(tok.eos_token + "]]")


@pytest.fixture(scope="module")
def qwen_store(tmp_path_factory):
    """A tiny random Qwen3 with the real Qwen3 vocabulary (hidden size 64), prepared by prepare_model.py
    from a folder holding the published tokenizer files."""
    import torch
    from test_convert import load_script
    root = tmp_path_factory.mktemp("qwen3")
    src = root / "hf"
    shutil.copytree(real_tokenizer("qwen3"), src)
    config = transformers.Qwen3Config(vocab_size=151669, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                      max_position_embeddings=256, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(src)
    assert load_script("prepare_model").main(["--src", str(src), "--out", str(root / "store"), "--quiet"]) == 0
    return root / "store"


def test_show_data_shows_the_template_and_the_trained_end_of_turn(qwen_store, tmp_path, capsys):
    from test_convert import load_script
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "Who lit the lamp?"},
                                             {"role": "assistant", "content": "The keeper."}]}) + "\n")
    finetune = load_script("finetune")
    assert finetune.main(["--model", str(qwen_store), "--data", str(path), "--show-data", "1", "--seq-len", "64",
                          "--val-split", "0", "-q"]) == 0
    out = capsys.readouterr().out
    assert "<|im_start|>user\nWho lit the lamp?<|im_end|>\n<|im_start|>assistant\n" in out
    assert "[[The keeper.<|im_end|>]]" in out and "<s>" not in out
    assert finetune.main(["--model", str(qwen_store), "--data", str(path), "--show-data", "1", "--show-data-ids",
                          "--seq-len", "64", "--val-split", "0", "-q"]) == 0
    assert "<|im_start|>⟨151644⟩" in capsys.readouterr().out


def test_a_byte_level_tokenizer_declared_as_llama_is_read_as_it_is():
    """DeepSeek-V3's tokenizer_config.json names LlamaTokenizerFast over a byte-level tokenizer.json:
    transformers reads that file as it is (no Metaspace rebuild), and so does phantom."""
    name = "deepseek_v3"
    tok, theirs, folder = ours(name), theirs_of(name), real_tokenizer(name)
    for text in strings()[::3]:
        assert tok.encode(text) == theirs(text)["input_ids"], text
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (theirs.bos_token_id, theirs.eos_token_id, theirs.pad_token_id)
    messages = chat.to_messages(RECORDS["system"], "chat")
    ids, labels = chat.encode_chat(tok, chat.read_template(folder, tok), messages)
    assert ids == theirs.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    trained = tok.decode([i for i, label in zip(ids, labels) if label != chat.IGNORE_INDEX], specials=True)
    eos = "<｜end▁of▁sentence｜>"
    assert trained == f"🙂 A tern, and gulls below it.{eos}  東京 at dusk, past the rocks.  {eos}"
