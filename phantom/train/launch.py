"""`run(cfg)`: what phantom.run and scripts/finetune.py call: one run (phantom.train.runner), or with
cfg.adapters several adapters trained in one pass over the weights (phantom.train.sweeprun).
"""
from __future__ import annotations

from phantom.train import runconfig as rc
from phantom.train import runner
from phantom.train.sweeprun import run_sweep

EXIT = runner.EXIT


def run(cfg: rc.RunConfig) -> dict:
    """The run's summary; a sweep's has each adapter's summary under "adapters" (and its table as `report`)."""
    return runner.run(cfg, sweep=run_sweep)
