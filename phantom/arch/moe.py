"""Mixture-of-experts MLP: a router picks each token's top-k experts; tokens are grouped by expert.

The forward sorts the (token, choice) pairs by expert (argsort + bincount), gathers each expert's
tokens with one index_select, runs one matmul chain per expert some token routes to, and adds the
weighted outputs back with one index_add: the loop is over the experts hit, never over tokens. It
imports only torch and phantom.arch.config (phantom.arch.layers builds it into a block).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from phantom.arch.config import ModelConfig


class Gated:
    """The usual gated MLP's hidden activations: act(gate) * up."""

    def __init__(self, act: Callable):
        self.act = act

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self.act(gate) * up


class ClampedSwiGLU:
    """gpt-oss's experts' activations, as transformers' GptOssExperts computes them: the gate clamped above
    and the up projection on both sides at limit, then (up + 1) * gate * sigmoid(alpha * gate)."""

    def __init__(self, limit: float, alpha: float):
        self.limit, self.alpha = limit, alpha

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


class ClampedGated(Gated):
    """DeepSeek-V4's experts' (and shared expert's) activations, as transformers' DeepseekV4Experts: act(gate) * up,
    the gate clamped above and the up projection on both sides at limit."""

    def __init__(self, act: Callable, limit: float):
        super().__init__(act)
        self.limit = limit

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self.act(gate.clamp(max=self.limit)) * up.clamp(-self.limit, self.limit)


def expert_glu(cfg: ModelConfig, act: Callable) -> Callable:
    """The routed experts' hidden activations: gpt-oss's clamped SwiGLU where cfg.swiglu_limit is set (DeepSeek-V4's
    plain one clamped, swiglu_clamped)."""
    if cfg.swiglu_limit is None:
        return Gated(act)
    return ClampedGated(act, cfg.swiglu_limit) if cfg.swiglu_clamped else ClampedSwiGLU(cfg.swiglu_limit,
                                                                                          cfg.swiglu_alpha)


class Expert(nn.Module):
    """One gated MLP, w2(glu(w1 x, w3 x)) (glu: Gated(act), or gpt-oss's ClampedSwiGLU), named as phantom's
    dense MLP; biases on the three where bias (gpt-oss's experts)."""

    def __init__(self, dim: int, width: int, glu: Callable, device=None, dtype=None, bias: bool = False):
        super().__init__()
        self.w1 = nn.Linear(dim, width, bias=bias, device=device, dtype=dtype)  # gate
        self.w2 = nn.Linear(width, dim, bias=bias, device=device, dtype=dtype)  # down
        self.w3 = nn.Linear(dim, width, bias=bias, device=device, dtype=dtype)  # up
        self.glu = glu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.glu(self.w1(x), self.w3(x)))


@dataclass(frozen=True)
class Routing:
    """How a router turns logits into choices beyond softmax and top-k (ModelConfig's router_* fields):
    DeepSeek-V3's and GLM-4.5's sigmoid scores in groups, DeepSeek-V2's softmax in groups, a scale."""

    score: str = "softmax"  # or "sigmoid"
    groups: int = 1  # the choice is limited to the topk_groups best groups of experts...
    topk_groups: int = 1
    group_score: str = "max"  # ...ranked by their best score, or their two best summed ("top2")
    scale: float = 1.0  # routed_scaling_factor

    @classmethod
    def of(cls, cfg: ModelConfig) -> "Routing":
        return cls(cfg.router_score, cfg.router_groups, cfg.router_topk_groups, cfg.router_group_score,
                   cfg.routed_scale)


