"""Measure this machine for a model, predict a step per placement, choose one: `python scripts/tune.py --model tiny`.

Prints the measurements, the fastest candidates and the choice with its predicted step time and
what bounds it, and saves the profile that `finetune.py --prefetch auto` reads. Imports phantom.
"""
import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

import phantom  # noqa: E402
from phantom import tune  # noqa: E402
from phantom.store import BlockStore  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument
    a("--model", default="tiny", help="preset name (prepared under weights/) or a store folder")
    a("--device", default="auto", help="cpu, cuda, cuda:N, mps or auto")
    a("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"], help="compute dtype (auto: bf16 on CUDA)")
    a("--batch-size", type=int, default=8, help="rows per optimizer step (finetune's batch size x grad accum)")
    a("--seq-len", type=int, default=128, help="tokens per row")
    a("--max-batch-size", type=int, default=None, help="let the tuner grow the rows per step up to this")
    a("--offload", default="ram,disk", help="comma list of tiers to consider (ram, disk)")
    a("--quick", action="store_true", help="fewer repeats and a smaller read sample")
    a("--top", type=int, default=12, help="candidates to print")
    a("--profile-dir", default=None, help="where profiles are saved (default $PHANTOM_CACHE/profiles or "
                                          "~/.cache/phantom/profiles)")
    return p.parse_args(argv)


def describe(p: tune.MachineProfile, c: tune.Placement) -> str:
    cold = f"{p.disk_cold_gbps:.2f} GB/s cold (page cache dropped), " if p.disk_cold_gbps else \
        "cold reads not possible here, "
    link = "host memory is the device: the RAM tier is zero-copy" if p.zero_copy else \
        f"host-to-device {p.h2d_gbps:.1f} GB/s, device-to-host {p.d2h_gbps:.1f} GB/s (pinned)"
    b = c.micro_batch
    fwd = p.fwd_call_s + b * p.fwd_row_s
    bwd = p.bwd_call_s + b * p.bwd_row_s + (p.fwd_grad_call_s + b * p.fwd_grad_row_s if c.recompute == "all" else 0)
    return "\n".join([
        f"machine   {p.machine} ({p.device}), model {p.model}: {p.n_blocks} blocks of {p.block_bytes / 2**20:.1f} MiB",
        f"disk      {cold}{p.disk_warm_gbps:.2f} GB/s warm, block read jitter {p.disk_jitter:.0%}",
        f"link      {link}",
        f"compute   one block at micro-batch {b} x {p.seq_len} tokens: forward {1e3 * fwd:.1f} ms, "
        f"backward{' with recompute' if c.recompute == 'all' else ''} {1e3 * bwd:.1f} ms; "
        f"head + loss {1e3 * p.head_row_s * b:.1f} ms",
        f"overlap   while blocks are read, compute runs x{p.busy_compute_slowdown:.2f} slower and reads "
        f"x{p.busy_read_slowdown:.2f}",
        f"memory    free: device {p.free_device_bytes / 2**30:.1f} GiB, host {p.free_host_bytes / 2**30:.1f} GiB"])


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        if args.batch_size < 1 or args.seq_len < 1:
            raise ValueError("--batch-size and --seq-len must be >= 1")
        device = phantom.resolve_device(args.device)
        dtype = args.dtype if args.dtype != "auto" else ("bf16" if device.type == "cuda" else "fp32")
        store = BlockStore(phantom.resolve_model(args.model), verify="none")
        if args.seq_len > store.cfg.max_seq_len:
            raise ValueError(f"--seq-len {args.seq_len} exceeds the model's max_seq_len {store.cfg.max_seq_len}")
        offloads = tuple(o.strip() for o in args.offload.split(","))
        if not offloads or set(offloads) - {"ram", "disk"}:
            raise ValueError(f"--offload takes ram and/or disk, got {args.offload!r}")
        profile = tune.measure(store, device, dtype, args.batch_size, args.seq_len, quick=args.quick)
        cands = tune.search(profile, args.batch_size, args.seq_len, args.max_batch_size, offloads)
        best = tune.choose(cands)
        path = tune.profile_path(store, device, dtype, args.profile_dir)
        tune.save_profile(profile, path)
    except (ValueError, FileNotFoundError, OSError) as e:  # StoreError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(describe(profile, best))
    print()
    print(tune.format_table(cands, args.top, best))
    print(f"\nchoice    {best.describe()}")
    print(f"predicted {best.step_s:.3f} s/step ({args.batch_size} x {args.seq_len} tokens), {best.bound}-bound; "
          f"device {best.device_bytes / 2**30:.2f} GiB, host {best.host_bytes / 2**30:.2f} GiB")
    if (more := tune.faster_if_more_memory(cands, best)) is not None:
        print(f"with more memory: {more.describe()} would take {more.step_s:.3f} s "
              f"({more.device_bytes / 2**30:.1f} GiB on the device)")
    if best.bound in ("disk", "link") and args.max_batch_size is None:
        print("transfer-bound: more rows per step cost little extra time; try --max-batch-size "
              f"{4 * args.batch_size} to see how many")
    print(f"profile   {path} (finetune.py --prefetch auto reads it)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
