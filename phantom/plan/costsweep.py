"""Several adapters in one run (phantom.stream.lanes) against as many separate runs, as the cost model sees them.

K adapters in one run put K times a run's rows through each loaded block (K times the compute, the kept
activations and the micro-batch calls) while the weights are read once a step; each adapter adds its LoRA
state (fp32 weights, gradients and AdamW's two moments) on the compute side. K separate runs read the
weights K times. Imports the cost model and the model config only.
"""
from __future__ import annotations

from dataclasses import dataclass

from phantom.arch.config import ModelConfig
from phantom.plan.costinputs import MachineProfile, Shape
from phantom.plan.costmodel import Prediction, gib, predict
from phantom.stream.placement import Activations, Placement

LORA_STATE_BYTES = 16  # per LoRA parameter: the fp32 weight, its gradient and AdamW's two moments


def lora_params(cfg: ModelConfig, rank: int = 8) -> int:
    """LoRA parameters of an adapter on q and v (finetune.py's default targets) at `rank`, every block."""
    q, v = cfg.n_heads * cfg.head_dim, (cfg.n_kv_heads or cfg.n_heads) * cfg.head_dim
    return cfg.n_layers * rank * (2 * cfg.dim + q + v)


@dataclass(frozen=True)
class SweepPrediction:
    """One step of K adapters together, one step of one adapter alone, and the adapters' LoRA state."""

    adapters: int
    together: Prediction
    alone: Prediction
    state_bytes: int  # all K adapters' LoRA state

    @property
    def separate_s(self) -> float:
        """K separate runs: K steps of one adapter each."""
        return self.adapters * self.alone.step_s

    @property
    def ratio(self) -> float:
        """One run of K adapters over K separate runs (step time)."""
        return self.together.step_s / self.separate_s

    def describe(self) -> str:
        t, a = self.together, self.alone
        return (f"adapters   {self.adapters} in one run: predicted {t.step_s:.3f} s/step ({t.bound}-bound, "
                f"{t.bytes_read / 1e9:.1f} GB read, {t.loads} loads); {self.adapters} separate runs: "
                f"{self.adapters} x {a.step_s:.3f} = {self.separate_s:.3f} s ({self.ratio:.2f}x of that); "
                f"their LoRA state {gib(self.state_bytes)}")


def predict_sweep(profile: MachineProfile, shape: Shape, placement: Placement, activations: Activations,
                  rows: int, adapters: int, adapter_bytes: int) -> SweepPrediction:
    """K adapters of `rows` rows a step each, on `placement`, against K separate runs on the same placement."""
    together = predict(profile, shape, placement, activations, rows * adapters)
    alone = predict(profile, shape, placement, activations, rows)
    return SweepPrediction(adapters, together, alone, adapters * adapter_bytes)


def adapters_that_fit(profile: MachineProfile, shape: Shape, placement: Placement, activations: Activations,
                      rows: int, adapter_bytes: int, most: int = 1024) -> int:
    """The most adapters (up to `most`) whose activations and LoRA state fit beside the blocks of `placement`."""
    def fits(k: int) -> bool:
        p = predict(profile, shape, placement, activations, rows * k)
        used, free = (p.host_bytes, profile.free_host_bytes) if profile.host_is_device else \
            (p.device_bytes, profile.free_device_bytes)
        return p.fits and (free is None or used + k * adapter_bytes <= free)
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= most and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, most + 1)
    while hi - lo > 1:  # fits(lo), not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
