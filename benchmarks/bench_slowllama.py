"""Seconds per iteration of slowllama's own finetune step on the same random Llama as benchmarks/bench.py.

slowllama (github.com/okuvshynov/slowllama) is not a dependency and none of its code is in this
repository: pass a checkout of its .py files with --slowllama (recipe in notes/bench-slowllama.md).

    python benchmarks/bench_slowllama.py --slowllama /tmp/slowllama --dim 2048 --layers 8 --heads 16 \\
        --vocab 4096 --batch-size 4 --seq-len 128 --lora-rank 4 --steps 3

What it does, each phase in its own process (slowllama numbers its on-disk modules with a
process-global counter, so preparing and loading must start from a fresh counter, as its own
prepare_model.py and finetune.py do):
  1. phantom's synthetic store (phantom.convert.synthetic.write_synthetic, the call benchmarks/bench.py makes;
     or --store PATH), read back with BlockStore.load_block/load_head/load_embed and written as a Meta
     checkpoint: consolidated.00.pth + params.json (+ tokenizer.model, unused).
  2. slowllama's llama2_loader.prepare_model: builds its Transformer (every attention, feed-forward,
     embedding and output module a BlackboxDisk, saved with torch.save) and fills it from the checkpoint.
  3. slowllama's llama2_loader.load_frozen, then the loop body of its finetune.py: opt.zero_grad(),
     model.manual_loop(X, y) (forward saving each module's input to disk, loss, backward loading each
     module again from disk and rerunning its forward), opt.step(), with AdamW(model.parameters()).
     One warm-up iteration, then --steps timed ones; prints the median s/iter.

Differences from benchmarks/bench.py that slowllama fixes (not options here): LoRA alpha 64 (scale 16; phantom
16/r), LoRA dropout 0.05 in training mode (phantom 0.0), the final norm's weight is trained too (it is in
model.parameters()), every module's input is torch.save'd to --work/cache and read back in backward.
The frozen dtype is the store's (fp32 for bench.py's default) unless --frozen-dtype bf16 (slowllama's
conf_fp32.py: bf16 on disk, fp32 compute, converted at each load).
torch >= 2.6 loads with weights_only=True by default, which refuses the pickled nn.Modules slowllama
saves; the phases run with TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 (the loading torch < 2.6 did).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchlib

from benchlib.measure import matmul_rate, peak_rss_gb  # noqa: E402

NEEDED = ("llama2.py", "llama2_loader.py", "blackbox.py", "model_config.py", "utils.py")
SLOWLLAMA_SEED = 54321  # conf.py's seed, set by its prepare_model.py and finetune.py


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--slowllama", required=True, help="directory with slowllama's .py files (llama2_loader.py, ...)")
    p.add_argument("--store", default=None, help="use this phantom store instead of writing a synthetic one")
    p.add_argument("--dim", type=int, default=2048, help="model width (synthetic store)")
    p.add_argument("--layers", type=int, default=8, help="number of blocks (synthetic store)")
    p.add_argument("--heads", type=int, default=16, help="attention heads (synthetic store)")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (synthetic store)")
    p.add_argument("--vocab", type=int, default=4096, help="vocabulary (synthetic store)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"], help="synthetic store dtype")
    p.add_argument("--seed", type=int, default=0, help="synthetic store seed (bench.py uses 0)")
    p.add_argument("--frozen-dtype", default="store", choices=["store", "fp32", "bf16", "fp16"],
                   help="dtype of slowllama's frozen module files (store: the store's; conf_fp32.py uses bf16)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lora-rank", type=int, default=4, help="LoRA rank (slowllama: always q and v)")
    p.add_argument("--steps", type=int, default=3, help="timed iterations (after one warm-up)")
    p.add_argument("--work", default=None, help="working directory (default: a new one under /tmp, removed after)")
    p.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def check_slowllama(path: str) -> Path:
    d = Path(path)
    missing = [f for f in NEEDED if not (d / f).is_file()]
    if missing:
        print(f"error: --slowllama {path}: not a slowllama checkout (missing {', '.join(missing)}); "
              f"see notes/bench-slowllama.md for the recipe", file=sys.stderr)
        sys.exit(2)
    return d.resolve()


def dtype_of(name: str):
    import torch
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def write_meta(store_path: Path, meta: Path) -> dict:
    """The phantom store as a Meta checkpoint (one shard), the form slowllama's prepare_model reads."""
    import torch
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from phantom.files.store import BlockStore
    store = BlockStore(store_path)
    c = store.cfg
    params = {"dim": c.dim, "n_layers": c.n_layers, "n_heads": c.n_heads, "multiple_of": c.multiple_of,
              "norm_eps": c.norm_eps, "rope_theta": c.rope_theta, "vocab_size": -1}
    if c.n_kv_heads is not None:
        params["n_kv_heads"] = c.n_kv_heads
    if c.ffn_dim_multiplier is not None:
        params["ffn_dim_multiplier"] = c.ffn_dim_multiplier
    hidden = int(2 * (4 * c.dim) / 3)  # slowllama's FeedForward rule (Meta's)
    if c.ffn_dim_multiplier is not None:
        hidden = int(c.ffn_dim_multiplier * hidden)
    hidden = c.multiple_of * ((hidden + c.multiple_of - 1) // c.multiple_of)
    if hidden != c.hidden_dim or c.rope_scaling is not None:
        sys.exit(f"error: store {store_path}: FFN width {c.hidden_dim} / rope scaling not expressible in slowllama")
    ckpt = {}
    for i in range(c.n_layers):  # clone: the store's tensors are views of one buffer, torch.save would keep it all
        ckpt.update({f"layers.{i}.{k}": v.clone() for k, v in store.load_block(i).items()})
    ckpt.update({k: v.clone() for k, v in store.load_embed().items()})
    ckpt.update({k: v.clone() for k, v in store.load_head().items()})
    meta.mkdir(parents=True, exist_ok=True)
    torch.save(ckpt, meta / "consolidated.00.pth")
    (meta / "params.json").write_text(json.dumps(params))
    tok = store.tokenizer_path
    if tok is not None and Path(tok).is_file():
        shutil.copy(tok, meta / "tokenizer.model")
    else:  # prepare_model copies it; nothing here reads it
        (meta / "tokenizer.model").write_bytes(b"")
    return {"vocab": c.vocab_size, "dtype": str(store.dtype).removeprefix("torch."), "dim": c.dim,
            "n_layers": c.n_layers, "n_heads": c.n_heads, "hidden": c.hidden_dim, "kv_dim": c.kv_heads * c.head_dim}


def phase_prepare(args, info: dict):
    import torch
    from llama2_loader import prepare_model  # slowllama's
    torch.random.manual_seed(SLOWLLAMA_SEED)
    work = Path(args.work)
    prepare_model(llama2_path=str(work / "meta"), frozen_path=str(work / "frozen"), compute_dtype=torch.float32,
                  lora_rank=args.lora_rank, frozen_dtype=dtype_of(info["frozen_dtype"]),
                  vocab_size_override=info["vocab"], cached_data_path=str(work / "cache"))


def iter_flops(info: dict, batch: int, seq: int) -> float:
    """Matmul FLOPs of one slowllama iteration: per block a forward, the forward rerun in backward and the
    input gradients (3 x 2PT, causal attention 2BT^2d each); the output layer likewise runs forward twice
    (manual_loop, then backprop_w_lora) plus its input gradient (3 x 2VdT). LoRA's rank-r matmuls left out."""
    d, h, t = info["dim"], info["hidden"], batch * seq
    kv = info["kv_dim"]
    per_block = 2 * d * d + 2 * d * kv + 3 * d * h
    return info["n_layers"] * 3 * (2 * per_block * t + 2 * batch * seq * seq * d) + 3 * 2 * info["vocab"] * d * t


def phase_train(args, info: dict) -> dict:
    import torch
    from llama2_loader import load_frozen  # slowllama's
    torch.random.manual_seed(SLOWLLAMA_SEED)
    work = Path(args.work)
    device = "cpu"
    compute_dtype = torch.float32
    # finetune.py: load_frozen(...).to(device).to(compute_dtype); AdamW(model.parameters(), lr, eps=adamw_eps)
    model = load_frozen(str(work / "frozen"), compute_dtype=compute_dtype, lora_rank=args.lora_rank,
                        frozen_dtype=dtype_of(info["frozen_dtype"]), vocab_size_override=info["vocab"],
                        cached_data_path=str(work / "cache")).to(device).to(compute_dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, eps=1e-8)  # conf.py lr, conf_fp32.py eps
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    gen = torch.Generator().manual_seed(0)  # the tokens benchmarks/bench.py draws
    tokens = torch.randint(0, info["vocab"], (args.batch_size, args.seq_len + 1), generator=gen)
    # contiguous, as finetune.py's get_batch (torch.stack) makes them: manual_loop calls targets.view(-1)
    X, y = tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device)
    times, cpu, losses, load = [], [], [], []
    for i in range(args.steps + 1):
        if i == 1:
            load.append(Path("/proc/loadavg").read_text().split()[0])
            rates = [matmul_rate(X.numel(), info["dim"], info["hidden"])]
        t0, c0 = time.perf_counter(), time.process_time()
        opt.zero_grad()
        loss = model.manual_loop(X, y)  # forward + backward, both in here; returns loss.item()
        opt.step()
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        losses.append(loss)
        print(f"iter {i}{' (warm-up)' if i == 0 else ''}: {dt:.3f} s, loss {loss:.4f}", file=sys.stderr, flush=True)
        if i:
            times.append(dt)
            cpu.append(dc)
    load.append(Path("/proc/loadavg").read_text().split()[0])
    rates.append(matmul_rate(X.numel(), info["dim"], info["hidden"]))
    return {"rates": rates, "times": times, "cpu": cpu, "load": load, "losses": losses, "trainable": trainable,
            "peak_rss_gb": peak_rss_gb()}


