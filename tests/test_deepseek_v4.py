"""DeepSeek-V4 beyond the shared checks of tests/test_families.py (logits and loss streamed every way, LoRA on its
attention, compressors and shared expert against peft, the merged export, the full step with the routers' loss
against AdamW):

- each feature of the family changes transformers' logits, so the shared checks see it;
- LoRA on attention and the experts (peft's target_parameters) equals peft, resident and streamed with the experts
  read routed and whole (the hashed layers' by the token ids carried to their blocks);
- LoRA on the grouped o_a_proj is peft's target_parameters LoRA on its weight (peft's LoRA module on it fails);
- the Hub's names (DeepSeek's own) and the older config fields are read as transformers reads them;
- what phantom does not model is refused in one line.
"""
from __future__ import annotations

import json
import math

import peft
import pytest
import torch
from safetensors.torch import load_file, save_file

import phantom
from family_check import V4, VOCAB, batch, lora_grads, make, peft_step, prepare, rel_err
from phantom.arch.config import ConfigError, block_tensor_shapes
from phantom.arch.family import config_from_hf
from phantom.files.store import BlockStore
from test_deepseek import differs, zero
from test_moe_lora import adapter_tensors, assert_runs_equal_peft, expert_adapter
from test_moe_routed import ram_streams  # noqa: F401  (a fixture: the RAM tier read into slots, as on CUDA)


CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"


def permuted(suffix: str):
    def edit(model):
        for n, t in model.named_buffers():
            if n.endswith(suffix):
                t.copy_(t.roll(1, dims=0))
    return edit


@pytest.mark.parametrize("change,edit", [
    (dict(hc_sinkhorn_iters=1), None),  # the streams' mixing matrix, made doubly stochastic
    (None, zero("attn_hc.base")),  # the hyper-connections' pre, post and comb biases
    (None, zero("hc_head.hc_base")),  # the head's mix of the streams
    (dict(index_topk=10), None),  # the indexer picks 3 of 10 entries; 10 is every one
    (None, zero("layers.2.self_attn.compressor.kv_proj.weight")),  # the heavily compressed entries
    (None, zero("layers.1.self_attn.compressor.position_bias")),  # a compressor's bias per slot
    (dict(sliding_window=8), None),
    (None, zero("self_attn.sinks")),
    (None, permuted("tid2eid")),  # the hashed layers' experts, by token id
    (dict(scoring_func="sigmoid"), None),  # sqrt(softplus) scores
    (None, zero("e_score_correction_bias")),
    (dict(routed_scaling_factor=1.0), None),
    (dict(swiglu_limit=100.0), None),  # the SwiGLU clamp
    (dict(rope_theta=500.0), None),  # the sliding layers' RoPE base
    (dict(compress_rope_theta=500.0), None),  # the compressed layers'
    (dict(rope_parameters={**V4["rope_parameters"], "factor": 2.0}), None),  # their YaRN
    (dict(partial_rotary_factor=0.5), None),  # RoPE over the last 8 of 32 dims of each head
])
def test_each_feature_changes_transformers_logits(change, edit):
    assert differs("deepseek_v4", change, edit) > 1e-3


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    built = {}

    def get(name):
        if name not in built:
            model = make(name)
            built[name] = model, prepare(model, tmp_path_factory.mktemp(name))
        return built[name]
    return get


@pytest.mark.usefixtures("ram_streams")
def test_expert_lora_equals_peft_with_experts_read_routed_and_whole(models, tmp_path):
    """q, k, v, o (q_b_proj, kv_proj, o_b_proj) and every expert: resident and streamed from disk and RAM, experts
    read routed (the hashed layers' by token id) and whole, within 1e-5 (logits) and 1e-4 (gradients) of peft."""
    model, store, tokens, targets, adapter, config = expert_adapter(models, "deepseek_v4", tmp_path)
    assert config["target_modules"] == ["self_attn.kv_proj", "self_attn.o_b_proj", "self_attn.q_b_proj"]
    assert_runs_equal_peft(store, tokens, targets, peft_step(model, adapter, tokens, targets))


