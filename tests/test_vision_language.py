"""Vision-language checkpoints (Llama 4, Qwen3.5-MoE, Kimi-K2.5) kept whole: tiny models of each transformers class,
saved by transformers, are converted (copied and --link), a LoRA step runs on the text model, and the merged HF
export is the vision-language checkpoint again:

- the store keeps the tensors the text model leaves out (vision tower, projector) in vision.safetensors (linked in
  place, nothing copied, under --link), and a run never opens it;
- transformers loads the export as the source's class; its text logits equal peft's merge_and_unload of the same
  adapter on the vision-language model (within 1e-5, fp32); every tensor the text model leaves out is the shipped
  one bit for bit, under its own name, and the text model's are under the checkpoint's names;
- a store made before the record exports the text model; a 16-bit export that would drop the quantization_config
  of quantized kept tensors is refused in one line; the GGUF export says the vision tower is not in it.
"""
from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from family_check import batch, prepare, rel_err
from phantom.convert import visionlanguage
from phantom.export.export import export
from phantom.files.store import BlockStore
from test_convert import load_script
from test_deepseek import kimi_k25, published_names
from test_llama4 import llama4_vl
from test_moe_lora import EXPERTS, few, phantom_step
from test_qwen35 import qwen35_vl

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


class TextOf(torch.nn.Module):
    """A vision-language model's text model under the text model's names (model.*, lm_head), its modules shared:
    peft loads phantom's adapter onto it, and merging it merges into the vision-language model."""

    def __init__(self, model, lm_head):
        super().__init__()
        self.model, self.lm_head = model, lm_head


def build(name: str):
    """(the vision-language model, its text model under the text names, the LoRA's targets)."""
    if name == "llama4":
        vl, _ = llama4_vl()
        return vl, TextOf(vl.language_model.model, vl.language_model.lm_head), EXPERTS
    if name == "qwen3_5_moe":
        vl = qwen35_vl()
        return vl, TextOf(vl.model.language_model, vl.lm_head), EXPERTS
    vl, _ = kimi_k25()
    return vl, TextOf(vl.model.language_model, vl.lm_head), ("q", "kv_a", "kv_b", "o", "gate", "up", "down")


def tensors(folder) -> dict[str, torch.Tensor]:
    with safe_open(folder / "model.safetensors", "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                      b.reshape(-1).view(torch.uint8))


def step_without_the_vision_file(store, adapter, targets, monkeypatch):
    """A LoRA step streamed from disk (adapter saved), the store's vision.safetensors moved away where it is a
    copy, and every store file a run opens recorded: the vision file is never one."""
    opened, entry = [], BlockStore._entry
    monkeypatch.setattr(BlockStore, "_entry", lambda self, rel, *a: opened.append(rel) or entry(self, rel, *a))
    kept = store / visionlanguage.FILE
    if kept.exists():
        kept.rename(store.parent / "away")
    tokens, labels = few()
    phantom_step(store, tokens, labels, adapter, lora_targets=targets, offload="disk")
    if (store.parent / "away").exists():
        (store.parent / "away").rename(kept)
    monkeypatch.undo()
    assert opened and visionlanguage.FILE not in opened and "blocks/000.safetensors" in opened


@pytest.mark.parametrize("link", [False, True], ids=["copy", "link"])
@pytest.mark.parametrize("name", ["llama4", "qwen3_5_moe", "kimi_k25"])
def test_the_merged_export_is_the_vision_language_checkpoint(name, link, tmp_path, monkeypatch):
    vl, text, targets = build(name)
    store = prepare(vl, tmp_path, link=link)
    source = tensors(tmp_path / "hf")
    manifest = json.loads((store / "manifest.json").read_text())
    kept = manifest[visionlanguage.RECORD]["tensors"]
    assert kept and not any(k.startswith(("language_model.", "model.language_model.")) for k in kept)
    assert any(w in k for k in kept for w in ("vision", "visual"))
    assert (store / visionlanguage.FILE).exists() != link  # --link: the file is a record of ranges of the shards
    assert visionlanguage.FILE in (manifest["links"]["files"] if link else manifest["files"])
    step_without_the_vision_file(store, tmp_path / "adapter", targets, monkeypatch)

    out = export(store, tmp_path / "export", tmp_path / "adapter", "hf", progress=False)
    config, shipped = (json.loads((f / "config.json").read_text()) for f in (out, tmp_path / "hf"))
    assert config["architectures"] == shipped["architectures"] and config["text_config"] == shipped["text_config"]
    written = tensors(out)
    assert written.keys() == source.keys()  # the text model under the checkpoint's names, the rest as shipped
    assert all(same_bits(written[k], source[k]) for k in kept)
    merged = transformers.AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32).eval()
    assert type(merged) is type(vl)
    tokens, _ = batch()
    with torch.no_grad():
        base = vl(input_ids=tokens).logits
        adapter_config = peft.PeftConfig.from_pretrained(tmp_path / "adapter")
        adapter_config.task_type = None  # the text model inside: a plain module, not a causal LM of its own
        peft.PeftModel.from_pretrained(text, tmp_path / "adapter", config=adapter_config).merge_and_unload()
        want = vl(input_ids=tokens).logits
        assert rel_err(merged(input_ids=tokens).logits, want) < 1e-5 and rel_err(base, want) > 1e-3
    assert all(same_bits(merged.state_dict()[k], t) for k, t in vl.state_dict().items()
               if k.startswith(("vision_model", "model.visual", "vision_tower")))


