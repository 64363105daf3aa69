"""The README's tiny chat demo end to end: finetune.py on the shipped chat file (rendered by the tiny
model's own template), then generate.py --chat answers held-out prompts and stops at the template's
end-of-turn token, never at the token limit."""
from __future__ import annotations

import json

import pytest

import phantom
from phantom.data import chat
from phantom.data.dataset import DEFAULT_DATA
from phantom.model.generate import generate
from phantom.model.adapterfiles import read_adapter_config
from phantom.data.tokenizer import Tokenizer
from test_convert import load_script

CHAT_DATA = DEFAULT_DATA.parent / "tiny_chat.jsonl"
MAX_NEW = 24  # answers are three words and a period: about 12 tokens


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory):
    out = tmp_path_factory.mktemp("chat") / "run"
    assert load_script("finetune").main(["--data", str(CHAT_DATA), "--out", str(out), "--iters", "60",
                                         "--batch-size", "4", "--seq-len", "96", "--eval-every", "0",
                                         "--sample-every", "0", "--device", "cpu", "-q"]) == 0
    return out / "adapter"


def held_out(n: int = 5) -> list[str]:
    """The first n user prompts of the held-out split (the last tenth of the records, --val-split 0.1)."""
    records = [json.loads(line) for line in CHAT_DATA.read_text().splitlines()]
    val = records[len(records) - max(1, round(len(records) * 0.1)):]
    return [r["messages"][0]["content"] for r in val[:n]]


def test_generate_chat_stops_at_the_end_of_turn(finetuned, capsys):
    store = phantom.resolve_model("tiny")
    tok = Tokenizer(phantom.BlockStore(store).tokenizer_path)
    template = chat.read_template(store, tok)
    stop = chat.end_of_turn_ids(tok, template)
    assert stop == {tok.eos_id}  # the tiny template ends a turn with EOS
    prompts = held_out()
    assert len(prompts) == 5
    with phantom.load(store, offload="disk", lora=read_adapter_config(finetuned)) as model:
        model.load_adapter(finetuned)
        answers = []
        for prompt in prompts:
            ids = chat.prompt_ids(tok, template, prompt)
            new = list(generate(model, ids, MAX_NEW, temperature=0, eos_id=stop))
            assert new[-1] in stop and len(new) < MAX_NEW, (prompt, tok.decode(new))
            answers.append(tok.decode(new[:-1]))
    for prompt, answer in zip(prompts, answers):  # the script prints the same answer, ended at the end of turn
        assert load_script("generate").main(["--adapter", str(finetuned), "--chat", "--prompt", prompt,
                                             "--temperature", "0", "--max-new-tokens", str(MAX_NEW)]) == 0
        assert capsys.readouterr().out.strip() == answer.strip()
