"""Independent references for the tokenizers: phantom's Tokenizer encodes as the format's own library does.

- a Hugging Face `tokenizer.json`, built with the `tokenizers` library here, against that library;
- a Llama-3-style tiktoken `tokenizer.model` (base64 token + rank per line, which sentencepiece cannot read),
  against tiktoken set up as Meta's llama-models `tokenizer.py` does it and against transformers'
  `TikTokenConverter` (a separate BPE implementation, with its own copy of Llama-3's split pattern);
- a sentencepiece `tokenizer.model` against sentencepiece.
Everything is trained in the test from the shipped text; nothing is downloaded. Under CI=true a missing
library fails instead of skipping.
"""
from __future__ import annotations

import base64
import json

import pytest

from conftest import need
from phantom.data.tokenizer import TINY_TEXT, Tokenizer, train_tiny_tokenizer


tokenizers = need("tokenizers")
tiktoken = need("tiktoken")
transformers = need("transformers")

TEXTS = ["The lighthouse keeper climbed the stairs.", "  two  spaces, tabs\tand\nnew lines\n\n",
         "Numbers 12345 and 3.14; unicode: café, naïve, 東京 🚀", "it's they'll WE'RE", "3486784401, 1234567 and 59049177147", "<|end_of_text|> as text"]

# Meta's llama-models (models/llama3/tokenizer.py): the split pattern, and special tokens numbered after the
# BPE ranks in this order, 256 in all. Written out here, not imported from phantom.
META_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
META_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|step_id|>", "<|start_header_id|>",
                "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
META_SPECIAL += [f"<|reserved_special_token_{2 + i}|>" for i in range(256 - len(META_SPECIAL))]


@pytest.fixture(scope="module")
def tiktoken_file(tmp_path_factory):
    """A Llama-3-format tokenizer.model: byte-level BPE ranks trained on the shipped text, in tiktoken's file format."""
    from tiktoken._educational import bpe_train
    digits = " ".join(str(3 ** k) for k in range(60))  # long numbers, so digit merges exist and the 1-3 split matters
    ranks = bpe_train(TINY_TEXT.read_text() + digits, 400, META_PATTERN, visualise=None)
    path = tmp_path_factory.mktemp("llama3") / "tokenizer.model"
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in sorted(ranks.items(), key=lambda x: x[1])))
    return path, ranks


def test_tiktoken_model_encodes_as_meta_llama3(tiktoken_file):
    path, ranks = tiktoken_file
    tok = Tokenizer(path)
    meta = tiktoken.Encoding(name="meta", pat_str=META_PATTERN, mergeable_ranks=ranks,
                             special_tokens={t: len(ranks) + i for i, t in enumerate(META_SPECIAL)})
    assert tok.kind == "tiktoken" and tok.vocab_size == len(ranks) + 256
    assert (tok.bos_id, tok.eos_id) == (len(ranks), len(ranks) + 1)  # <|begin_of_text|>, <|end_of_text|>
    for text in TEXTS:
        ids = meta.encode(text, disallowed_special=())
        assert tok.encode(text, bos=True, eos=True) == [len(ranks)] + ids + [len(ranks) + 1]
        assert tok.decode(tok.encode(text)) == text


def test_tiktoken_model_encodes_as_transformers_converter(tiktoken_file):
    """transformers' converter rebuilds the BPE as merges for the `tokenizers` library: another implementation."""
    path, ranks = tiktoken_file
    from transformers.convert_slow_tokenizer import TikTokenConverter
    hf = TikTokenConverter(str(path), extra_special_tokens=META_SPECIAL).converted()
    tok = Tokenizer(path)
    for text in TEXTS[:-1]:  # the last one spells a special token, which the HF tokenizer would match
        assert tok.encode(text, bos=False) == hf.encode(text, add_special_tokens=False).ids, text


