"""DeepSeek-V3.2 and GLM-5 (DeepSeek Sparse Attention) beyond the shared checks of tests/test_families.py, which run
rows of 40 tokens past a top-16 (logits streamed every way, LoRA on latent attention against peft, the merged
export, the full step against AdamW):

- each feature changes transformers' logits, so the shared checks see it: the sparse choice, the indexer's
  weights, GLM-5's shared indexers, its indexer's RoPE in pairs; at rows of at most index_topk keys the indexer
  picks every key (zeroing it changes nothing) and phantom attends densely;
- the sparse attention equals transformers in chunks of one query, inside a tiled block with inner checkpoints,
  with the carried top-k split into micro-batches and with experts read routed (LoRA on attention and the experts
  against peft), over packed rows (each example as transformers computes it alone), and as the reference of
  preference training;
- GLM-5's config read as GlmMoeDsaConfig derives indexer_types, what is not modelled refused in one line,
  generation past index_topk and GGUF export refused in one line;
- the top-k a GLM-5 block hands to later ones counted by the cost model.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import phantom
from family_check import CASES, batch, check_logits, check_quantized, hf_model, lora_step, make, peft_step, prepare, \
    rel_err, transformers
from phantom.arch import carry, dsa
from phantom.arch.config import ConfigError
from phantom.arch.family import config_from_hf
from phantom.arch.presets import PRESETS
from phantom.export.export import export
from phantom.model.generate import generate
from phantom.plan import costinputs as ci
from phantom.plan import costmodel
from test_deepseek import differs, zero
from test_moe_lora import RUNS, assert_runs_equal_peft, phantom_step
from test_moe_routed import ram_streams  # noqa: F401  (a fixture: the RAM tier read into slots, as on CUDA)

MLA_TARGETS = CASES["glm_moe_dsa"].lora_targets


def as_class(config_class: str, **fields):
    """CASES["glm_moe_dsa"]'s model, and its weights in `config_class` built with its fields (every layer with an
    indexer: layers 1 and 3 keep the ones seed 0 gives them)."""
    base = make("glm_moe_dsa")
    fields = {**{k: v for k, v in CASES["glm_moe_dsa"].fields.items() if k != "indexer_types"}, **fields}
    other = hf_model(config_class, **fields)
    missing, unexpected = other.load_state_dict(base.state_dict(), strict=False)
    assert not unexpected and missing and all(".indexer." in k for k in missing)
    return base, other


def logits(model, tokens=None) -> torch.Tensor:
    with torch.no_grad():
        return model(batch()[0] if tokens is None else tokens).logits


@pytest.mark.parametrize("name,change,edit", [
    ("deepseek_v32", dict(index_topk=40), None),  # a top-16 of 40 keys, not every key
    ("deepseek_v32", None, zero("indexer.wk.weight")),  # the indexer's weights choose
    ("glm_moe_dsa", dict(index_topk=40), None),
    ("glm_moe_dsa", None, zero("indexer.weights_proj.weight")),
])
def test_each_feature_changes_transformers_logits(name, change, edit):
    assert differs(name, change, edit) > 1e-3


def test_glm5_shares_its_indexers_and_turns_their_rope_in_pairs():
    """Layers 1 and 3 reuse the picks of layers 0 and 2: indexers of their own pick otherwise; the same weights in
    DeepSeek-V3.2's class, whose indexer turns halves where GLM-5's turns pairs, give other logits."""
    shared, own = as_class("GlmMoeDsaConfig", indexer_types=["full"] * 4)
    assert rel_err(logits(own), logits(shared)) > 1e-3
    halves = as_class("DeepseekV32Config")[1]
    assert rel_err(logits(halves), logits(own)) > 1e-3


def test_at_rows_of_at_most_index_topk_every_key_is_chosen(tmp_path):
    """A top-48 of 40 keys: the indexer picks every key (zeroing its weights leaves transformers' logits as they are)
    and phantom attends densely, equal to transformers streamed."""
    dense, zeroed = make("deepseek_v32", index_topk=48), make("deepseek_v32", index_topk=48)
    with torch.no_grad():
        zero("indexer.wk.weight")(zeroed)
    assert rel_err(logits(zeroed), logits(dense)) == 0
    model = make("glm_moe_dsa", index_topk=48)
    check_logits(model, prepare(model, tmp_path), *batch(), runs=[("disk", 1, "all"), ("ram", 0, "none")])


def check_lora_runs(model, store, tmp_path, tokens, targets, runs):
    """LoRA on latent attention (random B): logits, loss and every A/B gradient equal peft's, for each run's knobs."""
    adapter = tmp_path / "adapter"
    lora_step(store, tokens, targets, adapter, MLA_TARGETS, offload="none")
    ref_logits, ref_loss, ref_grads = peft_step(model, adapter, tokens, targets)
    for knobs in runs:
        got_logits, loss, grads = lora_step(store, tokens, targets, lora_targets=MLA_TARGETS, **knobs)
        assert rel_err(got_logits, ref_logits) < 1e-5, knobs
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
        for key, (ga, gb) in grads.items():
            assert rel_err(ga, ref_grads[key][0]) < 1e-4 and rel_err(gb, ref_grads[key][1]) < 1e-4, (knobs, key)


@pytest.mark.parametrize("name", ["deepseek_v32", "glm_moe_dsa"])
def test_sparse_attention_in_chunks_of_one_query_equals_transformers(family_models, name, tmp_path, monkeypatch):
    """The indexer's scores and the attention over the chosen keys one query at a time (the backward recomputing
    each), resident and streamed: logits, loss and LoRA gradients as transformers' and peft's."""
    monkeypatch.setattr(dsa, "CHUNK_BYTES", 1)
    model, store = family_models(name)
    check_logits(model, store, *batch(), runs=[("none", 0, "none"), ("disk", 1, "all")])
    check_lora_runs(model, store, tmp_path, *batch(), [dict(offload="none"), dict(offload="disk", recompute="all")])


def test_glm5_carries_its_top_k_through_tiles_checkpoints_and_micro_batches(family_models, tmp_path):
    """A block tiled in chunks of 8 tokens (its indexer's inputs too) with inner checkpoints, and one row a block
    call (the carried top-k split and joined with the rows), kept and recomputed: LoRA equals peft."""
    model, store = family_models("glm_moe_dsa")
    check_lora_runs(model, store, tmp_path, *batch(), [
        dict(offload="none", mlp_chunk=8, checkpoint_inner=True, micro_batch=1),
        dict(offload="disk", prefetch=1, recompute="all", mlp_chunk=8, micro_batch=1),
        dict(offload="ram", recompute="none", micro_batch=1, checkpoint_inner=True)])


@pytest.mark.usefixtures("ram_streams")
def test_glm5_expert_lora_equals_peft_with_experts_read_routed_and_whole(family_models, tmp_path):
    """LoRA on latent attention and the experts at rows past the top-k: resident and streamed from disk and RAM,
    experts read whole, and routed in micro-batches of a row (the block in halves, the top-k carried)."""
    model, store = family_models("glm_moe_dsa")
    tokens, targets = batch()
    phantom_step(store, tokens, targets, tmp_path / "adapter", offload="none")
    ref = peft_step(model, tmp_path / "adapter", tokens, targets)
    assert_runs_equal_peft(store, tokens, targets, ref, RUNS)


def test_glm5_nf4_store_of_three_block_layouts_streams_as_transformers_computes_it(family_models, tmp_path):
    """An NF4 copy (dense layer 0 with an indexer, sparse layers with and without one: three layouts in one store)
    from disk and RAM equals transformers on the weights it dequantizes to."""
    _, store = family_models("glm_moe_dsa")
    assert len({phantom.BlockStore(store).layout_index(i) for i in range(4)}) == 3
    check_quantized(store, tmp_path, "nf4")


def test_glm5_packed_rows_compute_each_example_as_transformers_alone(family_models):
    """A row packing an example of 24 tokens (past the top-16: sparse) and one of 16 (every key) beside an unpacked
    row: each example's logits as transformers' on it alone, resident and streamed."""
    model, store = family_models("glm_moe_dsa")
    tokens = batch()[0]
    segments = torch.tensor([[0] * 24 + [1] * 16, [0] * 40])
    want = torch.cat([torch.cat([logits(model, tokens[:1, :24]), logits(model, tokens[:1, 24:])], 1),
                      logits(model, tokens[1:])])
    for offload in ("none", "disk"):
        with phantom.load(store, offload=offload, lora=None) as pm, torch.no_grad():
            assert rel_err(pm(tokens, segments=segments), want) < 1e-5, offload


def test_glm5_reference_of_preference_training_carries_its_own_top_k(family_models):
    """sequence_logps with the reference: the base model's log-probabilities (adapters off), its indexers' picks
    carried apart from the policy's, streamed and recomputed."""
    model, store = family_models("glm_moe_dsa")
    tokens, targets = batch()
    logps = F.log_softmax(logits(model, tokens).double(), -1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    want = (logps * (targets != -100)).sum(-1)
    with phantom.load(store, offload="disk", recompute="all", lora=phantom.LoraConfig(targets=MLA_TARGETS)) as pm:
        with torch.no_grad():
            for p in pm.trainable_parameters():
                p.normal_(0, 0.1)
        policy, reference = pm.sequence_logps(tokens, targets, reference=True)
    assert rel_err(reference, want) < 1e-5 and rel_err(policy, want) > 1e-4


def hf_dict(name: str, **fields) -> dict:
    c = getattr(transformers, CASES[name].config_class)(**{**CASES[name].fields, **fields}).to_dict()
    return {**c, "architectures": [CASES[name].hf_class]}


@pytest.mark.parametrize("fields", [dict(index_topk_freq=4, index_skip_topk_offset=3, num_hidden_layers=10),
                                    dict(index_topk_pattern="FSSFS", num_hidden_layers=5),
                                    dict(index_topk_freq=2, num_hidden_layers=6)])
def test_glm5_shared_layers_as_its_config_class_derives_them(fields):
    """A config.json without indexer_types: the shared layers from index_topk_pattern, or index_topk_freq and
    index_skip_topk_offset, as GlmMoeDsaConfig derives indexer_types."""
    c = hf_dict("glm_moe_dsa", indexer_types=None, **fields)
    types = c.pop("indexer_types")
    assert "shared" in types
    assert config_from_hf({**c, **fields}).index_shared == tuple(i for i, t in enumerate(types) if t == "shared")


@pytest.mark.parametrize("name,change,named", [
    ("deepseek_v32", dict(layer_types=["full_attention"] + ["indexed_attention"] * 1), "layer_types"),
    ("deepseek_v32", dict(mlp_layer_types=["sparse", "dense"]), "mlp_layer_types"),
    ("glm_moe_dsa", dict(indexer_types=["shared", "full", "full", "shared"]), "indexer_types"),
    ("glm_moe_dsa", dict(indexer_types=["full", "dense", "full", "shared"]), "indexer_types"),
    ("glm_moe_dsa", dict(rope_interleave=False), "rope_interleave"),
    ("glm_moe_dsa", dict(indexer_rope_interleave=False), "indexer_rope_interleave"),
])
def test_what_is_not_modelled_is_refused_naming_the_field(name, change, named):
    with pytest.raises(ConfigError, match=f"{named}="):
        config_from_hf({**hf_dict(name), **change})


def test_generation_past_index_topk_and_gguf_export_are_refused_in_one_line(family_models, tmp_path):
    """Generation within index_topk tokens is greedy as transformers'; past it (the indexer's keys would need a
    cache of their own) it is refused before it starts; so is GGUF export of this model, whose 16-wide indexer heads
    llama.cpp would turn by a Hadamard matrix of 64 dims or more (DeepSeek-V3.2's too)."""
    model, store = family_models("glm_moe_dsa")
    prompt = batch()[0][0, :6].tolist()
    with phantom.load(store, offload="disk", lora=None) as pm:
        ours = generate(pm, prompt, max_new_tokens=10, temperature=0.0)
        with pytest.raises(ValueError, match=r"^request 0: prompt \+ max_new_tokens \(17\) exceeds index_topk \(16\)"):
            generate(pm, prompt, max_new_tokens=11, temperature=0.0)
    with torch.no_grad():
        theirs = model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False)[0, 6:].tolist()
    assert ours == theirs
    with pytest.raises(ValueError, match="llama.cpp's glm-dsa turns the indexer's queries and keys by a Hadamard"):
        export(store, tmp_path / "gguf", None, "gguf", progress=False)
    with pytest.raises(ValueError, match="llama.cpp's deepseek32 turns the indexer's queries and keys by a Hadamard"):
        export(family_models("deepseek_v32")[1], tmp_path / "v32", None, "gguf", progress=False)
    assert not (tmp_path / "gguf").exists() and not (tmp_path / "v32").exists()


def test_the_cost_model_counts_the_carried_top_k():
    """GLM-5 sharing its indexers (every fourth layer from the third runs one, as index_topk_freq 4 and
    index_skip_topk_offset 3 say) at 4096 tokens holds each handing indexer layer's top-2048 (int32) a token until
    the backward; at 2048 tokens (every key chosen) nothing; DeepSeek-V3.2 (no shared layers) carries nothing."""
    preset, v32 = PRESETS["glm-5-744B"], PRESETS["deepseek-v3.2-671B"]
    glm = dataclasses.replace(preset, index_shared=tuple(i for i in range(3, 78) if (i - 2) % 4))
    handing = len({max(j for j in range(i) if j not in glm.index_shared) for i in glm.index_shared})
    assert carry.bytes_per_token(glm, 4096) == handing * 2048 * 4 and carry.bytes_per_token(glm, 2048) == 0
    assert carry.bytes_per_token(v32, 4096) == 0
    long, base = ci.shape_of(glm, seq_len=4096), ci.shape_of(v32, seq_len=4096)
    assert long.carry_bytes_per_row == 4096 * handing * 2048 * 4 and base.carry_bytes_per_row == 0
    profile = ci.MachineProfile(machine="test", device="cuda")
    without = costmodel.activation_bytes(dataclasses.replace(long, carry_bytes_per_row=0), profile, 0, 2, 1)
    assert costmodel.activation_bytes(long, profile, 0, 2, 1) - without == 2 * long.carry_bytes_per_row


@pytest.mark.parametrize("chunk", [16, 256])
def test_sparse_attention_keeps_nothing_of_the_row_squared(family_models, monkeypatch, chunk):
    """What GLM-5's latent attention saves for its backward over a row of 256 tokens under a top-16: in chunks of
    16 queries (recomputed in the backward) nothing larger than its queries (256 x 4 heads x 16 dims); in one chunk
    of every query, the gathered latents, 256 x 16 keys x 16 dims (the check can fail)."""
    per_query = 16 * (16 + 8) * 4 + 3 * 4 * 16 * 4  # dsa.attend_selected's bytes a query: keys, scores
    monkeypatch.setattr(dsa, "CHUNK_BYTES", chunk * per_query)
    from phantom.arch.mla import LatentAttention
    from phantom.arch.ops import rope_table
    _, store = family_models("glm_moe_dsa")
    cfg = dataclasses.replace(phantom.BlockStore(store).cfg, max_seq_len=256)
    torch.manual_seed(0)
    att = LatentAttention(cfg)
    with torch.no_grad():
        for b in att.buffers():
            b.normal_()
    x = torch.randn(1, 256, cfg.dim, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        att(x, rope_table(cfg, 256)).sum().backward()
    queries = 256 * cfg.n_heads * cfg.head_dim
    assert max(saved) == queries if chunk == 16 else max(saved) >= 256 * 16 * cfg.kv_lora_rank > queries
