"""Generation: the KV-cached loop picks the same tokens as recomputing the whole sequence, resident and
streamed; sampling is seeded; the CLI prints a completion, with and without an adapter.
"""
from __future__ import annotations

import pytest
import torch

import phantom
from phantom.config import preset
from phantom.convert import write_synthetic
from phantom.generate import generate
from phantom.tokenizer import train_tiny_tokenizer
from conftest import SMALL
from test_convert import load_script

PROMPT = [1, 5, 17, 42, 8]


def greedy_without_cache(model, prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            tokens.append(int(model(torch.tensor([tokens]))[0, -1].argmax()))
    return tokens[len(prompt):]


@pytest.mark.parametrize("offload", ["none", "disk"])
def test_cached_generation_matches_recompute(small_store, offload):
    with phantom.load(small_store, offload=offload, lora=None) as model:
        expected = greedy_without_cache(model, PROMPT, 8)
        assert list(generate(model, PROMPT, 8, temperature=0)) == expected
        assert list(generate(model, PROMPT, 8, temperature=1.0, top_k=1)) == expected  # top-1 sampling is greedy


def test_sampling_is_seeded_and_length_is_checked(small_store):
    with phantom.load(small_store, offload="none", lora=None) as model:
        a = list(generate(model, PROMPT, 10, temperature=1.0, seed=3))
        assert a == list(generate(model, PROMPT, 10, temperature=1.0, seed=3)) and len(a) == 10
        with pytest.raises(ValueError, match="max_seq_len"):
            list(generate(model, PROMPT, SMALL.max_seq_len))


def test_generate_cli(tmp_path, capsys):
    tok = train_tiny_tokenizer(tmp_path / "tokenizer.model", vocab_size=512)
    store = write_synthetic(tmp_path / "tiny", preset("tiny", n_layers=2), torch.float32, seed=0, tokenizer=tok,
                            progress=False)
    with phantom.load(store, offload="none", lora=phantom.LoraConfig(rank=4)) as model, torch.no_grad():
        for p in model.trainable_parameters():
            p.normal_(0, 0.5)
        model.save_adapter(tmp_path / "adapter")
    main = load_script("generate").main
    outs = []
    for extra in ([], ["--adapter", str(tmp_path / "adapter")]):
        assert main(["--model", str(store), "--prompt", "Once upon a time", "--max-new-tokens", "12",
                     "--temperature", "0", "--device", "cpu", *extra]) == 0
        outs.append(capsys.readouterr().out)
        assert outs[-1].startswith("Once upon a time") and len(outs[-1]) > len("Once upon a time\n")
    assert outs[0] != outs[1]  # the adapter changes what the model says
    bare = write_synthetic(tmp_path / "bare", SMALL, torch.float32, progress=False)
    assert main(["--model", str(bare), "--prompt", "hi", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "tokenizer" in err[0]
