"""LoRA on a mixture of experts' experts, in the layout peft gives transformers 5's 3-D expert tensors.

peft (0.21, `target_parameters`, its ParamWrapper) puts one LoRA on each stacked expert tensor of
Qwen3-MoE, Qwen2-MoE, Mixtral and OLMoE: `mlp.experts.gate_up_proj` (E, 2*width, dim) and
`mlp.experts.down_proj` (E, dim, width). For a tensor (E, out, in) its lora_A is Linear(in, r*E), rows
e*r:(e+1)*r expert e's A; its lora_B is Linear(r*E, out), read as (out, r, E): column j*E + e is expert
e's rank-j column; expert e's update is scaling * B_e @ A_e. Phantom holds those two tensors as they are
(ExpertLoraBank, one per layer and tensor: an optimizer sees peft's parameters) and keeps each expert as
modules (experts.E.w1/w2/w3, swapped in by name when streamed): each is an ExpertLora computing with its
views of the bank, gate (w1) and up (w3), the two halves of gate_up_proj's rows (gpt-oss: its even and odd
rows, as its gate and up alternate), sharing expert e's A.

Where both tensors are adapted peft nests its wrappers in the order it meets the parameters (gate_up_proj
first): gate_up_proj's LoRA is then `mlp.experts.base_layer`, down_proj's `mlp.experts`; alone, either is
`mlp.experts`. Imports arch only.

Llama 4's experts are `feed_forward.experts.gate_up_proj` (E, dim, 2*width) and `down_proj` (E, width, dim): in
before out, and its module does not say so (transformers' `is_transposed`), so peft swaps the two sides: its A is
Linear(out, r*E) and its B Linear(r*E, in), and expert e's delta of the stored (in, out) tensor is B_e @ A_e. As a
Linear's (out, in) weight that delta is A_e^T @ B_e^T: the bank of such a family (`ExpertNames.swapped`) serves
B_e^T as the A the expert computes with and A_e^T as its B.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from typing import NamedTuple

from phantom.arch.layers import LoraLinear
from phantom.arch.moe import MoeFeedForward

# target name -> (transformers' parameter of the experts, the per-expert modules it stacks, in row order)
EXPERT_PARAMS = {"experts_gate_up": ("gate_up_proj", ("w1", "w3")), "experts_down": ("down_proj", ("w2",))}


class ExpertNames(NamedTuple):
    """Where a family's stacked expert tensors are inside a layer, and whether peft swaps their sides."""
    module: str = "mlp.experts"
    swapped: bool = False  # (E, in, out) tensors whose module does not say is_transposed (Llama 4)


EXPERT_MODULES = ("mlp.experts", "feed_forward.experts")  # every family's (ExpertNames.module)


def peft_parameter(target: str, module: str = "mlp.experts") -> str:
    """peft's target_parameters entry of an expert target: "experts_gate_up" -> "mlp.experts.gate_up_proj"."""
    return f"{module}.{EXPERT_PARAMS[target][0]}"


def target_of(parameter) -> str | None:
    """The expert target a target_parameters entry names (peft matches it at the end of the parameter's
    name: "gate_up_proj", "experts.gate_up_proj", "mlp.experts.gate_up_proj"); None for anything else."""
    for target in EXPERT_PARAMS:
        for module in EXPERT_MODULES:
            full = peft_parameter(target, module)
            if isinstance(parameter, str) and (parameter == full or full.endswith(f".{parameter}")):
                return target
    return None


def peft_wrappers(targets, module: str = "mlp.experts") -> dict[str, str]:
    """{expert target: the module peft's LoRA of it is, inside a layer} for the adapted ones of targets:
    nested in EXPERT_PARAMS' order, the last one outermost (`mlp.experts`)."""
    adapted = [t for t in EXPERT_PARAMS if t in targets]
    return {t: module + ".base_layer" * (len(adapted) - 1 - n) for n, t in enumerate(adapted)}


def bank_wrappers(banks: dict) -> dict[str, str]:
    """peft_wrappers of a block's banks ({expert target: ExpertLoraBank}), inside the module they name."""
    return peft_wrappers(banks, next(iter(banks.values())).names.module) if banks else {}


