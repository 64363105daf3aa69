"""One block's part of a recomputing LoRA step, at several chunks of tiled compute: CPU seconds, rounds interleaved.

    python benchmarks/blockstep.py --store STORE --seq-len 8192 --chunks 0,2048 [--rounds 2] [--threads 1]

The block (the store's first, its weights resident) runs as the executor runs it under recompute: a forward without
autograd, the forward again with autograd under outputs_unused (the recompute a block's backward runs), and the
backward into its input and its LoRA (q, v). Chunk 0 is the untiled block. Prints each chunk's CPU seconds per
round (the steadier figure on a machine others share), the fastest, and the fastest against chunk 0's.
"""
import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import phantom  # noqa: E402
from phantom.arch.ops import rope_table  # noqa: E402
from phantom.arch.tiled import outputs_unused  # noqa: E402


def block_step(block, x: torch.Tensor, rope: torch.Tensor, params: list, chunk: int) -> None:
    block.mlp_chunk = chunk
    with torch.no_grad():
        block(x, rope)
    xg = x.detach().requires_grad_()
    with outputs_unused():
        out = block(xg, rope)
    torch.autograd.grad(out, [xg] + params, torch.ones(out.shape))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--store", required=True, help="a store folder or preset")
    p.add_argument("--seq-len", type=int, default=8192, help="tokens in the row")
    p.add_argument("--chunks", default="0,2048", help="chunks of tiled compute to compare, the first the baseline")
    p.add_argument("--rounds", type=int, default=2, help="rounds, each chunk once per round")
    p.add_argument("--threads", type=int, default=None, help="torch's threads (default: torch's own)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    chunks = [int(c) for c in args.chunks.split(",")]
    model = phantom.load(args.store, offload="none", recompute="all")
    block = model.layers[0]
    x = torch.randn(1, args.seq_len, model.cfg.dim)
    rope = rope_table(model.cfg, args.seq_len)
    params = [q for q in block.parameters() if q.requires_grad]
    block_step(block, x, rope, params, chunks[0])  # warm
    secs = {c: [] for c in chunks}
    for _ in range(args.rounds):
        for c in chunks:
            c0 = time.process_time()
            block_step(block, x, rope, params, c)
            secs[c].append(time.process_time() - c0)
    print(f"seq_len {args.seq_len}, threads {torch.get_num_threads()}, load {open('/proc/loadavg').read().split()[:3]}")
    for c in chunks:
        print(f"  chunk {c:6d}: {[round(s, 2) for s in secs[c]]} CPU s, fastest {min(secs[c]):.2f} "
              f"({min(secs[c]) / min(secs[chunks[0]]) - 1:+.1%})")


if __name__ == "__main__":
    main()
