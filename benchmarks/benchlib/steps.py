"""The step benchmark: each mode (phantom's placements, transformers + peft, FSDP2 offload, the link and
matmul rates) in a process of its own, its rows, and the lines for full finetuning and DPO beside LoRA."""
from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import phantom
import phantom.files.workingcopy
import phantom.stream.optim
from phantom.plan import costfull
from phantom.stream.adam8bit import AdamW8bit
from benchlib.common import MODES, PEERS, free_port, machine, process_cpu_s, step_flops
from benchlib.measure import peak_rss_gb
from phantom.files.store import BlockStore
from phantom.files.tensorfile import dtype_name
from phantom.plan import costinputs as ci
from phantom.plan import costmodel as cm
from phantom.stream.placement import parse_bytes, split_knobs
from phantom.train.preference import Preference, PreferenceConfig

BENCH = Path(__file__).resolve().parent.parent / "bench.py"  # the workers run the entry point


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
    from phantom.stream.hostmem import HostBuffer
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


def worker(args) -> dict:
    """One mode in this process: warm-up step, timed steps, metrics."""
    mode, recompute, micro, prefetch = args.worker.split(":")
    mode, _, packing = mode.partition("+")  # +mask / +leaky: packed rows with or without the document mask
    others = {"hf-peft": hf_worker, "fsdp-offload": fsdp_worker, "h2d": h2d_worker, "matmul": matmul_worker}
    if mode in others:
        return others[mode](args)
    model, work = phantom_model(args, mode, recompute, micro, prefetch)
    try:
        times, stalls, metrics = timed_steps(args, model, step_loss(args, model, packing))
    finally:
        model.close()
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
    return step_result(args, model, times, stalls, metrics)


def phantom_model(args, mode: str, recompute: str, micro: str, prefetch: str):
    """The mode's PhantomModel (LoRA, or full finetuning on a working copy of the store), and that copy."""
    kw = dict(MODES[mode.removeprefix("tuned-")])
    if mode == "auto":
        kw.update(device_budget=parse_bytes(args.device_budget) if args.device_budget else None,
                  ram_budget=parse_bytes(args.ram_budget) if args.ram_budget else None)
    kw.setdefault("prefetch", int(prefetch) if prefetch != "-" else 0)
    store, work = BlockStore(args.store, drop_cache=args.cold), None
    placement, activations = split_knobs(
        dict({"recompute": recompute, **kw}, micro_batch=int(micro) if micro != "-" else None, compile=args.compile),
        phantom.Placement(), phantom.Activations())
    full = args.train.startswith("full")
    if full:  # the step rewrites the blocks: a working copy (hard links), as phantom.load(work_dir=...) makes
        work = Path(tempfile.mkdtemp(dir=Path(args.store).parent))
        store = BlockStore(phantom.files.workingcopy.clone_store(Path(args.store), work / "store"), drop_cache=args.cold)
    model = phantom.PhantomModel(store, phantom.resolve_device(args.device), store.dtype, placement, activations,
                                 lora=None if full else phantom.LoraConfig(rank=args.lora_rank),
                                 optim=phantom.AdamWConfig(lr=1e-4, optim=OPTIM[args.train]) if full else None)
    return model, work


