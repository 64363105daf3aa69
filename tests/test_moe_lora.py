"""LoRA on the experts of mixtures of experts, against peft's `target_parameters` LoRA on transformers 5's
stacked expert tensors (mlp.experts.gate_up_proj and down_proj): gradients (resident, streamed from disk
and RAM, experts read routed and whole; NF4 and int8 experts), the adapter both ways through PeftModel, one
AdamW step, the merged export, and the CLI (a resumed run bit-identical to one never stopped).

peft's layout is written out here by index, apart from phantom.arch.expertlora: for a tensor (E, out, in),
lora_A's rows e*r:(e+1)*r are expert e's A and lora_B's columns e, e+E, e+2E, ... expert e's B.
"""
from __future__ import annotations

import json

import numpy
import pytest
import torch
from safetensors.torch import load_file

import phantom
from family_check import batch, cross_entropy, lora_grads, make, peft, peft_step, prepare, rel_err
from phantom.arch.layers import LoraLinear
from phantom.export.export import export
from test_moe_routed import ram_streams  # noqa: F401  (a fixture: the RAM tier read into slots, as on CUDA)

EXPERTS = ("q", "k", "v", "o", "gate", "up", "down")  # attention and the experts
MODELS = {"qwen3_moe": dict(num_hidden_layers=3, mlp_only_layers=[1]), "mixtral": dict(num_local_experts=8),
          "qwen2_moe": dict(num_hidden_layers=3, mlp_only_layers=[1]), "olmoe": {}}
