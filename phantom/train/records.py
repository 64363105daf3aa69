"""The records of metrics.jsonl (one strict-JSON line a step, cut back to a checkpoint on resume) and
how a step's figures are shown (the log line, the progress bar). Apart from the loop: what a record
holds and how it reads, not when one is written.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from phantom.base import fileio


def to_json(rec: dict) -> str:
    """One metrics.jsonl line; NaN and inf become null (strict JSON)."""
    return json.dumps({k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in rec.items()}) + "\n"


def read_metrics(path: Path, upto: int) -> list[dict]:
    """Records of metrics.jsonl up to step `upto` (what a resumed run keeps); a torn last line (a run
    stopped mid-write) is dropped with a warning, and the resumed run rewrites the file without it."""
    return [r for r in fileio.read_records(path) if isinstance(r, dict) and r.get("step", 0) <= upto]


def describe_eval(rec: dict) -> str:
    """An evaluation's figures for the log: loss and perplexity, or the preference figures."""
    if "val_reward_accuracy" in rec:
        return f"val loss {rec['val_loss']:.4f}, reward accuracy {rec['val_reward_accuracy']:.3f}, " \
               f"margin {rec['val_reward_margin']:.4f}"
    return f"val loss {rec['val_loss']:.4f}, ppl {rec['val_ppl']:.2f}"


def describe_tasks(figures: dict) -> str:
    """lm-eval tasks' metrics (phantom.train.evaltasks.metrics_record) for the log: TASK/METRIC value, ..."""
    return ", ".join(f"{k} {v:.4g}" for k, v in figures.items()) or "no metrics"


def tier_metrics(model, m: dict, dt: float) -> dict:
    """A step's scheduler traffic for metrics.jsonl: stall fraction, kept activations, bytes and loads per tier,
    routed expert reads (round trips after a router)."""
    executor = getattr(model, "executor", None)
    return {"stall_frac": m.get("stall_s", 0.0) / dt, "kept_bytes": executor.kept_bytes if executor else 0,
            **{k: m[k] for k in m if k.startswith(("bytes", "loads", "expert_reads"))}}


def preference_postfix(rec: dict) -> dict:
    """The step's reward accuracy (preference training) or mean reward (GRPO) for the progress bar."""
    if "reward_accuracy" in rec:
        return {"acc": f"{rec['reward_accuracy']:.2f}"}
    if "generation_s" in rec:  # grpo, at a step that sampled: its reward, its time generating and training
        return {"reward": f"{rec['reward']:.3f}", "gen_s": f"{rec['generation_s']:.1f}",
                "train_s": f"{rec.get('train_s', 0.0):.1f}"}
    return {"reward": f"{rec['reward']:.3f}"} if "reward" in rec else {}


def tier_postfix(rec: dict) -> dict:
    """MB a step took from host RAM and from disk, for the progress bar (nothing when nothing streamed)."""
    ram, disk = rec.get("bytes_ram", 0), rec.get("bytes_read", 0)
    return {"ram_MB": f"{ram / 1e6:.0f}", "disk_MB": f"{disk / 1e6:.0f}"} if ram or disk else {}
