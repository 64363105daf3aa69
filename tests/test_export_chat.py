"""Tokenizer files out as Hugging Face repos ship them: the tiny model's merged export and a finetune's
adapter folder carry tokenizer.json (converted from its sentencepiece model) and tokenizer_config.json
with the chat template, so transformers alone (no sentencepiece, no protobuf) encodes text and chats as
phantom does."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

import phantom
from phantom.data import chat
from phantom.export.export import export, write_tokenizer_files
from phantom.data.tokenizer import Tokenizer

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

TEXTS = ["The keeper lit the lamp.", "  two  spaces,\ttabs\nand lines ", "Numbers 12345, café and 東京!"]
CHATS = [[{"role": "user", "content": "Who lit the lamp?"}, {"role": "assistant", "content": "The keeper."}],
         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "When?"},
          {"role": "assistant", "content": "At dusk."}, {"role": "user", "content": "Where?"},
          {"role": "assistant", "content": "On the pier."}]]

# transformers in a process where sentencepiece and protobuf cannot be imported
PROBE = """
import json, sys
sys.modules["sentencepiece"] = None
sys.modules["google.protobuf"] = None
import transformers
tok = transformers.AutoTokenizer.from_pretrained(sys.argv[1])
texts, chats = json.loads(sys.argv[2]), json.loads(sys.argv[3])
out = {"texts": [tok(t)["input_ids"] for t in texts],
       "chats": [tok.apply_chat_template(c, tokenize=True, return_dict=False) for c in chats],
       "masks": [tok.apply_chat_template(c, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
                 ["assistant_masks"] for c in chats],
       "prompt": tok.apply_chat_template(chats[0][:1], tokenize=True, return_dict=False, add_generation_prompt=True),
       "special": [tok.bos_token_id, tok.eos_token_id]}
print(json.dumps(out))
"""


def transformers_reads(folder) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, str(folder), json.dumps(TEXTS), json.dumps(CHATS)],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("where", ["merged", "adapter"])
def test_transformers_alone_encodes_text_and_chats_as_phantom(tmp_path, where):
    store = phantom.BlockStore(phantom.resolve_model("tiny"))
    folder = tmp_path / where
    if where == "merged":
        export(store.path, folder, progress=False)
    else:
        folder.mkdir()
        write_tokenizer_files(store, folder)  # what a finetune run writes into its adapter/
    assert {"tokenizer.json", "tokenizer_config.json"} <= {p.name for p in folder.iterdir()}
    assert json.loads((folder / "tokenizer_config.json").read_text())["chat_template"] == chat.TINY_CHAT_TEMPLATE
    tok = Tokenizer(store.tokenizer_path)
    template = chat.read_template(store.path, tok)
    theirs = transformers_reads(folder)
    assert theirs["texts"] == [tok.encode(t, bos=True) for t in TEXTS]
    ours = [chat.encode_chat(tok, template, c) for c in CHATS]
    assert theirs["chats"] == [ids for ids, _ in ours]
    assert theirs["masks"] == [[int(label != chat.IGNORE_INDEX) for label in labels] for _, labels in ours]
    assert theirs["prompt"] == chat.prompt_ids(tok, template, CHATS[0][0]["content"])
    assert theirs["special"] == [tok.bos_id, tok.eos_id]
