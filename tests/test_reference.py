"""Independent references: phantom's maths against code phantom did not write.

transformers' LlamaForCausalLM (with peft for LoRA) gives the logits and the gradients for MHA, GQA and
Llama-3.1 RoPE scaling past the original context; plain autograd of F.cross_entropy over full logits
checks the fused, chunked head + loss. Models are built in-process from configs (no download). Under
CI=true a missing library is an error, not a skip, so these checks cannot silently stop running.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import phantom
from phantom.arch.config import ModelConfig, RopeScaling
from phantom.files.store import BlockStore
from phantom.convert.convert import convert_checkpoint
from phantom.model.lora import PROJECTIONS, TARGETS, lora_modules
from phantom.model.heads import ChunkedHeadLoss
from conftest import need
from test_convert import hf_config


transformers = need("transformers")
peft = need("peft")

MHA = ModelConfig(dim=64, n_layers=2, n_heads=4, vocab_size=96, multiple_of=32, max_seq_len=64)  # Llama-2 7B style
GQA = ModelConfig(dim=64, n_layers=2, n_heads=8, n_kv_heads=2, vocab_size=96, multiple_of=32, max_seq_len=64)
LLAMA31 = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, multiple_of=32, max_seq_len=64,
                      rope_theta=500000.0, rope_scaling=RopeScaling(original_max_seq_len=16))
CONFIGS = {"mha": MHA, "gqa": GQA, "llama31": LLAMA31}
T = 40  # tokens per row: past LLAMA31's original context of 16, where its scaling changes the angles
ALL_TARGETS = PROJECTIONS


def hf_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Meta's q/k row order -> HF's, as transformers' convert_llama_weights_to_hf.py writes it (not phantom's)."""
    dim1 = w.shape[0]
    return w.view(n_heads, dim1 // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def hf_model(cfg: ModelConfig, seed: int = 0, **overrides):
    """A random LlamaForCausalLM in fp32, weights large enough that attention is far from uniform."""
    c = {k: v for k, v in hf_config(cfg).items() if k not in ("architectures", "torch_dtype")}
    config = transformers.LlamaConfig(**{**c, "initializer_range": 0.1, "attn_implementation": "eager",
                                         **overrides})
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape))  # norms that are not all ones
    return model


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """name -> (HF model, phantom store converted from its saved folder), built once per config."""
    out = {}

    def get(name: str):
        if name not in out:
            root = tmp_path_factory.mktemp(name)
            model = hf_model(CONFIGS[name])
            model.save_pretrained(root / "hf", safe_serialization=True)
            out[name] = model, convert_checkpoint(root / "hf", root / "store", progress=False)["out"]
        return out[name]
    return get


def tokens_and_targets(cfg: ModelConfig, b: int = 2, t: int = T, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (b, t), generator=gen)
    targets = torch.randint(0, cfg.vocab_size, (b, t), generator=gen)
    targets[:, :5] = -100  # a masked prompt
    targets[torch.rand(b, t, generator=gen) < 0.2] = -100
    return tokens, targets


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).abs().max() / b.abs().max()).item()


# ---------------------------------------------------------------------------------------------
# Logits: phantom (resident and streamed) against transformers