def run_phase(name: str, args, info: dict, slow: Path) -> str:
    env = dict(os.environ, TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD="1",
               PYTHONPATH=os.pathsep.join([str(slow)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--slowllama", str(slow), "--work", args.work,
           "--lora-rank", str(args.lora_rank), "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
           "--steps", str(args.steps), "--phase", name + ":" + json.dumps(info)]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, cwd=args.work, env=env, stdout=subprocess.PIPE, text=True)
    if out.returncode:
        sys.exit(f"error: slowllama {name} failed (exit {out.returncode})")
    print(f"{name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return out.stdout


def main(argv=None):
    args = parse_args(argv)
    slow = check_slowllama(args.slowllama)
    if args.phase:
        run_in_phase(args, slow)
        return
    own = args.work is None
    args.work = str(Path(args.work or tempfile.mkdtemp(prefix="bench-slowllama-", dir="/tmp")).resolve())
    Path(args.work).mkdir(parents=True, exist_ok=True)
    try:
        info = prepare_checkpoint(args)
        run_phase("prepare", args, info, slow)
        shutil.rmtree(Path(args.work) / "meta")  # slowllama's frozen/ copy is all it reads from here on
        r = json.loads(run_phase("train", args, info, slow).strip().splitlines()[-1])
    finally:
        if own:
            shutil.rmtree(args.work, ignore_errors=True)
    report(args, info, r, slow)


def run_in_phase(args, slow: Path) -> None:
    """--phase NAME:INFO: this process is one of slowllama's phases (prepare, train)."""
    name, info = args.phase.split(":", 1)
    info = json.loads(info)
    sys.path.insert(0, str(slow))
    import warnings
    warnings.filterwarnings("ignore", message="Environment variable TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")
    if name == "prepare":
        phase_prepare(args, info)
    else:
        print(json.dumps(phase_train(args, info)))


def prepare_checkpoint(args) -> dict:
    """The store (--store, or bench.py's synthetic one) as a Meta checkpoint in WORK/meta; its shapes."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from phantom.arch.config import ModelConfig
    from phantom.convert.synthetic import write_synthetic
    t0 = time.perf_counter()
    store = args.store
    if store is None:
        cfg = ModelConfig(dim=args.dim, n_layers=args.layers, n_heads=args.heads, n_kv_heads=args.kv_heads,
                          vocab_size=args.vocab, max_seq_len=max(args.seq_len, 256))  # as benchmarks/bench.py
        store = write_synthetic(Path(args.work) / "store", cfg, dtype_of(args.dtype), seed=args.seed,
                                progress=False)
    info = write_meta(Path(store), Path(args.work) / "meta")
    info["frozen_dtype"] = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[info["dtype"]] \
        if args.frozen_dtype == "store" else args.frozen_dtype
    if args.store is None:
        shutil.rmtree(Path(args.work) / "store")
    print(f"store -> Meta checkpoint: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return info


def report(args, info: dict, r: dict, slow: Path) -> None:
    """What was run, each iteration, and the median against the matmul floor."""
    import torch
    med = statistics.median(r["times"])
    commit = ""
    try:
        commit = subprocess.run(["git", "-C", str(slow), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
    except OSError:
        pass
    print(f"slowllama{' ' + commit if commit else ''} (disk, synchronous loads, forward rerun in backward): "
          f"dim {info['dim']}, {info['n_layers']} layers, {info['n_heads']} heads, FFN {info['hidden']}, vocab "
          f"{info['vocab']}, frozen {info['frozen_dtype']} on disk, compute fp32, batch {args.batch_size} x "
          f"{args.seq_len}, LoRA rank {args.lora_rank} on q,v ({r['trainable']} trainable incl. final norm), "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"iters: {', '.join(f'{t:.3f}' for t in r['times'])} s; losses {', '.join(f'{x:.4f}' for x in r['losses'])}; "
          f"peak RSS {r['peak_rss_gb']:.2f} GB")
    print(f"process CPU time per iter (user+sys, all threads): {', '.join(f'{t:.3f}' for t in r['cpu'])} s; "
          f"1-min load average {r['load'][0]} before the timed iterations, {r['load'][1]} after")
    flops = iter_flops(info, args.batch_size, args.seq_len)
    rate = statistics.mean(r["rates"])
    print(f"matmul rate (fp32, {args.batch_size * args.seq_len} x {info['dim']} @ {info['dim']} x {info['hidden']}): "
          f"{r['rates'][0] / 1e9:.1f} GFLOP/s before, {r['rates'][1] / 1e9:.1f} after; iteration {flops / 1e12:.3f} "
          f"TFLOP -> matmul floor {flops / rate:.3f} s at their mean; median / floor = {med / (flops / rate):.2f}x")
    print(f"slowllama s/iter (median of {len(r['times'])}): {med:.3f}")


if __name__ == "__main__":
    main()