def step_loss(args, model, packing: str):
    """The step's loss as a function: cross-entropy (packed rows with the document mask or without), or
    DPO over the same rows as pairs (row 2i chosen, 2i + 1 rejected)."""
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.cfg.vocab_size, (args.batch_size, args.seq_len + 1), generator=gen)
    x, y = tokens[:, :-1].to(model.device), tokens[:, 1:].to(model.device)
    packed = {}
    if packing == "mask":  # args.packed examples of equal length per row
        packed["segments"] = (torch.arange(args.seq_len) * args.packed // args.seq_len).expand(args.batch_size, -1)
    if args.train == "dpo":
        objective = Preference(PreferenceConfig())
        return lambda: objective(model, x.view(-1, 2, args.seq_len), y.view(-1, 2, args.seq_len))
    return lambda: model(x, targets=y, **packed)


def timed_steps(args, model, loss_of) -> tuple[list, list, list]:
    """Seconds, stall fractions and metrics of args.steps steps after a warm-up step."""
    opt = AdamW8bit(model.trainable_parameters(), lr=1e-4) if args.train == "full-8bit" else \
        torch.optim.AdamW(model.trainable_parameters(), lr=1e-4, fused=args.train == "full" or None)
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
    return times, stalls, metrics


def step_result(args, model, times: list, stalls: list, metrics: list) -> dict:
    """The row's figures: median step, mean stall, bytes moved and rates per step, memory."""
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
            "train": args.train, "optim_s": optim_s / len(metrics), "state_bytes_per_step": state_moved(model),
            "cpu_s": statistics.median(m["cpu_s"] for m in metrics), "optim_host_gb": optimizer_host_gb(model),
            "optim_params_per_s": sum(m.get("optim_params", 0) for m in metrics) / optim_s if optim_s else 0.0}


def run_worker(spec: str, argv, args, train: str = "lora") -> tuple:
    """One configuration (mode:recompute:micro:prefetch) in its own process; (mode, rc, micro, K, result)."""
    mode, recompute, micro, k = spec.split(":")
    recompute = MODES.get(mode.partition("+")[0], {}).get("recompute", recompute)  # naive always reruns the forward
    cmd = [sys.executable, str(BENCH), "--worker", spec] + \
          [a for a in (argv if argv is not None else sys.argv[1:]) if a] + ["--store", args.store, "--train", train]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"error: {mode} failed:\n{out.stderr[-2000:]}")
    r = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"{mode:10s} {train:4s} recompute={recompute:4s} micro={micro:3s} prefetch={k:2s} {r['step_s']:.3f} s/step",
          flush=True)
    return mode, recompute if mode not in ("resident", *PEERS, "h2d", "matmul") else "-", micro, k, r


def bench_shape(store: BlockStore, args) -> ci.Shape:
    name = dtype_name(store.dtype)
    return ci.shape_of(store.cfg, name, name, args.seq_len)


def predicted(profile: ci.MachineProfile, mode: str, recompute: str, micro: str, k: str, store, args) -> float:
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


OPTIM = {"full": "adamw_torch", "full-8bit": "adamw_8bit"}  # --train's full rows and their optimizers


def state_moved(model) -> int:
    """Bytes of block-optimizer state a step reads and writes (master weights and moments, each once each
    way): what the update moves through host memory, or the disk for the disk tier."""
    if model.block_optimizer is None:
        return 0
    cfg = model.cfg
    per_param = costfull.state_per_param(model.block_optimizer.cfg.optim, cfg.block_params())
    return int(2 * per_param * cfg.block_params() * cfg.n_layers)


def optimizer_host_gb(model) -> float:
    """Full finetuning: the host bytes the memory model gives the optimizers (phantom.stream.optim.state_memory
    for the blocks; 16 bytes a parameter for head and embedding: fp32 weight, gradient, two moments)."""
    if model.block_optimizer is None:
        return 0.0
    cfg = model.cfg
    optim = model.block_optimizer.cfg.optim
    blocks = phantom.stream.optim.state_memory(model.block_optimizer.tier, cfg.block_params(), cfg.n_layers,
                                               per_param=costfull.state_per_param(optim, cfg.block_params()))["host"]
    others = cfg.n_params() - cfg.n_layers * cfg.block_params()
    return (blocks + (8 + costfull.moment_bytes_per_param(optim, others)) * others) / 2**30