def test_o_a_proj_lora_is_peft_target_parameters_on_its_weight(models, tmp_path):
    """transformers' o_a_proj is a DeepseekV4GroupedLinear (its input (..., o_groups, in)): peft 0.21's LoRA module on
    it fails in its forward; its target_parameters LoRA on the weight (W + scale B A, viewed in groups) runs. An
    adapter get_peft_model makes so (layer 1 at rank 2 through rank_pattern) loads into phantom: logits within 1e-5
    and every A and B gradient within 1e-4 of peft's, resident and streamed; it saves back with peft's names and
    tensors. What peft's target_parameters LoRA cannot do (dropout, layers) and the module named as a target are
    refused in one line."""
    from phantom.files.tensorfile import StoreError
    from phantom.model.adapterfiles import read_adapter_config
    model, store = models("deepseek_v4")
    tokens, targets = batch()
    broken = peft.get_peft_model(make("deepseek_v4"), peft.LoraConfig(target_modules=["self_attn.o_a_proj"], r=4))
    with pytest.raises(RuntimeError, match="must match the size"):
        broken(tokens)
    pmodel = peft.get_peft_model(make("deepseek_v4"), peft.LoraConfig(
        target_modules=[], target_parameters=["self_attn.o_a_proj.weight"], r=4, lora_alpha=8,
        rank_pattern={"layers.1.self_attn.o_a_proj.weight": 2}))
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in (p for n, p in pmodel.named_parameters() if "lora_" in n):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    pmodel.save_pretrained(tmp_path / "peft")
    theirs = adapter_tensors(tmp_path / "peft")
    assert theirs["base_model.model.model.layers.1.self_attn.o_a_proj.lora_A.weight"].shape == (2, 64)
    assert theirs["base_model.model.model.layers.0.self_attn.o_a_proj.lora_B.weight"].shape == (32, 4)
    ref_logits, ref_loss, ref_grads = peft_step(model, tmp_path / "peft", tokens, targets)
    with torch.no_grad():
        assert rel_err(ref_logits, model(tokens).logits) > 1e-3  # the LoRA changes the logits
    lora = read_adapter_config(tmp_path / "peft")
    assert lora.targets == ("o_a",)
    for offload, prefetch in (("none", 0), ("disk", 1)):
        with phantom.load(store, lora=lora, offload=offload, prefetch=prefetch, loss_chunk=7) as pm:
            pm.load_adapter(tmp_path / "peft")
            with torch.no_grad():
                assert rel_err(pm(tokens), ref_logits) < 1e-5, offload
            loss = pm(tokens, targets=targets)
            loss.backward()
            torch.testing.assert_close(loss.detach(), ref_loss, rtol=1e-5, atol=0)
            grads = lora_grads(pm)
            assert grads.keys() == ref_grads.keys() and len(grads) == 4
            for key, (ga, gb) in grads.items():
                assert rel_err(ga, ref_grads[key][0]) < 1e-4 and rel_err(gb, ref_grads[key][1]) < 1e-4, key
            pm.save_adapter(tmp_path / "back")
    ours = adapter_tensors(tmp_path / "back")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    config = json.loads((tmp_path / "back" / "adapter_config.json").read_text())
    assert config["target_modules"] == [] and config["target_parameters"] == ["self_attn.o_a_proj.weight"]
    for bad, words in ((dict(dropout=0.1), "dropout"), (dict(layers=(0,)), "layers_to_transform")):
        with pytest.raises(ValueError, match=words):
            phantom.load(store, lora=phantom.LoraConfig(targets=("q", "o_a"), **bad))
    (tmp_path / "peft" / "adapter_config.json").write_text(json.dumps(
        json.loads((tmp_path / "peft" / "adapter_config.json").read_text()) | {"target_modules": ["self_attn.o_a_proj"],
                                                                               "target_parameters": None}))
    with pytest.raises(StoreError, match="target_parameters self_attn.o_a_proj.weight"):
        read_adapter_config(tmp_path / "peft")