class ExpertLoraBank(nn.Module):
    """One expert tensor's LoRA for every expert of a layer, held as peft holds it: lora_A (r*E, in) and
    lora_B (out, r*E), B's columns read as (out, r, E) (swapped: lora_A (r*E, out), lora_B (in, r*E)). Two
    parameters a layer, as peft's, so an optimizer keeps peft's state and an expert no token routes to gets
    zero rows of one gradient, as in peft."""

    def __init__(self, n_experts: int, d_in: int, d_out: int, rank: int, alpha: float, rslora: bool,
                 generator: torch.Generator, names: ExpertNames = ExpertNames()):
        super().__init__()
        self.n_experts, self.rank, self.scale = n_experts, rank, alpha / (math.sqrt(rank) if rslora else rank)
        self.names, self.swapped = names, names.swapped
        a_in, b_out = (d_out, d_in) if self.swapped else (d_in, d_out)  # peft's Linear(a_in, r*E), Linear(r*E, b_out)
        self.lora_A = nn.Parameter(torch.empty(rank * n_experts, a_in))
        bound = 1 / math.sqrt(a_in)  # kaiming_uniform_(a=sqrt(5)) of peft's Linear(a_in, r*E), as LoraLinear's A
        with torch.no_grad():
            self.lora_A.uniform_(-bound, bound, generator=generator)
        self.lora_B = nn.Parameter(torch.zeros(b_out, rank * n_experts))
        self.current: tuple | None = None  # views() while the layer's experts run (phantom.arch.moe.expert_views)

    def views(self) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """Every expert's A (r, in) and B (out, r) as it computes with them, as two unbinds (each one node of
        the graph)."""
        a = self.lora_A.view(self.n_experts, self.rank, -1)
        b = self.lora_B.view(self.lora_B.shape[0], self.rank, self.n_experts)
        if self.swapped:
            return b.permute(2, 1, 0).unbind(0), a.transpose(1, 2).unbind(0)
        return a.unbind(0), b.unbind(2)

    def a(self, expert: int) -> torch.Tensor:
        if self.current is not None:
            return self.current[0][expert]
        if self.swapped:
            return self.lora_B.view(self.lora_B.shape[0], self.rank, self.n_experts)[:, :, expert].T
        return self.lora_A[expert * self.rank:(expert + 1) * self.rank]

    def b(self, expert: int, rows: slice) -> torch.Tensor:
        if self.current is not None:
            return self.current[1][expert][rows]
        if self.swapped:
            return self.lora_A[expert * self.rank:(expert + 1) * self.rank, rows].T
        return self.lora_B.view(self.lora_B.shape[0], self.rank, self.n_experts)[rows, :, expert]


class ExpertLora(LoraLinear):
    """Expert `expert`'s module (w1, w2 or w3) with its slices of a bank as A and B: views, so gradients reach
    the bank (those moe.expert_views took for the forward, else sliced at each use, as the export's delta
    weights); its `rows` of the bank's out side (gate: the first half of gate_up_proj's)."""

    def __init__(self, base: nn.Linear, bank: ExpertLoraBank, expert: int, rows: slice):
        nn.Module.__init__(self)
        self.weight = base.weight
        self.weight.requires_grad_(False)
        self.bias = base.bias  # frozen with the weight (gpt-oss's experts), or None
        if self.bias is not None:
            self.bias.requires_grad_(False)
        self.rank, self.scale, self.expert, self.rows = bank.rank, bank.scale, expert, rows
        object.__setattr__(self, "bank", bank)  # not a submodule: the block holds it once (feed_forward.lora_*)
        self.dropout = nn.Identity()

    @property
    def lora_A(self) -> torch.Tensor:
        return self.bank.a(self.expert)

    @property
    def lora_B(self) -> torch.Tensor:
        return self.bank.b(self.expert, self.rows)


def apply_expert_lora(moe: MoeFeedForward, target: str, rank: int, alpha: float, rslora: bool,
                      generator: torch.Generator, where: ExpertNames = ExpertNames()) -> None:
    """Give every expert of moe its slices of one new bank on target's modules (in place); the bank is
    moe.lora_<target>."""
    parts = EXPERT_PARAMS[target][1]
    first = getattr(moe.experts[0], parts[0])
    d_out = first.out_features * len(parts)
    if rank > max(first.in_features, d_out):
        raise ValueError(f"LoRA rank {rank} of {peft_parameter(target, where.module)} exceeds both sides of each "
                         f"expert's {d_out}x{first.in_features} weight")
    bank = ExpertLoraBank(len(moe.experts), first.in_features, d_out, rank, alpha, rslora, generator, where)
    setattr(moe, f"lora_{target}", bank)
    for e, expert in enumerate(moe.experts):
        for n, name in enumerate(parts):
            width = getattr(expert, name).out_features
            rows = slice(n, None, len(parts)) if moe.interleaved else slice(n * width, (n + 1) * width)
            setattr(expert, name, ExpertLora(getattr(expert, name), bank, e, rows))


def expert_banks(block: nn.Module) -> dict[str, ExpertLoraBank]:
    """{expert target: its bank} of a block's adapted experts ({} where none)."""
    ffn = getattr(block, "feed_forward", None)
    if not isinstance(ffn, MoeFeedForward):
        return {}
    return {t: bank for t in EXPERT_PARAMS if (bank := getattr(ffn, f"lora_{t}", None)) is not None}
