"""AdamW's Triton kernels (CUDA): fp32 moments (:func:`.adamw.adamw_fp32_state`) and bf16 moments
(:func:`.adamw_bf16.adamw_bf16`), each a single pass that reads the gradient and state, steps in fp32 and writes
the state and the compensated weight (:func:`._triton_lib.write`): no fp32 copy of the weights.

Launches: :func:`._triton.launch` (the tensors of a (weight dtype, gradient dtype) share one launch over a pointer
table: weights, gradients, step counts, exp_avg, exp_avg_sq, Kahan buffers; a tensor of more than
``_triton.MAX_PROGRAMS`` programs gets a launch of its own), each program ``BLOCKS`` blocks of ``BLOCK`` elements.
Whole blocks are read and written without a mask (16-byte vectors; the table's addresses promised aligned where they
are), a tensor's last partial block with one. Nothing is read on the host: each tensor's step count lives on its
device (advanced by :func:`._triton.advance_steps` before the launch), its step size and bias correction are computed
once per step from it (:func:`._triton.adam_scalars`, float64 as torch's Python scalars), its noise key in the
kernel, which returns at once when the step's void flag is set. Conventions: see :mod:`._triton`.

The eager references: torch's AdamW on an fp32 copy then :func:`.compensation.write_all` (fp32 moments), and
``adamw_bf16._KERNELS`` (bf16 moments, whose noise streams these follow: the moment's key is the weight's key
xor ``WEIGHT_STREAM``). Each kernel is used once a probe on the device agreed with its reference
(:func:`._dispatch.cached`); else the caller runs its reference path.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import _triton
from .compensation import WEIGHT_STREAM

L = _triton.jit_helpers()

BLOCK = 2048  # elements per iteration: 16-byte vector loads (8 bf16 or 4 fp32 per thread and load)
# 8 elements a thread, not 16: half the registers, so twice the warps an SM holds to hide the latency of the
# per-element IEEE square root and divisions (serial, each behind a branch to its slow path); see issue 24's note
NUM_WARPS = 8
BLOCKS = 8  # blocks per program: its setup (pointers, scalars, noise key) serves them all
_BF16_MAX = tl.constexpr(3.3895313892515355e38)  # bf16's largest finite value (adamw_bf16._BF16_MAX)
_STREAM = tl.constexpr(WEIGHT_STREAM)


@triton.jit
def _tensor(table, info, count, OUT: tl.constexpr, GRAD: tl.constexpr, STATE: tl.constexpr, ALIGNED: tl.constexpr,
            SPAN: tl.constexpr):
    """This program's tensor (:func:`._triton_lib.tensor_of_program`, programs of ``SPAN`` elements): its pointers
    (weight, gradient, step count, exp_avg, exp_avg_sq of ``STATE``, Kahan buffer), size, position (or key) and first
    element. The table's loads do not wait for one another, nor for the flag's."""
    t, n, start = L.tensor_of_program(info, SPAN)
    pp = L.address(table, 0, count, t, OUT, 16 * ALIGNED)
    gp = L.address(table, 1, count, t, GRAD, 16 * ALIGNED)
    sp = L.address(table, 2, count, t, tl.float32, 0)
    mp = L.address(table, 3, count, t, STATE, 16 * ALIGNED)
    vp = L.address(table, 4, count, t, STATE, 16 * ALIGNED)
    cp = L.address(table, 5, count, t, tl.bfloat16, 16 * ALIGNED)
    return pp, gp, sp, mp, vp, cp, t, n, tl.load(info + count + t).to(tl.int32), start


@triton.jit
def _fp32_block(pp, gp, mp, vp, cp, offs, mask, wkey, step_size, bc2_sqrt, b2, omb2, from_m, lerp_c, decay, eps,
                MODE: tl.constexpr):
    """One block of :func:`fp32_state_kernel` (``mask`` None: every element in range, so loads are whole vectors).
    ``div_rn`` / ``sqrt_rn``: torch's IEEE division and square root (Triton's defaults approximate), for its bits."""
    g = tl.load(gp + offs, mask=mask).to(tl.float32)
    m = tl.load(mp + offs, mask=mask)
    v = tl.load(vp + offs, mask=mask)
    old = tl.load(pp + offs, mask=mask).to(tl.float32)
    m = tl.where(from_m, m, g) + lerp_c * (g - m)  # torch's lerp, its side chosen per program (see the kernel)
    v = v * b2 + omb2 * g * g
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    new = old * decay + (-step_size) * tl.div_rn(m, denom)
    tl.store(mp + offs, m, mask=mask)
    tl.store(vp + offs, v, mask=mask)
    L.write(pp, cp, offs, mask, old, new, wkey, offs.to(tl.int32), MODE)


@triton.jit(do_not_specialize=["count"])
def fp32_state_kernel(table, info, flag_ptr, count, coef, b2, omb2, lerp_w, decay, eps, MODE: tl.constexpr,
                      OUT: tl.constexpr, GRAD: tl.constexpr, ALIGNED: tl.constexpr, KEYED: tl.constexpr,
                      BLOCK: tl.constexpr, BLOCKS: tl.constexpr):
    """torch's AdamW (decoupled decay, lerp, addcmul, addcdiv, in its order) on fp32 moments, the weight written
    compensated, over ``BLOCKS`` blocks of tensor ``program_id(0)``; its step size and ``sqrt(1 - beta2^t)`` from
    ``coef`` (:func:`._triton.adam_scalars`). ``info``'s second half: each tensor's position (its noise key is
    ``weight_key(position, step)``), or with ``KEYED`` the key itself."""
    void = tl.load(flag_ptr)
    pp, gp, sp, mp, vp, cp, t, numel, key, start = _tensor(table, info, count, OUT, GRAD, tl.float32, ALIGNED,
                                                           BLOCK * BLOCKS)
    if (void == 0) & (start < numel):
        step_size = tl.load(coef + 3 * t)
        bc2_sqrt = tl.load(coef + 3 * t + 2)
        if KEYED:
            wkey = key
        else:
            wkey = L.weight_key(key, tl.load(sp).to(tl.int32))
        # torch's lerp: m + w (g - m) for a small weight, else g - (g - m)(1 - w) = g + (g - m)(w - 1), the same bits
        # (negation is exact): one form for both, a select per element instead of both computed
        from_m = lerp_w < 0.5
        lerp_c = tl.where(from_m, lerp_w, lerp_w - 1.0)
        for first in range(start, tl.minimum(start + BLOCK * BLOCKS, numel), BLOCK):
            offs = first + tl.arange(0, BLOCK)
            if first + BLOCK <= numel:
                _fp32_block(pp, gp, mp, vp, cp, offs, None, wkey, step_size, bc2_sqrt, b2, omb2, from_m, lerp_c,
                            decay, eps, MODE)
            else:
                _fp32_block(pp, gp, mp, vp, cp, offs, offs < numel, wkey, step_size, bc2_sqrt, b2, omb2, from_m,
                            lerp_c, decay, eps, MODE)


@triton.jit
def _bf16_block(pp, gp, mp, vp, cp, offs, mask, wkey, step_size, inv_bc2, b1, omb1, b2, omb2, eps, decay,
                MODE: tl.constexpr):
    """One block of :func:`bf16_state_kernel` (``mask`` None: every element in range, so loads are whole vectors).
    ``div_rn`` / ``sqrt_rn``: the eager kernel's IEEE division and square root, for its bits."""
    g = tl.load(gp + offs, mask=mask).to(tl.float32)
    m = tl.load(mp + offs, mask=mask).to(tl.float32) * b1 + g * omb1
    v = tl.load(vp + offs, mask=mask).to(tl.float32) * b2 + (g * g) * omb2
    v = tl.where(v > _BF16_MAX, _BF16_MAX, v)  # clamp(max=) that keeps NaN, as torch's
    tl.store(mp + offs, L.to_bf16(m), mask=mask)
    if MODE == 2:
        tl.store(vp + offs, L.to_bf16(v), mask=mask)
    else:
        tl.store(vp + offs, L.round_stochastic(v, L.hash_noise(wkey ^ _STREAM, offs.to(tl.int32)), tl.bfloat16),
                 mask=mask)
    denom = tl.sqrt_rn(v) * inv_bc2 + eps
    old = tl.load(pp + offs, mask=mask).to(tl.float32)
    new = old + (old * decay - tl.div_rn(m, denom) * step_size)
    L.write(pp, cp, offs, mask, old, new, wkey, offs.to(tl.int32), MODE)


