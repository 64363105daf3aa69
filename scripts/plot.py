"""Plot a finetune run: `python scripts/plot.py --out out/finetune` writes loss.png (train and eval
loss) and, when the run had --trace, timeline.png (compute vs reads vs copies per block). A sweep's
folder (OUT/sweep.md, one run folder per adapter) gets sweep.png: every adapter's losses in one plot.

Needs matplotlib (pip install matplotlib, or the package's `plot` extra).
"""
import argparse
import json
import sys
from pathlib import Path

LANES = ["compute", "read", "copy", "dequant", "stall", "write-back"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("out/finetune"), help="the run's output folder")
    p.add_argument("--last-ms", type=float, default=0, help="timeline: only the last N ms of the trace (0: all, "
                                                            "at most the last 3000 events)")
    return p.parse_args(argv)


def ema(xs: list[float], alpha: float = 0.1) -> list[float]:
    out, m = [], None
    for x in xs:
        m = x if m is None else (1 - alpha) * m + alpha * x
        out.append(m)
    return out


def plot_loss(plt, recs: list[dict], path: Path) -> None:
    train = [(r["step"], r["loss"]) for r in recs if r.get("loss") is not None]
    evals = [(r["step"], r["val_loss"]) for r in recs if r.get("val_loss") is not None]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    if train:
        steps, losses = zip(*train)
        ax.plot(steps, losses, color="tab:blue", alpha=0.25, lw=1, label="train (per step)")
        ax.plot(steps, ema(list(losses)), color="tab:blue", lw=2, label="train (EMA)")
    if evals:
        ax.plot(*zip(*evals), "o-", color="tab:orange", lw=2, label="eval")
    ax.set(xlabel="step", ylabel="loss (nats / token)", title=f"loss: {path.parent}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_sweep(plt, runs: dict[str, list[dict]], path: Path) -> None:
    """Each adapter's train loss (EMA) and held-out loss, one colour per adapter."""
    fig, ax = plt.subplots(figsize=(9, 5))
    cmap = plt.get_cmap("tab10")
    for k, (name, recs) in enumerate(runs.items()):
        train = [(r["step"], r["loss"]) for r in recs if r.get("loss") is not None]
        evals = [(r["step"], r["val_loss"]) for r in recs if r.get("val_loss") is not None]
        if train:
            steps, losses = zip(*train)
            ax.plot(steps, ema(list(losses)), color=cmap(k % 10), lw=1.5, label=f"{name} train (EMA)")
        if evals:
            ax.plot(*zip(*evals), "o--", color=cmap(k % 10), lw=1, ms=3, label=f"{name} held-out")
    ax.set(xlabel="step", ylabel="loss (nats / token)", title=f"sweep: {path.parent}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def read_records(metrics: Path) -> list[dict]:
    return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]


def plot_timeline(plt, trace: dict, path: Path, last_ms: float) -> None:
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    lane_of = {e["args"]["name"]: e["tid"] for e in trace["traceEvents"] if e.get("ph") == "M"}
    lanes = [lane for lane in LANES + sorted(set(lane_of) - set(LANES))  # a registered tier's lane after these
             if lane in lane_of and any(e["tid"] == lane_of[lane] for e in events)]
    end = max((e["ts"] + e["dur"] for e in events), default=0.0)
    events = [e for e in events if e["ts"] + e["dur"] >= end - last_ms * 1e3] if last_ms else events[-3000:]
    t0 = min((e["ts"] for e in events), default=0.0)
    cmap = plt.get_cmap("tab20")
    fig, ax = plt.subplots(figsize=(12, 1 + 0.6 * max(len(lanes), 1)))
    for row, lane in enumerate(lanes):
        mine = [e for e in events if e["tid"] == lane_of[lane]]
        bars = [((e["ts"] - t0) / 1e3, max(e["dur"] / 1e3, 1e-3)) for e in mine]
        colors = [cmap(_block(e["name"]) % 20) for e in mine]
        ax.broken_barh(bars, (row - 0.4, 0.8), facecolors=colors, edgecolor="none")
    ax.set_yticks(range(len(lanes)), lanes)
    ax.invert_yaxis()
    ax.set(xlabel="time (ms)", title="scheduler timeline (colour = block)")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _block(name: str) -> int:
    digits = "".join(c for c in name.split()[-1] if c.isdigit())
    return int(digits) if digits else 0


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("error: plotting needs matplotlib; pip install matplotlib", file=sys.stderr)
        return 2
    metrics = args.out / "metrics.jsonl"
    if (args.out / "sweep.md").is_file() and not metrics.is_file():
        runs = {d.name: read_records(d / "metrics.jsonl") for d in sorted(args.out.iterdir())
                if (d / "metrics.jsonl").is_file()}
        plot_sweep(plt, runs, args.out / "sweep.png")
        print(f"wrote {args.out / 'sweep.png'} ({len(runs)} adapters)")
        return 0
    if not metrics.is_file():
        print(f"error: no {metrics}; run scripts/finetune.py --out {args.out} first", file=sys.stderr)
        return 2
    recs = read_records(metrics)
    plot_loss(plt, recs, args.out / "loss.png")
    print(f"wrote {args.out / 'loss.png'}")
    trace = args.out / "trace.json"
    if trace.is_file():
        plot_timeline(plt, json.loads(trace.read_text()), args.out / "timeline.png", args.last_ms)
        print(f"wrote {args.out / 'timeline.png'}")
    else:
        print(f"no {trace} (run finetune.py with --trace for a timeline)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