def test_the_hub_names_are_read_as_transformers_reads_them(models, tmp_path):
    """DeepSeek's own names (layers.N.attn.wq_a, ffn.experts.E.w1, hc_head_fn, embed, head; no model. prefix), as
    the Hub's files hold them, give the store save_pretrained's files give."""
    model, store = models("deepseek_v4")
    hub = tmp_path / "hub"
    hub.mkdir()
    src = store.parent / "hf"
    tensors = load_file(str(src / "model.safetensors"))
    assert "model.layers.1.attn.compressor.ape" in tensors  # save_pretrained writes DeepSeek's names
    renamed = {k.removeprefix("model.").replace("hc_head.hc_", "hc_head_").replace("embed_tokens", "embed"): v
               for k, v in tensors.items()}
    assert {"embed.weight", "head.weight", "hc_head_fn", "layers.1.ffn.gate.tid2eid"} <= set(renamed)
    save_file(renamed, str(hub / "model.safetensors"), metadata={"format": "pt"})
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        if (src / name).is_file():
            (hub / name).write_bytes((src / name).read_bytes())
    out = prepare_from(hub, tmp_path / "store")
    ours, theirs = BlockStore(out), BlockStore(store)
    for i in range(ours.n_blocks):
        a, b = ours.load_block(i), theirs.load_block(i)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert all(torch.equal(v, theirs.load_head()[k]) for k, v in ours.load_head().items())


def prepare_from(src, out, link: bool = False):
    from test_convert import load_script
    args = ["--src", str(src), "--out", str(out), "--quiet"] + (["--link"] if link else [])
    assert load_script("prepare_model").main(args) == 0
    return out


def test_older_config_fields_are_read_as_transformers_folds_them():
    """compress_ratios (0 / 4 / 128 per layer), compress_rate_csa / _hca, num_hash_layers and qk_rope_head_dim, as
    DeepseekV4Config.__post_init__ folds them into layer_types, compress_rates, mlp_layer_types and the RoPE width."""
    c = make("deepseek_v4").config.to_dict()
    new = config_from_hf(c)
    for key in ("layer_types", "compress_rates", "mlp_layer_types", "partial_rotary_factor"):
        c.pop(key)
    old = config_from_hf({**c, "compress_ratios": [0, 4, 128, 4], "compress_rate_hca": 8, "num_hash_layers": 2,
                          "qk_rope_head_dim": 8})
    assert old == new
    assert (new.layer_types, new.csa_rate, new.hca_rate, new.hash_layers, new.rope_dim) == \
        (("sliding_attention", CSA, HCA, CSA), 4, 8, (0, 1), 8)


@pytest.mark.parametrize("fields,named", [
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"n_shared_experts": 2}, "n_shared_experts"),
    ({"norm_topk_prob": False}, "norm_topk_prob"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"attention_bias": True}, "attention_bias"),
    ({"layer_types": ["full_attention"] * 4}, "layer_types"),
    ({"rope_parameters": {"main": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4},
                          "compress": {"rope_type": "default", "rope_theta": 1.6e5}}}, "rope_parameters.main"),
    ({"rope_parameters": {"main": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 1.0},
                          "compress": {"rope_type": "default", "rope_theta": 1.6e5}}}, "partial_rotary_factor"),
    ({"quantization_config": {"quant_method": "awq"}}, "quantization_config"),
])
def test_what_is_not_modelled_is_refused_naming_the_field(fields, named):
    with pytest.raises(ConfigError, match=named):
        config_from_hf({**make("deepseek_v4").config.to_dict(), **fields})


def test_a_packed_row_equals_its_examples_alone(models):
    """A row packing two examples (24 and 16 tokens: past the window of 16 and several compressed windows each) gives
    each example's logits as transformers gives them for that example alone, streamed and resident; the hashed layers
    read each token's own id."""
    import phantom
    from family_check import rel_err
    model, store = models("deepseek_v4")
    tokens, _ = batch(2, 40)
    segments = torch.zeros_like(tokens)
    segments[:, 24:] = 1
    with torch.no_grad():
        refs = [model(tokens[:, :24]).logits, model(tokens[:, 24:]).logits]
    for offload in ("none", "disk"):
        with phantom.load(store, offload=offload, prefetch=1, lora=None) as pm, torch.no_grad():
            out = pm(tokens, segments=segments)
        assert rel_err(out[:, :24], refs[0]) < 1e-5 and rel_err(out[:, 24:], refs[1]) < 1e-5, offload


