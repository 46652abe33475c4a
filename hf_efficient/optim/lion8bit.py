"""Lion with blockwise 8-bit momentum: ~1 byte of state per parameter, half of 8-bit AdamW.

Math: Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms" (bitsandbytes' ``Lion8bit``,
torch-optimi's ``Lion``), fp32 arithmetic inside the step::

    p   = p * (1 - lr * weight_decay)                           # decoupled weight decay
    p   = p - lr * sign(beta1 * m + (1 - beta1) * g)             # the update: a sign, every element moves by lr
    m   = beta2 * m + (1 - beta2) * g                           # one moment

The update's size does not depend on the gradient's, so Lion wants a learning rate 3-10x below AdamW's (and a
weight decay as much larger, to keep ``lr * weight_decay``). ``sign(0) = 0``: a zero gradient on a zero momentum
moves nothing but the decay.

State per 8-bit parameter: ``step`` and ``exp_avg`` (uint8 codes into the signed map of :mod:`.quant8`) with
``exp_avg_absmax`` (fp32, one per block of 256): 1 byte per element + 4 per 256 = 1.016. Tensors under
``min_8bit_size`` elements and ``fp32_state_params`` (the registry passes the embeddings) keep an fp32 ``exp_avg``.
Kernels, layout and checkpoints as every 8-bit family (:mod:`._blockwise`): the Triton kernel
(:mod:`.blockwise_triton`) for contiguous tensors on CUDA, the C kernel ``lion8bit_cpu.c`` (the op
``hf_efficient::lion8bit_step``) for contiguous fp32/bf16 tensors on CPU, else the compiled or eager kernel. The
fp32-momentum tensors: :func:`lion` (on CUDA :mod:`.lion_triton`, one launch per weight and gradient dtype).
"""

from __future__ import annotations

from array import array

import torch
from torch import Tensor

from . import _dispatch, _triton, quant8
from ._blockwise import Blockwise8bit, on_device
from .compensation import step_in_fp32
from .facts import KAHAN, STEP, Family, codes

__all__ = ["LION8BIT", "Lion8bit", "lion"]

LION8BIT = Family("lion8bit", {"step": STEP, "exp_avg": codes(quant8, signed=True), "kahan_comp": KAHAN}, "lion",
                  uses_eps=False)


# coef = [beta1, 1 - beta1, beta2, 1 - beta2, 1 - lr * wd, lr]


def update(p: Tensor, g: Tensor, moments: list[Tensor], coef) -> tuple[Tensor, list[Tensor]]:
    """Lion's math on fp32 values, written once: the 8-bit kernel (Blockwise8bit.kernel decodes, calls this,
    encodes) and the fp32-state path both take it. ``coef`` as above, a tensor or fp32-rounded floats (the same
    bits either way: torch rounds a Python scalar to fp32 for an fp32 tensor)."""
    m = moments[0]
    step = torch.sign(m * coef[0] + g * coef[1])
    # m stays in range: a convex combination of m and g
    return p * coef[4] - step * coef[5], [m * coef[2] + g * coef[3]]


def _coefficients(group: dict, step: int) -> list[float]:
    beta1, beta2 = group["betas"]
    return _c_coefficients(lr=group["lr"], beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"])


def lion(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], *, lr: float, beta1: float, beta2: float,
         weight_decay: float, compensation: str = "none", comps=None, keys=None, c_kernel: bool = True, steps=None,
         positions=None, found_inf=None, tables=None, offsets=None) -> None:
    """Lion on fp32 momenta (any weight dtype: the step runs in fp32), the same operations as the 8-bit kernel;
    low-precision weights written under ``compensation`` (:func:`.compensation.step_in_fp32`), bf16 weights on CPU
    by the C kernel ``lion_step`` where it applies (the same bits; ``c_kernel`` False: never).

    With ``steps`` (each tensor's step count, float32 on its device) and ``positions`` (its index among the
    optimizer's parameters), the tensors (contiguous, where :func:`._triton.applies`) go through the Triton kernel
    (:mod:`.lion_triton`), which counts the steps (not where ``found_inf``, a flag on the device, is set) and keys
    the noise itself: no host synchronisation. ``tables``: a dict the caller keeps between steps for its pointer
    tables. ``keys`` are then unused. ``offsets``: as :func:`.adamw.adamw_fp32_state`'s (FSDP2 shards)."""
    comps = [None] * len(params) if comps is None else comps
    if steps is not None:
        from . import lion_triton

        coef = _c_coefficients(lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay)
        return lion_triton.lion(params, grads, exp_avgs, comps, steps, positions, found_inf, tables, coef, compensation)
    keys = [0] * len(params) if keys is None else keys
    states = [(m,) for m in exp_avgs]
    native, rest = ([], None) if not c_kernel or torch.is_tensor(lr) else _KERNEL.split(
        params, grads, states, comps, compensation)
    if native:
        pick = lambda xs, idx: [xs[i] for i in idx]  # noqa: E731
        coef = _c_coefficients(lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay)
        _KERNEL(pick(params, native), pick(grads, native), pick(states, native), pick(comps, native),
                pick(keys, native), coef * len(native), compensation)
        params, grads, exp_avgs, comps, keys = (pick(xs, rest) for xs in (params, grads, exp_avgs, comps, keys))
    if params:
        _torch_path(params, grads, exp_avgs, lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay,
                    compensation=compensation, comps=comps, keys=keys, offsets=offsets)