def test_kimi_published_names_are_written_back_as_published(tmp_path):
    """Kimi-K2.5's Hub names (language_model.model.layers.N) come back as they were shipped, through merge_lora.py."""
    vl, _, _ = build("kimi_k25")
    vl.save_pretrained(tmp_path / "hf", safe_serialization=True)
    published_names(tmp_path / "hf")
    shutil.copytree(tmp_path / "hf", tmp_path / "src")
    processor = '{"image_processor_type": "KimiK25ImageProcessor", "patch_size": 14}\n'  # how images are fed
    (tmp_path / "src" / "preprocessor_config.json").write_text(processor)
    store = prepare_from(tmp_path / "src", tmp_path / "store")
    args = ["--model", str(store), "--out", str(tmp_path / "export"), "--format", "hf", "--quiet"]
    assert load_script("merge_lora").main(args) == 0
    source, written = tensors(tmp_path / "src"), tensors(tmp_path / "export")
    assert written.keys() == source.keys() and any(".model.layers.0." in k for k in written)
    assert all(same_bits(written[k], source[k]) for k in source)  # no adapter: every tensor as shipped
    assert (tmp_path / "export" / "preprocessor_config.json").read_text() == processor  # the processor kept too


def prepare_from(src, out):
    from test_export_hf import llama3_style_tokenizer_json
    llama3_style_tokenizer_json(src)
    assert load_script("prepare_model").main(["--src", str(src), "--out", str(out), "--quiet"]) == 0
    return out


@pytest.fixture(scope="module")
def llama4_store(tmp_path_factory):
    vl, _ = llama4_vl()
    return vl, prepare(vl, tmp_path_factory.mktemp("llama4_vl"))


def test_a_store_without_the_record_exports_the_text_model(llama4_store, tmp_path):
    """A store made before the vision tower was kept (no record in its manifest) exports Llama4ForCausalLM."""
    vl, store = llama4_store
    old = tmp_path / "old"
    shutil.copytree(store, old)
    manifest = json.loads((old / "manifest.json").read_text())
    del manifest[visionlanguage.RECORD]
    (old / "manifest.json").write_text(json.dumps(manifest))
    out = export(old, tmp_path / "export", fmt="hf", progress=False)
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Llama4ForCausalLM"]
    text = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokens, _ = batch()
    with torch.no_grad():
        assert rel_err(text(tokens).logits, vl(input_ids=tokens).logits) < 1e-5


def test_a_quantized_copy_of_the_store_keeps_the_vision_tower(llama4_store, tmp_path):
    """prepare_model.py --quantize nf4 of a vision-language store carries its record and kept tensors: the export
    of the copy is Llama4ForConditionalGeneration again, the vision tensors the shipped ones bit for bit."""
    from phantom.convert.quantstore import quantize_store
    from phantom.arch.quantformat import QuantFormat
    _, store = llama4_store
    quantize_store(store, tmp_path / "nf4", QuantFormat("nf4"), dtype=torch.bfloat16, progress=False)
    out = export(tmp_path / "nf4", tmp_path / "export", fmt="hf", progress=False)
    source, written = tensors(store.parent / "hf"), tensors(out)
    kept = json.loads((store / "manifest.json").read_text())[visionlanguage.RECORD]["tensors"]
    assert written.keys() == source.keys() and all(same_bits(written[k], source[k]) for k in kept)
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Llama4ForConditionalGeneration"]