@pytest.mark.parametrize("specials", [("<s>", "</s>"), ("<|begin_of_text|>", "<|end_of_text|>")])
def test_tokenizer_json_encodes_as_tokenizers(tmp_path, specials):
    from tokenizers import Tokenizer as HF, decoders, models, pre_tokenizers, processors, trainers
    hf = HF(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", *specials],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    hf.train_from_iterator(TINY_TEXT.read_text().splitlines(), trainer)
    path = tmp_path / "tokenizer.json"
    hf.save(str(path))
    bare = Tokenizer(path)  # no tokenizer_config.json, no post-processor: no token is guessed from its text
    assert (bare.bos_id, bare.eos_id, bare.prefix) == (None, None, [])
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": specials[0], "eos_token": specials[1]}))
    tok = Tokenizer(path)
    assert tok.kind == "hf" and (tok.bos_id, tok.eos_id) == (1, 2) and tok.vocab_size == hf.get_vocab_size()
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert (ref.bos_token_id, ref.eos_token_id) == (1, 2) and tok.stop_ids == [2]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": specials[1], "pad_token": "<nope>"}))
    assert (Tokenizer(path).pad_id, Tokenizer(path).pad_or_eos) == (None, 2)  # not in the vocabulary: none, pad EOS
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<nope>"}))
    with pytest.raises(ValueError, match="eos_token '<nope>'"):
        Tokenizer(path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": specials[0], "eos_token": specials[1]}))
    hf.post_processor = processors.TemplateProcessing(single=f"{specials[0]} $A", special_tokens=[(specials[0], 1)])
    hf.save(str(path))
    tok = Tokenizer(path)
    for text in TEXTS:
        assert tok.encode(text, bos=True, eos=True) == [1] + hf.encode(text, add_special_tokens=False).ids + [2]
        assert tok.encode(text) == transformers.AutoTokenizer.from_pretrained(tmp_path)(text).input_ids
        assert tok.decode(tok.encode(text, bos=False)) == hf.decode(hf.encode(text).ids)


def test_sentencepiece_model_encodes_as_sentencepiece(tmp_path):
    import sentencepiece as spm
    path = train_tiny_tokenizer(tmp_path / "tokenizer.model", vocab_size=512)
    sp = spm.SentencePieceProcessor(model_file=str(path))
    tok = Tokenizer(path)
    assert tok.kind == "sentencepiece" and (tok.bos_token, tok.eos_token) == ("<s>", "</s>")
    for text in TEXTS:
        assert tok.encode(text, bos=True, eos=True) == [sp.bos_id()] + sp.encode(text) + [sp.eos_id()]


def test_unreadable_tokenizer_model_is_a_user_error(tmp_path):
    bad = tmp_path / "tokenizer.model"
    bad.write_bytes(b"\x00\x01 not a tokenizer at all")
    with pytest.raises(ValueError, match="not a sentencepiece, tiktoken or tokenizer.json"):
        Tokenizer(bad)
    (tmp_path / "tokenizer.json").write_text("{ broken")
    with pytest.raises(ValueError, match="not a readable tokenizer.json"):
        Tokenizer(tmp_path / "tokenizer.json")


def one_error_line(capsys, code: int, *words: str) -> None:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and "Traceback" not in err and "panicked" not in err, err
    assert len(lines) == 1 and lines[0].startswith("error: ") and all(w in lines[0] for w in words), err


def test_malformed_tokenizer_files_are_one_error_line(tmp_path, capsys):
    """A tiktoken file with a bad line (tiktoken's ValueError) and a tokenizer.json whose pattern would make
    the regex engine abort (a panic) are refused by the scripts with one line."""
    from test_convert import load_script
    generate = load_script("generate")
    bad = tmp_path / "tiktoken" / "tokenizer.model"
    bad.parent.mkdir()
    bad.write_text("IQ== 0\nIg== 1\nnot base64!! x\n")
    one_error_line(capsys, generate.main(["--tokenizer", str(bad), "--prompt", "Hi", "--max-new-tokens", "1"]),
                   str(bad), "not a tiktoken tokenizer.model")
    from tokenizers import Tokenizer as HF, models, pre_tokenizers
    hf = HF(models.BPE({"a": 0, "b": 1, "<unk>": 2}, [], unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Split(tokenizers.Regex("(a+)+$"), "isolated")
    evil = tmp_path / "tokenizer.json"
    hf.save(str(evil))
    one_error_line(capsys, generate.main(["--tokenizer", str(evil), "--prompt", "a" * 40 + "b",
                                          "--max-new-tokens", "1"]), str(evil), "(a+)+$")


def test_tokenizer_files_linked_outside_the_model_folder_are_refused(tmp_path, capsys):
    """prepare_model.py copies a model folder's tokenizer files into the store: a link leading elsewhere
    (a planted tokenizer_config.json -> /some/secret) is refused naming it; a hub snapshot's links into
    its repository's blobs stay allowed."""
    from phantom.convert.checkpoints import tokenizer_sources
    from test_convert import load_script
    src = tmp_path / "hf"
    src.mkdir()
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    transformers.LlamaForCausalLM(config).save_pretrained(src)
    capsys.readouterr()  # transformers' progress bar
    secret = tmp_path / "secret.txt"
    secret.write_text("not the model's")
    (src / "tokenizer_config.json").symlink_to(secret)
    code = load_script("prepare_model").main(["--src", str(src), "--out", str(tmp_path / "store"), "--quiet"])
    one_error_line(capsys, code, "tokenizer_config.json", "outside")
    assert not (tmp_path / "store").exists()
    repo = tmp_path / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    (repo / "snapshots" / "abc").mkdir(parents=True)
    (repo / "blobs" / "123").write_text("{}")
    (repo / "snapshots" / "abc" / "tokenizer_config.json").symlink_to("../../blobs/123")
    assert tokenizer_sources(repo / "snapshots" / "abc", repo) == [repo / "snapshots" / "abc" / "tokenizer_config.json"]
    with pytest.raises(ValueError, match="outside"):
        tokenizer_sources(repo / "snapshots" / "abc", None)
