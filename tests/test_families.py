"""Every family against its own transformers class: one suite over the table of tiny models (family_check.CASES).

Llama, Qwen2 / Qwen2.5, Qwen3, Mistral, Gemma-2 and -3, Phi-3 / Phi-4 and the mixtures of experts (Qwen3-MoE,
Qwen2-MoE, Mixtral, OLMoE), each a tiny random model saved by transformers and converted by
scripts/prepare_model.py: logits and loss equal transformers' streamed every way, LoRA logits and gradients
equal peft's and the adapter loads in peft, the merged export loads in transformers with equal logits, one
full-finetuning step equals torch.optim.AdamW resident and streamed. What only one family has (Gemma's soft
caps, Mistral's window, Phi-3's fused rows and longrope, Qwen3's q/k norms, the experts' routing) is checked
in that family's own file.
"""
from __future__ import annotations

import json

import pytest

from family_check import CASES, batch, check_full_step, check_logits, check_lora, check_merged_export, make
from phantom.files.store import BlockStore


@pytest.mark.parametrize("name", list(CASES))
def test_logits_and_loss_match_transformers_streamed_every_way(family_models, name):
    model, store = family_models(name)
    cfg = BlockStore(store).cfg
    assert {k: getattr(cfg, k) for k in CASES[name].facts} == CASES[name].facts
    check_logits(model, store, *batch(), runs=CASES[name].runs)  # 40 tokens: past every window of 16


@pytest.mark.parametrize("name", list(CASES))
def test_lora_matches_peft_and_the_merged_export_loads(family_models, name, tmp_path):
    """Logits, loss and every A/B gradient equal peft's on the transformers model, streamed; the adapter loads in
    peft, a fused module (Phi-3's qkv_proj) as one LoRA; the merged export loads in transformers."""
    model, store = family_models(name)
    case = CASES[name]
    tokens, targets = batch()
    adapter, logits = check_lora(model, store, tmp_path, tokens, targets, runs=case.lora_runs,
                                 lora_targets=case.lora_targets)
    assert json.loads((adapter / "adapter_config.json").read_text())["target_modules"] == list(case.adapter_modules)
    check_merged_export(store, adapter, tmp_path, tokens, logits, case.hf_class)


@pytest.mark.parametrize("name", list(CASES))
def test_full_step_matches_adamw_resident_and_streamed(family_models, name, tmp_path):
    """One full-finetuning step (for a mixture of experts, cross-entropy plus router_aux_loss_coef times
    transformers' load-balancing loss) equals torch.optim.AdamW on the transformers model: every weight, the
    routers included, resident and streamed from disk (blocks updated inside the backward, recomputed). Each
    step moves the transformers model: a fresh one each, the shared one kept as stored."""
    _, store = family_models(name)
    check_full_step(make(name), store, *batch())
    check_full_step(make(name), store, *batch(), work_dir=tmp_path / "work")


def test_a_tied_model_keeps_one_table_and_links_it(family_models):
    """A tied table is one parameter: the embedding's and the head's gradients add up in it, and full
    finetuning updates it once (the full step above); the store keeps it once and links it in place."""
    model, store = family_models("qwen2-tied", link=True)
    s = BlockStore(store)
    assert s.cfg.tie_embeddings and set(s.load_head()) == {"norm.weight"}
    manifest = json.loads((store / "manifest.json").read_text())
    assert "embed.safetensors" in json.dumps(manifest.get("links", {}))  # read in place, not copied
    check_logits(model, store, *batch(), runs=[("disk", 1, "all")])
