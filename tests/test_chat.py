"""phantom.data.chat against transformers' apply_chat_template: templates written here in the styles of four
families (Llama-3 header tokens, ChatML as Qwen writes it, Mistral's [INST], Gemma's turns), each with a
byte-level BPE tokenizer trained in the test; ids, assistant masks and record shapes."""
from __future__ import annotations

import json

import pytest

from phantom.data import chat
from phantom.data.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

OPEN, CLOSE = "{% generation %}", "{% endgeneration %}"  # replaced by "" for the unmarked variants

LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    "{% if message['role'] == 'assistant' %}GEN_OPEN{{ message['content'] | trim + '<|eot_id|>' }}GEN_CLOSE"
    "{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")

CHATML = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}GEN_OPEN{{ message['content'] + '<|im_end|>' }}GEN_CLOSE{{ '\n' }}"
    "{% else %}{{ message['content'] + '<|im_end|>' + '\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

MISTRAL = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set system_message = messages[0]['content'] %}"
    "{% set loop_messages = messages[1:] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{% if loop.first and system_message %}"
    "{{ '[INST] ' + system_message + '\n\n' + message['content'] + ' [/INST]' }}"
    "{% else %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% endif %}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' }}GEN_OPEN{{ message['content'] + eos_token }}GEN_CLOSE"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}")

GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{% set first_user_prefix = messages[0]['content'] + '\n\n' %}{% set loop_messages = messages[1:] %}"
    "{% else %}{% set first_user_prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'assistant' %}{{ '<start_of_turn>model\n' }}"
    "GEN_OPEN{{ message['content'] | trim + '<end_of_turn>' }}GEN_CLOSE{{ '\n' }}"
    "{% else %}{{ '<start_of_turn>' + message['role'] + '\n' + (first_user_prefix if loop.first else '') "
    "+ message['content'] | trim + '<end_of_turn>\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")

FAMILIES = {  # template, bos, eos, end of turn
    "llama3": (LLAMA3, "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"),
    "chatml": (CHATML, None, "<|im_end|>", "<|im_end|>"),
    "mistral": (MISTRAL, "<s>", "</s>", "</s>"),
    "gemma": (GEMMA, "<bos>", "<eos>", "<end_of_turn>"),
}
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
            "<|im_start|>", "<|im_end|>", "<s>", "</s>", "[INST]", "[/INST]", "<bos>", "<eos>", "<start_of_turn>",
            "<end_of_turn>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|endoftext|>"]
CORPUS = ["The keeper lit the lamp at dusk and watched the ships pass the pier.",
          "Which bird nests on the cliff? A tern, and the gulls below it.",
          "You are a helpful assistant. Answer briefly, in one sentence.",
          "Where is the harbour? Past the rocks, by the white tower. When does the tide turn?"] * 4

SYSTEM = {"role": "system", "content": "Answer briefly."}
CHATS = {
    "single": [{"role": "user", "content": "Who lit the lamp?"}, {"role": "assistant", "content": "The keeper."}],
    "multi": [{"role": "user", "content": "Which bird nests on the cliff?"},
              {"role": "assistant", "content": "A tern, and gulls below it."},
              {"role": "user", "content": "When does the tide turn?"},
              {"role": "assistant", "content": "At dusk, past the rocks."}],
}


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


def family(name: str, marked: bool) -> tuple[str, str | None, str, str]:
    source, bos, eos, eot = FAMILIES[name]
    source = source.replace("GEN_OPEN", OPEN if marked else "").replace("GEN_CLOSE", CLOSE if marked else "")
    return source, bos, eos, eot


def reference(tokenizer_file, bos, eos, source):
    return transformers.PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file), bos_token=bos, eos_token=eos,
                                                chat_template=source)


