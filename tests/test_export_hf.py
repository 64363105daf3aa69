"""Merged checkpoints the Hugging Face ecosystem loads as they are, tokenizer included.

A user's path, through the scripts: an HF folder (weights + tokenizer files) -> prepare_model.py -> a LoRA
adapter -> merge_lora.py --format hf. The merged folder must load with AutoTokenizer (same ids as phantom's
tokenizer), AutoModelForCausalLM, and pipeline("text-generation"), whose greedy tokens must be those of
scripts/generate.py on base + adapter (compared as token ids: random weights emit stray byte-fallback
tokens, which each library renders as text its own way). Two sources: a sentencepiece tokenizer.model alone (Llama-2 style;
the export derives tokenizer_config.json and generation_config.json), and tokenizer.json +
tokenizer_config.json (Llama-3 style; the export copies them). Everything is built in the test, offline.
"""
from __future__ import annotations

import io
import json
import shutil

import pytest
import torch

import phantom
from phantom.convert.checkpoints import TOKENIZER_FILES
from phantom.model.generate import _pieces as text_pieces, generate
from phantom.files.store import BlockStore
from phantom.data.tokenizer import TINY_TEXT, Tokenizer
from conftest import need
from test_convert import load_script


transformers = need("transformers")
tokenizers = need("tokenizers")

TEXTS = ["Once upon a time", "The lighthouse keeper climbed the stairs.", "Numbers 12345, café and 東京!",
         "a  b\tc\nd"]
PROMPT = "The keeper climbed"


def llama2_style_sentencepiece(folder) -> int:
    """tokenizer.model trained with Llama-2's sentencepiece settings (no normalization, byte fallback)."""
    import sentencepiece as spm
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TINY_TEXT.read_text().splitlines()), model_writer=model, model_type="bpe",
        vocab_size=512, character_coverage=1.0, byte_fallback=True, normalization_rule_name="identity",
        remove_extra_whitespaces=False, add_dummy_prefix=True, split_digits=True, num_threads=1,
        shuffle_input_sentence=False, bos_id=1, eos_id=2, unk_id=0, pad_id=-1, minloglevel=2)
    (folder / "tokenizer.model").write_bytes(model.getvalue())
    return 512


def llama3_style_tokenizer_json(folder) -> int:
    """tokenizer.json (byte-level BPE whose post-processor adds <|begin_of_text|>) + tokenizer_config.json."""
    from tokenizers import Tokenizer as HF, decoders, models, pre_tokenizers, processors, trainers
    hf = HF(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|end_of_text|>"]
    hf.train_from_iterator(TINY_TEXT.read_text().splitlines(), trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    hf.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A", special_tokens=[
        ("<|begin_of_text|>", hf.token_to_id("<|begin_of_text|>"))])
    hf.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": specials[0], "eos_token": specials[1],
              "model_max_length": 64}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return hf.get_vocab_size()


SOURCES = {"sentencepiece": llama2_style_sentencepiece, "tokenizer_json": llama3_style_tokenizer_json}


@pytest.fixture(scope="module", params=list(SOURCES))
def merged(request, tmp_path_factory):
    """(store, adapter, merged HF folder), all written by phantom's scripts from an HF source folder."""
    root = tmp_path_factory.mktemp(request.param)
    src = root / "hf"
    src.mkdir()
    vocab = SOURCES[request.param](src)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      initializer_range=0.1, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(src)
    assert load_script("prepare_model").main(["--src", str(src), "--out", str(root / "store"), "--quiet"]) == 0
    lora = phantom.LoraConfig(rank=4, alpha=8, targets=("q", "k", "v", "o", "gate", "up", "down"))
    with phantom.load(root / "store", offload="none", lora=lora) as model, torch.no_grad():
        gen = torch.Generator().manual_seed(1)
        for p in model.trainable_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
        model.save_adapter(root / "adapter")
    assert load_script("merge_lora").main(["--model", str(root / "store"), "--adapter", str(root / "adapter"),
                                           "--out", str(root / "merged"), "--format", "hf", "--quiet"]) == 0
    return root / "store", root / "adapter", root / "merged"


