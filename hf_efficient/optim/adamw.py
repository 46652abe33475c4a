"""AdamW with fp32 moments for bf16 / fp16 weights, whose updates are not lost to rounding.

``torch.optim.AdamW`` on a bf16 model keeps bf16 moments and rounds each new weight to nearest: an update below half
a bf16 ulp of its weight is lost (stale weights). Here the step runs on an fp32 copy of each low-precision weight
(torch's own kernel: fused on CPU and CUDA) with fp32 moments, and the new weight is written by
:func:`.compensation.write` (``compensation``: kahan, stochastic or none). fp32 weights get torch's AdamW as is.
State per low-precision parameter: ``exp_avg``, ``exp_avg_sq`` (fp32, 8 bytes) and, under kahan, ``kahan_comp``
(bf16, 2 bytes), against 4 + 8 for an fp32 master copy with fp32 moments.

On CPU, bf16 weights (fp32 or bf16 gradients, no amsgrad or maximize) go through a C kernel instead
(``adamw_cpu.c``, the op ``hf_efficient::adamw_step``): torch's fused step and the compensated write in one pass over
the tensors, no copy. It gives the torch path's bits (torch 2.13, x86), and must agree with it on a probe before
it is used. 8-bit AdamW's fp32-state tensors (biases, norms) take this path too.
"""

from __future__ import annotations

import math
from array import array

import torch
from torch import Tensor
from torch.optim.adamw import adamw as _torch_adamw

from ..options import check_saved, start_step
from . import _dispatch
from .compensation import LOW_PRECISION, check_compensation, drop_unused_buffers, step_in_fp32, weight_key

__all__ = ["AdamW", "adamw_fp32_state"]


def adamw_fp32_state(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, *, lr, beta1, beta2, eps,
                     weight_decay, amsgrad: bool = False, maximize: bool = False, compensation: str = "none",
                     comps=None, keys=None, c_kernel: bool = True) -> None:
    """torch's own AdamW (fused on CPU and CUDA) on fp32 moments; weights of other dtypes are stepped as fp32 copies
    and written back by :func:`.compensation.step_in_fp32` (``comps``: each tensor's Kahan buffer or None; ``keys``:
    each tensor's noise key), bf16 weights on CPU by the C kernel where it applies (``_KERNEL.split``; ``c_kernel``
    False: never). Increments ``steps``."""
    comps = [None] * len(params) if comps is None else comps
    keys = [0] * len(params) if keys is None else keys
    states = list(zip(exp_avgs, exp_avg_sqs))
    native, rest = ([], None) if not c_kernel or amsgrad or maximize or torch.is_tensor(lr) else _KERNEL.split(
        params, grads, states, comps, compensation)
    if native:
        pick = lambda xs, idx: [xs[i] for i in idx]  # noqa: E731
        torch._foreach_add_(pick(steps, native), 1)
        coef, by_step = [], {}  # the tensors of a group mostly share their step: its scalars computed once
        for i in native:
            step = int(steps[i].item())
            if step not in by_step:
                by_step[step] = _c_coefficients(step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                                                weight_decay=weight_decay)
            coef += by_step[step]
        _KERNEL(pick(params, native), pick(grads, native), pick(states, native), pick(comps, native),
                pick(keys, native), coef, compensation)
        if not rest:
            return
        params, grads, exp_avgs, exp_avg_sqs, steps, comps, keys = (
            pick(xs, rest) for xs in (params, grads, exp_avgs, exp_avg_sqs, steps, comps, keys))
    _torch_path(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr=lr, beta1=beta1, beta2=beta2,
                eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize, compensation=compensation,
                comps=comps, keys=keys)


def _torch_path(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, *, lr, beta1, beta2, eps, weight_decay,
                amsgrad, maximize, compensation, comps, keys) -> None:
    """:func:`adamw_fp32_state` with torch's kernels: fp32 weights in place, the others through fp32 copies."""
    def step(idx, ps):
        pick = lambda xs: [xs[i] for i in idx]  # noqa: E731
        gs = [grads[i] if grads[i].dtype == torch.float32 else grads[i].float() for i in idx]
        fused = all(p.device.type == "cpu" for p in ps)  # CUDA's fused kernel wants its steps on the GPU
        _torch_adamw(ps, gs, pick(exp_avgs), pick(exp_avg_sqs), pick(max_exp_avg_sqs) if amsgrad else [],
                     pick(steps), foreach=None if fused else False, fused=fused, amsgrad=amsgrad, beta1=beta1,
                     beta2=beta2, lr=lr, weight_decay=weight_decay, eps=eps, maximize=maximize)

    step_in_fp32(params, step, compensation, comps, keys)


