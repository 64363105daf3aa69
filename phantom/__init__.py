"""phantom: finetune large Llama models by streaming their blocks through a small device.

    model = phantom.load("tiny", device="cpu", offload="disk", lora=phantom.LoraConfig(rank=8))
"""
from __future__ import annotations

from phantom.arch.config import ModelConfig
from phantom.arch.presets import PRESETS, preset
from phantom.base.provenance import VERSION as __version__  # noqa: F401
from phantom.files.store import BlockStore, StoreError
from phantom.model.lora import LoraConfig
from phantom.model.phantom_model import PhantomModel
from phantom.stream.optim import AdamWConfig
from phantom.stream.placement import Activations, Placement
from phantom.train.load import load, resolve_device, resolve_model, weights_dir  # noqa: F401 (resolve_device: API)
from phantom.train.runconfig import DataSource, ModelSource, Output, RunConfig
from phantom.train.trainconfig import TrainConfig

__all__ = ["load", "run", "RunConfig", "ModelSource", "DataSource", "TrainConfig", "Output", "Placement", "Activations", "resolve_model", "weights_dir", "LoraConfig", "AdamWConfig", "ModelConfig", "PhantomModel", "BlockStore",
           "StoreError", "PRESETS", "preset"]


def run(cfg: RunConfig) -> dict:
    """One finetuning run, what `scripts/finetune.py` does with the same flags (phantom.train.runner):

        s = phantom.run(phantom.RunConfig(train=phantom.TrainConfig(iters=20, out="runs/demo")))

    Returns the run's summary (status, steps, final loss, files); with cfg.adapters (several adapters in one
    pass over the weights), each adapter's summary under "adapters". Raises ValueError or
    FileNotFoundError on bad input, before anything is written."""
    from phantom.train.launch import run as run_
    return run_(cfg)