def test_store_keeps_the_tokenizer_files_checksummed(merged):
    store, _, _ = merged
    listed = BlockStore(store).manifest["tokenizer_files"]
    kept = {p.name for p in (store.parent / "hf").iterdir() if p.name in TOKENIZER_FILES}
    assert set(listed) == kept and kept >= {"generation_config.json"} and len(kept) >= 2
    assert all(len(v["sha256"]) == 64 and v["size"] > 0 for v in listed.values())


def test_auto_tokenizer_encodes_as_phantom(merged):
    store, _, folder = merged
    ours = Tokenizer(BlockStore(store).tokenizer_path)
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    for text in TEXTS:
        assert theirs(text)["input_ids"] == ours.encode(text, bos=True), text
    assert (theirs.bos_token_id, theirs.eos_token_id) == (ours.bos_id, ours.eos_id)


def test_pipeline_greedy_equals_generate_script(merged, capsys):
    store, adapter, folder = merged
    pipe = transformers.pipeline("text-generation", model=str(folder), device="cpu", dtype=torch.float32)
    out = pipe(PROMPT, max_new_tokens=12, do_sample=False, return_tensors=True)[0]["generated_token_ids"]
    with phantom.load(store, offload="none", lora=phantom.model.adapterfiles.read_adapter_config(adapter)) as model:
        model.load_adapter(adapter)
        tok = Tokenizer(BlockStore(store).tokenizer_path)
        prompt = tok.encode(PROMPT, bos=True)
        ours = list(generate(model, prompt, 12, temperature=0, eos_id=tok.eos_id))
    assert list(out) == prompt + ours
    assert load_script("generate").main(["--model", str(store), "--adapter", str(adapter), "--prompt", PROMPT,
                                         "--max-new-tokens", "12", "--temperature", "0", "--device", "cpu"]) == 0
    printed = capsys.readouterr().out.removesuffix("\n")
    assert printed == PROMPT + "".join(text_pieces(tok, list(prompt), iter(ours)))  # the script printed those tokens


def test_auto_model_loads_the_merged_weights(merged):
    store, adapter, folder = merged
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokens = torch.randint(0, model.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    with phantom.load(store, offload="none", lora=phantom.model.adapterfiles.read_adapter_config(adapter)) as pm, torch.no_grad():
        pm.load_adapter(adapter)
        expected = pm(tokens)
        got = model(tokens).logits
    assert ((got - expected).abs().max() / expected.abs().max()).item() < 1e-5


def test_meta_export_carries_tokenizer_model_and_a_changed_file_is_refused(merged, tmp_path, capsys):
    store, adapter, _ = merged
    merge = load_script("merge_lora").main
    assert merge(["--model", str(store), "--out", str(tmp_path / "meta"), "--format", "meta", "--quiet"]) == 0
    main = BlockStore(store).tokenizer_path
    if main.name == "tokenizer.model":
        assert (tmp_path / "meta" / "tokenizer.model").read_bytes() == main.read_bytes()
    copy = tmp_path / "store"
    shutil.copytree(store, copy)
    (copy / main.name).write_bytes(main.read_bytes() + b" ")
    capsys.readouterr()
    assert merge(["--model", str(copy), "--out", str(tmp_path / "bad"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "changed" in err[0]
    assert not (tmp_path / "bad").exists() and not list(tmp_path.glob(".bad*"))  # nothing half-written


def test_finetune_adapter_folder_carries_the_tokenizer(merged, tmp_path):
    """finetune.py's adapter/ holds the tokenizer files, so PeftModel + AutoTokenizer load from that one folder."""
    peft = need("peft")
    store, _, _ = merged
    assert load_script("finetune").main(["--model", str(store), "--data", str(TINY_TEXT), "--iters", "2",
                                         "--seq-len", "32", "--batch-size", "2", "--out", str(tmp_path / "run"),
                                         "--device", "cpu", "--quiet"]) == 0
    adapter = tmp_path / "run" / "adapter"
    ours = Tokenizer(BlockStore(store).tokenizer_path)
    theirs = transformers.AutoTokenizer.from_pretrained(adapter)
    assert [theirs(t)["input_ids"] for t in TEXTS] == [ours.encode(t, bos=True) for t in TEXTS]
    assert load_script("merge_lora").main(["--model", str(store), "--out", str(tmp_path / "base"), "--quiet"]) == 0
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, adapter).eval()
    with torch.no_grad():
        assert torch.isfinite(model(**theirs(PROMPT, return_tensors="pt")).logits).all()