def test_scoring_equals_transformers_log_probabilities(models):
    """lm-eval's loglikelihood on token ids (phantom.train.score): requests of three lengths right-padded into one
    micro-batch (the hashed layers routed by each row's own ids, the streams mixed by the head's hyper-connection), each
    continuation's log-probability as transformers' logits give it, resident and streamed; generation, which needs the
    compressors' cache, is refused in one line."""
    import phantom
    from phantom.model.generate import Request, generate_many
    from phantom.train import score
    model, store = models("deepseek_v4")
    gen = torch.Generator().manual_seed(0)
    requests = [(torch.randint(0, VOCAB, (n,), generator=gen).tolist(), torch.randint(0, VOCAB, (m,), generator=gen)
                 .tolist()) for n, m in ((30, 8), (10, 5), (7, 3))]
    with torch.no_grad():
        want = [float(torch.log_softmax(model(torch.tensor([c + x])).logits[0, len(c) - 1:-1], -1)
                      .gather(1, torch.tensor(x)[:, None]).sum()) for c, x in requests]
    for offload in ("none", "disk"):
        with phantom.load(store, offload=offload, prefetch=1, lora=None) as pm:
            got = score.score(pm, requests, batch_size=3)
            assert max(abs(g - w) for (g, _), w in zip(got, want)) < 1e-4, (offload, got, want)
            with pytest.raises(ValueError, match="keeps no cache: generation is not supported"):
                generate_many(pm, [Request(requests[0][0], 2)])


def test_the_hashed_layers_tables_are_stored_exactly(models):
    """Each token id's experts (tid2eid, int64) kept as two base-256 digits, given back exactly by the export's names;
    no correction bias in those layers; the token ids cost 8 bytes a token of carried state."""
    from phantom.arch import carry
    from phantom.convert.hflayout import to_hf
    model, store = models("deepseek_v4")
    s = BlockStore(store)
    assert s.cfg.hash_layers == (0, 1) and "feed_forward.gate.e_score_correction_bias" not in s.load_block(0)
    for i in (0, 1):
        hf = to_hf(s.cfg, i, s.load_block(i), fused_experts=True)
        assert torch.equal(hf[f"model.layers.{i}.mlp.gate.tid2eid"], model.state_dict()[f"model.layers.{i}.mlp.gate.tid2eid"])
    assert carry.bytes_per_token(s.cfg, 40) == 8


def test_tune_plans_the_flash_preset_with_256g_of_host_memory(tmp_path, monkeypatch, capsys):
    """scripts/tune.py --preset deepseek-v4-flash-284B --host-memory 256G --device-budget 24G plans its 43 blocks (a
    profile measured on a small shape stands in for this machine's: no V4-sized block is written here)."""
    import dataclasses
    from phantom.arch.config import ModelConfig
    from phantom.plan import costinputs as ci
    from phantom.plan import profiles
    from test_tune import script
    small = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, multiple_of=16, max_seq_len=64)
    profile = dataclasses.replace(profiles.probe(small, "cpu", ci.Workload(1, 16, "fp32", "bf16"), tmp_path, quick=True),
                                  free_device_bytes=None, free_host_bytes=256 << 30)
    monkeypatch.setattr(profiles, "probe", lambda *a, **k: profile)
    argv = ["--preset", "deepseek-v4-flash-284B", "--host-memory", "256G", "--device-budget", "24G", "--device", "cpu",
            "--disk-budget", "1TB", "--json"]
    assert script().main(argv) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"] and len(plan["tiers"]) == 43, plan


def test_gguf_export_is_refused_in_one_line(models, tmp_path):
    from phantom.export.export import export
    _, store = models("deepseek_v4")
    with pytest.raises(ValueError, match="GGUF export of DeepSeek-V4"):
        export(store, tmp_path / "out.gguf", fmt="gguf", progress=False)