# (offload, prefetch, recompute, expert_reads): resident, streamed from disk and RAM, experts routed and whole
RUNS = [("none", 0, "none", "whole"), ("disk", 1, "all", "whole"), ("disk", 0, "none", "routed"),
        ("ram", 1, "none", "routed"), ("ram", 0, "all", "whole")]  # the routed ones in two micro-batches


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (the transformers model, its store), made once a module (some tests train a copy of the model)."""
    built = {}

    def get(name):
        if name not in built:
            model = make(name, **MODELS[name])
            built[name] = model, prepare(model, tmp_path_factory.mktemp(name))
        return built[name]
    return get


def few():
    """Few tokens a step (every target counted), so that some experts of each layer are not hit."""
    return batch(2, 3)[0], batch(2, 3, seed=1)[0]


# Llama 4's experts are in transformers' Llama4TextExperts, under feed_forward, stored (E, in, out) without
# is_transposed: peft swaps their sides (its A on the out side, its B on the in side)
SWAPPED_EXPERTS = {"llama4": "feed_forward.experts"}


def experts_module(pm) -> str:
    return SWAPPED_EXPERTS.get(pm.cfg.family, "mlp.experts")


def peft_expert_keys(block, module: str = "mlp.experts") -> dict[str, tuple[str, list[list[LoraLinear]]]]:
    """{peft module: (phantom's parameter holding it, per expert its LoraLinears in row order)} of a block's
    experts. peft wraps gate_up_proj first and down_proj around it: where both are adapted gate_up_proj's
    LoRA is the inner `mlp.experts.base_layer` (as peft's own adapters have it: the test of those below)."""
    ffn = block.feed_forward
    if not hasattr(ffn, "experts"):
        return {}
    gate_up, down = (isinstance(getattr(ffn.experts[0], w), LoraLinear) for w in ("w1", "w2"))
    out = {}
    if gate_up:
        out[f"{module}.base_layer" if down else module] = (
            "feed_forward.lora_experts_gate_up", [[x.w1, x.w3] for x in ffn.experts])
    if down:
        out[module] = ("feed_forward.lora_experts_down", [[x.w2] for x in ffn.experts])
    return out


def to_peft(parts, get, interleaved: bool = False, swapped: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """peft's (lora_A (r*E, in), lora_B (out, r*E)) of one expert tensor, by index; with interleaved (gpt-oss's
    gate_up_proj) lora_B's rows alternate gate and up, as the tensor's columns do. Swapped (Llama 4): peft's
    lora_A (r*E, out) holds each expert's B transposed, its lora_B (in, r*E) each A transposed."""
    a, b = _to_peft(parts, get, interleaved)
    if not swapped:
        return a, b
    n, r = len(parts), a.shape[0] // len(parts)
    return (b.view(b.shape[0], r, n).permute(2, 1, 0).reshape(n * r, -1),
            a.view(n, r, -1).permute(2, 1, 0).reshape(-1, r * n))


def _to_peft(parts, get, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    n, (r, d_in) = len(parts), get(parts[0][0].lora_A).shape
    b_e = [torch.stack([get(m.lora_B) for m in ms], dim=1).flatten(0, 1) if interleaved else
           torch.cat([get(m.lora_B) for m in ms]) for ms in parts]
    a, b = torch.zeros(r * n, d_in), torch.zeros(b_e[0].shape[0], r * n)
    for e, ms in enumerate(parts):
        a[e * r:(e + 1) * r] = get(ms[0].lora_A)
        b[:, e::n] = b_e[e]  # column j*E + e
    return a, b


def expert_grads(pm) -> dict:
    """{(layer, peft module): (A's gradient, B's)} of the experts, and of attention. The experts' parameters
    are peft's tensors (what each expert computes with is checked against them by index: check_views)."""
    out = lora_grads(pm)
    for i, block in enumerate(pm.layers):
        params = dict(block.named_parameters())
        for module, (name, _) in peft_expert_keys(block, experts_module(pm)).items():
            out[(i, module)] = (params[f"{name}.lora_A"].grad, params[f"{name}.lora_B"].grad)
    return out


def check_views(pm, adapter) -> None:
    """Each expert computes with its A and B at peft's indices of the saved tensors (to_peft, by index)."""
    saved = adapter_tensors(adapter)
    for i, block in enumerate(pm.layers):
        for module, (_, parts) in peft_expert_keys(block, experts_module(pm)).items():
            a, b = to_peft(parts, lambda t: t.detach(), pm.cfg.interleaved_experts, pm.cfg.family in SWAPPED_EXPERTS)
            key = f"base_model.model.model.layers.{i}.{module}"
            assert torch.equal(a, saved[f"{key}.lora_A.weight"]) and torch.equal(b, saved[f"{key}.lora_B.weight"])


def randomize(pm, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in pm.trainable_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


def phantom_step(store, tokens, targets, adapter_dir=None, lora_targets=EXPERTS, **knobs):
    with phantom.load(store, lora=phantom.LoraConfig(rank=4, alpha=8, targets=lora_targets), loss_chunk=7,
                      verify="none", **knobs) as pm:
        randomize(pm)
        with torch.no_grad():
            logits = pm(tokens)
        if adapter_dir is not None:
            pm.save_adapter(adapter_dir)
            check_views(pm, adapter_dir)
        loss = pm(tokens, targets=targets)
        loss.backward()
        if knobs.get("expert_reads") == "routed":  # it did read some experts alone, not every block whole
            m, block = pm.backend.scheduler.take_metrics(), pm.store.block_nbytes
            assert 0 < m["bytes_experts"] and m["bytes_read"] + m["bytes_ram"] < m["loads"] * block, m
        return logits, loss.detach(), expert_grads(pm)


def assert_equals_peft(got, ref, run, unhit: bool = False) -> None:
    """Logits within 1e-5 of peft's, the loss, every A and B gradient within 1e-4; with `unhit`, the experts'
    gradients zero exactly where peft's are (the experts no token picked)."""
    (logits, loss, grads), (ref_logits, ref_loss, ref_grads) = got, ref
    assert rel_err(logits, ref_logits) < 1e-5, run
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    assert grads.keys() == ref_grads.keys()
    for key, (ga, gb) in grads.items():
        ra, rb = ref_grads[key]
        assert rel_err(ga, ra) < 1e-4 and rel_err(gb, rb) < 1e-4, (run, key)
        assert not unhit or torch.equal(ga == 0, ra == 0) or "experts" not in key[1], (run, key)


def assert_runs_equal_peft(store, tokens, targets, ref, runs=RUNS) -> None:
    """Each run (offload, prefetch, recompute, expert reads) of the store equals peft's `ref`
    (assert_equals_peft, unhit experts' gradients included)."""
    for offload, prefetch, recompute, reads in runs:
        knobs = {} if offload == "none" else dict(expert_reads=reads, micro_batch=1 if reads == "routed" else None)
        got = phantom_step(store, tokens, targets, offload=offload, prefetch=prefetch, recompute=recompute, **knobs)
        assert_equals_peft(got, ref, (offload, prefetch, recompute, reads), unhit=True)


def expert_adapter(models, name, tmp_path):
    """The model and store of `name`, few() tokens, and an adapter on attention and the experts saved from a
    resident phantom model (its adapter_config.json read: the experts as peft's target_parameters)."""
    model, store = models(name)
    tokens, targets = few()
    adapter = tmp_path / "adapter"
    phantom_step(store, tokens, targets, adapter, offload="none")
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    return model, store, tokens, targets, adapter, config


@pytest.mark.usefixtures("ram_streams")
@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "qwen2_moe", "olmoe"])
def test_expert_lora_gradients_equal_peft_target_parameters(models, name, tmp_path):
    """LoRA on attention and experts: logits within 1e-5 of peft's, loss, and every A and B gradient within
    1e-4, resident and streamed from disk and RAM, experts read routed and whole; unhit experts' gradients
    are zeros in both. Qwen2-MoE's shared expert and dense layer 1 take one too (target_modules, as peft
    adapts them there); Qwen3-MoE's dense layer 1 none (peft turns gate_proj there into the experts')."""
    model, store, tokens, targets, adapter, config = expert_adapter(models, name, tmp_path)
    plain = ["down_proj", "gate_proj", "up_proj"] if name == "qwen2_moe" else []  # its shared expert, dense layer
    assert config["target_modules"] == sorted([*plain, "k_proj", "o_proj", "q_proj", "v_proj"])
    ref_logits, ref_loss, ref_grads = peft_step(model, adapter, tokens, targets)
    runs = RUNS if name in ("qwen3_moe", "mixtral") else RUNS[:2]
    unhit = [(k, e) for k, (ga, _) in ref_grads.items() if "experts" in k[1]
             for e, rows in enumerate(ga.unflatten(0, (-1, 4))) if not rows.any()]
    assert unhit or runs == RUNS[:2]  # some experts are not hit: their gradients are zeros
    assert_runs_equal_peft(store, tokens, targets, (ref_logits, ref_loss, ref_grads), runs)


def adapter_tensors(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(str(folder / "adapter_model.safetensors"))


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_one_adamw_step_equals_peft_and_the_adapters_load_both_ways(models, name, tmp_path):
    """From the same initial adapter (B zero), one AdamW step (weight decay on) moves every LoRA parameter as
    peft's step moves its stacked ones, within 1e-5: unhit experts decay as peft's zero-gradient rows do.
    After it (B non-zero) phantom's adapter gives peft's logits through PeftModel, and peft's adapter,
    saved by peft, gives them in phantom."""
    model, store = models(name)
    tokens, targets = few()
    # eps 1: the first update lr * g / (|g| + eps) is near lr * g, which gradient rounding moves by ~1e-6 of
    # itself (a small eps makes it lr * sign(g), see family_check.check_full_step); decay moves A by 1e-3 of itself
    opt_args = dict(lr=1e-2, weight_decay=0.1, eps=1.0)
    lora = phantom.LoraConfig(rank=4, alpha=8, targets=EXPERTS)
    ours = []
    for n, knobs in enumerate((dict(offload="none"), dict(offload="disk", prefetch=1, expert_reads="routed"))):
        with phantom.load(store, lora=lora, verify="none", **knobs) as pm:
            pm.load_adapter(tmp_path / "init") if n else pm.save_adapter(tmp_path / "init")
            opt = torch.optim.AdamW(pm.trainable_parameters(), **opt_args)
            pm(tokens, targets=targets).backward()
            opt.step()
            pm.save_adapter(tmp_path / f"ours{n}")
            with torch.no_grad():
                ours.append(pm(tokens))
    pmodel = peft.PeftModel.from_pretrained(model, tmp_path / "init", is_trainable=True).eval()
    try:
        params = {n: p for n, p in pmodel.named_parameters() if p.requires_grad}
        opt = torch.optim.AdamW(params.values(), **opt_args)
        cross_entropy(pmodel(tokens).logits, targets).backward()
        opt.step()
        pmodel.save_pretrained(tmp_path / "theirs")
        with torch.no_grad():
            theirs = pmodel(tokens).logits
    finally:
        pmodel.unload()
        for p in model.parameters():
            p.grad = None
    before = adapter_tensors(tmp_path / "init")
    stepped = {n.replace(".default", ""): p for n, p in params.items()}
    for n, logits in enumerate(ours):  # resident, then streamed with routed expert reads
        saved = adapter_tensors(tmp_path / f"ours{n}")
        assert saved.keys() == stepped.keys() and any("experts" in k for k in saved)
        for key, p in stepped.items():
            assert not torch.equal(saved[key], before[key]), key  # the step moved it (decay alone, for A)
            assert rel_err(saved[key], p) < 1e-5, (n, key)
        assert rel_err(logits, theirs) < 1e-5
        assert rel_err(peft_logits(model, tmp_path / f"ours{n}", tokens), logits) < 1e-5
    with phantom.load(store, lora=phantom.model.adapterfiles.read_adapter_config(tmp_path / "theirs"), offload="none") as pm:
        pm.load_adapter(tmp_path / "theirs")
        with torch.no_grad():
            assert rel_err(pm(tokens), theirs) < 1e-5


def peft_logits(model, adapter, tokens) -> torch.Tensor:
    pmodel = peft.PeftModel.from_pretrained(model, adapter).eval()
    try:
        with torch.no_grad():
            return pmodel(tokens).logits
    finally:
        pmodel.unload()


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe"])
def test_the_merged_export_equals_peft_merged_model(models, name, tmp_path):
    """merge_lora's --format hf adds each expert's B_e A_e: transformers loads it with the logits of peft's
    merge_and_unload on the same adapter (Qwen3-MoE with a dense layer, Qwen2-MoE with its shared expert)."""
    model, store = models(name)
    tokens, targets = few()
    phantom_step(store, tokens, targets, tmp_path / "adapter", offload="none")
    fresh = make(name, **MODELS[name])  # merge_and_unload changes the model it is given
    merged_ref = peft.PeftModel.from_pretrained(fresh, tmp_path / "adapter").merge_and_unload().eval()
    if name == "qwen3_moe":  # through the script
        from test_convert import load_script
        assert load_script("merge_lora").main(["--model", str(store), "--adapter", str(tmp_path / "adapter"), "--out",
                                               str(tmp_path / "hf"), "--format", "hf", "--dtype", "fp32",
                                               "--quiet"]) == 0
        out = tmp_path / "hf"
    else:
        out = export(store, tmp_path / "hf", tmp_path / "adapter", "hf", progress=False)
    import transformers
    merged = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        want, base = merged_ref(tokens).logits, model(tokens).logits
        assert rel_err(merged(tokens).logits, want) < 1e-5 and rel_err(base, want) > 1e-3


def test_what_peft_cannot_do_on_experts_is_refused_in_one_line(models, tmp_path):
    """all-linear (peft turns it into LoRA on the routers too), dropout and layers with expert targets; an
    adapter naming gate_proj on Qwen3-MoE (peft makes that the experts' tensors at twice the rank); experts_*
    on a dense model."""
    from phantom.arch.config import ModelConfig
    from phantom.model.lora import family_targets
    from phantom.model.adapterfiles import read_adapter_config
    _, qwen3 = models("qwen3_moe")
    phantom_step(qwen3, *few(), tmp_path / "adapter", lora_targets=("q", "down"), offload="none")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps(config | {"target_modules": ["gate_proj"]}))
    with pytest.raises(ValueError, match="no such plain module"):
        phantom.load(qwen3, lora=read_adapter_config(tmp_path / "adapter"))
    with pytest.raises(ValueError, match="has no experts"):
        family_targets(("q", "experts_down"), ModelConfig(dim=64, n_layers=1, n_heads=4, vocab_size=10))
    _, store = models("mixtral")
    for lora, words in ((phantom.LoraConfig(targets=("all-linear",)), "all-linear"),
                        (phantom.LoraConfig(targets=("q", "gate"), dropout=0.1), "dropout"),
                        (phantom.LoraConfig(targets=("down",), layers=(0,)), "layers_to_transform")):
        with pytest.raises(ValueError, match=words):
            phantom.load(store, lora=lora)
    with phantom.load(store, lora=phantom.LoraConfig(targets=("q", "v"), dropout=0.1), offload="none") as pm:
        assert len(pm.trainable_parameters()) == 8  # dropout on attention alone is peft's as before


@pytest.fixture(scope="module")
def synthetic_moe(tmp_path_factory):
    """(a Qwen3-MoE-shaped synthetic store, token ids to train on) for the CLI, made once a module."""
    import dataclasses
    from phantom.arch.presets import PRESETS
    from phantom.convert.synthetic import write_synthetic
    root = tmp_path_factory.mktemp("synthetic_moe")
    cfg = dataclasses.replace(PRESETS["qwen3-30B-A3B"], dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                              explicit_head_dim=16, vocab_size=97, intermediate_size=96, max_seq_len=64, n_experts=6,
                              experts_per_token=2, expert_dim=32)
    store = write_synthetic(root / "store", cfg, torch.float32, progress=False)
    ids = root / "ids.npy"
    numpy.save(ids, torch.randint(0, 97, (400,), generator=torch.Generator().manual_seed(0)).numpy().astype("int32"))
    return store, ids


def test_the_cli_trains_the_experts_and_refuses_in_one_line(synthetic_moe, tmp_path, capsys):
    """finetune.py on a Qwen3-MoE-shaped synthetic store: --lora-targets q,v,gate,up,down trains the experts
    (peft's adapter_config.json names them); all-linear and dropout on experts exit 2 with one line."""
    from test_convert import load_script
    store, ids = synthetic_moe
    finetune = load_script("finetune")
    args = ["--model", str(store), "--data", str(ids), "--iters", "2", "--seq-len", "8", "--batch-size", "1",
            "--offload", "disk", "--device", "cpu", "--quiet"]
    assert finetune.main([*args, "--lora-targets", "q,v,gate,up,down", "--out", str(tmp_path / "run")]) == 0
    config = json.loads((tmp_path / "run" / "adapter" / "adapter_config.json").read_text())
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    assert config["target_modules"] == ["q_proj", "v_proj"] and config["lora_dropout"] == 0
    assert any(t.abs().sum() > 0 for k, t in adapter_tensors(tmp_path / "run" / "adapter").items()
               if "experts" in k and "lora_B" in k)  # the steps trained them
    capsys.readouterr()
    for bad in (["--lora-targets", "all-linear"], ["--lora-targets", "down", "--lora-dropout", "0.1"]):
        assert finetune.main([*args, *bad, "--out", str(tmp_path / "bad")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: "), err

class Crash(Exception):
    """The interruption: raised where the crash tests SIGKILL (here in-process, after a step's update)."""


@pytest.mark.parametrize("reads", ["routed", "whole"])
def test_resume_with_expert_targets_is_bit_identical(synthetic_moe, tmp_path, monkeypatch, reads):
    """--lora-targets q,v,gate,up,down streamed from disk, the experts read routed or whole: 4 steps straight,
    and 4 steps stopped after step 3's update (the checkpoint is step 2's) then --resume'd, end with the same
    adapter, trainable tensors and AdamW moments bit for bit and the same losses (peft's stacked expert
    parameters and their optimizer state go through the checkpoint as attention's do)."""
    from phantom.base import faults
    from phantom.train.checkpoint import read_state
    from test_convert import load_script
    store, ids = synthetic_moe
    args = ["--model", str(store), "--data", str(ids), "--iters", "4", "--save-every", "2", "--seq-len", "8",
            "--batch-size", "2", "--offload", "disk", "--prefetch", "0", "--expert-reads", reads, "--device", "cpu",
            "--lora-targets", "q,v,gate,up,down", "--lr", "1e-2", "--eval-every", "0", "--val-split", "0", "--quiet"]
    finetune = load_script("finetune").main
    assert finetune([*args, "--out", str(tmp_path / "ref")]) == 0
    hits = []

    def point(name):
        hits.append(name)
        if hits.count("optimizer.step") == 3 and name == "optimizer.step":
            raise Crash
    monkeypatch.setattr(faults, "point", point)
    with pytest.raises(Crash):
        finetune([*args, "--out", str(tmp_path / "run")])
    monkeypatch.undo()
    assert json.loads((tmp_path / "run" / "checkpoint" / "meta.json").read_text())["step"] == 2
    assert finetune([*args, "--out", str(tmp_path / "run"), "--resume"]) == 0
    ref, run = tmp_path / "ref", tmp_path / "run"
    for f in ("adapter/adapter_model.safetensors", "checkpoint/trainable.safetensors"):
        a, b = (load_file(str(d / f)) for d in (ref, run))
        assert a.keys() == b.keys() and any("experts" in k for k in a)
        assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]
    a, b = (read_state(d / "checkpoint" / "state.pt")["optimizer"]["state"] for d in (ref, run))
    assert a.keys() == b.keys() and all(torch.equal(a[i][m], b[i][m]) for i in a for m in a[i])
    records = [[json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()] for d in (ref, run)]
    strip = [[{k: r.get(k) for k in ("step", "loss", "lr", "grad_norm")} for r in recs] for recs in records]
    assert strip[0] == strip[1] and [r["step"] for r in strip[0]] == [1, 2, 3, 4]
    # routed reads ran (how many blocks a step reads routed depends on what the slots held: not compared)
    assert all(r.get("expert_reads", 0) > 0 for recs in records for r in recs) == (reads == "routed")



@pytest.mark.parametrize("name,modules,params", [
    ("qwen3_moe", ["q_proj"], ["mlp.experts.down_proj"]), ("qwen3_moe", ["q_proj"], ["gate_up_proj"]),
    ("qwen3_moe", ["q_proj"], ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
    ("qwen2_moe", ["gate_proj", "down_proj"], None),  # the shared expert's and the dense layer's alone
    ("qwen2_moe", ["v_proj"], ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),  # the experts alone
])
def test_an_adapter_peft_makes_loads_into_phantom_and_saves_back_the_same(models, name, modules, params, tmp_path):
    """get_peft_model's own adapter (one expert tensor, whose LoRA is then `mlp.experts`, or both, nested;
    down_proj at rank 2 through rank_pattern; Qwen2-MoE's plain linears or its experts alone): phantom loads
    it with peft's logits and saves it back with the same names and tensors."""
    from phantom.model.adapterfiles import read_adapter_config
    _, store = models(name)
    tokens, _ = few()
    pmodel = peft.get_peft_model(make(name, **MODELS[name]), peft.LoraConfig(
        target_modules=modules, target_parameters=params, r=4, lora_alpha=8, rank_pattern={"down_proj": 2}))
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in (p for n, p in pmodel.named_parameters() if "lora_" in n):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        want = pmodel.eval()(tokens).logits
    pmodel.save_pretrained(tmp_path / "peft")
    with phantom.load(store, lora=read_adapter_config(tmp_path / "peft"), offload="disk", prefetch=0) as pm:
        pm.load_adapter(tmp_path / "peft")
        with torch.no_grad():
            assert rel_err(pm(tokens), want) < 1e-5
        pm.save_adapter(tmp_path / "back")
    theirs, ours = adapter_tensors(tmp_path / "peft"), adapter_tensors(tmp_path / "back")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


@pytest.mark.parametrize("method", ["nf4", "int8"])
def test_expert_lora_on_a_quantized_store_equals_peft_on_its_dequantized_weights(models, method, tmp_path):
    """NF4 / int8 experts (the rest bfloat16), fp32 compute: LoRA on attention and experts gives the logits (1e-5)
    and every A and B gradient (1e-4) of peft's target_parameters LoRA on transformers loaded with the weights
    the store dequantizes to (its --format hf export), resident and streamed from disk and RAM, experts read
    whole, and routed (the hit experts' codes and scales alone, dequantized alone)."""
    from phantom.arch.quantformat import QuantFormat
    from phantom.convert.quantstore import quantize_store
    import transformers
    model, store = models("qwen3_moe")
    quantize_store(store, tmp_path / "q", QuantFormat(method), dtype=torch.bfloat16, progress=False)
    out = export(tmp_path / "q", tmp_path / "hf", None, "hf", dtype=torch.float32, progress=False)
    reference = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                                  attn_implementation="eager").eval()
    tokens, targets = few()
    with torch.no_grad():  # the dequantized weights, not the unquantized ones, are what is compared with
        assert rel_err(model(tokens).logits, reference(tokens).logits) > 1e-3
    adapter = tmp_path / "adapter"
    phantom_step(tmp_path / "q", tokens, targets, adapter, offload="none", dtype=torch.float32)
    ref_logits, ref_loss, ref_grads = peft_step(reference, adapter, tokens, targets)
    assert any("experts" in k[1] for k in ref_grads)
    runs = [("none", 0, "none", "auto"), ("disk", 1, "all", "auto"), ("ram", 0, "none", "whole"),
            ("disk", 0, "none", "routed")]
    for offload, prefetch, recompute, reads in runs:
        knobs = {} if offload == "none" else dict(expert_reads=reads, micro_batch=1 if reads == "routed" else None)
        got = phantom_step(tmp_path / "q", tokens, targets, offload=offload, prefetch=prefetch, recompute=recompute,
                           dtype=torch.float32, **knobs)
        assert_equals_peft(got, (ref_logits, ref_loss, ref_grads), (offload, reads))


def test_an_unhit_experts_stale_weights_reach_nothing():
    """A routed read leaves an unhit expert's base weights unread (whatever its slot held): the expert does not
    run, NaN there changes no output or gradient, and its rows of its bank's gradients are zeros."""
    import torch.nn.functional as F
    from phantom.arch.config import ModelConfig
    from phantom.arch.expertlora import apply_expert_lora
    from phantom.arch.moe import MoeFeedForward, expert_views, mix
    cfg = ModelConfig(dim=8, n_layers=1, n_heads=2, vocab_size=10, n_experts=3, experts_per_token=2, expert_dim=6)
    results = []
    for stale in (0.0, float("nan")):
        torch.manual_seed(0)
        moe = MoeFeedForward(cfg, F.silu)
        for p in moe.parameters():
            p.requires_grad_(False)
        for target in ("experts_gate_up", "experts_down"):
            apply_expert_lora(moe, target, 2, 4.0, False, torch.Generator().manual_seed(1))
        banks = [p for n, p in moe.named_parameters() if "lora_" in n]
        with torch.no_grad():
            for p in banks:
                p.normal_()
            for name in ("w1", "w2", "w3"):
                getattr(moe.experts[2], name).weight.fill_(stale)  # expert 2: no token routes to it
        x = torch.randn(5, 8, requires_grad=True)
        chosen = torch.tensor([[0, 1], [1, 0], [0, 1], [1, 0], [0, 1]])
        with expert_views(moe):  # as MoeFeedForward.forward runs them
            out = mix(x, torch.full((5, 2), 0.5), chosen, moe.experts)
        out.square().sum().backward()
        for p in banks:  # A (r*E, in): rows 4:6; B (out, r*E): columns 2, 5
            assert not (p.grad[4:6] if p.shape[0] == 6 else p.grad[:, 2::3]).any()
        results.append((out.detach(), x.grad, [p.grad for p in banks]))
    (out0, gx0, g0), (out1, gx1, g1) = results
    assert torch.equal(out0, out1) and torch.equal(gx0, gx1) and all(torch.equal(a, b) for a, b in zip(g0, g1))