@triton.jit(do_not_specialize=["count"])
def bf16_state_kernel(table, info, flag_ptr, count, coef, b1, omb1, b2, omb2, eps, decay, MODE: tl.constexpr,
                      OUT: tl.constexpr, GRAD: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr,
                      BLOCKS: tl.constexpr):
    """``adamw_bf16``'s eager kernel (``_adamw_update`` then ``write``) over ``BLOCKS`` blocks of tensor
    ``program_id(0)``: moments stored in bf16, ``exp_avg_sq`` rounded stochastically except under none; its step
    size and ``1 / sqrt(1 - beta2^t)`` from ``coef`` (:func:`._triton.adam_scalars`); ``info``'s second half: each
    tensor's position (its noise id)."""
    void = tl.load(flag_ptr)
    pp, gp, sp, mp, vp, cp, t, numel, key, start = _tensor(table, info, count, OUT, GRAD, tl.bfloat16, ALIGNED,
                                                           BLOCK * BLOCKS)
    if (void == 0) & (start < numel):
        step_size = tl.load(coef + 3 * t)
        inv_bc2 = tl.load(coef + 3 * t + 1)
        wkey = L.weight_key(key, tl.load(sp).to(tl.int32))  # the weight's stream; the moment's is noise_key(...)
        for first in range(start, tl.minimum(start + BLOCK * BLOCKS, numel), BLOCK):
            offs = first + tl.arange(0, BLOCK)
            if first + BLOCK <= numel:
                _bf16_block(pp, gp, mp, vp, cp, offs, None, wkey, step_size, inv_bc2, b1, omb1, b2, omb2, eps, decay,
                            MODE)
            else:
                _bf16_block(pp, gp, mp, vp, cp, offs, offs < numel, wkey, step_size, inv_bc2, b1, omb1, b2, omb2,
                            eps, decay, MODE)


