"""The checks every family passes against its own transformers model (imported by tests/test_<family>.py).

A tiny random model of the family is built from its transformers config class, saved with
save_pretrained (with a byte-level BPE tokenizer), converted by scripts/prepare_model.py, and
compared: logits and loss of the streamed model (disk and RAM tiers, prefetch 0 and 2, activations
kept and recomputed) with transformers'; LoRA gradients with peft's; the adapter loaded by peft;
the merged --format hf export loaded by AutoModelForCausalLM and AutoTokenizer; one full-finetuning
step with torch.optim.AdamW on the transformers model.
"""
from __future__ import annotations

import importlib
import itertools
import json
import os

import pytest
import torch
import torch.nn.functional as F

import phantom
from phantom.model.export import export, to_hf
from phantom.model.lora import TARGETS, adapted_modules
from phantom.files.store import BlockStore
from test_convert import load_script
from test_export_hf import llama3_style_tokenizer_json


def need(module: str):
    """The module, or a skip outside CI; in CI (CI=true) a missing cross-check library fails the run."""
    if os.environ.get("CI") == "true":
        return importlib.import_module(module)
    return pytest.importorskip(module)


transformers = need("transformers")
peft = need("peft")

VOCAB = 400  # the tokenizer's size: ids the tokenizer makes are ids the model has
ALL_TARGETS = tuple(TARGETS)
EPS = 1e-3  # AdamW's eps in the full-finetuning step (see check_full_step)
STREAMED = list(itertools.product(("disk", "ram"), (0, 2), ("none", "all")))  # offload, prefetch, recompute


def hf_model(config_class: str, seed: int = 0, **fields):
    """A random model of the family in fp32 (eager attention), with norms and biases that are not 1 and 0."""
    config = getattr(transformers, config_class)(**{"vocab_size": VOCAB, "initializer_range": 0.1, **fields})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape))
    return model


def prepare(model, root, link: bool = False):
    """save_pretrained (+ a tokenizer) -> scripts/prepare_model.py -> the store's folder."""
    model.save_pretrained(root / "hf", safe_serialization=True)
    llama3_style_tokenizer_json(root / "hf")
    args = ["--src", str(root / "hf"), "--out", str(root / "store"), "--quiet"] + (["--link"] if link else [])
    assert load_script("prepare_model").main(args) == 0
    return root / "store"


def model_stores(tmp_path_factory, make):
    """get(name, link=False) -> (the transformers model make(name) builds, its store), each made once (a
    module-scoped fixture's body)."""
    built = {}

    def get(name: str, link: bool = False):
        if (name, link) not in built:
            model = make(name)
            built[(name, link)] = model, prepare(model, tmp_path_factory.mktemp(name), link=link)
        return built[(name, link)]
    return get


def batch(b: int = 2, t: int = 40, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (b, t), generator=gen)
    targets = torch.randint(0, VOCAB, (b, t), generator=gen)
    targets[:, :5] = -100
    return tokens, targets


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).abs().max() / b.abs().max()).item()


def cross_entropy(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)


def check_logits(model, store, tokens, targets, runs=STREAMED):
    """The base model, streamed every way: logits and loss equal transformers' within 1e-5."""
    with torch.no_grad():
        ref = model(tokens).logits
    ref_loss = cross_entropy(ref, targets)
    for offload, prefetch, recompute in runs:
        with phantom.load(store, offload=offload, prefetch=prefetch, recompute=recompute, lora=None) as pm:
            with torch.no_grad():
                assert rel_err(pm(tokens), ref) < 1e-5, (offload, prefetch, recompute)
                torch.testing.assert_close(pm(tokens, targets=targets), ref_loss, rtol=1e-5, atol=0)
    return ref


def lora_step(store, tokens, targets, adapter_dir=None, lora_targets=ALL_TARGETS, **knobs):
    """A LoRA on every projection (or lora_targets), B random (so A gets gradients): logits, loss,
    {(layer, target): grads}."""
    lora = phantom.LoraConfig(rank=4, alpha=8, targets=lora_targets)
    with phantom.load(store, lora=lora, loss_chunk=7, **knobs) as pm:
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in pm.trainable_parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            logits = pm(tokens)
        if adapter_dir is not None:
            pm.save_adapter(adapter_dir)
        loss = pm(tokens, targets=targets)
        loss.backward()
        grads = lora_grads(pm)
    return logits, loss.detach(), grads


def lora_grads(pm) -> dict:
    """{(layer, HF module): (A's gradient, B's in HF's rows)}, as peft has them: a fused module's (Phi-3's
    qkv_proj) is one A, shared by its parts, and its parts' B rows stacked."""
    heads = {"q": pm.cfg.n_heads, "k": pm.cfg.kv_heads}
    out = {}
    for i, module, parts in adapted_modules(pm.layers, pm.cfg):
        bs = [to_hf_rows(m.lora_B.grad, heads[t], pm.cfg.rope_dim) if t in heads else m.lora_B.grad for t, m in parts]
        out[(i, module)] = (parts[0][1].lora_A.grad.clone(), torch.cat(bs))
    return out


def peft_grads(pmodel) -> dict:
    """{(layer, HF module): (A's gradient, B's)} of every LoRA in a peft model."""
    params = dict(pmodel.named_parameters())
    out = {}
    for name, p in params.items():
        if name.endswith(".lora_A.default.weight"):
            base = name.removesuffix(".lora_A.default.weight")
            layer, module = base.split(".layers.", 1)[1].split(".", 1)
            out[(int(layer), module)] = (p.grad, params[f"{base}.lora_B.default.weight"].grad)
    return out