def route(logits: torch.Tensor, k: int, renormalise: bool, rule: Routing = Routing(),
          bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's top-k experts and their weights, as transformers' routers choose them: softmax over every
    expert in fp32 (or sigmoid, rule.score), the k largest, renormalised to sum to 1 where asked
    (norm_topk_prob; Mixtral always: its original top-k then softmax over the k is the same numbers), back in
    the logits' dtype. DeepSeekMoE: bias (e_score_correction_bias) is added to the scores for the choice
    alone, the choice is limited to the best groups, and the weights (the scores, unbiased) are scaled.

    Returns:
        weights (N, k) and expert ids (N, k)."""
    if rule.score in ("topk_softmax", "topk_sigmoid"):  # the k largest logits, softmax over them (gpt-oss) or sigmoid
        top, experts = torch.topk(logits, k, dim=-1)
        weights = F.softmax(top, dim=-1, dtype=torch.float32) if rule.score == "topk_softmax" else top.float().sigmoid()
        return weights.to(logits.dtype), experts
    sigmoid = rule.score in ("sigmoid", "sqrtsoftplus")  # renormalised with transformers' 1e-20 beside the sum
    scores = router_scores(logits, rule.score)
    if bias is None and rule.groups == 1:
        weights, experts = torch.topk(scores, k, dim=-1)
    else:
        choice = scores if bias is None else scores + bias.float()
        experts = torch.topk(limit_groups(choice, rule) if rule.groups > 1 else choice, k, dim=-1).indices
        weights = scores.gather(1, experts)
    if renormalise:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + (1e-20 if sigmoid else 0.0))
    if rule.scale != 1.0:
        weights = weights * rule.scale
    return weights.to(logits.dtype), experts


def router_scores(logits: torch.Tensor, score: str) -> torch.Tensor:
    """Each expert's score in fp32: sigmoid, sqrt(softplus) (DeepSeek-V4's sqrtsoftplus) or softmax of the logits."""
    if score == "sigmoid":
        return logits.float().sigmoid()
    if score == "sqrtsoftplus":
        return F.softplus(logits.float()).sqrt()
    return F.softmax(logits, dim=-1, dtype=torch.float32)


def hashed(logits: torch.Tensor, experts: torch.Tensor, rule: Routing) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V4's hash routing (DeepseekV4HashRouter): the experts each token's id names (experts (N, k), no
    choice), weighted by their scores renormalised (plus 1e-20) and scaled, as a routed choice is."""
    weights = router_scores(logits, rule.score).gather(1, experts)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * rule.scale
    return weights.to(logits.dtype), experts


def limit_groups(choice: torch.Tensor, rule: Routing) -> torch.Tensor:
    """choice (N, experts) with every expert outside each row's rule.topk_groups best groups at -inf."""
    groups = choice.view(choice.shape[0], rule.groups, -1)
    ranked = groups.topk(2, dim=-1).values.sum(-1) if rule.group_score == "top2" else groups.max(dim=-1).values
    keep = torch.zeros_like(ranked, dtype=torch.bool).scatter_(1, ranked.topk(rule.topk_groups, dim=-1).indices, True)
    return choice.masked_fill(~keep.repeat_interleave(groups.shape[-1], dim=1), float("-inf"))


def dispatch(experts: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, list[int]]:
    """The (token, choice) pairs of experts (N, k) sorted by expert: their flat indices (into N * k) and
    how many each expert has (one host sync, for the split sizes)."""
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    return order, torch.bincount(flat, minlength=n_experts).tolist()


def mix(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, modules: nn.ModuleList,
        scale_input: bool = False) -> torch.Tensor:
    """sum over each row's chosen experts of weight * expert(row) (expert(weight * row) with scale_input: Llama 4),
    x (N, dim); one call per expert hit.
    Where the experts' weights train, the others run on no rows too: their gradients are zeros, not
    None, so an optimizer decays them as it does transformers' experts (one tensor for all of them)."""
    k = experts.shape[1]
    order, counts = dispatch(experts, len(modules))
    tokens = order // k
    w = weights.reshape(-1).index_select(0, order)[:, None]
    xs = x.index_select(0, tokens)
    gathered = (xs * w.to(xs.dtype) if scale_input else xs).split(counts)
    every = torch.is_grad_enabled() and any(p.requires_grad for p in modules[0].parameters())
    outs = [modules[e](xs) for e, xs in enumerate(gathered) if counts[e] or every]
    y = torch.cat(outs) if scale_input else torch.cat(outs) * w
    return torch.zeros_like(x).index_add_(0, tokens, y.to(x.dtype))


@contextlib.contextmanager
def expert_views(moe: nn.Module):
    """While the experts run: each module attached to moe that holds something for every expert stacked
    (phantom.arch.expertlora's LoRA banks: they have `views`) takes its per-expert views once, so its
    backward is one stack of the experts' gradients, not a full-size zero tensor per expert's slice."""
    held = [m for m in moe.children() if hasattr(m, "views")]
    for m in held:
        m.current = m.views()
    try:
        yield
    finally:
        for m in held:
            m.current = None


class Router(nn.Linear):
    """The router's logits, x W^T (in fp32 where cfg.router_fp32, as DeepSeek's routers compute them), plus
    gpt-oss's bias where cfg.router_logit_bias (a parameter: it trains); and DeepSeek-V3's
    e_score_correction_bias where cfg.router_bias: a buffer, as transformers keeps it (it moves the choice
    alone, so no gradient reaches it and full finetuning leaves it as it is)."""

    def __init__(self, cfg: ModelConfig, device=None, dtype=None, hashed: bool = False):
        super().__init__(cfg.dim, cfg.n_experts, bias=cfg.router_logit_bias, device=device, dtype=dtype)
        self.fp32 = cfg.router_fp32
        if hashed:  # DeepSeek-V4's hashed layer: each token id's experts, as two base-256 digits (config.py)
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, cfg.experts_per_token, 2, device=device,
                                                        dtype=dtype))
        if cfg.router_bias and not hashed:
            self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_experts, device=device, dtype=dtype))
        else:
            self.e_score_correction_bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp32:
            return F.linear(x.float(), self.weight.float(), None if self.bias is None else self.bias.float())
        return F.linear(x, self.weight, self.bias)


