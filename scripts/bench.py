"""Benchmark one LoRA training step of the same synthetic model under several placements, side by side.

    python scripts/bench.py --dim 1024 --layers 8 --batch-size 4 --seq-len 256 --cold

Modes: resident (offload=none, plain autograd), ram and disk (phantom streaming with prefetch K),
naive (disk, prefetch 0: load each block synchronously before use, as slowllama does). Each mode
runs in its own process so peak memory is its own. The table goes to stdout and to
notes/bench-<device>.md with the command line and the machine.

    python scripts/bench.py --modes disk --prefetch 0,1,2,4 --micro-batch 1,2 --tuned --cold

sweeps prefetch depth x micro-batch, then runs the tuner's choice (phantom.tune, searching the
swept tiers and recompute policies with no resident blocks) and prints each row's predicted step.

    python scripts/bench.py --modes resident+leaky,resident+mask,disk+leaky,disk+mask --packed 8

packs 8 examples into each row, stepping with the document mask (segment ids: block-diagonal causal
attention, positions from 0 per example) or without it (the leaky plain causal mask), side by side.

    OMP_NUM_THREADS=1 python scripts/bench.py --modes diskread --dim 1024 --layers 12 --vocab 1024 --batch-size 1 --seq-len 8

(alone) races the disk tier's first pass (crc32 checked) against raw O_DIRECT reads of the same
files, then half the blocks in RAM against pure disk with the cost model's predictions; to notes/bench-tiers.md.

    python scripts/bench.py --modes quant --dim 2048 --layers 8 --dtype bf16 --quant-batches 1x32,8x256 --cold

(alone) the same model stored bf16, NF4 and int8 (prepare_model.py --quantize), disk tier: bytes read per
step, the loader's dequantization, step time beside the cost model's prediction; to notes/bench-quant.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import phantom  # noqa: E402
import phantom.checksum  # noqa: E402
import phantom.directio  # noqa: E402
import phantom.fileio  # noqa: E402
from phantom import cli  # noqa: E402
from phantom import costmodel as cm  # noqa: E402
from phantom import tune  # noqa: E402
from phantom.config import ModelConfig, block_tensor_shapes  # noqa: E402
from phantom.convert import write_synthetic  # noqa: E402
from phantom.placement import parse_bytes, split_knobs  # noqa: E402
from phantom.preference import Preference, PreferenceConfig  # noqa: E402
from phantom.store import BlockStore  # noqa: E402
from phantom.tensorfile import dtype_name  # noqa: E402

MODES = {  # name -> load arguments
    "resident": dict(offload="none"),
    "ram": dict(offload="ram"),
    "disk": dict(offload="disk"),
    "naive": dict(offload="disk", prefetch=0, recompute="all"),  # slowllama's schedule: sync loads, rerun forward
    "auto": dict(offload="auto"),  # tiers by budget: --device-budget / --ram-budget
    "h2d": dict(),  # CUDA: the pinned host-to-device copy peak, one block at a time
    "matmul": dict(),  # the measured matmul rate at the block's shapes (for the FLOP floor)
    "hf-peft": dict(),  # transformers + peft, resident, if installed (the outside reference)
    "fsdp-offload": dict(),  # transformers + peft under FSDP2 with CPUOffloadPolicy (CUDA; plain FSDP2 on CPU)
    "diskread": dict(),  # disk tier vs raw O_DIRECT reads; half the blocks in RAM vs disk (own table)
    "quant": dict(),  # bf16 vs NF4 vs int8 stores, disk tier, with the cost model (own table)
}
PEERS = ("hf-peft", "fsdp-offload")  # other tools' rows: no recompute policy, no streaming metrics


def peak_rss_gb() -> float:
    """This process's own peak RSS. Not ru_maxrss: a child started by subprocess reports its parent's
    peak there until it exceeds it (Linux keeps the high-water mark across exec)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 2**20
    except (OSError, StopIteration, ValueError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dim", type=int, default=1024, help="model width")
    p.add_argument("--layers", type=int, default=8, help="number of blocks")
    p.add_argument("--heads", type=int, default=16, help="attention heads")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (GQA); default: heads")
    p.add_argument("--preset", default=None, help="take the shapes of a preset (e.g. 70B); --layers still cuts depth")
    p.add_argument("--batch-size", type=int, default=4, help="rows per step")
    p.add_argument("--micro-batch", default="", help="comma list of micro-batch sizes to sweep (layer-major accumulation)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per row")
    p.add_argument("--dtype", default="fp32", choices=cli.STORE_DTYPES, help="store and compute dtype")
    p.add_argument("--prefetch", default="2", help="comma list of prefetch depths K for ram/disk (a sweep)")
    p.add_argument("--tuned", action="store_true", help="measure a tuning profile, run the tuner's choice too and "
                                                         "print each row's predicted step time")
    p.add_argument("--recompute", default="auto", help="comma list of recompute policies to run (auto, the API's "
                                                         "default; all; none)")
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary of the synthetic model")
    p.add_argument("--lora-rank", type=int, default=8, help="LoRA rank (q and v, as PEFT's default targets)")
    p.add_argument("--modes", default="resident,ram,disk,naive", help=f"comma list of {', '.join(MODES)}")
    p.add_argument("--train", default="lora", help="comma list of what a step trains: lora, full (every weight: "
                   "per-block AdamW beside the backward); with full, rows for the optimizer's parameters/s and "
                   "the host memory bandwidth measured in the same run; dpo: the same rows as --batch-size / 2 "
                   "preference pairs (LoRA, the reference beside the policy), with its ratio to the lora row")
    p.add_argument("--steps", type=int, default=3, help="timed steps per mode (after one warm-up step)")
    p.add_argument("--rounds", type=int, default=1, help="run every row this many times, interleaved, and keep "
                   "each row's fastest: on a shared machine rows measured minutes apart differ by the load")
    p.add_argument("--cold", action="store_true", help="evict block files from the page cache after each read")
    p.add_argument("--device", default="cpu", help="cpu, cuda, mps")
    p.add_argument("--store", default=None, help="use this store instead of writing a synthetic one")
    p.add_argument("--out", default=None, help="notes file to append to (default notes/bench-<device>.md)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False, help="torch.compile blocks")
    p.add_argument("--device-budget", default=None, help="bytes for resident blocks in mode auto (e.g. 20G)")
    p.add_argument("--ram-budget", default=None, help="bytes of RAM tier in mode auto (e.g. 8G)")
    p.add_argument("--packed", type=int, default=8, help="modes suffixed +mask or +leaky (e.g. disk+mask): each row "
                   "packs this many examples, with the document mask (segment ids) or without (default: 8)")
    p.add_argument("--quant-batches", default="1x32,8x256", help="mode quant: rows x tokens per step to run, "
                                                                   "e.g. a read-bound and a compute-bound one")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def hf_peft_model(store: BlockStore, rank: int = 8):
    """A resident transformers LlamaForCausalLM with peft's LoRA on q and v, same shapes and dtype."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM
    c = store.cfg
    hf = LlamaConfig(hidden_size=c.dim, intermediate_size=c.hidden_dim, num_hidden_layers=c.n_layers,
                     num_attention_heads=c.n_heads, num_key_value_heads=c.kv_heads, vocab_size=c.vocab_size,
                     max_position_embeddings=c.max_seq_len, rms_norm_eps=c.norm_eps, rope_theta=c.rope_theta,
                     attn_implementation="sdpa")
    model = LlamaForCausalLM(hf).to(store.dtype)
    return get_peft_model(model, LoraConfig(r=rank, lora_alpha=16, target_modules=["q_proj", "v_proj"]))


def hf_worker(args) -> dict:
    """transformers + peft, everything resident on the device."""
    store = BlockStore(args.store)
    model = hf_peft_model(store, args.lora_rank).to(args.device)
    return hf_steps(model, store, args)


def fsdp_worker(args) -> dict:
    """What a GPU user picks when the model does not fit: PyTorch FSDP2 with CPUOffloadPolicy in one
    process (parameters in pinned host memory, copied up layer by layer; the optimizer on the host),
    the same transformers + peft model. On a CPU there is nowhere to offload to: plain FSDP2 (gloo),
    which only checks the harness."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
    device = torch.device(args.device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    try:
        store = BlockStore(args.store)
        model = hf_peft_model(store, args.lora_rank)  # built on the host; FSDP keeps it there
        mesh = init_device_mesh(device.type, (1,))
        offload = CPUOffloadPolicy(pin_memory=True) if device.type == "cuda" else OffloadPolicy()
        mp = MixedPrecisionPolicy(param_dtype=store.dtype, reduce_dtype=torch.float32)  # LoRA params are fp32
        for layer in model.base_model.model.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp, offload_policy=offload)
        fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload)
        return hf_steps(model, store, args)
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def hf_steps(model, store: BlockStore, args) -> dict:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    tokens = torch.randint(0, store.cfg.vocab_size, (args.batch_size, args.seq_len),
                           generator=torch.Generator().manual_seed(0)).to(args.device)
    cuda = torch.device(args.device).type == "cuda"
    times = []
    for step in range(args.steps + 1):
        t0 = time.perf_counter()
        model(input_ids=tokens, labels=tokens).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        if step:
            times.append(time.perf_counter() - t0)
    return {"step_s": statistics.median(times), "stall": 0.0, "loads": 0, "bytes_per_step": 0, "read_gbps": 0.0,
            "peak_rss_gb": peak_rss_gb(),
            "peak_dev_gb": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0}


def h2d_worker(args) -> dict:
    """Pinned host -> device copies of one block (exactly pinned, as the RAM tier is): the link's peak."""
    from phantom.hostmem import HostBuffer
    store = BlockStore(args.store)
    host = HostBuffer(store.block_nbytes, pin=True)
    dev = torch.empty(store.block_nbytes, dtype=torch.uint8, device=args.device)
    times = []
    for _ in range(args.steps + 2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dev.copy_(host.tensor, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    t = statistics.median(times[1:])
    return {"step_s": t, "stall": 0.0, "loads": 1, "bytes_per_step": store.block_nbytes,
            "read_gbps": store.block_nbytes / t / 1e9, "peak_rss_gb": 0.0, "peak_dev_gb": 0.0}


def matmul_worker(args) -> dict:
    """Rate of the block's largest matmul (tokens x dim @ dim x hidden) in the store's dtype: FLOP/s."""
    store = BlockStore(args.store)
    c, dev = store.cfg, torch.device(args.device)
    a = torch.randn(args.batch_size * args.seq_len, c.dim, dtype=store.dtype, device=dev)
    w = torch.randn(c.hidden_dim, c.dim, dtype=store.dtype, device=dev)  # (out, in), as the model's weights
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    reps, best = 10, float("inf")
    for layout in (lambda: torch.nn.functional.linear(a, w), lambda: a @ w.t().contiguous()):
        layout()
        times = []
        for _ in range(args.steps + 1):
            sync()
            t0 = time.perf_counter()
            for _ in range(reps):
                layout()
            sync()
            times.append((time.perf_counter() - t0) / reps)
        best = min(best, statistics.median(times[1:]))  # the faster layout: the rate the hardware reaches
    t = best
    return {"step_s": t, "stall": 0.0, "loads": 0, "bytes_per_step": 0, "read_gbps": 0.0,
            "flops_per_s": 2 * a.shape[0] * c.dim * c.hidden_dim / t, "peak_rss_gb": 0.0, "peak_dev_gb": 0.0}


def step_flops(cfg, batch: int, seq: int, recompute: str) -> float:
    """Matmul FLOPs of one LoRA step: forward 2PT, input gradients 2PT, a recomputed forward 2PT
    (recompute all); causal attention half of 4 B T^2 dim per pass; the head 2VdT forward + backward."""
    tokens = batch * seq
    per_block = sum(math.prod(shape) for shape in block_tensor_shapes(cfg).values())
    passes = 3 if recompute == "all" else 2
    attn = 2 * batch * seq * seq * cfg.dim
    return cfg.n_layers * passes * (2 * per_block * tokens + attn) + 4 * cfg.vocab_size * cfg.dim * tokens


def worker(args) -> dict:
    """One mode in this process: warm-up step, timed steps, metrics."""
    mode, recompute, micro, prefetch = args.worker.split(":")
    mode, _, packing = mode.partition("+")  # +mask / +leaky: packed rows with or without the document mask
    if mode == "hf-peft":
        return hf_worker(args)
    if mode == "fsdp-offload":
        return fsdp_worker(args)
    if mode == "h2d":
        return h2d_worker(args)
    if mode == "matmul":
        return matmul_worker(args)
    kw = dict(MODES[mode.removeprefix("tuned-")])
    if mode == "auto":
        kw.update(device_budget=parse_bytes(args.device_budget) if args.device_budget else None,
                  ram_budget=parse_bytes(args.ram_budget) if args.ram_budget else None)
    kw.setdefault("prefetch", int(prefetch) if prefetch != "-" else 0)
    store = BlockStore(args.store, drop_cache=args.cold)
    placement, activations = split_knobs(
        dict({"recompute": recompute, **kw}, micro_batch=int(micro) if micro != "-" else None, compile=args.compile),
        phantom.Placement(), phantom.Activations())
    full = args.train == "full"
    if full:  # the step rewrites the blocks: a working copy (hard links), as phantom.load(work_dir=...) makes
        work = Path(tempfile.mkdtemp(dir=Path(args.store).parent))
        store = BlockStore(phantom.store.clone_store(Path(args.store), work / "store"), drop_cache=args.cold)
    model = phantom.PhantomModel(store, phantom.resolve_device(args.device), store.dtype, placement, activations,
                                 lora=None if full else phantom.LoraConfig(rank=args.lora_rank),
                                 optim=phantom.AdamWConfig(lr=1e-4) if full else None)
    opt = torch.optim.AdamW(model.trainable_parameters(), lr=1e-4, fused=full or None)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.cfg.vocab_size, (args.batch_size, args.seq_len + 1), generator=gen)
    x, y = tokens[:, :-1].to(model.device), tokens[:, 1:].to(model.device)
    packed = {}
    if packing == "mask":  # args.packed examples of equal length per row
        packed["segments"] = (torch.arange(args.seq_len) * args.packed // args.seq_len).expand(args.batch_size, -1)
    loss_of = lambda: model(x, targets=y, **packed)  # noqa: E731
    if args.train == "dpo":  # the same rows as pairs: row 2i chosen, 2i + 1 rejected
        objective = Preference(PreferenceConfig())
        loss_of = lambda: objective(model, x.view(-1, 2, args.seq_len), y.view(-1, 2, args.seq_len))  # noqa: E731
    times, stalls, metrics = [], [], []
    for step in range(args.steps + 1):
        if model.scheduler:
            model.scheduler.take_metrics()
        t0, c0 = time.perf_counter(), process_cpu_s()
        loss_of().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        model.finish_step()  # full: the blocks' updates have landed
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        m = model.scheduler.take_metrics() if model.scheduler else {}
        if model.block_optimizer is not None:
            m.update(model.block_optimizer.take_rate())
        m["cpu_s"] = process_cpu_s() - c0
        if step:  # step 0 is warm-up
            times.append(dt)
            stalls.append(m.get("stall_s", 0.0) / dt)
            metrics.append(m)
    model.close()
    if full:
        shutil.rmtree(work, ignore_errors=True)
    optim_s = sum(m.get("optim_s", 0.0) for m in metrics)
    moved = sum(m.get("bytes_read", 0) + m.get("bytes_h2d", 0) for m in metrics) / len(metrics)
    read_s = sum(m.get("read_s", 0) for m in metrics)
    copy_s = sum(m.get("copy_s", 0) for m in metrics)
    return {"step_s": statistics.median(times), "stall": statistics.mean(stalls),
            "h2d_per_step": sum(m.get("bytes_h2d", 0) for m in metrics) / len(metrics),
            "copy_gbps": sum(m.get("bytes_h2d", 0) for m in metrics) / copy_s / 1e9 if copy_s else 0.0,
            "loads": metrics[-1].get("loads", 0), "bytes_per_step": moved,
            "read_gbps": sum(m.get("bytes_read", 0) for m in metrics) / read_s / 1e9 if read_s else 0.0,
            "peak_rss_gb": peak_rss_gb(),
            "peak_dev_gb": torch.cuda.max_memory_allocated() / 2**30 if model.device.type == "cuda" else 0.0,
            "train": args.train, "optim_s": optim_s / len(metrics),
            "cpu_s": statistics.median(m["cpu_s"] for m in metrics), "optim_host_gb": optimizer_host_gb(model),
            "optim_params_per_s": sum(m.get("optim_params", 0) for m in metrics) / optim_s if optim_s else 0.0}


def run_worker(spec: str, argv, args, train: str = "lora") -> tuple:
    """One configuration (mode:recompute:micro:prefetch) in its own process; (mode, rc, micro, K, result)."""
    mode, recompute, micro, k = spec.split(":")
    recompute = MODES.get(mode.partition("+")[0], {}).get("recompute", recompute)  # naive always reruns the forward
    cmd = [sys.executable, __file__, "--worker", spec] + \
          [a for a in (argv if argv is not None else sys.argv[1:]) if a] + ["--store", args.store, "--train", train]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"error: {mode} failed:\n{out.stderr[-2000:]}")
    r = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"{mode:10s} {train:4s} recompute={recompute:4s} micro={micro:3s} prefetch={k:2s} {r['step_s']:.3f} s/step",
          flush=True)
    return mode, recompute if mode not in ("resident", *PEERS, "h2d", "matmul") else "-", micro, k, r


def bench_shape(store: BlockStore, args) -> cm.Shape:
    name = dtype_name(store.dtype)
    return cm.shape_of(store.cfg, name, name, args.seq_len)


def predicted(profile: cm.MachineProfile, mode: str, recompute: str, micro: str, k: str, store, args) -> float:
    """The cost model's step time for one streamed row of the table."""
    kw = MODES[mode.removeprefix("tuned-").partition("+")[0]]
    placement = phantom.Placement(offload=kw["offload"], prefetch=kw.get("prefetch", int(k) if k != "-" else 0),
                                  resident=0)
    acts = phantom.Activations(recompute=kw.get("recompute", recompute),
                               micro_batch=int(micro) if micro != "-" else None)
    return cm.predict(profile, bench_shape(store, args), placement, acts, args.batch_size).step_s


def tuning_lines(best: cm.Prediction, rows: list) -> list[str]:
    """The tuner's choice against the best swept row."""
    swept = [x for x in rows if x[0] not in ("resident", *PEERS) and not x[0].startswith("tuned")]
    top, tuned = min(swept, key=lambda x: x[4]["step_s"]), rows[-1][4]["step_s"]
    return ["", f"- tuned: {best.describe()}, predicted {best.step_s:.3f} s, measured {tuned:.3f} s "
                f"({tuned / best.step_s - 1:+.1%}); best swept: {top[0]} micro {top[2]} prefetch {top[3]}, "
                f"{top[4]['step_s']:.3f} s; tuned / best swept = {tuned / top[4]['step_s']:.3f}"]


def raw_read_gbps(store: BlockStore, threads: int, chunk: int, huge: bool = True) -> float:
    """The drive's best case: every block's data read once with O_DIRECT, `threads` requests of `chunk`
    bytes in flight, no checksum and no scheduler. Only the 4 KiB-aligned part of each block is read,
    into fresh memory as the tier's HostBuffers (huge pages), or with huge=False into 4 KiB pages."""
    from concurrent.futures import ThreadPoolExecutor
    from phantom.hostmem import HostBuffer, aligned_memory
    from phantom.tensorfile import DATA_ALIGN
    sizes = [e.nbytes // DATA_ALIGN * DATA_ALIGN for e in store.blocks]
    # fresh memory, as a tier pass's fresh slots
    host = HostBuffer(sum(sizes), pin=False).tensor if huge else aligned_memory(sum(sizes))
    host.fill_(0)  # pages faulted in before the clock starts, as the tier's slots (tier_pass_gbps)
    buf = host.numpy()
    fds = [os.open(e.path, os.O_RDONLY | os.O_DIRECT) for e in store.blocks]
    jobs, pos = [], 0
    for fd, e, n in zip(fds, store.blocks, sizes):
        jobs += [(fd, e.data_start + a, pos + a, min(chunk, n - a)) for a in range(0, n, chunk)]
        pos += n

    def read(job):
        fd, off, at, n = job
        got = 0
        while got < n:
            if not (r := os.preadv(fd, [memoryview(buf[at + got: at + n])], off + got)):
                raise OSError(f"{fd}: short read at {off + got}")
            got += r
    try:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(read, jobs))
        return sum(sizes) / (time.perf_counter() - t0) / 1e9
    finally:
        for fd in fds:
            os.close(fd)


def tier_pass_gbps(store: BlockStore, prefetch: int) -> float:
    """The disk tier's achieved rate: a fresh scheduler streams every block in order with nothing to
    compute, until its loaders and checksum threads are done (close). On a store opened with verify
    fast the first pass checks each block's checksum: that time is in the figure. As for the raw read,
    the clock starts once the destination memory (the slots, allocated once per run) is faulted in."""
    from phantom.scheduler import BlockScheduler
    n = store.n_blocks
    with BlockScheduler(store, "cpu", phantom.Placement(offload="disk", prefetch=prefetch)) as sched:
        for slot in sched.slots:
            slot.buf.fill_(0)
        t0 = time.perf_counter()
        sched.plan(list(range(n)))
        for i in range(n):
            sched.acquire(i)
            sched.release(i)
    return n * store.block_nbytes / (time.perf_counter() - t0) / 1e9


def lora_steps(store: BlockStore, placement, rows: int, seq: int, args) -> tuple[list, list, tuple]:
    """(step times, scheduler metrics, tiers) of LoRA steps after one warm-up step (recompute none:
    every block keeps its activations, as the cost model is told); the warm-up is left out."""
    model = phantom.PhantomModel(store, torch.device("cpu"), store.dtype, placement,
                                 phantom.Activations(recompute="none"), lora=phantom.LoraConfig(rank=args.lora_rank))
    tokens = torch.randint(0, model.cfg.vocab_size, (rows, seq + 1), generator=torch.Generator().manual_seed(0))
    times, metrics = [], []
    with model:
        for s in range(args.steps + 1):
            model.scheduler.take_metrics()
            t0 = time.perf_counter()
            model(tokens[:, :-1], targets=tokens[:, 1:]).backward()
            times.append(time.perf_counter() - t0)
            metrics.append(model.scheduler.take_metrics())
        return times[1:], metrics[1:], model.scheduler.tiers


def tier_steps(store_path: str, placement, args) -> dict:
    """Step times and per-step tier traffic of LoRA steps (lora_steps)."""
    times, metrics, tiers = lora_steps(BlockStore(store_path), placement, args.batch_size, args.seq_len, args)
    return {"times": times, "tiers": tiers, "stall": [m["stall_s"] for m in metrics],
            "bytes_read": [m["bytes_read"] for m in metrics], "bytes_ram": [m["bytes_ram"] for m in metrics]}


def shell(cmd: str) -> str:
    out = subprocess.run(cmd, shell=True, capture_output=True, text=True)
    return out.stdout.strip() or out.stderr.strip()


def diskread(args, store: BlockStore, rounds: int = 3, read_rounds: int = 21) -> str:
    """Mode diskread: the disk tier's cold read rate against the best raw read of the same
    files, into fresh huge-page memory as the tier's buffers (also into 4 KiB pages, a row of its own)
    (first pass: verify fast checks each block's crc32 record, with ISA-L's crc32 where the isal
    package is installed and with zlib's; also on the same files under a manifest without crc32, where it
    checks sha256 as on older stores; again: nothing left to check), then a RAM budget of half the
    blocks against pure disk, measured and as the cost model predicts. The drive and the CPU are shared,
    so each comparison is made in rounds (`read_rounds` for the reads, `rounds` for the steps) that
    alternate the contenders, and medians are compared. The cost model gets this run's disk-tier
    rate and a compute rate fitted to the all-RAM row; its two streamed predictions are out of sample."""
    from phantom import costmodel as cm
    from phantom.tensorfile import dtype_name
    k, n, nb = int(args.prefetch.split(",")[0]), store.n_blocks, store.block_nbytes
    if not hasattr(os, "O_DIRECT") or phantom.directio._open_direct(store.blocks[0].path) is None:
        print(f"error: {store.path} is on a filesystem without O_DIRECT; put the store (--store, or run from a "
              f"folder) on the drive to measure", file=sys.stderr)
        sys.exit(2)
    if nb < phantom.directio.READ_CHUNK:
        print(f"note: blocks of {nb >> 20} MiB are read buffered (O_DIRECT from {phantom.directio.READ_CHUNK >> 20} "
              f"MiB); use a larger --dim to measure the drive", file=sys.stderr)
    load = [shell("uptime")]
    grid = {(t, c << 20): raw_read_gbps(store, t, c << 20) for t in (1, 2, 4, 8) for c in (4, 16)}
    best = max(grid, key=grid.get)  # the raw read's best configuration, then raced against the tier
    crc = store.blocks[0].crc
    checked = (f"crc32 ({phantom.checksum.CRC32}) of each {crc[0] >> 20} MiB, hashed by the read's threads"
               if crc is not None else "sha256 (this store's manifest has no crc32)")
    old = Path(tempfile.mkdtemp(dir=store.path.parent, prefix=".diskread-")) if crc is not None else None
    try:
        if old is not None:  # the same files (hard links) under a manifest without crc32: an older store
            phantom.store.link_tree(store.path, old / "store")
            m = json.loads((old / "store" / phantom.store.MANIFEST).read_text())
            for info in [*m["files"].values(), *m.get("links", {}).get("files", {}).values()]:
                info.pop("crc32", None)
            phantom.fileio.atomic_write_json(old / "store" / phantom.store.MANIFEST, m)  # a new file, not the link
        def with_zlib() -> float:  # the first pass where the isal package is not installed
            return tier_pass_gbps(BlockStore(store.path, verify="fast", crc32="zlib"), k)
        contenders = {"raw": lambda: raw_read_gbps(store, *best),
                      "plain": lambda: raw_read_gbps(store, *best, huge=False),  # into 4 KiB pages
                      "first": lambda: tier_pass_gbps(BlockStore(store.path, verify="fast"), k)}  # reads + checksums
        if old is not None and phantom.checksum.CRC32 != "zlib":
            contenders["zlib"] = with_zlib
        if old is not None:
            contenders["sha256"] = lambda: tier_pass_gbps(BlockStore(old / "store", verify="fast"), k)  # + sha256
        contenders["again"] = lambda: tier_pass_gbps(BlockStore(store.path, verify="none"), k)  # the drive again
        rates = {key: [] for key in contenders}
        order = list(contenders)
        for r in range(read_rounds):  # A B C D, B C D A, ...: each contender in each place, after each other one
            for key in order[r % len(order):] + order[:r % len(order)]:
                rates[key].append(contenders[key]())
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    rate = {key: statistics.median(v) for key, v in rates.items()}
    raw_best = max(rate["raw"], max(grid.values()))
    print(f"raw {rate['raw']:.2f} GB/s ({best[0]} threads x {best[1] >> 20} MiB); disk tier first pass "
          f"{rate['first']:.2f} ({checked}), again {rate['again']:.2f}", flush=True)

    half = (n // 2) * nb + nb // 2
    places = {"ram": phantom.Placement(offload="ram", prefetch=k),
              "disk": phantom.Placement(offload="disk", prefetch=k),
              "half": phantom.Placement(offload="auto", prefetch=k, ram_budget=half)}
    runs: dict[str, dict] = {}
    for _ in range(rounds):
        for name, place in places.items():
            r = tier_steps(args.store, place, args)
            for key in ("times", "stall", "bytes_read", "bytes_ram"):
                runs.setdefault(name, {"tiers": r["tiers"]}).setdefault(key, []).extend(r[key])
    step = {name: statistics.median(r["times"]) for name, r in runs.items()}
    for name, r in runs.items():
        print(f"{name:5s} {step[name]:.3f} s/step, {statistics.median(r['bytes_read']) / 1e6:.0f} MB read/step",
              flush=True)
    load.append(shell("uptime"))

    read_rows = {"raw": f"raw O_DIRECT, best of the grid below: {best[0]} threads x {best[1] >> 20} MiB, no checksum",
                 "plain": "raw O_DIRECT as above, into 4 KiB pages (no huge pages: the buffers before)",
                 "first": f"disk tier, first pass (verify fast: {checked})",
                 "zlib": "disk tier, first pass, crc32 by zlib (the isal package not installed)",
                 "sha256": "disk tier, first pass, same files, manifest without crc32 (verify fast: sha256, as older "
                           "stores)",
                 "again": "disk tier, again (nothing left to verify)"}
    dt = dtype_name(store.dtype)
    shape = cm.shape_of(store.cfg, dt, dt, args.seq_len)
    acts = phantom.Activations(recompute="none")
    unit = cm.MachineProfile(machine="bench", device="cpu", dtype=dt, disk_gbps=rate["again"], fwd_flops=1e12)
    profile = dataclasses.replace(unit, fwd_flops=1e12 * cm.predict(unit, shape, places["ram"], acts,
                                                                     args.batch_size).step_s / step["ram"])
    pred = {name: cm.predict(profile, shape, place, acts, args.batch_size) for name, place in places.items()}

    cfg, tok = store.cfg, args.batch_size * args.seq_len
    lines = [f"## {time.strftime('%Y-%m-%d %H:%M')}: `python scripts/bench.py {' '.join(sys.argv[1:])}`", "",
             f"- machine: {machine()}; OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')} "
             f"(torch threads {torch.get_num_threads()})",
             "- `lscpu | head`: " + "; ".join(" ".join(l.split()) for l in shell("lscpu | head -n 8").splitlines()),
             f"- store: {store.path.parent} on `{' '.join(shell(f'df -T {store.path} | tail -1').split())}` "
             f"(device, type, 1K-blocks, used, available, use%, mount)",
             f"- load: before `{load[0]}`; after `{load[1]}`",
             f"- model: dim {cfg.dim}, {n} blocks of {nb / 2**20:.1f} MiB ({dt}), {tok} tokens per step "
             f"({args.batch_size} x {args.seq_len}), prefetch {k}, LoRA rank {args.lora_rank}, recompute none; "
             f"{read_rounds} rounds of reads (the contenders' order rotated each round) and {rounds} of steps, "
             f"medians", "",
             "| read (whole store, every block once) | GB/s per round | median | vs raw |", "|---|---|---|---|",
             *(f"| {label} | {' '.join(f'{x:.2f}' for x in rates[key])} | {rate[key]:.2f} | "
               f"{rate[key] / rate['raw']:.2f} |" for key, label in read_rows.items() if key in rate), "",
             "- raw grid (threads x MiB: GB/s): " + ", ".join(f"{t}x{c >> 20}: {r:.2f}" for (t, c), r in grid.items()),
             "", "| placement | tiers device/RAM/disk | step s (median) | predicted s | MB read/step | predicted MB "
             "| MB from RAM/step | stall |", "|---|---|---|---|---|---|---|---|"]
    for name, r in runs.items():
        p, split = pred[name], "/".join(str(r["tiers"].count(t)) for t in ("device", "ram", "disk"))
        lines.append(f"| {name} | {split} | {step[name]:.3f} | {p.step_s:.3f}{' (fitted)' if name == 'ram' else ''} | "
                     f"{statistics.median(r['bytes_read']) / 1e6:.0f} | {p.bytes_read / 1e6:.0f} | "
                     f"{statistics.median(r['bytes_ram']) / 1e6:.0f} | "
                     f"{statistics.median(r['stall']) / step[name]:.0%} |")
    fall, pfall = step["half"] / step["disk"], pred["half"].step_s / pred["disk"].step_s
    read = statistics.median(runs["half"]["bytes_read"]) / statistics.median(runs["disk"]["bytes_read"])
    paired = statistics.median(f / r for f, r in zip(rates["first"], rates["raw"]))  # the same round: seconds apart
    lines += ["", f"- disk tier first pass / raw = {rate['first'] / rate['raw']:.2f} (the aim: >= 0.9); the "
                  f"median of each round's first pass / raw: {paired:.2f}; against "
                  f"the best single raw figure of the run ({raw_best:.2f}): {rate['first'] / raw_best:.2f}"
                  + (f"; with zlib's crc32: {rate['zlib'] / rate['raw']:.2f}" if "zlib" in rate else "")
                  + (f"; with sha256 instead of crc32: {rate['sha256'] / rate['raw']:.2f}" if "sha256" in rate else ""),
              f"- half RAM / disk: step time x{fall:.2f} measured, x{pfall:.2f} predicted ({fall / pfall - 1:+.1%}); "
              f"bytes read x{read:.2f} measured, x{pred['half'].bytes_read / pred['disk'].bytes_read:.2f} predicted",
              f"- prediction error (measured / predicted - 1): disk {step['disk'] / pred['disk'].step_s - 1:+.1%}, "
              f"half {step['half'] / pred['half'].step_s - 1:+.1%}; compute fitted to the ram row "
              f"({profile.fwd_flops / 1e9:.0f} GFLOP/s), disk {rate['again']:.2f} GB/s from the tier's second pass"]
    return "\n".join(lines) + "\n"


def quant_steps(store: BlockStore, placement, rows: int, seq: int, args) -> dict:
    """Median step time and per-step metrics of LoRA steps (lora_steps)."""
    times, metrics, _ = lora_steps(store, placement, rows, seq, args)
    med = {k: statistics.median(m[k] for m in metrics) for k in ("bytes_read", "dequant_s", "stall_s", "loads")}
    return {"step_s": statistics.median(times), "times": times, **med}


def quant_bench(args, store: BlockStore) -> str:
    """Mode quant: the bench model stored bf16 (this store), NF4 (double-quantized scales) and int8, each
    read from disk (prefetch K, cold: O_DIRECT and the page cache dropped) at each of --quant-batches.
    The cost model's profile is measured once on the bf16 store (tune.measure: disk, compute); each
    quantized store adds its own measured dequantization rate (tune.measure_dequant: the loader's work).
    """
    from phantom.convert import quantize_store
    from phantom.quant import QuantFormat
    if store.dtype.itemsize != 2 or store.quant is not None:
        print("error: --modes quant needs a 16-bit store to quantize (--dtype bf16)", file=sys.stderr)
        sys.exit(2)
    k = int(args.prefetch.split(",")[0])
    batches = [tuple(int(x) for x in b.split("x")) for b in args.quant_batches.split(",")]
    load = [shell("cat /proc/loadavg")]
    t0 = time.perf_counter()
    stores = {"bf16": store}
    for method in ("nf4", "int8"):
        out = store.path.parent / f"{store.path.name}-{method}"
        if not (out / "manifest.json").is_file():
            quantize_store(store.path, out, QuantFormat(method), progress=False)
        stores[method] = BlockStore(out, drop_cache=args.cold)
    stores["bf16"] = BlockStore(store.path, drop_cache=args.cold)
    quantize_s = time.perf_counter() - t0
    big = max(batches)
    profile = tune.measure(stores["bf16"], torch.device("cpu"), store.dtype, big[0], big[1], quick=True)
    rates = {m: tune.measure_dequant(stores[m], torch.device("cpu"), store.dtype) for m in ("nf4", "int8")}
    place = phantom.Placement(offload="disk", prefetch=k)
    acts = phantom.Activations(recompute="none")
    rows = []
    for rows_, seq in batches:
        for name, st in stores.items():
            r = quant_steps(st, place, rows_, seq, args)
            prof = dataclasses.replace(profile, dequant_gbps=rates.get(name, profile.dequant_gbps))
            dt = dtype_name(store.dtype)
            pred = cm.predict(prof, cm.shape_of(st.cfg, dt, dt, seq, st.quant.method if st.quant else None),
                              place, acts, rows_)
            rows.append((name, rows_, seq, st, r, pred))
            print(f"{name} {rows_}x{seq}: {r['step_s']:.3f} s/step (predicted {pred.step_s:.3f}), "
                  f"{r['bytes_read'] / 1e6:.0f} MB read", flush=True)
    load.append(shell("cat /proc/loadavg"))
    return quant_lines(args, store, stores, rows, rates, profile, k, load, quantize_s)


def quant_lines(args, store, stores, rows, rates, profile, k, load, quantize_s) -> str:
    cfg, dense = store.cfg, store.block_nbytes * 1.0
    lines = [f"## {time.strftime('%Y-%m-%d %H:%M')}: `python scripts/bench.py {' '.join(sys.argv[1:])}`", "",
             f"- machine: {machine()}; torch threads {torch.get_num_threads()}",
             f"- load (/proc/loadavg) before `{load[0]}`; after `{load[1]}` (the CPU is shared)",
             f"- model: dim {cfg.dim}, {cfg.n_layers} blocks, vocab {cfg.vocab_size}; compute {dtype_name(store.dtype)}; "
             f"disk tier, prefetch {k}, {'cold (O_DIRECT; page cache dropped)' if args.cold else 'warm'}; LoRA rank "
             f"{args.lora_rank} (q, v), recompute none; {args.steps} timed steps after a warm-up, medians",
             f"- stores: " + "; ".join(f"{n} {s.block_nbytes / 2**20:.1f} MiB/block ({s.block_nbytes / dense:.3f}x), "
                                       f"RAM tier {s.block_nbytes * cfg.n_layers / 1e9:.2f} GB" for n, s in stores.items())
             + f" (NF4 and int8 written from the bf16 store in {quantize_s:.0f} s)",
             "- dequantization (loader thread, per block, into the compute dtype; tune.measure_dequant): "
             + "; ".join(f"{m} {g:.2f} GB/s of weights produced" for m, g in rates.items())
             + f", on {torch.get_num_threads()} torch threads; disk read {profile.disk_gbps:.2f} GB/s cold "
               f"(tune.measure_disk)", "",
             "| store | rows x tokens | MB read/step | vs bf16 | dequant s/step | stall | step s | predicted s | "
             "error |", "|---|---|---|---|---|---|---|---|---|"]
    base = {(r, s): res["bytes_read"] for n, r, s, _, res, _ in rows if n == "bf16"}
    for name, r, s, st, res, pred in rows:
        lines.append(f"| {name} | {r} x {s} | {res['bytes_read'] / 1e6:.0f} | {res['bytes_read'] / base[(r, s)]:.3f} | "
                     f"{res['dequant_s']:.3f} | {res['stall_s'] / res['step_s']:.0%} | {res['step_s']:.3f} | "
                     f"{pred.step_s:.3f} | {res['step_s'] / pred.step_s - 1:+.1%} |")
    for m in ("nf4", "int8"):
        saved = (dense - stores[m].block_nbytes) / (profile.disk_gbps * 1e9)
        spent = dense / (rates[m] * 1e9)
        lines.append(f"- {m}: dequantizing a block takes {spent * 1e3:.0f} ms, the read it saves "
                     f"{saved * 1e3:.0f} ms: the dequantization is {'slower' if spent > saved else 'faster'} than "
                     f"the read it saves on this CPU")
    return "\n".join(lines) + "\n"


def host_speeds(n: int = 64 << 20, rounds: int = 5) -> dict:
    """Host memory bandwidth (`a += b` over n fp32, in place like the optimizer: 12 bytes read and
    written per element, every thread) and torch's fused AdamW alone on n parameters (28 bytes each:
    read p, g, m, v; write p, m, v)."""
    a, b = torch.zeros(n), torch.zeros(n)
    p, g, m, v = torch.zeros(n), torch.full((n,), 1e-3), torch.zeros(n), torch.zeros(n)

    def best(fn) -> float:
        fn()  # first touch of the pages
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)
    add_s = best(lambda: a.add_(b))
    cfg = phantom.AdamWConfig(lr=1e-4, weight_decay=0.1)
    adamw_s = best(lambda: phantom.optim.adamw_step([p], [g], [m], [v], 1, cfg, cfg.lr))
    return {"threads": torch.get_num_threads(), "mem_gbps": 12 * n / add_s / 1e9, "adamw_params_per_s": n / adamw_s}


def process_cpu_s() -> float:
    """CPU seconds (user + system, every thread) this process has used: on a shared machine a
    step's CPU time moves less with the load than its wall time."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def fastest_of_rounds(rows: list) -> list:
    """One row per configuration (in first-run order): the run with the shortest step."""
    best = {}
    for row in rows:
        key = (*row[:4], row[4].get("train", "lora"))
        if key not in best or row[4]["step_s"] < best[key][4]["step_s"]:
            best[key] = row
    return list(best.values())


def optimizer_host_gb(model) -> float:
    """Full finetuning: the host bytes the memory model gives the optimizers (phantom.optim.state_memory
    for the blocks; 16 bytes a parameter for head and embedding: fp32 weight, gradient, two moments)."""
    if model.block_optimizer is None:
        return 0.0
    cfg = model.cfg
    blocks = phantom.optim.state_memory(model.block_optimizer.tier, cfg.block_params(), cfg.n_layers)["host"]
    return (blocks + 16 * (cfg.n_params() - cfg.n_layers * cfg.block_params())) / 2**30


def full_lines(host: dict, rows: list) -> list[str]:
    """Full finetuning beside LoRA: each full row's step against the LoRA row of the same placement,
    the block optimizer's parameters/s in the step, and the host's speeds measured in this run."""
    lora = {(m, rc, mi, k): r for m, rc, mi, k, r in rows if r.get("train", "lora") == "lora"}
    bw, rate = host["mem_gbps"], host["adamw_params_per_s"]
    lines = ["", f"- host memory bandwidth (in-place a += b, read + write, {host['threads']} threads): {bw:.1f} GB/s; "
             f"fused AdamW alone: {rate / 1e9:.2f} G params/s = {28 * rate / 1e9:.1f} GB/s at 28 B/param "
             f"({28 * rate / 1e9 / bw:.0%} of that bandwidth)", "",
             "| full finetuning | step s | LoRA step s | full / LoRA | CPU s/step: full, LoRA (ratio) "
             "| optimizer s/step (write-back thread) "
             "| optimizer G params/s in the step | host memory GB/s | peak RSS GB: full - LoRA | optimizers' host GB "
             "(model) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for m, rc, mi, k, r in rows:
        if r.get("train") != "full":
            continue
        base = lora.get((m, rc, mi, k))
        ratio = f"{r['step_s'] / base['step_s']:.2f}x" if base else "-"
        rss = f"{r['peak_rss_gb'] - base['peak_rss_gb']:.2f}" if base else "-"
        cpu = f"{r['cpu_s']:.1f}, {base['cpu_s']:.1f} ({r['cpu_s'] / base['cpu_s']:.2f}x)" if base else "-"
        lines.append(f"| {m} {rc} micro {mi} prefetch {k} | {r['step_s']:.3f} | {base['step_s'] if base else 0:.3f} | "
                     f"{ratio} | {cpu} | {r['optim_s']:.3f} | {r['optim_params_per_s'] / 1e9:.2f} | {bw:.1f} | {rss} | "
                     f"{r['optim_host_gb']:.2f} |")
    return lines


def dpo_lines(rows: list) -> list[str]:
    """A DPO step against the SFT (lora) step over the same rows, per placement, from the same run."""
    sft = {(m, rc, mi, k): r for m, rc, mi, k, r in rows if r.get("train", "lora") == "lora"}
    out = []
    for m, rc, mi, k, r in rows:
        if r.get("train") == "dpo" and (m, rc, mi, k) in sft:
            base = sft[m, rc, mi, k]
            out.append(f"- dpo / sft step, {m} recompute={rc} prefetch={k}: {r['step_s'] / base['step_s']:.3f}x "
                       f"({r['step_s']:.3f} vs {base['step_s']:.3f} s); MB read per step {r['bytes_per_step'] / 2**20:.0f} "
                       f"vs {base['bytes_per_step'] / 2**20:.0f}")
    return [""] + out if out else []


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, Python {platform.python_version()}"


def main(argv=None):
    args = parse_args(argv)
    for alone in ("diskread", "quant"):
        if alone in args.modes.split(",") and args.modes != alone:
            print(f"error: --modes {alone} runs alone (its own tables); give it in a run of its own", file=sys.stderr)
            sys.exit(2)
    if args.worker:
        print(json.dumps(worker(args)))
        return
    with tempfile.TemporaryDirectory(dir=Path.cwd()) as tmp:
        if args.store is None:
            if args.preset:
                cfg = phantom.preset(args.preset, n_layers=args.layers)
            else:
                cfg = ModelConfig(dim=args.dim, n_layers=args.layers, n_heads=args.heads, n_kv_heads=args.kv_heads,
                                  vocab_size=args.vocab, max_seq_len=max(args.seq_len, 256))
            args.store = str(write_synthetic(Path(tmp) / "bench", cfg, phantom.tensorfile.parse_dtype(args.dtype)))
        store = BlockStore(args.store)
        block_mb = store.block_nbytes / 2**20
        if args.modes in ("diskread", "quant"):  # their own tables, in notes/bench-tiers.md, notes/bench-quant.md
            text = diskread(args, store) if args.modes == "diskread" else quant_bench(args, store)
            print(text)
            out = Path(args.out or Path(__file__).resolve().parent.parent / "notes" /
                       f"bench-{'tiers' if args.modes == 'diskread' else 'quant'}.md")
            with open(out, "a") as f:
                f.write(text + "\n")
            return
        policies = args.recompute.split(",")
        profile = None
        if args.tuned:  # measured first, so the sweep below runs under the same conditions it saw
            profile = tune.measure(store, phantom.resolve_device(args.device), store.dtype, args.batch_size,
                                   args.seq_len)
        trains = args.train.split(",")
        if set(trains) - {"lora", "full", "dpo"}:
            print(f"error: --train takes lora, full and/or dpo, not {args.train!r}", file=sys.stderr)
            sys.exit(2)
        if "dpo" in trains and args.batch_size % 2:
            print(f"error: --train dpo needs an even --batch-size (pairs of rows), not {args.batch_size}",
                  file=sys.stderr)
            sys.exit(2)
        if args.rounds < 1:
            print(f"error: --rounds must be at least 1, not {args.rounds}", file=sys.stderr)
            sys.exit(2)
        host = host_speeds() if "full" in trains else None  # same run, before the rows' processes
        rows = []
        for _ in range(args.rounds):  # rounds interleave the rows: A B A B, not A A B B
            for recompute in policies:
                for micro in (args.micro_batch.split(",") if args.micro_batch else ["-"]):
                    for mode, train in ((mo, t) for mo in args.modes.split(",") for t in trains):
                        if train != "lora" and mode in (*PEERS, "h2d", "matmul"):
                            continue  # LoRA-only rows
                        if mode in PEERS:
                            try:
                                import peft, transformers  # noqa: F401
                            except ImportError:
                                print(f"{mode}: transformers/peft not installed, skipped")
                                continue
                        if mode in ("resident", *PEERS, "h2d", "matmul", "naive") and recompute != policies[0]:
                            continue  # resident has no recompute policy: one row is enough
                        for k in (args.prefetch.split(",") if mode.partition("+")[0] in ("ram", "disk", "auto") else ["-"]):
                            rows.append(run_worker(f"{mode}:{recompute}:{micro}:{k}", argv, args, train))
        rows = fastest_of_rounds(rows)
        if profile is not None:
            offloads = tuple(m for m in ("ram", "disk") if m in args.modes.split(","))
            name = dtype_name(store.dtype)
            best = tune.plan(profile, store.cfg, cm.Workload(args.batch_size, args.seq_len, name, name),
                             cm.SearchSpace(offloads=offloads, recompute=tuple(policies),
                                            budgets=phantom.Placement(resident=0)))[0]
            p, a = best.placement, best.activations
            rows.append(run_worker(f"tuned-{p.offload}:{a.recompute}:{a.micro_batch or '-'}:{p.prefetch}",
                                   argv, args))
    base = next((r["step_s"] for m, _, _, _, r in rows if m == "resident"), None)
    cfg = store.cfg
    lines = [f"## {time.strftime('%Y-%m-%d %H:%M')}: `python scripts/bench.py {' '.join(sys.argv[1:])}`", "",
             f"- machine: {machine()}; device {args.device}",
             f"- model: dim {cfg.dim}, {cfg.n_layers} blocks of {block_mb:.1f} MiB ({store.dtype}), "
             f"batch {args.batch_size} x {args.seq_len}, prefetch {args.prefetch}, "
             f"{'cold (page cache dropped after each read)' if args.cold else 'warm page cache'}", "",
             "| mode | recompute | micro-batch | prefetch | step s | predicted s | vs resident | stall | block loads "
             "| MB moved/step | read GB/s | copy GB/s | floor s | step / floor | peak RSS GB | peak device GB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    peak = next((r["read_gbps"] * 1e9 for m, _, _, _, r in rows if m == "h2d"), None)
    rate = next((r["flops_per_s"] for m, _, _, _, r in rows if m == "matmul"), None)
    for mode, rc, micro, k, r in rows:
        ratio = f"{r['step_s'] / base:.3f}x" if base else "-"
        streamed = profile is not None and mode not in ("resident", *PEERS, "h2d", "matmul", "auto")
        pred = f"{predicted(profile, mode, rc, micro, k, store, args):.3f}" if streamed else "-"
        floor = "-"
        if rate and mode not in ("h2d", "matmul"):  # max(link time, needed matmul time): the step's floor
            # the FLOPs a LoRA step needs (no recomputed forward: rerunning it is overhead, not floor)
            f = max(r.get("h2d_per_step", 0) / peak if peak else 0.0,
                    step_flops(cfg, args.batch_size, args.seq_len, "none") / rate)
            floor = f"{f:.3f} | {r['step_s'] / f:.2f}x"
        else:
            floor = "- | -"
        shown = mode if r.get("train", "lora") == "lora" else f"{mode} ({r['train']})"
        lines.append(f"| {shown} | {rc} | {micro} | {k} | {r['step_s']:.3f} | {pred} | {ratio} | {r['stall']:.1%} | "
                     f"{r['loads']} | {r['bytes_per_step'] / 2**20:.0f} | {r['read_gbps']:.2f} | "
                     f"{r.get('copy_gbps', 0.0):.2f} | {floor} | "
                     f"{r['peak_rss_gb']:.2f} | {r['peak_dev_gb']:.2f} |")
    if profile is not None:
        lines += tuning_lines(best, rows)
    if host is not None:
        lines += full_lines(host, rows)
    lines += dpo_lines(rows)
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(args.out or Path(__file__).resolve().parent.parent / "notes" / f"bench-{torch.device(args.device).type}.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "a") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
