"""Quantized stores: what the manifest records, what is refused, and the streamed quantized model
against a resident model built from the dequantized weights (disk and RAM tiers, prefetch 0 and 2)."""
from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch

import phantom
import phantom.stream.memory
import phantom.model.phantom_model
import phantom.stream.placement
from phantom.arch import quant
from phantom.arch.config import block_tensor_shapes
from phantom.convert.quantstore import quantize_store
from phantom.convert.synthetic import write_synthetic
from phantom.stream.placement import Placement
from phantom.arch.quantformat import QuantFormat, block_layout
from phantom.stream.scheduler import BlockScheduler
from phantom.data.tokenizer import train_tiny_tokenizer
from phantom.files.store import BlockStore, StoreError
from phantom.files.storeformat import MANIFEST, block_file
from phantom.files.storewriter import StoreWriter
from phantom.files.tensorfile import read_header, write_safetensors
from conftest import max_rel_err, randomize_lora
from test_bad_inputs import check, script
from test_tiers import CFG, assert_same, one_thread, step  # noqa: F401 (one_thread: a module fixture)

FORMATS = {"nf4": QuantFormat("nf4"), "nf4-plain": QuantFormat("nf4", double_quant=False),
           "int8": QuantFormat("int8")}


@pytest.fixture(scope="module")
def bf16(tmp_path_factory) -> Path:
    """A bf16 store with the tiny model's tokenizer (64 pieces, within CFG's vocabulary)."""
    root = tmp_path_factory.mktemp("q")
    tok = root / "tokenizer.model"
    train_tiny_tokenizer(tok, vocab_size=64)
    return write_synthetic(root / "bf16", CFG, torch.bfloat16, seed=5, progress=False, init="fan_in", tokenizer=tok)


@pytest.fixture(scope="module")
def stores(bf16):
    """format name -> a quantized store made from the bf16 store (the --src STORE path)."""
    return {name: quantize_store(bf16, bf16.parent / name, fmt, progress=False)["out"] for name, fmt in FORMATS.items()}


def dequantized_store(src: Path, out: Path, dtype=torch.float32) -> Path:
    """A plain store of the quantized store's weights, dequantized into dtype."""
    q = BlockStore(src)
    with StoreWriter(out, q.cfg, dtype) as w:
        w.write_embed(q.load_embed())
        for i in range(q.n_blocks):
            w.write_block(i, q.load_block(i, dtype))
        w.write_head(q.load_head())
        return w.finish()


@pytest.fixture(scope="module")
def resident(stores):
    """format -> loss and LoRA grads of the resident fp32 model built from the dequantized weights."""
    out = {}
    for name, path in stores.items():
        ref = dequantized_store(path, path.parent / f"{name}-fp32")
        with phantom.load(ref, offload="none") as model:
            randomize_lora(model)
            out[name] = step(model)
    return out


def test_manifest_records_how_each_tensor_is_stored(bf16, stores):
    plain = BlockStore(bf16)
    for name, path in stores.items():
        store, fmt = BlockStore(path, verify="full"), FORMATS[name]
        rec = json.loads((path / MANIFEST).read_text())["quantization"]
        assert QuantFormat.from_record(rec) == fmt == store.quant
        assert rec["tensors"] == {n: fmt.method if len(s) == 2 else "bfloat16" for n, s in block_tensor_shapes(CFG).items()}
        specs = {s.name: (s.shape, str(s.dtype).removeprefix("torch.")) for s in read_header(path / block_file(3))[0]}
        assert specs == block_layout(fmt, block_tensor_shapes(CFG), "bfloat16")
        assert store.dense_nbytes == plain.block_nbytes
        # embedding and head stay 16-bit, the very tensors of the store it came from
        assert torch.equal(store.load_embed()["tok_embeddings.weight"], plain.load_embed()["tok_embeddings.weight"])
        assert torch.equal(store.load_head()["output.weight"], plain.load_head()["output.weight"])
        # the stored codes are those of the bf16 weights
        w = plain.load_block(3)["feed_forward.w2.weight"]
        parts = quant.quantize_int8(w) if fmt.method == "int8" else quant.quantize_nf4(w, fmt)
        stored = store.block_views(store.map_block(3))
        assert all(torch.equal(stored[f"feed_forward.w2.weight.{k}"], v) for k, v in parts.items())
    ratio = {n: BlockStore(p).block_nbytes / plain.block_nbytes for n, p in stores.items()}
    assert ratio["nf4"] < 0.3 and ratio["int8"] < 0.55 and ratio["nf4"] < ratio["nf4-plain"]


