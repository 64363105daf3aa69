"""The model's head and loss as fused autograd Functions: final norm, output projection and
cross-entropy (or each row's log-probability of its targets), a chunk of tokens at a time, so no
(B, T, vocab) logits ever exist; and the chunk size. Apart from the model because they are maths on
hidden states and weights alone: the backends and the blocks' streaming never meet them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from phantom.arch.ops import rms_norm, softcap
from phantom.data.special_tokens import IGNORE_INDEX
from phantom.stream.memory import free_device_bytes
from phantom.stream.placement import LOSS_BYTES_PER_LOGIT, loss_budget


class ChunkedHeadLoss(torch.autograd.Function):
    """Final norm + output projection + cross-entropy, a chunk of tokens at a time.

    The forward also computes the gradient with respect to the hidden states, chunk by chunk, so no
    (B, T, vocab) tensor ever exists and the head weight is used once per step. Targets equal to
    -100 are ignored; the loss is the mean over the rest (0 if every target is ignored).
    """

    @staticmethod
    def forward(ctx, h, norm_w, out_w, targets, eps: float, chunk: int, *head):
        norm_offset, cap = head + (0.0, None)[len(head):]  # optional: the final norm's offset, the logits' soft-cap
        hf, tf = h.reshape(-1, h.shape[-1]), targets.reshape(-1)
        n_valid = (tf != IGNORE_INDEX).sum().clamp(min=1)
        wants = [ctx.needs_input_grad[0], norm_w.requires_grad, out_w.requires_grad]
        grads = [torch.zeros_like(hf) if wants[0] else None, torch.zeros_like(norm_w) if wants[1] else None,
                 torch.zeros_like(out_w) if wants[2] else None]
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for s in range(0, hf.shape[0], chunk):
            hc = hf[s:s + chunk].detach().requires_grad_(wants[0])
            with torch.enable_grad():
                logits = softcap(F.linear(rms_norm(hc, norm_w, eps, norm_offset), out_w).float(), cap)  # (chunk, vocab)
                loss = F.cross_entropy(logits, tf[s:s + chunk], ignore_index=IGNORE_INDEX, reduction="sum")
            if any(wants):
                inputs = [t for t, w in zip((hc, norm_w, out_w), wants) if w]
                gs = iter(torch.autograd.grad(loss, inputs))
                if wants[0]:
                    grads[0][s:s + chunk] = next(gs)
                for k in (1, 2):
                    if wants[k]:
                        grads[k] += next(gs)
            total += loss.detach()
        ctx.save_for_backward(*(g / n_valid if g is not None else None for g in grads))
        ctx.h_shape = h.shape
        ctx.n_args = 6 + len(head)  # backward answers each argument apply was given
        return total / n_valid

    @staticmethod
    def backward(ctx, g):
        gh, gn, go = ctx.saved_tensors
        grads = (gh.view(ctx.h_shape) * g if gh is not None else None, gn * g if gn is not None else None,
                 go * g if go is not None else None)
        return grads + (None,) * (ctx.n_args - 3)


class ChunkedHeadLogps(torch.autograd.Function):
    """Final norm + output projection + each row's summed log-probability of its targets (-100
    ignored): (B,) fp32, a chunk of tokens at a time, as ChunkedHeadLoss (no (B, T, vocab) tensor).

    The forward computes each token's gradient of its own row's sum with respect to h; the backward
    scales it by that row's upstream gradient, which is exact since a token belongs to one row. Norm
    and head weights are frozen here (LoRA): sequence scores are for preference training.
    """

    @staticmethod
    def forward(ctx, h, norm_w, out_w, targets, eps: float, chunk: int, norm_offset: float = 0.0,
                cap: float | None = None):
        if norm_w.requires_grad or out_w.requires_grad:
            raise ValueError("sequence log-probabilities need a frozen head (train a LoRA, not --mode full)")
        hf, tf = h.reshape(-1, h.shape[-1]), targets.reshape(-1)
        token_logps = torch.zeros(tf.shape, dtype=torch.float32, device=h.device)
        grad = torch.zeros_like(hf) if ctx.needs_input_grad[0] else None
        for s in range(0, hf.shape[0], chunk):
            hc = hf[s:s + chunk].detach().requires_grad_(grad is not None)
            with torch.enable_grad():
                logits = softcap(F.linear(rms_norm(hc, norm_w, eps, norm_offset), out_w).float(), cap)  # (chunk, vocab)
                lp = -F.cross_entropy(logits, tf[s:s + chunk], ignore_index=IGNORE_INDEX, reduction="none")
                total = lp.sum()
            if grad is not None:
                grad[s:s + chunk] = torch.autograd.grad(total, hc)[0]
            token_logps[s:s + chunk] = lp.detach()
        ctx.save_for_backward(grad)
        ctx.shape = targets.shape
        return token_logps.view(ctx.shape).sum(1)  # per row, in a fixed order (deterministic)

    @staticmethod
    def backward(ctx, g):
        (grad,) = ctx.saved_tensors
        B, T = ctx.shape
        gh = grad.view(B, T, -1) * g.view(B, 1, 1).to(grad.dtype)
        return gh, None, None, None, None, None, None, None


class ChunkedHeadTokenLogps(torch.autograd.Function):
    """Final norm + output projection + each token's log-probability of its target under softmax(logits /
    temperature) (-100: 0), (B, T) fp32, and each token's entropy of that softmax (no autograd), a chunk of tokens
    at a time, as ChunkedHeadLogps: the forward keeps each token's gradient of its own log-probability with
    respect to h, which the backward scales by that token's upstream gradient (exact: a log-probability depends
    on its own position's hidden state alone). What a policy-gradient loss (GRPO) needs, whose terms are not
    linear in the log-probabilities."""

    @staticmethod
    def forward(ctx, h, norm_w, out_w, targets, eps: float, chunk: int, norm_offset: float = 0.0,
                cap: float | None = None, temperature: float = 1.0):
        if norm_w.requires_grad or out_w.requires_grad:
            raise ValueError("token log-probabilities need a frozen head (train a LoRA, not --mode full)")
        hf, tf = h.reshape(-1, h.shape[-1]), targets.reshape(-1)
        logps = torch.zeros(tf.shape, dtype=torch.float32, device=h.device)
        entropy = torch.zeros(tf.shape, dtype=torch.float32, device=h.device)
        grad = torch.zeros_like(hf) if ctx.needs_input_grad[0] else None
        for s in range(0, hf.shape[0], chunk):
            hc = hf[s:s + chunk].detach().requires_grad_(grad is not None)
            with torch.enable_grad():
                logits = softcap(F.linear(rms_norm(hc, norm_w, eps, norm_offset), out_w).float(), cap) / temperature
                lp = -F.cross_entropy(logits, tf[s:s + chunk], ignore_index=IGNORE_INDEX, reduction="none")
                total = lp.sum()
            if grad is not None:
                grad[s:s + chunk] = torch.autograd.grad(total, hc)[0]
            with torch.no_grad():
                all_lp = torch.log_softmax(logits.detach(), -1)
                entropy[s:s + chunk] = -(all_lp.exp() * all_lp).sum(-1)
            logps[s:s + chunk] = lp.detach()
        ctx.save_for_backward(grad)
        ctx.shape = targets.shape
        entropy = entropy.view(ctx.shape)
        ctx.mark_non_differentiable(entropy)
        return logps.view(ctx.shape), entropy

    @staticmethod
    def backward(ctx, g, _g_entropy):
        (grad,) = ctx.saved_tensors
        B, T = ctx.shape
        return (grad.view(B, T, -1) * g.view(B, T, 1).to(grad.dtype),) + (None,) * 8


def head_logits(h: torch.Tensor, norm_w: torch.Tensor, out_w: torch.Tensor, cfg) -> torch.Tensor:
    """Final norm, output projection and soft-cap of hidden states h (..., dim): fp32 logits (generation's
    last position; training never forms them)."""
    return softcap(F.linear(rms_norm(h, norm_w, cfg.norm_eps, cfg.norm_offset), out_w).float(), cfg.final_softcap)


def default_loss_chunk(vocab_size: int, device: torch.device) -> int:
    """Tokens per chunk of the fused head + loss: ~64 MB of fp32 logits on a CPU; on CUDA a chunk whose
    peak (LOSS_BYTES_PER_LOGIT: ~4.5x its fp32 logits) takes phantom.stream.placement.loss_budget, an eighth
    of free memory (at most 2 GiB), so a 128k vocabulary runs a few large matmuls, not hundreds of thin
    ones. The model keeps that peak out of the blocks' device budget (device_reserve)."""
    if device.type == "cuda":
        return max(16, loss_budget(free_device_bytes(device)) // (LOSS_BYTES_PER_LOGIT * vocab_size))
    return max(16, (64 << 20) // (4 * vocab_size))