@pytest.mark.parametrize("offload", ["none", "disk"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(stores, name, offload):
    model, store = stores(name)
    tokens, _ = tokens_and_targets(CONFIGS[name])
    with torch.no_grad():
        expected = model(tokens).logits
    with phantom.load(store, offload=offload, lora=None, prefetch=1) as pm, torch.no_grad():
        got = pm(tokens)
    assert rel_err(got, expected) < 1e-5


def test_llama31_scaling_matters_where_it_is_checked(stores):
    """The scaled test above would pass unscaled RoPE too if scaling changed nothing at these positions."""
    model, _ = stores("llama31")
    unscaled = hf_model(LLAMA31, rope_scaling=None)
    unscaled.load_state_dict(model.state_dict())
    tokens, _ = tokens_and_targets(LLAMA31)
    with torch.no_grad():
        a, b = model(tokens).logits, unscaled(tokens).logits
    assert rel_err(a[:, 0], b[:, 0]) < 1e-6  # position 0 has no rotation
    assert rel_err(a[:, 16:], b[:, 16:]) > 0.05  # past the original context: far more than rounding


# ---------------------------------------------------------------------------------------------
# LoRA: phantom's adapter on peft's model; loss and every A/B gradient against peft's autograd

def phantom_lora_step(store, tokens, targets, adapter_dir, offload: str, targets_lora=ALL_TARGETS):
    lora = phantom.LoraConfig(rank=4, alpha=8, targets=targets_lora)
    with phantom.load(store, offload=offload, lora=lora, prefetch=1, loss_chunk=7) as pm:
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in pm.trainable_parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)  # B nonzero, so A gets gradients
            logits = pm(tokens)
        pm.save_adapter(adapter_dir)
        loss = pm(tokens, targets=targets)
        loss.backward()
        grads = {(i, t): (m.lora_A.grad.clone(), m.lora_B.grad.clone()) for (i, t), m in lora_modules(pm.layers).items()}
    return logits, loss.detach(), grads


def peft_step(model, adapter_dir, tokens, targets):
    pmodel = peft.PeftModel.from_pretrained(model, adapter_dir, is_trainable=True).eval()
    logits = pmodel(tokens).logits
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    loss.backward()
    params = dict(pmodel.named_parameters())
    grads = {}
    for i in range(model.config.num_hidden_layers):
        for t, (_, hf_name) in TARGETS.items():
            key = f"base_model.model.model.layers.{i}.{hf_name}"
            if f"{key}.lora_A.default.weight" in params:
                grads[(i, t)] = (params[f"{key}.lora_A.default.weight"].grad,
                                 params[f"{key}.lora_B.default.weight"].grad)
    pmodel.unload()  # leave the shared HF model as it was
    return logits.detach(), loss.detach(), grads


def peft_lora_grads(pmodel, n_layers: int) -> dict:
    """(A, B) LoRA gradients of every block and target of a peft model, keyed (block, phantom target);
    a target the adapter lacks is a KeyError."""
    params = dict(pmodel.named_parameters())
    grads = {}
    for i in range(n_layers):
        for t in PROJECTIONS:
            key = f"base_model.model.model.layers.{i}.{TARGETS[t][1]}"
            grads[(i, t)] = (params[f"{key}.lora_A.default.weight"].grad, params[f"{key}.lora_B.default.weight"].grad)
    return grads


def in_pairs(store) -> bool:
    """Whether the store keeps q/k rows in Meta's rotary pairs (an older store; one converted from a Hugging Face
    checkpoint keeps HF's halves, as shipped: its manifest's rope_interleave false)."""
    return BlockStore(store).cfg.rope_interleave


def assert_lora_grads_match(grads: dict, ref: dict, cfg: ModelConfig, tol: float, pairs: bool = False) -> None:
    """{(block, target): (A's gradient, B's)} of every block and target equal peft's within tol (with `pairs`, B's
    q and k rows put in HF's order first: a store in Meta's pairs)."""
    assert grads.keys() == ref.keys() and len(grads) == cfg.n_layers * len(ALL_TARGETS)
    heads = {"q": cfg.n_heads, "k": cfg.kv_heads}
    for (i, t), (ga, gb) in grads.items():
        ra, rb = ref[(i, t)]
        if t in heads and pairs:
            gb = hf_permute(gb, heads[t])
        assert rel_err(ga, ra) < tol, (i, t, "A")
        assert rel_err(gb, rb) < tol, (i, t, "B")


@pytest.mark.parametrize("offload", ["none", "disk"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_lora_gradients_match_peft(stores, tmp_path, name, offload):
    model, store = stores(name)
    cfg = CONFIGS[name]
    tokens, targets = tokens_and_targets(cfg)
    logits, loss, grads = phantom_lora_step(store, tokens, targets, tmp_path / "adapter", offload)
    ref_logits, ref_loss, ref_grads = peft_step(model, tmp_path / "adapter", tokens, targets)
    assert rel_err(logits, ref_logits) < 1e-5
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    assert_lora_grads_match(grads, ref_grads, cfg, 1e-4, in_pairs(store))


def test_qk_adapter_under_gqa_gives_peft_logits(stores, tmp_path):
    """q and k LoRA under GQA: lora_B's rows are permuted per query or kv head; peft must see the same model."""
    model, store = stores("gqa")
    tokens, targets = tokens_and_targets(GQA)
    logits, _, _ = phantom_lora_step(store, tokens, targets, tmp_path / "qk", "none", ("q", "k"))
    with torch.no_grad():
        base = model(tokens).logits
        pmodel = peft.PeftModel.from_pretrained(model, tmp_path / "qk").eval()
        ref = pmodel(tokens).logits
        pmodel.unload()
    assert rel_err(ref, base) > 1e-2  # the adapter changes the output
    assert rel_err(logits, ref) < 1e-5


# ---------------------------------------------------------------------------------------------
# Full finetuning: every gradient (embedding, blocks, norm, head) against transformers' autograd

@pytest.mark.parametrize("name", ["mha", "gqa"])
def test_full_gradients_match_transformers(stores, name):
    model, store = stores(name)
    cfg = CONFIGS[name]
    tokens, targets = tokens_and_targets(cfg)
    for p in model.parameters():
        p.requires_grad_(True)  # peft froze them in the tests above
        p.grad = None
    loss_ref = F.cross_entropy(model(tokens).logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    loss_ref.backward()
    ref = {k: p.grad for k, p in model.named_parameters()}
    with phantom.load(store, offload="none", lora=None, mode="full", loss_chunk=7) as pm:
        loss = pm(tokens, targets=targets)
        loss.backward()
        torch.testing.assert_close(loss.detach(), loss_ref.detach(), rtol=1e-5, atol=0)
        assert rel_err(pm.embed_table.grad, ref["model.embed_tokens.weight"]) < 1e-4
        assert rel_err(pm.norm_weight.grad, ref["model.norm.weight"]) < 1e-4
        assert rel_err(pm.output_weight.grad, ref["lm_head.weight"]) < 1e-4
        hf_names = {"attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
                    "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
                    "feed_forward.w1": "mlp.gate_proj", "feed_forward.w2": "mlp.down_proj",
                    "feed_forward.w3": "mlp.up_proj", "attention_norm": "input_layernorm",
                    "ffn_norm": "post_attention_layernorm"}
        for i, block in enumerate(pm.layers):
            for ours, theirs in hf_names.items():
                g = block.get_submodule(ours).weight.grad
                if ours in ("attention.wq", "attention.wk") and in_pairs(store):
                    g = hf_permute(g, cfg.n_heads if ours == "attention.wq" else cfg.kv_heads)
                assert rel_err(g, ref[f"model.layers.{i}.{theirs}.weight"]) < 1e-4, (i, ours)


# ---------------------------------------------------------------------------------------------
# The fused head + loss against plain autograd over full logits

def plain_head_loss(h, norm_w, out_w, targets, eps):
    x = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * norm_w
    return F.cross_entropy((x @ out_w.T).flatten(0, 1), targets.flatten(), ignore_index=-100)


@pytest.mark.parametrize("chunk", [1, 5, 22, 1000])
def test_fused_head_loss_matches_cross_entropy(chunk):
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(2, 11, 32, generator=gen)
    norm_w, out_w = 1 + 0.2 * torch.randn(32, generator=gen), torch.randn(50, 32, generator=gen) * 0.3
    targets = torch.randint(0, 50, (2, 11), generator=gen)
    targets[0, :4] = -100
    targets[1, 7] = -100
    ins = [t.clone().requires_grad_() for t in (h, norm_w, out_w)]
    ref = [t.clone().requires_grad_() for t in (h, norm_w, out_w)]
    loss = ChunkedHeadLoss.apply(*ins, targets, 1e-5, chunk)
    (2.5 * loss).backward()  # an upstream gradient other than 1
    expected = plain_head_loss(*ref, targets, 1e-5)
    (2.5 * expected).backward()
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
    for a, b in zip(ins, ref):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7)


def test_fused_head_loss_with_every_target_ignored_is_zero():
    h, norm_w, out_w = torch.randn(1, 4, 8, requires_grad=True), torch.ones(8), torch.randn(10, 8)
    loss = ChunkedHeadLoss.apply(h, norm_w, out_w, torch.full((1, 4), -100), 1e-5, 3)
    loss.backward()
    assert loss.item() == 0 and not h.grad.any()
