"""Adafactor whose ``lr`` is the step size, so the Trainer's learning rate and schedulers mean what they say.

Shazeer & Stern (2018): for a matrix, keep only the row and column means of the squared gradient
(``exp_avg_sq_row``, ``exp_avg_sq_col``: n + m numbers instead of n * m) and rebuild the second moment as
their outer product. transformers' ``Adafactor`` and ``torch.optim.Adafactor`` both scale the step by the
parameter's RMS by default (``scale_parameter`` / relative step), so a Trainer learning rate of 5e-5 is
silently not the step size; here it is (transformers' ``scale_parameter=False, relative_step=False``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..options import check_group, check_hyperparams, start_step

__all__ = ["Adafactor"]

_FP32_MAX = torch.finfo(torch.float32).max
_SQRT_FP32_MAX = 2.0**64 * (1 - 2.0**-24)  # the largest fp32 whose square is finite in fp32


class Adafactor(torch.optim.Optimizer):
    """Factored-second-moment optimizer; fp32 statistics, any parameter dtype.

    Finite gradients keep the state and the weights finite, also where a gradient's square is beyond fp32
    (|g| >= 2**64): squares are scaled before they are summed, and a statistic beyond fp32 is held at the
    largest float; a vector's gradient elements beyond 2**64 count as +-2**64. The gradients themselves
    are never written to.

    Args:
        params: parameters or param groups (each parameter once).
        lr: step size (the update's RMS is clipped to ``clip_threshold`` before ``lr`` multiplies it).
        weight_decay: decoupled decay, ``p -= lr * weight_decay * p``.
        beta1: first-moment decay; None keeps no first moment (least memory).
        decay_rate: second-moment decay ``beta2_t = 1 - t ** decay_rate`` (the paper's -0.8).
        clip_threshold: RMS bound of the normalised update.
        eps: added to squared gradients (transformers' ``eps[0]``).
    """

    def __init__(self, params, *, lr: float = 1e-3, weight_decay: float = 0.0, beta1: float | None = None,
                 decay_rate: float = -0.8, clip_threshold: float = 1.0, eps: float = 1e-30):
        defaults = dict(lr=lr, weight_decay=weight_decay, beta1=beta1, decay_rate=decay_rate,
                        clip_threshold=clip_threshold, eps=eps)
        check_group(None, defaults, "Adafactor", _check_family_keys)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        """As torch's, after :func:`..options.check_group` (hyperparameters, maximize, parameters listed twice)."""
        super().add_param_group(check_group(self, param_group, "Adafactor", _check_family_keys))

    def __setstate__(self, state: dict) -> None:
        # torch accepts a Python number as a saved ``step`` (older checkpoints): make it the tensor step() uses
        super().__setstate__(state)
        for per_param in self.state.values():
            if "step" in per_param and not torch.is_tensor(per_param["step"]):
                per_param["step"] = torch.tensor(float(per_param["step"]), dtype=torch.float32)

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
        loss = start_step(self, closure, "Adafactor")  # closure, then sparse gradients refused: nothing half-done
        todo = [(p, group) for group in self.param_groups for p in group["params"] if p.grad is not None]
        for p, group in todo:
            state = self.state[p] if self.state[p] else self._init_state(p, group["beta1"])
            _adafactor_step(p, p.grad, state, group)
        return loss


def _check_family_keys(group: dict) -> None:
    """Adafactor's own keys (:func:`..options.check_group` checks lr, eps, weight_decay and maximize)."""
    beta1 = group["beta1"]
    if beta1 is not None:
        check_hyperparams(lr=group["lr"], betas=(beta1, 0.0))
    if not group["decay_rate"] < 0:
        raise ValueError(f"Invalid decay_rate={group['decay_rate']!r}: it must be negative "
                         f"(beta2_t = 1 - t**decay_rate)")
    if not group["clip_threshold"] > 0:
        raise ValueError(f"Invalid clip_threshold={group['clip_threshold']!r}: it must be > 0")


def _adafactor_step(p: Tensor, grad: Tensor, state: dict, group: dict) -> None:
    state["step"] += 1
    w = state["step"].item() ** group["decay_rate"]  # 1 - beta2_t: the weight of this step's squared gradient
    eps = group["eps"]
    # one fp32 scratch tensor: the squared gradient, then the update; ``grad`` is only read
    buf = torch.empty(p.shape, dtype=torch.float32, device=p.device)
    if "exp_avg_sq_row" in state:
        row, col = state["exp_avg_sq_row"], state["exp_avg_sq_col"]
        n, m = p.shape[-2], p.shape[-1]
        k = max(n, m)
        # g * g / k, scaled before the square completes: no sum below overflows unless the mean it gives does,
        # and a mean beyond fp32 (|g| near fp32's max) is held at fp32's max instead of becoming inf
        _scaled_copy(buf, grad, 1.0 / k).mul_(grad)
        row.lerp_(buf.sum(dim=-1).mul_(k / m).add_(eps).clamp_(max=_FP32_MAX), w)
        col.lerp_(buf.sum(dim=-2).mul_(k / n).add_(eps).clamp_(max=_FP32_MAX), w)
        # v ~ outer(row, col) / mean(row): the rank-1 estimate that minimises the I-divergence
        row_mean = row.div(n).sum(dim=-1, keepdim=True).clamp_(max=_FP32_MAX)
        r = row.div(row_mean).rsqrt_().unsqueeze(-1)
        update = torch.mul(grad, r, out=buf).mul_(col.rsqrt().unsqueeze(-2))  # (g * r) * c stays finite
    else:  # vectors are small: clamp the gradient so that its square, and so g / sqrt(v), stay exact
        g = _scaled_copy(buf, grad, 1.0).clamp_(-_SQRT_FP32_MAX, _SQRT_FP32_MAX)
        v = state["exp_avg_sq"].lerp_(g.square().add_(eps), w)
        update = g.mul_(v.rsqrt())
    scale = 1.0 / max(_rms(update) / group["clip_threshold"], 1.0)
    lr, decay = group["lr"], 1.0 - group["lr"] * group["weight_decay"]
    if group["beta1"] is not None:
        if scale != 1.0:
            update.mul_(scale)
        update, scale = state["exp_avg"].lerp_(update, 1.0 - group["beta1"]), 1.0
    if p.dtype == torch.float32:
        if decay != 1.0:
            p.mul_(decay)
        p.add_(update, alpha=-lr * scale)
    else:  # low-precision params: do the arithmetic in fp32 (in the scratch tensor) and round once
        torch.mul(update, -lr * scale, out=buf).add_(p, alpha=decay)
        p.copy_(buf)


def _scaled_copy(out: Tensor, grad: Tensor, factor: float) -> Tensor:
    """``out = factor * grad`` in fp32 (a low-precision gradient is widened first, not multiplied in its dtype)."""
    if grad.dtype == torch.float32:
        return torch.mul(grad, factor, out=out)
    out.copy_(grad)
    return out.mul_(factor) if factor != 1.0 else out


def _rms(update: Tensor) -> float:
    """Root mean square of ``update`` (a contiguous fp32 tensor), exact also where the squares overflow fp32."""
    flat = update.view(-1)
    sumsq = torch.dot(flat, flat).item()
    if math.isinf(sumsq):  # rare: some |element| >= 2**64; rescale by the largest so the squares are <= 1
        top = flat.abs().max().item()
        scaled = flat / top
        sumsq = torch.dot(scaled, scaled).item() * top * top  # Python floats: double range
    return math.sqrt(sumsq / max(flat.numel(), 1))