def _torch_path(params, grads, exp_avgs, *, lr, beta1, beta2, weight_decay, compensation, comps, keys,
                offsets=None) -> None:
    """:func:`lion` with torch's operations, on fp32 copies of low-precision weights."""
    coef = _c_coefficients(lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay)

    def step(idx, ps):
        for i, p32 in zip(idx, ps):
            new_p, (m,) = update(p32, grads[i].float(), [exp_avgs[i]], coef)
            p32.copy_(new_p)
            exp_avgs[i].copy_(m)

    step_in_fp32(params, step, compensation, comps, keys, offsets)


def _c_coefficients(*, lr, beta1, beta2, weight_decay) -> list[float]:
    """The C kernels' scalars, in the order of ``lion8bit_cpu.c``'s ``lion_coef_t`` (decay: ``1 - lr * wd``), each
    rounded to fp32 once as torch rounds a Python scalar."""
    return array("f", [beta1, 1.0 - beta1, beta2, 1.0 - beta2, 1.0 - lr * weight_decay, lr]).tolist()


_PROBE = dict(lr=2e-3, beta1=0.9, beta2=0.99, weight_decay=0.01)
_KERNEL = _dispatch.Bf16WeightKernel(
    "lion_step", "lion8bit_cpu.c", "lion_step",
    lambda ps, gs, states, cs, keys, mode: _torch_path(ps, gs, [m for m, in states], compensation=mode, comps=cs,
                                                       keys=keys, **_PROBE),
    (1e-3,), lambda: _c_coefficients(**_PROBE))


class Lion8bit(Blockwise8bit):
    """Lion with a blockwise 8-bit momentum (bitsandbytes' format), in plain PyTorch.

    A standard ``torch.optim.Optimizer``: param groups carry every hyperparameter, state keys are ``step``,
    ``exp_avg`` and ``exp_avg_absmax``, and ``state_dict()`` (canonical layout, see :mod:`.quant8`) loads with
    ``torch.load(weights_only=True)`` and moves to and from ``bnb.optim.Lion8bit``.

    Args:
        params: parameters or param groups.
        lr: step size of every element's update (3-10x below AdamW's).
        betas: (beta1: interpolation for the update's sign, beta2: the momentum's decay).
        weight_decay: decoupled, ``p *= 1 - lr * weight_decay``.
        min_8bit_size: tensors with fewer elements keep an fp32 momentum (bitsandbytes' default: 4096).
        fp32_state_params: parameters (or their ``id()``) that keep an fp32 momentum, e.g. embeddings.
        compile: None (automatic): the Triton kernels for contiguous tensors on CUDA, the C kernel for contiguous
            fp32/bf16 tensors on CPU, else the torch.compile'd kernel; True: the compiled kernel; False: always
            eager. A compiled kernel that fails to compile falls back to the eager kernel with a warning.
        compensation: how updates reach bf16 / fp16 weights: ``"stochastic"`` / ``"kahan"`` / ``"none"`` (see
            :mod:`.compensation`); default: the family's (``LION8BIT.compensation``); fp32 weights ignore it.

    Example::

        opt = Lion8bit(model.parameters(), lr=3e-5, weight_decay=0.1)
    """

    FACTS = LION8BIT
    C_KERNEL = TRITON_KERNEL = True
    TRITON_FP32 = True
    update = staticmethod(update)
    coefficients = staticmethod(_coefficients)

    def __init__(self, params, *, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0, min_8bit_size: int = 4096, fp32_state_params=None,
                 compile: bool | None = None, compensation: str = LION8BIT.compensation):
        defaults = dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay, min_8bit_size=min_8bit_size,
                        compile=compile, compensation=compensation)
        super().__init__(params, defaults, fp32_state_params)

    def step_32bit(self, group: dict, items, offsets=None) -> None:
        """fp32-state tensors: those on CUDA through the Triton kernel (device steps, no host sync), others through
        torch's operations or the C kernel (steps counted here). ``offsets``: FSDP2 shards' (see
        :meth:`._blockwise.Blockwise8bit.step_32bit`)."""
        beta1, beta2 = group["betas"]
        hyper = dict(lr=group["lr"], beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"],
                     compensation=group["compensation"], c_kernel=group["compile"] is None)
        uses = [self._uses_triton(it[0], group) for it in items]  # their steps are on the device (_init_state)
        tri, rest = [it for it, u in zip(items, uses) if u], [it for it, u in zip(items, uses) if not u]
        for device in {it[0].device for it in tri}:
            mine = [it for it in tri if it[0].device == device]
            with on_device(device):
                lion([p for p, *_ in mine], [g for _, g, *_ in mine], [it[2]["exp_avg"] for it in mine],
                     comps=[it[2].get("kahan_comp") for it in mine], steps=[it[2]["step"] for it in mine],
                     positions=[it[3] for it in mine], found_inf=_triton.flag(self, device),
                     tables=self._tables.setdefault(id(group), {}), **hyper)
        if rest:
            keys = self.noise_keys(rest)
            for it in rest:
                it[2]["step"] += 1
            lion([p for p, *_ in rest], [g for _, g, *_ in rest], [it[2]["exp_avg"] for it in rest],
                 comps=[it[2].get("kahan_comp") for it in rest], keys=keys, offsets=offsets, **hyper)
