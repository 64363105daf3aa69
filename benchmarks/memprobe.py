"""Peak host RSS of one LoRA training step, in a fresh process: for memory claims in notes/.

    python benchmarks/memprobe.py --store STORE --seq-len 8192 [--checkpoint-inner] [--offload disk] [--mlp-chunk 0]
        [--threads 1]

Also prints the step's seconds (forward and backward, the model already open) and the CPU seconds of its
threads (on a machine others share, the steadier figure of the two), and the cost model's predicted peak for the
same step on a CPU (phantom.plan.costmodel: `predicted_gb`).
"""
import argparse
import json
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import phantom  # noqa: E402
from phantom.files.tensorfile import dtype_name  # noqa: E402
from phantom.plan import costinputs as ci, costmodel as cm  # noqa: E402
from phantom.stream.placement import RECOMPUTE, Activations, Placement, offload_choices  # noqa: E402


def predicted_peak(args, model) -> float:
    """GiB the cost model predicts this step's process holds at its peak on a CPU (its own memory rules alone:
    no rates needed)."""
    store, dtype = model.store, dtype_name(model.dtype)
    shape = ci.shape_of(store.cfg, store.manifest["dtype"], dtype, args.seq_len, store.quant)
    profile = ci.MachineProfile(machine="here", device="cpu", dtype=dtype)
    acts = Activations(recompute=args.recompute, mlp_chunk=args.mlp_chunk, checkpoint_inner=args.checkpoint_inner)
    return cm.predict(profile, shape, Placement(offload=args.offload), acts, args.batch_size).host_bytes / 2**30


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--store", required=True, help="a store folder or preset")
    p.add_argument("--offload", default="disk", choices=offload_choices(), help="placement")
    p.add_argument("--batch-size", type=int, default=1, help="rows")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per row")
    p.add_argument("--checkpoint-inner", action="store_true", help="checkpoint attention and MLP inside blocks")
    p.add_argument("--recompute", default="all", choices=RECOMPUTE, help="recompute policy")
    p.add_argument("--mlp-chunk", type=int, default=Activations.mlp_chunk,
                   help="tokens per chunk of a block's tiled compute (0: whole rows, untiled)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch's threads (default: torch's own); 1 on a machine others share keeps the CPU seconds "
                        "of many small parallel ops from counting the time a thread waits for a busy core")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = phantom.load(args.store, offload=args.offload, checkpoint_inner=args.checkpoint_inner,
                         recompute=args.recompute, mlp_chunk=args.mlp_chunk)
    x = torch.randint(0, model.cfg.vocab_size, (args.batch_size, args.seq_len + 1))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    t0, c0 = time.perf_counter(), time.process_time()
    model(x[:, :-1], targets=x[:, 1:]).backward()
    step_s, cpu_s = time.perf_counter() - t0, time.process_time() - c0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(json.dumps({**vars(args), "rss_before_gb": round(before, 3), "peak_gb": round(peak, 3),
                      "predicted_gb": round(predicted_peak(args, model), 3),
                      "step_s": round(step_s, 2), "step_cpu_s": round(cpu_s, 2)}))


if __name__ == "__main__":
    main()
