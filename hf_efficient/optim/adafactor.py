"""Adafactor whose ``lr`` is the step size, so the Trainer's learning rate and schedulers mean what they say.

Shazeer & Stern (2018): for a matrix, keep only the row and column means of the squared gradient
(``exp_avg_sq_row``, ``exp_avg_sq_col``: n + m numbers instead of n * m) and rebuild the second moment as
their outer product. transformers' ``Adafactor`` and ``torch.optim.Adafactor`` both scale the step by the
parameter's RMS by default (``scale_parameter`` / relative step), so a Trainer learning rate of 5e-5 is
silently not the step size; here it is (transformers' ``scale_parameter=False, relative_step=False``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..options import check_hyperparams

__all__ = ["Adafactor"]


class Adafactor(torch.optim.Optimizer):
    """Factored-second-moment optimizer; fp32 statistics, any parameter dtype.

    Args:
        params: parameters or param groups.
        lr: step size (the update's RMS is clipped to ``clip_threshold`` before ``lr`` multiplies it).
        weight_decay: decoupled decay, ``p -= lr * weight_decay * p``.
        beta1: first-moment decay; None keeps no first moment (least memory).
        decay_rate: second-moment decay ``beta2_t = 1 - t ** decay_rate`` (the paper's -0.8).
        clip_threshold: RMS bound of the normalised update.
        eps: (added to squared gradients, unused floor kept for parity with transformers).
    """

    def __init__(self, params, *, lr: float = 1e-3, weight_decay: float = 0.0, beta1: float | None = None,
                 decay_rate: float = -0.8, clip_threshold: float = 1.0, eps: float = 1e-30):
        check_hyperparams(lr=lr, betas=None if beta1 is None else (beta1, 0.0), eps=eps, weight_decay=weight_decay)
        if not decay_rate < 0:
            raise ValueError(f"Invalid decay_rate={decay_rate!r}: it must be negative (beta2_t = 1 - t**decay_rate)")
        if not clip_threshold > 0:
            raise ValueError(f"Invalid clip_threshold={clip_threshold!r}: it must be > 0")
        defaults = dict(lr=lr, weight_decay=weight_decay, beta1=beta1, decay_rate=decay_rate,
                        clip_threshold=clip_threshold, eps=eps)
        super().__init__(params, defaults)

    def _init_state(self, p: Tensor, beta1: float | None) -> dict:
        state = self.state[p]
        state["step"] = torch.tensor(0.0)
        if p.dim() >= 2:
            state["exp_avg_sq_row"] = torch.zeros(p.shape[:-1], dtype=torch.float32, device=p.device)
            state["exp_avg_sq_col"] = torch.zeros(p.shape[:-2] + p.shape[-1:], dtype=torch.float32, device=p.device)
        else:
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
        if beta1 is not None:
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Adafactor does not support sparse gradients")
                state = self.state[p] if self.state[p] else self._init_state(p, group["beta1"])
                _adafactor_step(p, p.grad, state, group)
        return loss


def _adafactor_step(p: Tensor, grad: Tensor, state: dict, group: dict) -> None:
    state["step"] += 1
    t = state["step"].item()
    beta2t = 1.0 - t ** group["decay_rate"]
    g = grad.float()
    sq = g.square().add_(group["eps"])
    if "exp_avg_sq_row" in state:
        row, col = state["exp_avg_sq_row"], state["exp_avg_sq_col"]
        row.lerp_(sq.mean(dim=-1), 1.0 - beta2t)
        col.lerp_(sq.mean(dim=-2), 1.0 - beta2t)
        # v ~ outer(row, col) / mean(row): the rank-1 estimate that minimises the I-divergence
        r = (row / row.mean(dim=-1, keepdim=True)).rsqrt_().unsqueeze(-1)
        update = g.mul_(r).mul_(col.rsqrt().unsqueeze(-2))
    else:
        v = state["exp_avg_sq"].lerp_(sq, 1.0 - beta2t)
        update = g.mul_(v.rsqrt())
    rms = update.norm().div_(update.numel() ** 0.5)
    update.div_((rms / group["clip_threshold"]).clamp_(min=1.0))
    if group["beta1"] is not None:
        update = state["exp_avg"].lerp_(update, 1.0 - group["beta1"])
    lr = group["lr"]
    if p.dtype == torch.float32:
        if group["weight_decay"]:
            p.mul_(1.0 - lr * group["weight_decay"])
        p.add_(update, alpha=-lr)
    else:  # low-precision params: do the arithmetic in fp32 and round once
        p32 = p.float()
        if group["weight_decay"]:
            p32.mul_(1.0 - lr * group["weight_decay"])
        p.copy_(p32.add_(update, alpha=-lr))
