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

import ctypes
import math
from array import array

import torch
from torch import Tensor
from torch.optim.adamw import adamw as _torch_adamw

from ..options import check_saved, start_step
from . import _dispatch, _native
from .compensation import (C_MODES, COMPENSATIONS, LOW_PRECISION, check_compensation, drop_unused_buffers,
                           step_in_fp32, weight_key)

__all__ = ["AdamW", "adamw_fp32_state"]


def adamw_fp32_state(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, *, lr, beta1, beta2, eps,
                     weight_decay, amsgrad: bool = False, maximize: bool = False, compensation: str = "none",
                     comps=None, keys=None) -> None:
    """torch's own AdamW (fused on CPU and CUDA) on fp32 moments; weights of other dtypes are stepped as fp32 copies
    and written back by :func:`.compensation.step_in_fp32` (``comps``: each tensor's Kahan buffer or None; ``keys``:
    each tensor's noise key), bf16 weights on CPU by the C kernel where it applies (:func:`_native_eligible`).
    Increments ``steps``."""
    comps = [None] * len(params) if comps is None else comps
    keys = [0] * len(params) if keys is None else keys
    native = [] if amsgrad or maximize or torch.is_tensor(lr) else [
        i for i in range(len(params))
        if _native_eligible(params[i], grads[i], exp_avgs[i], exp_avg_sqs[i], comps[i], compensation)]
    if native and _native_fn() is not None:
        pick = lambda xs, idx: [xs[i] for i in idx]  # noqa: E731
        torch._foreach_add_(pick(steps, native), 1)
        coef, by_step = [], {}  # the tensors of a group mostly share their step: its scalars computed once
        for i in native:
            step = int(steps[i].item())
            if step not in by_step:
                by_step[step] = _c_coefficients(step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                                                weight_decay=weight_decay)
            coef += by_step[step]
        _op([params[i].detach() for i in native], pick(grads, native), pick(exp_avgs, native),
            pick(exp_avg_sqs, native), [comps[i] for i in native if comps[i] is not None], pick(keys, native), coef,
            compensation, -1)
        rest = [i for i in range(len(params)) if i not in set(native)]
        if not rest:
            return
        params, grads, exp_avgs, exp_avg_sqs, steps, comps, keys = (
            pick(xs, rest) for xs in (params, grads, exp_avgs, exp_avg_sqs, steps, comps, keys))
        max_exp_avg_sqs = pick(max_exp_avg_sqs, rest) if amsgrad else max_exp_avg_sqs
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

_NATIVE_SOURCE, _NATIVE_SYMBOL = "adamw_cpu.c", "adamw_step"


def _native_eligible(p: Tensor, g: Tensor, m: Tensor, v: Tensor, comp: Tensor | None, compensation: str) -> bool:
    """Whether the C kernel can step ``p``: a plain contiguous bf16 CPU weight, fp32 or bf16 gradient, fp32 moments,
    and its bf16 Kahan buffer under kahan."""
    if p.dtype != torch.bfloat16 or not p.is_cpu or g.dtype not in (torch.float32, torch.bfloat16):
        return False
    tensors = (p, g, m, v, comp) if compensation == "kahan" else (p, g, m, v)
    return (m.dtype == v.dtype == torch.float32 and (compensation != "kahan" or (
        comp is not None and comp.dtype == torch.bfloat16))
            and all(t.is_cpu and t.is_contiguous() for t in tensors) and _native.plain(*tensors))


def _c_coefficients(step: int, *, lr, beta1, beta2, eps, weight_decay) -> list[float]:
    """The C kernel's scalars for ``step`` (see ``adamw_cpu.c``): computed in double, as torch's fused CPU kernel
    computes them, then rounded to fp32 once."""
    lerp = array("f", [1.0 - beta1])[0]
    toward_m = abs(lerp) < 0.5  # torch's lerp: from the moment's side for small weights, else from the gradient's
    raw = [lerp if toward_m else lerp - 1.0, float(toward_m), beta2, 1.0 - beta2, math.sqrt(1.0 - beta2**step), eps,
           1.0 - lr * weight_decay, -(lr / (1.0 - beta1**step))]
    return array("f", raw).tolist()  # each rounded to fp32 once