def test_synthetic_and_checkpoint_paths_write_the_same_store(bf16, stores, tmp_path):
    direct = write_synthetic(tmp_path / "direct", CFG, torch.bfloat16, seed=5, progress=False, init="fan_in",
                             quant=FORMATS["nf4"])
    for i in (0, 7):
        assert (direct / block_file(i)).read_bytes() == (stores["nf4"] / block_file(i)).read_bytes()


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("offload", ["disk", "ram"])
def test_streamed_quantized_model_equals_resident_dequantized(stores, resident, name, prefetch, offload):
    with phantom.load(stores[name], placement=Placement(offload=offload, prefetch=prefetch)) as model:
        randomize_lora(model)
        sched = model.scheduler
        assert sched.tiers == (offload,) * CFG.n_layers
        first = step(model)
        m = sched.take_metrics()
        assert_same(first, resident[name])
        assert step(model)[0] == first[0]
        m = sched.take_metrics()
        moved = m["bytes_read"] if offload == "disk" else m["bytes_ram"]
        assert moved == m["loads"] * model.store.block_nbytes > 0  # quantized bytes, not dense ones
        assert m["dequant_s"] > 0


def test_a_cpu_dequantizes_on_the_training_thread_when_a_block_is_acquired(stores, resident, monkeypatch):
    """On a CPU a loader only reads: the training thread dequantizes a loaded block at its acquire, on the
    compute's threads (a loader's dequantization competed with the compute for the cores), counted as
    dequantization, not as a stall, once per load whatever the block's later acquires."""
    names, real = [], BlockStore.dequantize_block

    def slow(self, *a, **k):
        names.append(threading.current_thread().name)
        time.sleep(0.02)
        return real(self, *a, **k)
    monkeypatch.setattr(BlockStore, "dequantize_block", slow)
    with phantom.load(stores["nf4"], placement=Placement(offload="disk", prefetch=2)) as model:
        randomize_lora(model)
        model.scheduler.take_metrics()
        del names[:]
        assert_same(step(model), resident["nf4"])
        m = model.scheduler.take_metrics()
    assert set(names) == {threading.main_thread().name} and len(names) == m["loads"] > 0
    assert m["dequant_s"] >= 0.02 * m["loads"] and m["stall_s"] < 0.5 * m["dequant_s"]


def test_device_tier_and_resident_load_dequantize_too(stores, resident, monkeypatch):
    """A quantized block kept on the device (dequantized once), and offload="none", equal the reference."""
    three = ("device",) * 2 + ("ram",) * 3 + ("disk",) * 3  # as CUDA places them (a CPU has no device tier)
    real = phantom.stream.placement.resolve
    monkeypatch.setattr(phantom.stream.placement, "resolve", lambda *a, **k: real(*a, **{**k, "tiers": three}))
    with phantom.load(stores["nf4"], placement=Placement(prefetch=1)) as model:
        randomize_lora(model)
        assert model.scheduler.tiers == three
        assert_same(step(model), resident["nf4"])
    with phantom.load(stores["int8"], offload="none") as model:
        randomize_lora(model)
        assert_same(step(model), resident["int8"])


def test_ram_tier_holds_quantized_bytes_by_budget(stores):
    store = BlockStore(stores["nf4"])
    budget = 5 * store.block_nbytes + store.block_nbytes // 2  # five quantized blocks; under two dense ones
    assert budget < 2 * store.dense_nbytes * 2  # (fp32 compute)
    with BlockScheduler(store, "cpu", Placement(offload="auto", prefetch=1, ram_budget=budget),
                        dtype=torch.float32) as sched:
        assert sched.tiers.count("ram") == 5


# ---------------------------------------------------------------------------------------------
# Refusals: one `error:` line, exit 2

def gen(store: Path, *extra) -> int:
    return script("generate").main(["--model", str(store), "--prompt", "a", "--max-new-tokens", "2", *extra])


def copy(stores, tmp_path, name="nf4") -> Path:
    return Path(shutil.copytree(stores[name], tmp_path / name))