def ours(source, bos, eos) -> chat.ChatTemplate:
    return chat.ChatTemplate(source, {k: v for k, v in (("bos_token", bos), ("eos_token", eos)) if v})


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("turns", CHATS)
@pytest.mark.parametrize("system", [False, True])
def test_ids_equal_transformers(tokenizer_file, name, turns, system):
    source, bos, eos, _ = family(name, marked=False)
    ref, tok, template = reference(tokenizer_file, bos, eos, source), Tokenizer(tokenizer_file), ours(source, bos, eos)
    messages = ([SYSTEM] if system else []) + CHATS[turns]
    want = ref.apply_chat_template(messages, tokenize=True, return_dict=False)
    got, labels = chat.encode_chat(tok, template, messages)
    assert got == want
    trained = [i for i, label in zip(got, labels) if label != chat.IGNORE_INDEX]
    assert ref.convert_tokens_to_ids(FAMILIES[name][3]) == trained[-1]  # it ends with the end of turn, not the \n
    # the generation prompt: the chat up to the last question
    prompt = messages[:-1]
    want = ref.apply_chat_template(prompt, tokenize=True, return_dict=False, add_generation_prompt=True)
    text, _ = template.render(prompt, add_generation_prompt=True)
    assert tok.encode_rendered(text)[0] == want
    if not system:
        assert chat.prompt_ids(tok, template, messages[0]["content"]) == ref.apply_chat_template(
            messages[:1], tokenize=True, return_dict=False, add_generation_prompt=True)


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("turns", CHATS)
def test_assistant_mask_equals_transformers(tokenizer_file, name, turns):
    source, bos, eos, eot = family(name, marked=True)
    ref, tok, template = reference(tokenizer_file, bos, eos, source), Tokenizer(tokenizer_file), ours(source, bos, eos)
    messages = CHATS[turns]
    out = ref.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, labels = chat.encode_chat(tok, template, messages)
    assert ids == out["input_ids"]
    assert [int(label != chat.IGNORE_INDEX) for label in labels] == out["assistant_masks"]
    trained = [i for i, label in zip(ids, labels) if label != chat.IGNORE_INDEX]
    assert trained.count(tok.encode_rendered(eot)[0][0]) == len(messages) // 2  # every turn ends trained
    # unmarked, the template trains the same tokens: each content and its end of turn
    plain_ids, plain_labels = chat.encode_chat(tok, ours(*family(name, marked=False)[:1], bos, eos), messages)
    assert plain_ids == ids and plain_labels == labels


@pytest.mark.parametrize("name", FAMILIES)
def test_train_on_last_and_prompt_too(tokenizer_file, name):
    source, bos, eos, _ = family(name, marked=True)
    tok, template = Tokenizer(tokenizer_file), ours(source, bos, eos)
    ids, every = chat.encode_chat(tok, template, CHATS["multi"], "all")
    _, last = chat.encode_chat(tok, template, CHATS["multi"], "last")
    _, both = chat.encode_chat(tok, template, CHATS["multi"], "prompt-too")
    runs = [k for k in range(len(every)) if every[k] != chat.IGNORE_INDEX and every[k - 1] == chat.IGNORE_INDEX]
    assert len(runs) == 2  # two assistant turns trained
    assert all(label == chat.IGNORE_INDEX for label in last[:runs[1]]) and last[runs[1]:] == every[runs[1]:]
    assert both == [chat.IGNORE_INDEX] + ids[1:]


@pytest.mark.parametrize("name", FAMILIES)
def test_sharegpt_alpaca_prompt_records_match_messages(tokenizer_file, name):
    source, bos, eos, _ = family(name, marked=False)
    tok, template = Tokenizer(tokenizer_file), ours(source, bos, eos)
    speaker = {"system": "system", "user": "human", "assistant": "gpt"}
    for messages in ([SYSTEM] + CHATS["multi"], CHATS["multi"]):
        sharegpt = {"conversations": [{"from": speaker[m["role"]], "value": m["content"]} for m in messages]}
        assert chat.encode_chat(tok, template, chat.to_messages(sharegpt, "sharegpt")) == \
            chat.encode_chat(tok, template, chat.to_messages({"messages": messages}, "chat"))
    single = CHATS["single"]
    prompt = {"prompt": single[0]["content"], "response": single[1]["content"]}
    alpaca = {"instruction": single[0]["content"], "input": "", "output": single[1]["content"]}
    want = chat.encode_chat(tok, template, single)
    assert chat.encode_chat(tok, template, chat.to_messages(prompt, "prompt")) == want
    assert chat.encode_chat(tok, template, chat.to_messages(alpaca, "alpaca")) == want