def _native_probe(fn) -> bool:
    """The C function agrees with the torch path in every mode, over 3 threads (every element must be done, whatever
    team OpenMP gives): moments within 1e-6 relative, weights within one bf16 spacing, Kahan buffers within 1%
    (a lost compensation fails: weights 1.0, updates ~a quarter of a bf16 spacing). Fresh tensors, none of the
    user's. (On torch 2.13 for x86 the bits are equal; another build may round its multiply-adds otherwise.)"""
    n = 2 * _native._MIN_PER_THREAD + 37
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(n, generator=gen), (torch.randn(n, generator=gen) * 1e-3).bfloat16()]
    for mode in COMPENSATIONS:
        runs = []
        for c_kernel in (True, False):
            ps = [torch.ones(n, dtype=torch.bfloat16) for _ in grads]
            ms, vs = [torch.full((n,), 1e-3) for _ in grads], [torch.full((n,), 1e-4) for _ in grads]
            cs = [torch.zeros(n, dtype=torch.bfloat16) for _ in grads] if mode == "kahan" else [None, None]
            steps, kw = [torch.tensor(2.0) for _ in grads], dict(lr=2e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                                                                  weight_decay=0.01)
            if c_kernel:
                torch._foreach_add_(steps, 1)
                coef = [c for s in steps for c in _c_coefficients(int(s.item()), **kw)]
                _native.run_split(fn, _native_args(ps, grads, ms, vs, [c for c in cs if c is not None], [7, -9],
                                                   coef, mode), 2 * n, threads=3)
            else:
                _torch_path(ps, grads, ms, vs, [], steps, amsgrad=False, maximize=False, compensation=mode,
                            comps=cs, keys=[7, -9], **kw)
            runs.append((ps, ms, vs, cs))
        (pc, mc, vc, cc), (pt, mt, vt, ct) = runs
        close = all(torch.allclose(a, b, rtol=1e-6, atol=0.0) for a, b in zip(mc + vc, mt + vt))
        close &= all(((a.float() - b.float()).abs() <= 2.0**-7).all() for a, b in zip(pc, pt))
        if mode == "kahan":
            close &= all(torch.allclose(a.float(), b.float(), rtol=1e-2, atol=0.0) for a, b in zip(cc, ct))
        if not close:
            return False
    return True


def _native_fn():
    """The C function of ``adamw_cpu.c``, once its probe passed; else None (see :func:`._dispatch.native`)."""
    return _dispatch.native(_NATIVE_SOURCE, _NATIVE_SYMBOL, [ctypes.c_int64] + [ctypes.c_void_p] * 9
                            + [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int], _native_probe)



def _native_args(params, grads, exp_avgs, exp_avg_sqs, comps, keys, coef, mode: str) -> tuple:
    """The C function's arguments before its range and thread count (``comps``: empty unless kahan)."""
    c = _dispatch.c_array
    return (len(params), *(c(ctypes.c_void_p, ts) for ts in (params, grads, exp_avgs, exp_avg_sqs)),
            c(ctypes.c_void_p, comps) if comps else None, c(ctypes.c_int64, [p.numel() for p in params]),
            c(ctypes.c_int32, [g.dtype == torch.bfloat16 for g in grads]), c(ctypes.c_int32, keys),
            c(ctypes.c_float, coef), C_MODES[mode])


def _step_op(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
             comps: list[Tensor], keys: list[int], coef: list[float], compensation: str, threads: int) -> None:
    """The C kernel's step over lists, in place (``comps``: empty unless kahan; ``threads`` < 0: torch's count).
    Not ``mode``: torch's dispatch passes a keyword of that name to ops."""
    _native.run_split(_native_fn(), _native_args(params, grads, exp_avgs, exp_avg_sqs, comps, keys, coef,
                                                 compensation), sum(p.numel() for p in params),
                      threads=None if threads < 0 else threads)


_op = _dispatch.custom_op("adamw_step", _step_op, ("params", "exp_avgs", "exp_avg_sqs", "comps"))


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