def peft_step(model, adapter_dir, tokens, targets):
    """The adapter on the transformers model through peft: logits, loss, gradients (HF's q/k row order)."""
    pmodel = peft.PeftModel.from_pretrained(model, adapter_dir, is_trainable=True).eval()
    logits = pmodel(tokens).logits
    loss = cross_entropy(logits, targets)
    loss.backward()
    grads = peft_grads(pmodel)
    pmodel.unload()
    for p in model.parameters():
        p.grad = None
    return logits.detach(), loss.detach(), grads


def check_lora(model, store, tmp_path, tokens, targets, runs=STREAMED, lora_targets=ALL_TARGETS):
    """LoRA logits, loss and every A/B gradient equal peft's, streamed every way; the adapter loads in peft."""
    adapter = tmp_path / "adapter"
    lora_step(store, tokens, targets, adapter, lora_targets, offload="none")
    ref_logits, ref_loss, ref_grads = peft_step(model, adapter, tokens, targets)
    for offload, prefetch, recompute in runs:
        logits, loss, grads = lora_step(store, tokens, targets, lora_targets=lora_targets, offload=offload,
                                        prefetch=prefetch, recompute=recompute)
        assert rel_err(logits, ref_logits) < 1e-5, (offload, prefetch, recompute)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
        assert grads.keys() == ref_grads.keys()
        for (i, t), (ga, gb) in grads.items():
            ra, rb = ref_grads[(i, t)]
            assert rel_err(ga, ra) < 1e-4, (offload, prefetch, recompute, i, t, "A")
            assert rel_err(gb, rb) < 1e-4, (offload, prefetch, recompute, i, t, "B")
    return adapter, ref_logits


def to_hf_rows(w: torch.Tensor, n_heads: int, rotary: int) -> torch.Tensor:
    """Meta's interleaved RoPE rows -> HF's half split, over the leading `rotary` rows of each head (the rest
    stay): rows 0, 2, 4, .. then 1, 3, 5, .. of each head, as transformers' convert_llama_weights_to_hf.py
    orders them (written here by index, apart from phantom's permute)."""
    head = w.shape[0] // n_heads
    order = torch.cat([torch.arange(0, rotary, 2), torch.arange(1, rotary, 2), torch.arange(rotary, head)])
    return w[(torch.arange(n_heads)[:, None] * head + order).flatten()]


def check_merged_export(store, adapter, tmp_path, tokens, expected_logits, hf_class: str):
    """merge_lora's --format hf: loads with AutoModelForCausalLM as the family's class, equal logits; AutoTokenizer."""
    out = export(store, tmp_path / "merged", adapter, "hf", progress=False)
    merged = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(merged).__name__ == hf_class
    generation = json.loads((out / "generation_config.json").read_text())  # the tokenizer's ids, in config.json too
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(merged.config, key) == generation.get(key), key
    with torch.no_grad():
        assert rel_err(merged(tokens).logits, expected_logits) < 1e-5
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok("Once upon a time")["input_ids"]  # the tokenizer the model came with


def check_full_step(model, store, tokens, targets, work_dir=None, lr: float = 1e-3):
    """One full-finetuning step equals torch.optim.AdamW on the transformers model within 1e-5: resident,
    or streamed from disk with work_dir (blocks updated by the block optimizer inside backward).

    AdamW's first update is lr * g / (|g| + eps): at eps 1e-8 that is lr * sign(g), so a gradient of
    1e-7 that rounding moves by 1e-7 may flip; eps 1e-3 (on both sides) keeps the update a smooth
    function of the gradient, which is what the comparison is about. It still scales gradient
    rounding (fp32 gradients agree to a few 1e-6) by lr / eps: lr 1e-3 keeps that under the bound
    while the update (1e-3 a weight) is at least 100 times the tolerance."""
    for p in model.parameters():
        p.requires_grad_(True)
        p.grad = None
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ref_opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, eps=EPS)
    moe = hasattr(model.config, "router_aux_loss_coef")  # its router loss, as transformers adds it
    out = model(tokens, output_router_logits=True) if moe else model(tokens)
    (cross_entropy(out.logits, targets) + (model.config.router_aux_loss_coef * out.aux_loss if moe else 0)).backward()
    ref_opt.step()
    knobs = dict(offload="none") if work_dir is None else dict(offload="disk", prefetch=1, work_dir=work_dir)
    with phantom.load(store, mode="full", loss_chunk=7, optim=phantom.AdamWConfig(lr=lr, weight_decay=0.1, eps=EPS),
                      **knobs) as pm:
        opt = torch.optim.AdamW(pm.trainable_parameters(), lr=lr, weight_decay=0.1, eps=EPS)
        pm(tokens, targets=targets).backward()
        opt.step()
        n_trained = len(pm.trainable_parameters())
        if work_dir is not None:
            pm.finish_step()
            pm.save_full()
            trained = BlockStore(work_dir / "store")
            parts = {"embed": trained.load_embed(), "head": trained.load_head(),
                     **{i: trained.load_block(i) for i in range(trained.n_blocks)}}
        else:
            parts = {"embed": {"tok_embeddings.weight": pm.embed_table}, "head": {"norm.weight": pm.norm_weight},
                     **{i: block.state_dict() for i, block in enumerate(pm.layers)}}
            if not pm.cfg.tie_embeddings:
                parts["head"]["output.weight"] = pm.output_weight
    ours = {}
    for part, tensors in parts.items():
        ours |= to_hf(pm.cfg, part, {k: v.detach() for k, v in tensors.items()}, fused_experts=moe)
    theirs = dict(model.named_parameters())
    assert set(ours) == set(theirs)
    if work_dir is None:
        assert n_trained == sum(map(len, parts.values()))  # a tied table is one parameter in both
    for name, p in theirs.items():
        assert not torch.equal(p, before[name]), name  # the step moved it
        assert rel_err(ours[name], p) < 1e-5, name
