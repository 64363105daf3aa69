"""`AdapterModel`: one adapter of a multi-adapter PhantomModel, seen as a model of its own.

The training loop, its checkpoints, evaluation and the DPO reference take a model; a sweep gives them
this view of one adapter (phantom.stream.lanes): its forward runs the adapter's rows alone, its
parameters, names and adapter files are the adapter's, named as a model loaded with that LoRA alone
names them, and everything else is the shared model's.
"""
from __future__ import annotations

from pathlib import Path

import torch

from phantom.base import provenance
from phantom.model.adapterfiles import save_adapter
from phantom.model.backends import build_layers
from phantom.model.lora import LoraConfig, for_family
from phantom.stream.lanes import Adapter, Lane, RngStream


def add_adapter(model, name: str, lora: LoraConfig) -> Adapter:
    """Another LoRA on `model`'s loaded weights (a PhantomModel; phantom.stream.lanes): its own copy of the
    block modules (base weights bound to the model's, its LoRA initialised from lora.seed as a model loaded
    with it alone) and its own dropout stream. Forward its rows in a `lanes` list to train it beside others."""
    if model.full:
        raise ValueError("several adapters train LoRAs; full finetuning updates the weights they share")
    cfg = for_family(lora, model.cfg)
    layers = build_layers(model.cfg, cfg, model.activations, model.weight_dtype, model.device)
    model.backend.share(layers)
    model.adapters.append(layers)  # registered: .to(), train() and eval() reach them
    return Adapter(name, cfg, layers, RngStream.seeded(model.device, lora.seed))


class AdapterModel:
    """`adapter` of `model` as a model: what a PhantomModel loaded with its LoRA alone would be."""

    full = False

    def __init__(self, model, adapter: Adapter):
        self.model, self.adapter = model, adapter
        self.layers, self.lora_cfg = adapter.layers, adapter.lora

    def __getattr__(self, name: str):
        return getattr(self.model, name)  # the shared model's device, store, scheduler, training, ...

    def lane(self, rows: int) -> list[Lane]:
        return [Lane(self.adapter, rows)]

    def __call__(self, tokens: torch.Tensor, targets: torch.Tensor | None = None,
                 segments: torch.Tensor | None = None):
        out = self.model(tokens, targets, segments, lanes=self.lane(tokens.shape[0]))
        return out if targets is None else out[0]

    def sequence_logps(self, tokens: torch.Tensor, targets: torch.Tensor, reference: bool = False):
        return self.model.sequence_logps(tokens, targets, reference, lanes=self.lane(tokens.shape[0]))[0]

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return self.adapter.parameters()

    def named_parameters(self):
        """The adapter's parameters by the names a model loaded with its LoRA alone gives them."""
        return self.layers.named_parameters(prefix="layers")

    def train(self, mode: bool = True) -> "AdapterModel":
        self.model.train(mode)
        return self

    def eval(self) -> "AdapterModel":
        return self.train(False)

    def save_adapter(self, out: Path | str, base_model: str = "") -> Path:
        base, revision = (base_model, None) if base_model else \
            provenance.base_model(self.store.manifest, self.store.path)
        return save_adapter(self.layers, self.cfg, self.lora_cfg, Path(out), base, revision)