class MoeFeedForward(nn.Module):
    """The block's MLP as a mixture of experts (cfg.n_experts), with a shared expert every token runs when
    cfg.shared_expert_dim is set (gated by a sigmoid as Qwen2-MoE's, or not as DeepSeek's). With
    `router_loss` set (RouterLoss.attach), the router's load-balancing loss sees its logits and adds its
    gradient to them."""

    def __init__(self, cfg: ModelConfig, act: Callable, device=None, dtype=None, layer: int | None = None):
        super().__init__()
        self.k, self.renormalise, self.rule = cfg.experts_per_token, cfg.norm_topk_prob, Routing.of(cfg)
        self.interleaved = cfg.interleaved_experts  # how peft's LoRA on gate_up_proj orders gate's and up's rows
        self.takes_carry = layer in cfg.hash_layers  # hashed: the experts come from the carried token ids
        self.gate = Router(cfg, device, dtype, hashed=self.takes_carry)
        glu = expert_glu(cfg, act)
        self.experts = nn.ModuleList(Expert(cfg.dim, cfg.expert_dim, glu, device, dtype, cfg.expert_bias)
                                     for _ in range(cfg.n_experts))
        self.shared_expert = self.shared_expert_gate = None
        if cfg.shared_expert_dim:
            self.shared_expert = Expert(cfg.dim, cfg.shared_expert_dim, glu if cfg.swiglu_clamped else Gated(act),
                                        device, dtype)
            if cfg.shared_expert_gate:
                self.shared_expert_gate = nn.Linear(cfg.dim, 1, bias=False, device=device, dtype=dtype)
        self.router_loss: RouterLoss | None = None
        self.observer: Callable[[torch.Tensor], None] | None = None  # sees each forward's choices (N, k)

    def route(self, x: torch.Tensor, carry: dict | None = None) -> torch.Tensor:
        """The experts each row of x (N, dim) routes to, (N, k), without autograd or the router loss:
        what a routed read of the block must fetch before the experts run."""
        with torch.no_grad():
            return self.choose(self.gate(x), carry)[1]

    def choose(self, logits: torch.Tensor, carry: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if self.takes_carry:
            return hashed(logits, self.hashed_experts(carry), self.rule)
        return route(logits, self.k, self.renormalise, self.rule, self.gate.e_score_correction_bias)

    def hashed_experts(self, carry: dict | None) -> torch.Tensor:
        """(N, k): the experts tid2eid names for each carried token id (its two base-256 digits)."""
        if carry is None or "input_ids" not in carry:
            raise ValueError("a hash-routed layer needs the batch's token ids (carry['input_ids'])")
        digits = self.gate.tid2eid[carry["input_ids"].reshape(-1).to(self.gate.tid2eid.device)].long()
        return digits[..., 0] * 256 + digits[..., 1]

    def forward(self, x: torch.Tensor, carry: dict | None = None) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # (N, dim)
        logits = self.gate(flat)  # (N, n_experts)
        if self.router_loss is not None and not self.takes_carry:  # transformers' loss sees the top-k routers alone
            logits = _RouterGrad.apply(logits, self.router_loss)
        weights, chosen = self.choose(logits, carry)
        if self.observer is not None:
            self.observer(chosen)
        with expert_views(self):
            out = mix(flat, weights, chosen, self.experts, self.rule.score == "topk_sigmoid")
        if self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        elif self.shared_expert is not None:
            out = out + self.shared_expert(flat)
        return out.view(x.shape)


class RouterLoss:
    """One step's load-balancing loss over every MoE layer, times cfg.router_aux_coef, as transformers adds
    it with output_router_logits (load_balancing_loss below, no attention mask), for streamed blocks too.

    aux = E * sum_e (C_e / R) * (P_e / R): C_e the top-k choices of expert e and P_e its router
    probabilities summed over every layer's R rows. The forward counts them as each block runs (its
    first pass; a recomputation in the backward does not count again); term() gives the loss's value
    and records the upstream gradient it gets, and each router's backward adds that gradient times
    d aux / d logits = p * (v - sum_e p_e v_e), v = coef * E * C / R^2 (the counts are not differentiable)."""

    def __init__(self, cfg: ModelConfig, device):
        self.n, self.k, self.coef = cfg.n_experts, cfg.experts_per_token, cfg.router_aux_coef
        self.counts = torch.zeros(self.n, dtype=torch.float32, device=device)
        self.probs = torch.zeros_like(self.counts)
        self.rows, self.frozen, self.scale = 0, False, None

    @classmethod
    def attach(cls, layers: nn.ModuleList, cfg: ModelConfig, device, on: bool = True) -> "RouterLoss | None":
        """A fresh loss bound to every MoE layer of layers; None (and none bound) where not on or cfg has
        no experts or no coefficient."""
        loss = cls(cfg, device) if on and cfg.n_experts and cfg.router_aux_coef else None
        for block in layers:
            if isinstance(block.feed_forward, MoeFeedForward):
                block.feed_forward.router_loss = loss
        return loss

    def observe(self, logits: torch.Tensor) -> None:
        if not self.frozen:
            p = F.softmax(logits.detach().float(), dim=-1)
            self.counts += torch.bincount(torch.topk(p, self.k, dim=-1).indices.reshape(-1), minlength=self.n)
            self.probs += p.sum(0)
            self.rows += p.shape[0]

    def term(self, h: torch.Tensor) -> torch.Tensor:
        """coef * aux as a scalar of the graph (h: any tensor of it); the counting stops here."""
        self.frozen = True
        return _AuxTerm.apply(h, self)

    def value(self) -> torch.Tensor:
        return self.coef * self.n * torch.sum((self.counts / self.rows) * (self.probs / self.rows))

    def grad(self, logits: torch.Tensor) -> torch.Tensor:
        p = F.softmax(logits.float(), dim=-1)
        v = self.coef * self.n * self.counts / self.rows ** 2
        return (self.scale * p * (v - (p * v).sum(-1, keepdim=True))).to(logits.dtype)


class _RouterGrad(torch.autograd.Function):
    """Identity on a router's logits that counts them forward and adds the router loss's gradient backward."""

    @staticmethod
    def forward(ctx, logits, loss: RouterLoss):
        loss.observe(logits)
        ctx.loss = loss
        ctx.save_for_backward(logits)
        return logits.view_as(logits)

    @staticmethod
    def backward(ctx, g):
        (logits,) = ctx.saved_tensors
        return (g if ctx.loss.scale is None else g + ctx.loss.grad(logits)), None


class _AuxTerm(torch.autograd.Function):
    """The loss's value as a node after the blocks: autograd runs its backward before theirs (it is newer),
    so it hands them the upstream gradient (a caller's loss scaling included)."""

    @staticmethod
    def forward(ctx, h, loss: RouterLoss):
        ctx.loss = loss
        return loss.value()

    @staticmethod
    def backward(ctx, g):
        ctx.loss.scale = g
        return None, None


def load_balancing_loss(router_logits: list[torch.Tensor], n_experts: int, k: int) -> torch.Tensor:
    """Switch Transformer's auxiliary loss over the MoE layers' router logits (each (N, n_experts)), as
    transformers' load_balancing_loss_func computes it without an attention mask: n_experts times the
    sum over experts of (the share of top-k choices it gets) * (its mean router probability), both
    averaged over every layer's rows."""
    chosen = torch.zeros(n_experts, dtype=torch.float32, device=router_logits[0].device)
    probs = torch.zeros_like(chosen)
    rows = 0
    for logits in router_logits:
        p = F.softmax(logits.float(), dim=-1)
        top = torch.topk(p, k, dim=-1).indices
        chosen = chosen + torch.bincount(top.reshape(-1), minlength=n_experts).float()
        probs = probs + p.sum(0)
        rows += logits.shape[0]
    return n_experts * torch.sum((chosen / rows) * (probs / rows))


def expert_ranges(specs, n_experts: int) -> list[list[int]]:
    """[start, end) of each expert's weights in a block file's data section (specs: its TensorSpecs), so a
    reader can fetch one expert's bytes alone; raises ValueError where an expert's tensors are not back
    to back (a file phantom did not lay out)."""
    spans: dict[int, list[tuple[int, int]]] = {}
    for s in specs:
        parts = s.name.split(".")
        if parts[:2] == ["feed_forward", "experts"]:
            spans.setdefault(int(parts[2]), []).append((s.start, s.end))
    out = []
    for e in range(n_experts):
        pieces = sorted(spans.get(e, []))
        if not pieces or any(a[1] != b[0] for a, b in zip(pieces, pieces[1:])):
            raise ValueError(f"expert {e}'s tensors are not contiguous in the block file")
        out.append([pieces[0][0], pieces[-1][1]])
    return out