def test_end_of_turn_is_the_templates(tokenizer_file):
    tok = Tokenizer(tokenizer_file)
    for name in FAMILIES:
        source, bos, eos, eot = family(name, marked=False)
        assert tok.encode_rendered(eot)[0][0] in chat.end_of_turn_ids(tok, ours(source, bos, eos)), name


def test_template_errors_are_value_errors(tokenizer_file):
    tok = Tokenizer(tokenizer_file)
    mistral = ours(*family("mistral", False)[:1], "<s>", "</s>")
    with pytest.raises(ValueError, match="refused it: Conversation roles must alternate"):
        chat.encode_chat(tok, mistral, [{"role": "assistant", "content": "x"}])
    with pytest.raises(ValueError, match="at least one assistant"):
        chat.encode_chat(tok, mistral, [{"role": "user", "content": "x"}])
    with pytest.raises(ValueError, match="does not parse"):
        chat.compile_template("{% for m in messages %}")
    with pytest.raises(ValueError, match="unknown ShareGPT speaker 'bot'"):
        chat.to_messages({"conversations": [{"from": "bot", "value": "x"}]}, "sharegpt")
    # the sandbox: no reaching into Python internals from a template
    evil = ours("{{ messages.__class__.__mro__ }}", "<s>", "</s>")
    with pytest.raises(ValueError):
        chat.encode_chat(tok, evil, CHATS["single"])


def test_read_template_from_a_folder(tmp_path, tokenizer_file):
    tok = Tokenizer(tokenizer_file)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": {"content": "<s>"}, "eos_token": "</s>", "chat_template": [
            {"name": "tool_use", "template": "x"}, {"name": "default", "template": MISTRAL.replace("GEN_OPEN", "")
                                                   .replace("GEN_CLOSE", "")}]}))
    t = chat.read_template(tmp_path, tok)
    assert t.special["bos_token"] == "<s>" and t.special["eos_token"] == "</s>" and "[INST]" in t.source
    (tmp_path / "chat_template.jinja").write_text(CHATML.replace("GEN_OPEN", "").replace("GEN_CLOSE", ""))
    assert "<|im_start|>" in chat.read_template(tmp_path, tok).source  # transformers 5's file wins
    assert chat.read_template(tmp_path / "nothing", tok) is None


# Templates that do not render a conversation as the sum of its turns, in the published templates' styles:
# Mistral-Nemo puts the system prompt into the last user message, and only when that message is the last;
# Phi-3.5 ends a turn with <|end|> (which shares "<|" with the next turn's <|user|>) and the conversation
# with <|endoftext|>. GEN_OPEN/GEN_CLOSE: where TRL-style markers go (the answer and its end of turn).
NEMO = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{{- bos_token }}{%- for message in loop_messages %}{%- if message['role'] == 'user' %}"
    "{%- if loop.last and system_message is defined %}"
    "{{- '[INST]' + system_message + '\n\n' + message['content'] + '[/INST]' }}"
    "{%- else %}{{- '[INST]' + message['content'] + '[/INST]' }}{%- endif %}"
    "{%- elif message.tool_calls is defined %}{%- for call in message.tool_calls %}{{- call.name }}{%- endfor %}"
    "{%- elif message['role'] == 'assistant' %}GEN_OPEN{{- message['content'] + eos_token }}GEN_CLOSE"
    "{%- endif %}{%- endfor %}")
