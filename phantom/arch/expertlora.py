"""LoRA on a mixture of experts' experts, in the layout peft gives transformers 5's 3-D expert tensors.

peft (0.21, `target_parameters`, its ParamWrapper) puts one LoRA on each stacked expert tensor of
Qwen3-MoE, Qwen2-MoE, Mixtral and OLMoE: `mlp.experts.gate_up_proj` (E, 2*width, dim) and
`mlp.experts.down_proj` (E, dim, width). For a tensor (E, out, in) its lora_A is Linear(in, r*E), rows
e*r:(e+1)*r expert e's A; its lora_B is Linear(r*E, out), read as (out, r, E): column j*E + e is expert
e's rank-j column; expert e's update is scaling * B_e @ A_e. Phantom keeps each expert as modules
(experts.E.w1/w2/w3, swapped in by name when streamed): each gets a LoraLinear with its own slices,
gate (w1) and up (w3), the two halves of gate_up_proj's rows, sharing one A as a fused module's parts do.

Where both tensors are adapted peft nests its wrappers in the order it meets the parameters (gate_up_proj
first): gate_up_proj's LoRA is then `mlp.experts.base_layer`, down_proj's `mlp.experts`; alone, either is
`mlp.experts`. Imports arch only.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from phantom.arch.layers import LoraLinear
from phantom.arch.moe import MoeFeedForward

# short target name -> (transformers' parameter of the experts, the per-expert modules it stacks, in row order)
EXPERT_PARAMS = {"gate_up": ("gate_up_proj", ("w1", "w3")), "down": ("down_proj", ("w2",))}


def peft_parameter(target: str) -> str:
    """peft's target_parameters entry of an expert target: "gate_up" -> "mlp.experts.gate_up_proj"."""
    return f"mlp.experts.{EXPERT_PARAMS[target][0]}"


def target_of(parameter) -> str | None:
    """The expert target a target_parameters entry names (peft matches it at the end of the parameter's
    name: "gate_up_proj", "experts.gate_up_proj", "mlp.experts.gate_up_proj"); None for anything else."""
    for target in EXPERT_PARAMS:
        full = peft_parameter(target)
        if isinstance(parameter, str) and (parameter == full or full.endswith(f".{parameter}")):
            return target
    return None


def peft_wrappers(targets) -> dict[str, str]:
    """{expert target: the module peft's LoRA of it is, inside a layer} for the adapted ones of targets:
    nested in EXPERT_PARAMS' order, the last one outermost (`mlp.experts`)."""
    adapted = [t for t in EXPERT_PARAMS if t in targets]
    return {t: "mlp.experts" + ".base_layer" * (len(adapted) - 1 - n) for n, t in enumerate(adapted)}


def apply_expert_lora(moe: MoeFeedForward, target: str, rank: int, alpha: float, rslora: bool,
                      generator: torch.Generator) -> None:
    """Give every expert of moe a LoraLinear on target's modules (in place), its parts sharing one A."""
    for expert in moe.experts:
        shared = None
        for name in EXPERT_PARAMS[target][1]:
            base = getattr(expert, name)
            if rank > max(base.in_features, base.out_features):
                raise ValueError(f"LoRA rank {rank} of {peft_parameter(target)} exceeds both sides of each expert's "
                                 f"{base.out_features}x{base.in_features} weight")
            lora = LoraLinear(base, rank, alpha, 0.0, generator=generator, lora_A=shared, rslora=rslora)
            setattr(expert, name, lora)
            shared = lora.lora_A


def expert_loras(block: nn.Module) -> dict[str, list[list[LoraLinear]]]:
    """{expert target: per expert, its LoraLinears in row order} of a block's adapted experts ({} where none)."""
    ffn = getattr(block, "feed_forward", None)
    if not isinstance(ffn, MoeFeedForward):
        return {}
    out = {}
    for target, (_, names) in EXPERT_PARAMS.items():
        if isinstance(getattr(ffn.experts[0], names[0]), LoraLinear):
            out[target] = [[getattr(expert, n) for n in names] for expert in ffn.experts]
    return out


def stacked(parts: list[list[LoraLinear]], grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """peft's (lora_A (r*E, in), lora_B (out, r*E)) of one expert target from its per-expert LoraLinears
    (or of their gradients, with grad)."""
    get = (lambda p: p.grad) if grad else (lambda p: p.detach())  # noqa: E731
    a = torch.cat([get(ms[0].lora_A) for ms in parts])  # expert e's rows e*r:(e+1)*r
    b = torch.stack([torch.cat([get(m.lora_B) for m in ms]) for ms in parts], dim=-1)  # (out, r, E)
    return a, b.reshape(b.shape[0], -1)


def unstack_into(parts: list[list[LoraLinear]], a: torch.Tensor, b: torch.Tensor) -> None:
    """Copy peft's lora_A (r*E, in) and lora_B (out, r*E) of one expert target into its per-expert
    LoraLinears (shapes checked by the caller: those stacked() gives)."""
    n = len(parts)
    b = b.reshape(b.shape[0], -1, n)
    with torch.no_grad():
        for e, (a_e, ms) in enumerate(zip(a.reshape(n, -1, a.shape[-1]), parts)):
            ms[0].lora_A.copy_(a_e)  # the parts share it
            for m, rows in zip(ms, b[:, :, e].split([m.lora_B.shape[0] for m in ms])):
                m.lora_B.copy_(rows)