def _launch(kernel, tensors, keys, flag, scalars, prepare, compensation, small, tables, **constexprs) -> None:
    """``kernel`` over each tensor of ``tensors`` = (params, grads, exp_avgs, exp_avg_sqs, comps, steps) through
    :func:`._triton.launch` (``comps`` entries may be None where the mode reads none: the weight stands in; ``keys``:
    each tensor's int key; ``small``: tensors of as many elements or more get a launch of their own, for probes and
    tests to take both kinds; ``tables``: the caller's dict of pointer tables, or None)."""
    params, grads, ms, vs, comps, steps = tensors
    items = [(keys[i], [p, grads[i], steps[i], ms[i], vs[i], p if comps[i] is None else comps[i]])
             for i, p in enumerate(params)]
    if items:
        _triton.launch(kernel, items, tables, flag, scalars, compensation, BLOCK * BLOCKS, num_warps=NUM_WARPS,
                       prepare=prepare, alone_from=small, BLOCK=BLOCK, BLOCKS=BLOCKS, **constexprs)


def fp32_state_step(params, grads, exp_avgs, exp_avg_sqs, comps, steps, keys, flag, *, keyed: bool, lr, beta1,
                    beta2, eps, weight_decay, compensation: str, small: int | None = None, tables=None) -> None:
    """:func:`.adamw.adamw_fp32_state` on the device (steps advanced here): ``keys`` are positions, or noise keys
    with ``keyed``."""
    _triton.advance_steps(steps, flag)
    scalars = (beta2, 1.0 - beta2, _triton.fp32(1.0 - beta1), 1.0 - lr * weight_decay, eps)
    _launch(fp32_state_kernel, (params, grads, exp_avgs, exp_avg_sqs, comps, steps), keys, flag, scalars,
            _triton.adam_scalars(lr, beta1, beta2), compensation, small, tables, KEYED=keyed)


def bf16_state_step(params, grads, exp_avgs, exp_avg_sqs, comps, steps, positions, flag, *, lr, beta1, beta2, eps,
                    weight_decay, compensation: str, small: int | None = None, tables=None) -> None:
    """:func:`.adamw_bf16.adamw_bf16`'s low-precision tensors on the device (steps advanced here); ``positions``:
    each tensor's noise id."""
    _triton.advance_steps(steps, flag)
    scalars = (beta1, 1.0 - beta1, beta2, 1.0 - beta2, eps, -lr * weight_decay)
    _launch(bf16_state_kernel, (params, grads, exp_avgs, exp_avg_sqs, comps, steps), positions, flag, scalars,
            _triton.adam_scalars(lr, beta1, beta2), compensation, small, tables)