PHI35 = (
    "{% for message in messages %}{% if message['role'] == 'system' and message['content'] %}"
    "{{'<|system|>\n' + message['content'] + '<|end|>\n'}}{% elif message['role'] == 'user' %}"
    "{{'<|user|>\n' + message['content'] + '<|end|>\n'}}{% elif message['role'] == 'assistant' %}"
    "{{'<|assistant|>\n'}}GEN_OPEN{{message['content'] + '<|end|>'}}GEN_CLOSE{{'\n'}}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}")
STYLES = {"nemo": (NEMO, "<s>", "</s>"), "phi35": (PHI35, None, "<|endoftext|>"),
          "chatml": (FAMILIES["chatml"][0], None, "<|im_end|>"), "gemma": (FAMILIES["gemma"][0], "<bos>", "<eos>")}


def styled(name: str, marked: bool) -> str:
    return STYLES[name][0].replace("GEN_OPEN", OPEN if marked else "").replace("GEN_CLOSE", CLOSE if marked else "")


@pytest.mark.parametrize("name", STYLES)
@pytest.mark.parametrize("system", [False, True])
def test_masks_of_templates_that_are_not_the_sum_of_their_turns(tokenizer_file, name, system):
    """The published template (no markers) trains what transformers' return_assistant_tokens_mask marks on
    it with markers around each answer and its end of turn: not the user's words (Nemo's system prompt
    moves), not the next turn's <|user|> (Phi), not the newline after the end of turn (ChatML, Gemma,
    Phi) nor Phi's closing <|endoftext|>."""
    _, bos, eos = STYLES[name]
    tok, messages = Tokenizer(tokenizer_file), ([SYSTEM] if system else []) + CHATS["multi"]
    ref = reference(tokenizer_file, bos, eos, styled(name, marked=True))
    out = ref.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, labels = chat.encode_chat(tok, ours(styled(name, marked=False), bos, eos), messages)
    assert ids == out["input_ids"]
    assert [int(label != chat.IGNORE_INDEX) for label in labels] == out["assistant_masks"]
    trained = ref.decode([i for i, label in zip(ids, labels) if label != chat.IGNORE_INDEX])
    assert "\n" not in trained and "<|user|>" not in trained and "<|endoftext|>" not in trained
    assert "Which bird" not in trained and "Answer briefly" not in trained


def test_token_mask_marks_every_token_a_span_touches():
    """An answer starting with a multi-byte character: its byte tokens share the character's offsets."""
    mask = chat.token_mask([(0, 5), (5, 6), (5, 6), (5, 6), (6, 7)], [(5, 7)])
    assert mask.tolist() == [False, True, True, True, True]
    assert chat.token_mask([(0, 2), (2, 4), (4, 6)], [(3, 3), (5, 9)]).tolist() == [False, False, True]


def test_null_fields_are_dropped_before_rendering(tokenizer_file):
    """Chat UIs export `"tool_calls": null`; transformers renders such a message as one without the key."""
    tok, template = Tokenizer(tokenizer_file), ours(styled("nemo", False), "<s>", "</s>")
    record = {"messages": [{"role": "user", "content": "Who lit the lamp?", "name": None},
                           {"role": "assistant", "content": "The keeper.", "tool_calls": None}]}
    assert chat.encode_chat(tok, template, chat.to_messages(record, "chat")) == \
        chat.encode_chat(tok, template, CHATS["single"])


def test_a_template_that_rewrites_the_answer_is_refused(tokenizer_file):
    tok = Tokenizer(tokenizer_file)
    upper = ours("{% for m in messages %}{{ m['content'] | upper }}{{ eos_token }}{% endfor %}", None, "</s>")
    with pytest.raises(ValueError, match="cannot be mapped exactly"):
        chat.encode_chat(tok, upper, CHATS["single"])