# A DeepSeek-V4-shaped checkpoint as the Hub ships V4: widths of whole 128 x 128 FP8 tiles, every block linear weight
# FP8 with a power-of-two (ue8m0) scale per tile (NAME.scale, e8m0), the experts FP4 (int8, two e2m1 values a byte)
# with an e8m0 scale per 32 values, the compressors' and indexer's own projections in bf16, the tensors transformers
# keeps in float32 (hyper-connections, sinks, position biases, norms, the correction bias) in float32, the rest bf16
SHIPPED = dict(V4, hidden_size=256, moe_intermediate_size=128, num_hidden_layers=3, num_attention_heads=2,
               head_dim=128, q_lora_rank=128, n_routed_experts=4, o_lora_rank=128, index_head_dim=64,
               layer_types=V4["layer_types"][:3], mlp_layer_types=V4["mlp_layer_types"][1:])
SIXTEEN_BIT = ("compressor.wkv", "compressor.wgate", "indexer.weights_proj", "ffn.gate.weight")
FP32 = ("hc_attn", "hc_ffn", "attn_sink", ".ape", "gate.bias", "norm.weight")


def ship_v4(model, folder):
    """model's weights as DeepSeek-V4 ships them (DeepSeek's names, as save_pretrained writes them), into folder."""
    from phantom.arch.quant import quantize_fp8, quantize_mxfp4
    from phantom.arch.quantformat import QuantFormat
    model.save_pretrained(folder / "src")
    out = {}
    for k, v in load_file(str(folder / "src" / "model.safetensors")).items():
        linear = ".layers." in k and k.endswith(".weight") and v.dim() == 2 and not any(b in k for b in SIXTEEN_BIT)
        if linear and ".experts." in k:
            parts = quantize_mxfp4(v.float())
            out[k] = parts["blocks"].reshape(v.shape[0], -1).view(torch.int8)
            out[k.removesuffix("weight") + "scale"] = parts["scales"].view(torch.float8_e8m0fnu)
        elif linear:
            parts = quantize_fp8(v.float(), QuantFormat("fp8-block"), pow2=True)
            out[k], out[k.removesuffix("weight") + "scale"] = parts["fp8"], parts["scale_inv"].to(torch.float8_e8m0fnu)
        else:
            out[k] = v if ".layers." in k and any(f in k for f in FP32) or not v.is_floating_point() else v.bfloat16()
    (folder / "ship").mkdir()
    save_file(out, str(folder / "ship" / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "src" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128], "scale_fmt": "ue8m0", "expert_dtype": "fp4"}
    (folder / "ship" / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / "ship" / name).write_bytes((folder / "src" / name).read_bytes())
    return folder / "ship"


def test_the_shipped_fp8_and_fp4_checkpoint_streams_as_shipped(tmp_path):
    """A V4-shaped checkpoint with FP4 experts beside FP8 blocks: read into a store as shipped (the experts' bytes
    as MXFP4's, at most 0.30x their bf16 bytes; read in place by --link) and streamed from disk and RAM, its logits
    equal to transformers' own dequantized load of the checkpoint (fp32) within 1e-5."""
    import phantom
    from family_check import hf_model, llama3_style_tokenizer_json, rel_err
    model = hf_model("DeepseekV4Config", **SHIPPED)
    (tmp_path / "src").mkdir()
    llama3_style_tokenizer_json(tmp_path / "src")
    src = ship_v4(model, tmp_path)
    import transformers
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).float().eval()
    tokens, _ = batch()
    with torch.no_grad():
        ref = ref_model(tokens).logits
    for link in (False, True):
        store = prepare_from(src, tmp_path / f"store-{link}", link)
        s = BlockStore(store)
        assert s.quant.method == "fp8-block" and s.quant.experts == "mxfp4"
        experts = [x for x in s.blocks[1].specs if x.name.startswith("feed_forward.experts.")]
        dense = 2 * sum(math.prod(sh) for n, sh in block_tensor_shapes(s.cfg, 1).items() if ".experts." in n)
        assert sum(x.end - x.start for x in experts) <= 0.30 * dense
        for offload in ("none", "disk", "ram"):
            with phantom.load(store, offload=offload, prefetch=1, lora=None) as pm, torch.no_grad():
                assert rel_err(pm(tokens), ref) < 1e-5, (link, offload)