def test_tampered_scale_tensor_is_refused(stores, tmp_path, capsys):
    store = copy(stores, tmp_path)
    path = store / block_file(2)
    specs, start = read_header(path)
    scale = next(s for s in specs if s.name == "attention.wo.weight.absmax2")
    raw = bytearray(path.read_bytes())
    raw[start + scale.start + 1] ^= 0x40
    path.write_bytes(bytes(raw))
    with pytest.raises(StoreError, match="checksum mismatch"):
        BlockStore(store).load_block(2)
    check(capsys, gen(store, "--device", "cpu"), tmp_path, "checksum mismatch", "002.safetensors")


def test_negative_scale_with_matching_checksums_is_refused(stores, tmp_path, capsys):
    """A file rewritten with its manifest entry to match still cannot carry scales no quantizer writes."""
    store = copy(stores, tmp_path, "nf4-plain")
    path = store / block_file(1)
    tensors = BlockStore(store).block_views(BlockStore(store).map_block(1))
    tensors = {k: v.clone() for k, v in tensors.items()}
    tensors["feed_forward.w1.weight.absmax"][3] = -1.0
    manifest = json.loads((store / MANIFEST).read_text())
    manifest["files"][block_file(1)] = write_safetensors(path, tensors)
    (store / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(StoreError, match="scales"):
        BlockStore(store).load_block(1)
    check(capsys, gen(store, "--device", "cpu"), tmp_path, "001.safetensors", "scales")


@pytest.mark.parametrize("damage, words", [
    (lambda q: q.update(method="int8"), ("quantization record", "int8")),
    (lambda q: q.update({"method": "int8", "tensors": {k: "int8" if v == "nf4" else v for k, v in q["tensors"].items()}},
                        **{k: None for k in ("blocksize", "double_quant", "absmax_blocksize")}) or
     [q.pop(k) for k in ("blocksize", "double_quant", "absmax_blocksize")], ("000.safetensors", "do not match")),
    (lambda q: q.update(blocksize=128), ("000.safetensors", "wrong shape")),
    (lambda q: q.update(double_quant=False), ("000.safetensors",)),
    (lambda q: q["tensors"].update({"attention.wq.weight": "bfloat16"}), ("quantization record",)),
    (lambda q: q.update(method="nf2"), ("quantization record", "nf2")),
    (lambda q: q.pop("blocksize"), ("quantization record",)),
])
def test_mismatched_quantization_record_is_refused(stores, tmp_path, capsys, damage, words):
    store = copy(stores, tmp_path)
    manifest = json.loads((store / MANIFEST).read_text())
    damage(manifest["quantization"])
    (store / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(StoreError):
        BlockStore(store)
    check(capsys, gen(store), tmp_path, *words)


def test_full_finetuning_of_a_quantized_store_is_refused(stores, tmp_path, capsys):
    out = tmp_path / "out"
    code = script("finetune").main(["--model", str(stores["nf4"]), "--mode", "full", "--iters", "1", "--quiet",
                                    "--batch-size", "1", "--seq-len", "8", "--val-split", "0", "--out", str(out),
                                    "--data", str(Path(phantom.__file__).parent / "assets" / "tiny.txt")])
    check(capsys, code, tmp_path, "frozen", "full finetuning")
    assert not (out / "store").exists()


def test_prepare_quantize_refusals(stores, bf16, tmp_path, capsys):
    prep = script("prepare_model").main
    check(capsys, prep(["--src", str(stores["nf4"]), "--out", str(tmp_path / "x"), "--quantize", "int8",
                        "--quiet"]), tmp_path, "already quantized")
    check(capsys, prep(["--synthetic", "--out", str(tmp_path / "y"), "--quantize", "nf4", "--dtype", "fp32",
                        "--quiet"]), tmp_path, "16 bits")
    check(capsys, prep(["--src", str(bf16), "--out", str(tmp_path / "z"), "--quantize", "nf4", "--dtype", "fp32",
                        "--quiet"]), tmp_path, "16 bits")
    assert not any(tmp_path.iterdir())


# ---------------------------------------------------------------------------------------------
# What people do with the result: the adapter on the 16-bit model (peft), merge, generate

@pytest.fixture(scope="module")
def trained(stores, tmp_path_factory):
    """An adapter trained (3 AdamW steps, every projection) on the NF4 store, and phantom's logits with it."""
    from phantom.model.lora import PROJECTIONS
    root = tmp_path_factory.mktemp("adapter")
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(3))
    lora = phantom.LoraConfig(rank=4, alpha=8, targets=PROJECTIONS)
    with phantom.load(stores["nf4"], offload="disk", prefetch=2, lora=lora) as model:
        randomize_lora(model)
        opt = torch.optim.AdamW(model.trainable_parameters(), lr=1e-2)
        for _ in range(3):
            model(tokens[:, :-1], targets=tokens[:, 1:]).backward()
            opt.step()
            opt.zero_grad()
        model.save_adapter(root / "adapter")
        with torch.no_grad():
            logits = model(tokens)
    return root / "adapter", tokens, logits


def test_adapter_trained_on_nf4_loads_with_peft_on_the_dequantized_model(stores, trained, tmp_path):
    """QLoRA's deployment: the adapter onto transformers' model given the dequantized weights (written by
    merge_lora.py without an adapter), through peft: the same logits."""
    transformers, peft = pytest.importorskip("transformers"), pytest.importorskip("peft")
    adapter, tokens, logits = trained
    base = tmp_path / "hf"
    assert script("merge_lora").main(["--model", str(stores["nf4"]), "--out", str(base), "--dtype", "fp32",
                                      "--quiet"]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager")
    ref = peft.PeftModel.from_pretrained(hf.eval(), adapter).eval()
    with torch.no_grad():
        assert max_rel_err(logits, ref(tokens).logits) < 1e-5
    merged = tmp_path / "merged"  # and merged into the dequantized weights, written 16-bit
    assert script("merge_lora").main(["--model", str(stores["nf4"]), "--adapter", str(adapter), "--out", str(merged),
                                      "--quiet"]) == 0
    m = transformers.AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    assert json.loads((merged / "config.json").read_text())["torch_dtype"] == "bfloat16"
    with torch.no_grad():
        assert max_rel_err(m(tokens).logits, logits) < 2e-2  # bf16 weights (W + BA rounded once)


def test_generate_runs_the_quantized_store(stores, trained, tmp_path, capsys):
    """generate.py on the NF4 store (streamed, dequantized) prints what it prints on a plain fp32 store
    of the dequantized weights: greedy, with the adapter."""
    adapter = trained[0]
    ref = dequantized_store(stores["nf4"], tmp_path / "fp32")
    shutil.copy(BlockStore(stores["nf4"]).tokenizer_path, ref / "tokenizer.model")
    texts = []
    for store in (stores["nf4"], ref):
        assert script("generate").main(["--model", str(store), "--adapter", str(adapter), "--prompt", "the ",
                                        "--max-new-tokens", "12", "--temperature", "0", "--device", "cpu",
                                        "--tokenizer", str(ref / "tokenizer.model")]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and len(texts[0]) > len("the \n")


# ---------------------------------------------------------------------------------------------
# The cost model counts quantized bytes and the dequantization

@pytest.fixture(scope="module")
def linked(tmp_path_factory) -> Path:
    """A store that reads an HF checkpoint's safetensors files in place (prepare_model.py --link)."""
    from phantom.convert.convert import convert_checkpoint
    from test_convert import random_model, write_hf
    root = tmp_path_factory.mktemp("link")
    info = convert_checkpoint(write_hf(root / "hf", CFG, random_model(CFG, seed=3)), root / "linked", link=True,
                              progress=False)
    assert info["linked_bytes"] > 0  # the blocks' tensors are read from the checkpoint's files
    return info["out"]


def test_cost_model_counts_quantized_bytes_and_dequantization(bf16, stores, linked):
    from phantom.plan import costinputs as ci, costmodel as cm
    from phantom.stream.placement import Activations, loads_per_step
    for path in (bf16, *stores.values(), linked):  # 16-bit, nf4 with and without double quantization, int8, linked
        store = BlockStore(path)
        assert ci.shape_of(store.cfg, store.manifest["dtype"], "fp32", 16, store.quant).block_bytes == store.block_nbytes
    store = BlockStore(stores["nf4"])
    shape, plain = ci.shape_of(CFG, "bf16", "fp32", 16, "nf4"), ci.shape_of(CFG, "bf16", "fp32", 16)
    assert shape.block_bytes == store.block_nbytes and shape.converts and shape.dequant_bytes == plain.resident_bytes
    fast, slow = (ci.MachineProfile(machine="t", device="cpu", dequant_gbps=g) for g in (100.0, 0.01))
    place = Placement(offload="disk", prefetch=0)
    a, b = (cm.predict(p, shape, place, Activations(), rows=2) for p in (fast, slow))
    loads = loads_per_step(a.tiers, 1, ram_streams=True)["disk"]  # prefetch 0: one slot
    assert a.bytes_read == b.bytes_read == loads * store.block_nbytes
    dequant = shape.dequant_bytes / 1e9 * (1 / 0.01 - 1 / 100.0)
    assert b.step_s - a.step_s == pytest.approx(loads * dequant, rel=1e-6)  # prefetch 0: in series
    # with the same RAM budget the quantized store holds about 3.6x the blocks a bf16 one does
    ram = Placement(offload="auto", prefetch=1, ram_budget=6 * store.block_nbytes)
    q, bf = (cm.predict(fast, ci.shape_of(CFG, "bf16", "bf16", 16, qt), ram, Activations(), rows=2) for qt in ("nf4", None))
    assert q.split["ram"] == 6 and bf.split["ram"] == 1


def test_a_cpus_dequantization_is_timed_on_bytes_just_read_as_a_run_dequantizes_them(stores, monkeypatch):
    """A run dequantizes a block right after its read (an O_DIRECT read: nothing of it in the caches); timed
    again and again on the same bytes a dim-2048 fp8-block block took two thirds of that. measure_dequant reads
    the block before each timed call."""
    import itertools

    from phantom.plan import profiles
    store, log = BlockStore(stores["nf4"]), []
    read, dequantize = store.read_block_into, store.dequantize_block
    monkeypatch.setattr(store, "read_block_into", lambda *a, **k: (log.append("R"), read(*a, **k))[1])
    monkeypatch.setattr(store, "dequantize_block", lambda *a, **k: (log.append("D"), dequantize(*a, **k))[1])
    assert profiles.measure_dequant(store, torch.device("cpu"), torch.float32, repeats=3, sample_s=0.0) > 0
    calls = "".join(k for k, _ in itertools.groupby(log))  # a call's tensors may go to several workers
    assert calls == "RD" + "RD" * 3  # the first read and the warm-up, then a read before each timed call


def test_tuner_measures_the_dequantization_and_keeps_its_own_profile(stores, bf16, tmp_path):
    from phantom.plan import profiles
    store = BlockStore(stores["nf4"])
    assert profiles.measure_dequant(store, torch.device("cpu"), torch.float32, repeats=1) > 0
    assert profiles.measure(store, "cpu", "fp32", 1, 16, quick=True).dequant_gbps != \
        profiles.measure(BlockStore(bf16), "cpu", "fp32", 1, 16, quick=True).dequant_gbps  # measured, not the default
    paths = {profiles.profile_path(BlockStore(p), "cpu", "fp32", 16, tmp_path) for p in (bf16, stores["nf4"], stores["int8"])}
    assert len(paths) == 3
    assert profiles.profile_path(CFG, "cpu", "fp32", 16, tmp_path, "bf16", "nf4") == \
        profiles.profile_path(store, "cpu", "fp32", 16, tmp_path)


def test_cost_model_places_a_quantized_store_as_the_scheduler_does(stores, monkeypatch):
    """CUDA's budgets (a CPU has no device tier): the device tier counts dequantized blocks, RAM stored ones."""
    from phantom.plan import costinputs as ci, costmodel as cm
    from phantom.stream.residency import resolve_layout
    store = BlockStore(stores["nf4"])
    shape = ci.shape_of(CFG, "bf16", "bf16", 16, "nf4")
    place = Placement(offload="auto", prefetch=1, device_budget=2 * store.block_nbytes + 3 * store.dense_nbytes,
                      ram_budget=3 * store.block_nbytes + 100)
    profile = ci.MachineProfile(machine="t", device="cuda", free_device_bytes=1 << 40, free_host_bytes=1 << 40)
    planned = cm.layout(shape, profile, place).tiers
    monkeypatch.setattr(phantom.stream.memory, "free_device_bytes", lambda device: 1 << 40)
    # the scheduler's tier choice alone, without allocating on a device
    resolved = resolve_layout(store, torch.device("cuda"), torch.bfloat16, place, zero_copy=None, device_reserve=0)
    assert resolved.tiers == planned
    assert planned.count("ram") == 3 and 0 < planned.count("device") <= 3