# ----------------------------------------------------------------------------------------------------
# The C kernel (bf16 weights on CPU), cached, probed and published by :mod:`._dispatch`
# ----------------------------------------------------------------------------------------------------

def _c_coefficients(step: int, *, lr, beta1, beta2, eps, weight_decay) -> list[float]:
    """The C kernel's scalars for ``step`` (see ``adamw_cpu.c``): computed in double, as torch's fused CPU kernel
    computes them, then rounded to fp32 once."""
    lerp = array("f", [1.0 - beta1])[0]
    toward_m = abs(lerp) < 0.5  # torch's lerp: from the moment's side for small weights, else from the gradient's
    raw = [lerp if toward_m else lerp - 1.0, float(toward_m), beta2, 1.0 - beta2, math.sqrt(1.0 - beta2**step), eps,
           1.0 - lr * weight_decay, -(lr / (1.0 - beta1**step))]
    return array("f", raw).tolist()  # each rounded to fp32 once


_PROBE = dict(lr=2e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)  # the probe's step 3


def _probe_reference(params, grads, states, comps, keys, mode: str) -> None:
    _torch_path(params, grads, [m for m, _ in states], [v for _, v in states], [],
                [torch.tensor(2.0) for _ in params], amsgrad=False, maximize=False, compensation=mode, comps=comps,
                keys=keys, **_PROBE)


_KERNEL = _dispatch.Bf16WeightKernel("adamw_step", "adamw_cpu.c", "adamw_step", _probe_reference, (1e-3, 1e-4),
                                     lambda: _c_coefficients(3, **_PROBE))


class AdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` (its groups, flags and state keys) with fp32 moments and a compensated write for
    bf16/fp16 weights; see the module docstring. ``compensation``: ``"kahan"`` (default), ``"stochastic"`` or
    ``"none"`` (round to nearest: torch's stale weights, with fp32 moments)."""

    def __init__(self, params, *, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, maximize: bool = False,
                 compensation: str = "kahan"):
        check_compensation(compensation)
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         maximize=maximize)
        self.defaults["compensation"] = compensation
        for group in self.param_groups:
            group.setdefault("compensation", compensation)

    def add_param_group(self, param_group: dict) -> None:
        check_compensation(param_group.get("compensation", self.defaults.get("compensation", "kahan")))
        super().add_param_group(param_group)

    def _init_state(self, p: Tensor, group: dict) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            keys = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ())
            for key in keys:
                state[key] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
        if group["compensation"] == "kahan" and p.dtype in LOW_PRECISION and "kahan_comp" not in state:
            state["kahan_comp"] = torch.zeros_like(p, dtype=torch.bfloat16, memory_format=torch.preserve_format)
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """As torch's, but moments stay fp32 (torch casts them to the parameter's dtype) and Kahan buffers bf16;
        a buffer no tensor uses any more is dropped (:func:`.compensation.drop_unused_buffers`)."""
        check_saved(self, state_dict, "AdamW")
        super().load_state_dict(state_dict)
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        for i, p in zip(saved_ids, (p for g in self.param_groups for p in g["params"])):
            saved, state = state_dict["state"].get(i, {}), self.state[p]
            for key, value in saved.items():
                if key != "step" and key in state and torch.is_tensor(value):
                    state[key] = value.to(device=p.device,
                                          dtype=torch.bfloat16 if key == "kahan_comp" else torch.float32)
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].to(torch.float32)
        drop_unused_buffers(self, "AdamW")

    @torch.no_grad()
    def step(self, closure=None):
        loss = start_step(self, closure, "AdamW")  # closure, then sparse gradients refused: nothing half-done
        position = 0  # a parameter's index across groups, as in state_dict(): its stochastic-rounding stream
        for group in self.param_groups:
            items = []
            for p in group["params"]:
                position += 1
                if p.grad is not None:
                    state = self._init_state(p, group)
                    items.append((p, state, weight_key(position - 1, int(state["step"].item()) + 1)))
            if not items:
                continue
            states = [st for _, st, _ in items]
            beta1, beta2 = group["betas"]
            adamw_fp32_state([p for p, _, _ in items], [p.grad for p, _, _ in items],
                             [st["exp_avg"] for st in states], [st["exp_avg_sq"] for st in states],
                             [st.get("max_exp_avg_sq") for st in states], [st["step"] for st in states],
                             lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                             weight_decay=group["weight_decay"], amsgrad=group["amsgrad"],
                             maximize=group["maximize"], compensation=group["compensation"],
                             comps=[st.get("kahan_comp") for st in states], keys=[k for _, _, k in items])
        return loss