def full_lines(host: dict, rows: list) -> list[str]:
    """Full finetuning beside LoRA: each full row's step against the LoRA row of the same placement, the
    block optimizer's seconds and parameters/s in the step, the state it moves and that over the host's
    memory bandwidth (the floor of moving it), all measured in this run."""
    lora = {(m, rc, mi, k): r for m, rc, mi, k, r in rows if r.get("train", "lora") == "lora"}
    bw, rate, rate8 = host["mem_gbps"], host["adamw_params_per_s"], host["adamw8_params_per_s"]
    lines = ["", f"- host memory bandwidth (in-place a += b, read + write, {host['threads']} threads): {bw:.1f} GB/s; "
             f"alone on {host['n'] >> 20} M parameters: fused AdamW {rate / 1e9:.2f} G params/s = {28 * rate / 1e9:.1f} "
             f"GB/s at 28 B/param, 8-bit AdamW {rate8 / 1e9:.2f} G params/s = {16 * rate8 / 1e9:.1f} GB/s at 16 "
             f"B/param ({rate / rate8:.1f}x the fused AdamW's time)", "",
             "| full finetuning | step s | LoRA step s | full / LoRA | CPU s/step: full, LoRA (ratio) "
             "| optimizer s/step (write-back thread) | its share of the step | optimizer G params/s in the step "
             "| state GB moved per step | / host bandwidth s | peak RSS GB: full - LoRA | optimizers' host GB (model) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for m, rc, mi, k, r in rows:
        if not r.get("train", "").startswith("full"):
            continue
        base = lora.get((m, rc, mi, k))
        ratio = f"{r['step_s'] / base['step_s']:.2f}x" if base else "-"
        rss = f"{r['peak_rss_gb'] - base['peak_rss_gb']:.2f}" if base else "-"
        cpu = f"{r['cpu_s']:.1f}, {base['cpu_s']:.1f} ({r['cpu_s'] / base['cpu_s']:.2f}x)" if base else "-"
        moved = r["state_bytes_per_step"] / 1e9
        lines.append(f"| {m} {r['train']} ({OPTIM[r['train']]}) {rc} micro {mi} prefetch {k} | {r['step_s']:.3f} | "
                     f"{base['step_s'] if base else 0:.3f} | {ratio} | {cpu} | {r['optim_s']:.3f} | "
                     f"{r['optim_s'] / r['step_s']:.0%} | {r['optim_params_per_s'] / 1e9:.2f} | {moved:.2f} | "
                     f"{moved / bw:.3f} | {rss} | {r['optim_host_gb']:.2f} |")
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


def step_table(args, store: BlockStore, rows: list, profile, best, host: dict | None) -> str:
    """The note: the machine, the model, one row per configuration (predicted beside measured where the
    tuner's profile was measured, the FLOP floor where the matmul rate was), full-finetuning and DPO lines."""
    base = next((r["step_s"] for m, _, _, _, r in rows if m == "resident"), None)
    cfg = store.cfg
    lines = [f"## {time.strftime('%Y-%m-%d %H:%M')}: `python benchmarks/bench.py {' '.join(sys.argv[1:])}`", "",
             f"- machine: {machine()}; device {args.device}",
             f"- model: dim {cfg.dim}, {cfg.n_layers} blocks of {store.block_nbytes / 2**20:.1f} MiB ({store.dtype}), "
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
        floor = "- | -"
        if rate and mode not in ("h2d", "matmul"):  # max(link time, needed matmul time): the step's floor
            # the FLOPs a LoRA step needs (no recomputed forward: rerunning it is overhead, not floor)
            f = max(r.get("h2d_per_step", 0) / peak if peak else 0.0,
                    step_flops(cfg, args.batch_size, args.seq_len, "none") / rate)
            floor = f"{f:.3f} | {r['step_s'] / f:.2f}x"
        shown = mode if r.get("train", "lora") == "lora" else f"{mode} ({r['train']})"
        lines.append(f"| {shown} | {rc} | {micro} | {k} | {r['step_s']:.3f} | {pred} | {ratio} | {r['stall']:.1%} | "
                     f"{r['loads']} | {r['bytes_per_step'] / 2**20:.0f} | {r['read_gbps']:.2f} | "
                     f"{r.get('copy_gbps', 0.0):.2f} | {floor} | {r['peak_rss_gb']:.2f} | {r['peak_dev_gb']:.2f} |")
    if best is not None:
        lines += tuning_lines(best, rows)
    if host is not None:
        lines += full_lines(host, rows)
    lines += dpo_lines(rows)
    return "\n".join(lines) + "\n"