def test_quantized_kept_tensors_refuse_a_16_bit_export_and_gguf_says_the_tower_is_not_in_it(llama4_store, tmp_path,
                                                                                             caplog):
    """Kept tensors the checkpoint ships quantized (FP8 here, by their record) would lose the quantization_config
    they are read by in a 16-bit export: refused in one line, naming --requantize. The GGUF export holds the text
    model, said in one line."""
    _, store = llama4_store
    q = tmp_path / "q"
    shutil.copytree(store, q)
    manifest = json.loads((q / "manifest.json").read_text())
    rec = manifest[visionlanguage.RECORD]
    rec["config"]["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    rec["tensors"]["vision_model.patch_embedding.linear.weight"][0] = "float8_e4m3fn"
    (q / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=r"^.*patch_embedding.linear.weight, kept beside the text model as shipped, "
                                         r"is quantized; .* add --requantize$"):
        export(q, tmp_path / "export", fmt="hf", progress=False)
    with caplog.at_level("INFO"):
        visionlanguage.check_export(BlockStore(store), "gguf", False)
    assert [r.getMessage() for r in caplog.records if "mmproj" in r.getMessage()] == [
        f"{store}: the GGUF file holds the text model; the vision tower stays in the store (llama.cpp's mmproj file "
        f"is not written)"]


def test_the_prefixes_turn_each_text_name_into_the_checkpoints():
    """The few (text, checkpoint) prefixes of each family's names; a mapping no fixed prefixes give is refused."""
    kimi = {"model.layers.0.mlp.gate_proj.weight": "language_model.model.blocks.0.mlp.gate_proj.weight",
            "model.norm.weight": "language_model.model.norm.weight", "lm_head.weight": "language_model.lm_head.weight"}
    assert visionlanguage.text_prefixes(kimi, "src") == [["model.layers.", "language_model.model.blocks."],
                                                         ["", "language_model."]]
    qwen = {"model.layers.0.mlp.gate.weight": "model.language_model.layers.0.mlp.gate.weight",
            "model.norm.weight": "model.language_model.norm.weight", "lm_head.weight": "lm_head.weight"}
    assert visionlanguage.text_prefixes(qwen, "src") == [["model.", "model.language_model."], ["", ""]]
    with pytest.raises(ValueError, match="not under fixed prefixes"):
        visionlanguage.text_prefixes({"model.a.weight": "x.a.weight", "model.b.weight": "y.b.weight"}, "src")


def int4_kimi_k25(folder):
    """A tiny Kimi-K2.5 as the Hub ships it: its routed experts compressed-tensors INT4 (tests/int4_checkpoint.py),
    the rest bf16 (the router's correction bias float32), config.json's `ignore` naming the vision tower and
    projector; and the same checkpoint dequantized by compressed-tensors, 16-bit, in folder/"reference"."""
    from int4_checkpoint import WEIGHTS, compress, decompress
    vl, _, _ = build("kimi_k25")
    vl.save_pretrained(folder / "hf", safe_serialization=True)
    expert = re.compile(r"language_model\.model\.blocks\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")
    shipped = {}
    for k, v in tensors(folder / "hf").items():
        if expert.match(k):
            shipped.update({f"{k}_{p.removeprefix('weight_')}": t for p, t in compress(v.to(torch.bfloat16)).items()})
        else:
            shipped[k] = v.to(torch.float32 if k.endswith("e_score_correction_bias") else torch.bfloat16)
    save_file(shipped, folder / "hf" / "model.safetensors", metadata={"format": "pt"})
    config = {**json.loads((folder / "hf" / "config.json").read_text()), "dtype": "bfloat16"}
    shutil.copytree(folder / "hf", folder / "reference")
    save_file({k.removesuffix("_packed"): decompress(shipped, k) if k.endswith("_packed") else v
               for k, v in shipped.items() if not k.endswith(("_scale", "_shape"))},
              folder / "reference" / "model.safetensors", metadata={"format": "pt"})
    config["quantization_config"] = {
        "config_groups": {"group_0": {"input_activations": None, "output_activations": None, "targets": ["Linear"],
                                      "weights": WEIGHTS}},
        "format": "pack-quantized", "ignore": ["lm_head", r"re:.*self_attn.*", r"re:.*shared_experts.*",
                                               r"re:.*mlp\.(gate|up|down)_proj.*", r"re:.*vision_tower.*",
                                               r"re:.*mm_projector.*"],
        "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed"}
    (folder / "hf" / "config.json").write_text(json.dumps(config, indent=2))
    return config


def test_an_int4_kimi_k25_exports_as_shipped_requantized_and_dequantized_without_its_quantization_config(tmp_path):
    """--requantize without an adapter writes every tensor of the INT4 vision-language checkpoint (the experts' INT4
    parts, the vision tower) and its config.json back as shipped, byte for byte; the 16-bit export drops
    quantization_config and transformers loads it as Kimi_K25ForConditionalGeneration with the logits of
    compressed-tensors' dequantization of the same checkpoint (within 1e-5)."""
    config = int4_kimi_k25(tmp_path)
    store = prepare_from(tmp_path / "hf", tmp_path / "store")
    args = ["--model", str(store), "--format", "hf", "--quiet"]
    assert load_script("merge_lora").main([*args, "--out", str(tmp_path / "requantized"), "--requantize"]) == 0
    source, written = tensors(tmp_path / "hf"), tensors(tmp_path / "requantized")
    assert written.keys() == source.keys() and all(same_bits(written[k], source[k]) for k in source)
    assert json.loads((tmp_path / "requantized" / "config.json").read_text()) == config
    assert load_script("merge_lora").main([*args, "--out", str(tmp_path / "16-bit")]) == 0
    exported = json.loads((tmp_path / "16-bit" / "config.json").read_text())
    assert "quantization_config" not in exported and exported["architectures"] == ["Kimi_K25ForConditionalGeneration"]
    merged, reference = (transformers.AutoModelForImageTextToText.from_pretrained(tmp_path / f, dtype=torch.float32)
                         .eval() for f in ("16-bit", "reference"))
    assert type(merged).__name__ == "Kimi_K25ForConditionalGeneration"
    tokens, _ = batch()
    with torch.no_grad():
        assert rel_err(merged(input_ids=tokens).logits, reference(input_ids=tokens).logits) < 1e-5
