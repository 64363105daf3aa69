"""What one LoRA training step holds at its peak, by the op that allocated each tensor: for memory claims in notes/.

    python benchmarks/memattr.py --store STORE --seq-len 16384 [--mlp-chunk 512] [--offload disk]

Runs one step (forward + backward) under torch's profiler with its allocation events, replays them to find the
largest total of live CPU tensor bytes in each phase of the step (the forward of the blocks, the head, each
block's backward, and within those the backward op running), and prints, per phase, that peak and the tensors
alive then that are at least a twentieth of a model-width row (T x dim x 4 bytes), each with the ops that made
it, in model-width vectors (T x dim fp32). What scales with the row's length is what is counted in vectors;
the process, the weights and the loss chunk are not among the tensors listed (a loss chunk's logits are).
"""
import argparse
import sys
from pathlib import Path

import torch
from torch._C._profiler import _EventType

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import phantom  # noqa: E402
from phantom.stream.placement import offload_choices  # noqa: E402


def allocations(prof) -> list[tuple[int, int, int, tuple[str, ...]]]:
    """(time, address, bytes (< 0: a free), the names of the ops around it) of each CPU allocation, in order."""
    out = []

    def walk(ev, stack):
        if ev.tag == _EventType.Allocation:
            if ev.extra_fields.device.type == "cpu":
                out.append((ev.start_time_ns, ev.extra_fields.ptr, ev.extra_fields.alloc_size, tuple(stack)))
            return
        for child in ev.children:
            walk(child, stack + [ev.name])
    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root, [])
    return sorted(out)


def phase(stack: tuple[str, ...]) -> str:
    """The step's part an allocation belongs to: the block or head op around it, and the backward op inside."""
    top = next((n for n in stack if "StreamedBlock" in n or "ChunkedHead" in n), "other")
    inner = [n.replace("autograd::engine::evaluate_function: ", "") for n in stack if "evaluate_function" in n]
    return f"{top} / {inner[-1] if inner else ''}"


def peaks(allocs, least: int) -> dict[str, tuple[int, list]]:
    """phase -> (the most live bytes while it allocated, the live tensors of at least `least` bytes then)."""
    live, total, out = {}, 0, {}
    for t, ptr, size, stack in allocs:
        if size > 0:
            live[ptr], total = (size, stack, t), total + size
        elif ptr in live:
            total -= live.pop(ptr)[0]
        where = phase(stack)
        if total > out.get(where, (0,))[0]:
            out[where] = (total, sorted((v for v in live.values() if v[0] >= least), key=lambda v: v[2]))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--store", required=True, help="a store folder or preset")
    p.add_argument("--seq-len", type=int, default=4096, help="tokens in the row")
    p.add_argument("--mlp-chunk", type=int, default=2048, help="tokens per chunk of tiled compute (0: untiled)")
    p.add_argument("--offload", default="disk", choices=offload_choices(), help="placement")
    p.add_argument("--top", type=int, default=6, help="phases printed, largest peak first")
    args = p.parse_args()
    model = phantom.load(args.store, offload=args.offload, recompute="all", mlp_chunk=args.mlp_chunk)
    vector = args.seq_len * model.cfg.dim * 4
    x = torch.randint(0, model.cfg.vocab_size, (1, args.seq_len + 1))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        model(x[:, :-1], targets=x[:, 1:]).backward()
    found = peaks(allocations(prof), vector // 20)
    for where, (total, tensors) in sorted(found.items(), key=lambda kv: -kv[1][0])[:args.top]:
        print(f"[{where}] peak {total / 2**30:.3f} GiB = {total / vector:.2f} vectors; live then:")
        for size, stack, _ in tensors:
            print(f"  {size / vector:6.2f}  {' > '.join(stack[-3:])}")


if __name__ == "__main__":
    main()
