"""Generation: the KV-cached loop picks the same tokens as recomputing the whole sequence, resident and
streamed; sampling is seeded; the CLI prints a completion, with and without an adapter.
"""
from __future__ import annotations

import pytest
import torch

import phantom
from phantom.arch.presets import preset
from phantom.convert.synthetic import write_synthetic
from phantom.model.generate import generate
from phantom.data.tokenizer import train_tiny_tokenizer
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
    tok = train_tiny_tokenizer(tmp_path / "tokenizer.model", vocab_size=preset("tiny").vocab_size)
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


def test_temperature_top_k_and_seed_shape_the_samples():
    """sample() on fixed logits, many draws: the frequencies follow softmax(logits / T) over the top k."""
    from phantom.model.generate import sample
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]]).expand(4000, -1)

    def freqs(temperature, top_k, seed=0):
        ids = sample(logits, temperature, top_k, torch.Generator().manual_seed(seed))
        return torch.bincount(ids, minlength=6).float() / len(ids)

    for t in (0.5, 1.0, 2.0):
        expected = torch.softmax(logits[0] / t, -1)
        assert (freqs(t, None) - expected).abs().max() < 0.03, t  # 4000 draws: a few sigma of 0.008
    assert freqs(0.5, None)[0] > freqs(2.0, None)[0] + 0.2  # colder is peakier
    top3 = freqs(1.0, 3)
    assert top3[3:].sum() == 0 and (top3[:3] - torch.softmax(logits[0, :3], -1)).abs().max() < 0.03
    assert freqs(1.0, 1)[0] == 1 and freqs(0, None)[0] == 1  # top-1 and temperature 0 are the argmax
    a, b = (sample(logits[:50], 1.0, None, torch.Generator().manual_seed(s)) for s in (1, 2))
    assert not torch.equal(a, b)  # another seed, other draws


def test_eos_stops_generation(small_store):
    with phantom.load(small_store, offload="none", lora=None) as model:
        greedy = list(generate(model, PROMPT, 8, temperature=0))
        eos = greedy[2]
        stopped = list(generate(model, PROMPT, 8, temperature=0, eos_id=eos))
    assert stopped == greedy[:greedy.index(eos) + 1]  # the EOS token is the last one yielded


def test_generate_cli_completes_a_prompts_file_in_input_order(tmp_path, capsys):
    """Each line's fields plus its completion, in input order, as the single-prompt path completes it; a line
    that is not JSON: one line, exit 2, no output file."""
    import json
    tok = train_tiny_tokenizer(tmp_path / "tokenizer.model", vocab_size=preset("tiny").vocab_size)
    store = write_synthetic(tmp_path / "tiny", preset("tiny", n_layers=2), torch.float32, seed=0, tokenizer=tok,
                            progress=False)
    texts = ["Once upon a time", "The keeper", "A", "In the morning the lamp was lit and"]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"prompt": t, "id": n}) + "\n" for n, t in enumerate(texts)))
    main = load_script("generate").main
    common = ["--model", str(store), "--max-new-tokens", "6", "--temperature", "0", "--device", "cpu"]
    assert main([*common, "--prompts", str(tmp_path / "in.jsonl"), "--out", str(tmp_path / "out.jsonl"),
                 "--batch-size", "3"]) == 0
    out = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["id"] for r in out] == [0, 1, 2, 3] and [r["prompt"] for r in out] == texts
    capsys.readouterr()
    for r in out[:2]:
        assert main([*common, "--prompt", r["prompt"]]) == 0
        assert capsys.readouterr().out == r["prompt"] + r["completion"] + "\n"
        assert len(r["completion_ids"]) <= 6
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n{"prompt": oops}\n')
    assert main([*common, "--prompts", str(tmp_path / "bad.jsonl"), "--out", str(tmp_path / "bad-out.jsonl")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bad.jsonl:2" in err[0] and not (tmp_path / "bad-out.jsonl").exists()
