"""AdamW's Triton kernels (CUDA): fp32 moments (:func:`.adamw.adamw_fp32_state`) and bf16 moments
(:func:`.adamw_bf16.adamw_bf16`), each a single pass that reads the gradient and state, steps in fp32 and writes
the state and the compensated weight (:func:`._triton_lib.compensated`): no fp32 copy of the weights.

Launches: a tensor of ``SMALL`` elements or more gets one launch (a grid over its blocks); the smaller ones of a
(weight dtype, gradient dtype) share one launch over a :class:`._triton.PointerTable` (grid: tensors x blocks).
Nothing is read on the host: each tensor's step count lives on its device (advanced by
:func:`._triton.advance_steps` before the launch), the kernel computes its bias corrections and noise keys from it,
and returns at once when the step's void flag is set. Conventions: see :mod:`._triton`.

The eager references: torch's AdamW on an fp32 copy then :func:`.compensation.write_all` (fp32 moments), and
``adamw_bf16._KERNELS`` (bf16 moments, whose noise streams these follow: the moment's key is the weight's key
xor ``WEIGHT_STREAM``). Each kernel is used once a probe on the device agreed with its reference
(:func:`._dispatch.cached`); else the caller runs its reference path.
"""

from __future__ import annotations

from collections import OrderedDict
from contextlib import nullcontext

import torch
import triton
import triton.language as tl

from . import _triton
from .compensation import C_MODES, WEIGHT_STREAM

L = _triton.jit_helpers()

BLOCK = 2048  # elements per program: 16-byte vector loads (8 bf16 or 4 fp32 per thread and load), 4 warps
NUM_WARPS = 4
SMALL = 1 << 16  # tensors below this share one launch; the batched grid wastes < SMALL / BLOCK programs per tensor
_BF16_MAX = tl.constexpr(3.3895313892515355e38)  # bf16's largest finite value (adamw_bf16._BF16_MAX)
_STREAM = tl.constexpr(WEIGHT_STREAM)


@triton.jit
def _tensor(p_ptr, g_ptr, m_ptr, v_ptr, c_ptr, step_ptr, ptrs, sizes, n, key, count, TABLE: tl.constexpr):
    """This program's tensor and block: the arguments as given and block ``program_id(0)``, or (``TABLE``) row
    ``program_id(0)`` of the pointer table (``ptrs``: p, g, m, v, c, step addresses, each ``count`` long; ``sizes``:
    numels, then keys) and block ``program_id(1)``: tensors on the grid's first dimension, which has room for 2**31
    of them (the others 65535)."""
    blk = tl.program_id(0).to(tl.int64)
    if TABLE:
        t = tl.program_id(0)
        blk = tl.program_id(1).to(tl.int64)
        p_ptr = tl.load(ptrs + t).to(tl.pointer_type(p_ptr.dtype.element_ty))
        g_ptr = tl.load(ptrs + count + t).to(tl.pointer_type(g_ptr.dtype.element_ty))
        m_ptr = tl.load(ptrs + 2 * count + t).to(tl.pointer_type(m_ptr.dtype.element_ty))
        v_ptr = tl.load(ptrs + 3 * count + t).to(tl.pointer_type(v_ptr.dtype.element_ty))
        c_ptr = tl.load(ptrs + 4 * count + t).to(tl.pointer_type(c_ptr.dtype.element_ty))
        step_ptr = tl.load(ptrs + 5 * count + t).to(tl.pointer_type(tl.float32))
        n = tl.load(sizes + t)
        key = tl.load(sizes + count + t).to(tl.int32)
    return p_ptr, g_ptr, m_ptr, v_ptr, c_ptr, step_ptr, n.to(tl.int64), key, blk


@triton.jit
def _write(pp, cp, offs, mask, old, new, wkey, MODE: tl.constexpr):
    """The new weight, compensated (the Kahan buffer ``cp``, bf16, is read and written only where one is used)."""
    OUT: tl.constexpr = pp.dtype.element_ty
    if MODE == 0 and OUT != tl.float32:
        comp = tl.load(cp + offs, mask=mask).to(tl.float32)
        w, comp = L.compensated(old, new, comp, wkey, offs.to(tl.int32), MODE, OUT)
        tl.store(cp + offs, L.to_bf16(comp), mask=mask)
    else:
        w, _ = L.compensated(old, new, old, wkey, offs.to(tl.int32), MODE, OUT)
    tl.store(pp + offs, w, mask=mask)


@triton.jit(do_not_specialize=["n", "key", "count"])  # a key or size of 1 must not become a constant
def fp32_state_kernel(flag_ptr, p_ptr, g_ptr, m_ptr, v_ptr, c_ptr, step_ptr, ptrs, sizes, n, key, count,
                      lr_hi, lr_lo, b1_hi, b1_lo, b2_hi, b2_lo, b2, omb2, lerp_w, decay, eps,
                      MODE: tl.constexpr, KEYED: tl.constexpr, TABLE: tl.constexpr, BLOCK: tl.constexpr):
    """torch's AdamW (decoupled decay, lerp, addcmul, addcdiv, in its order) on fp32 moments, the weight written
    compensated. ``key``: the tensor's position (its noise key is ``weight_key(position, step)``), or with
    ``KEYED`` the key itself."""
    if tl.load(flag_ptr) == 0:
        pp, gp, mp, vp, cp, sp, numel, tkey, blk = _tensor(p_ptr, g_ptr, m_ptr, v_ptr, c_ptr, step_ptr, ptrs, sizes,
                                                           n, key, count, TABLE)
        offs = blk * BLOCK + tl.arange(0, BLOCK)
        if blk * BLOCK < numel:
            mask = offs < numel
            step = tl.load(sp).to(tl.int32)
            bc1 = 1.0 - L.pow_int(b1_hi, b1_lo, step)  # float64, as torch's Python scalars
            step_size = ((tl.cast(lr_hi, tl.float64) + tl.cast(lr_lo, tl.float64)) / bc1).to(tl.float32)
            bc2_sqrt = tl.sqrt(1.0 - L.pow_int(b2_hi, b2_lo, step)).to(tl.float32)
            wkey = tkey if KEYED else L.weight_key(tkey, step)
            g = tl.load(gp + offs, mask=mask).to(tl.float32)
            m = tl.load(mp + offs, mask=mask)
            v = tl.load(vp + offs, mask=mask)
            old = tl.load(pp + offs, mask=mask).to(tl.float32)
            diff = g - m  # torch's lerp: from the moment's side for a small weight, else from the gradient's
            m = tl.where(lerp_w < 0.5, m + lerp_w * diff, g - diff * (1.0 - lerp_w))
            v = v * b2 + omb2 * g * g
            denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
            new = old * decay + (-step_size) * tl.div_rn(m, denom)
            tl.store(mp + offs, m, mask=mask)
            tl.store(vp + offs, v, mask=mask)
            _write(pp, cp, offs, mask, old, new, wkey, MODE)


@triton.jit(do_not_specialize=["n", "key", "count"])
def bf16_state_kernel(flag_ptr, p_ptr, g_ptr, m_ptr, v_ptr, c_ptr, step_ptr, ptrs, sizes, n, key, count,
                      lr_hi, lr_lo, b1_hi, b1_lo, b2_hi, b2_lo, b1, omb1, b2, omb2, eps, decay,
                      MODE: tl.constexpr, TABLE: tl.constexpr, BLOCK: tl.constexpr):
    """``adamw_bf16``'s eager kernel (``_adamw_update`` then ``write``): moments stored in bf16, ``exp_avg_sq``
    rounded stochastically except under none; ``key``: the tensor's position (its noise id)."""
    if tl.load(flag_ptr) == 0:
        pp, gp, mp, vp, cp, sp, numel, tkey, blk = _tensor(p_ptr, g_ptr, m_ptr, v_ptr, c_ptr, step_ptr, ptrs, sizes,
                                                           n, key, count, TABLE)
        offs = blk * BLOCK + tl.arange(0, BLOCK)
        if blk * BLOCK < numel:
            mask = offs < numel
            step = tl.load(sp).to(tl.int32)
            one = tl.full((), 1.0, tl.float64)
            inv_bc2 = (one / tl.sqrt(one - L.pow_int(b2_hi, b2_lo, step))).to(tl.float32)
            lr = tl.cast(lr_hi, tl.float64) + tl.cast(lr_lo, tl.float64)
            step_size = (lr / (one - L.pow_int(b1_hi, b1_lo, step))).to(tl.float32)
            wkey = L.weight_key(tkey, step)  # the weight's stream; the moment's is noise_key(position, step)
            idx = offs.to(tl.int32)
            g = tl.load(gp + offs, mask=mask).to(tl.float32)
            m = tl.load(mp + offs, mask=mask).to(tl.float32) * b1 + g * omb1
            v = tl.load(vp + offs, mask=mask).to(tl.float32) * b2 + (g * g) * omb2
            v = tl.where(v > _BF16_MAX, _BF16_MAX, v)  # clamp(max=) that keeps NaN, as torch's
            tl.store(mp + offs, L.to_bf16(m), mask=mask)
            if MODE == 2:
                tl.store(vp + offs, L.to_bf16(v), mask=mask)
            else:
                tl.store(vp + offs, L.round_stochastic(v, L.hash_noise(wkey ^ _STREAM, idx), tl.bfloat16),
                         mask=mask)
            denom = tl.sqrt_rn(v) * inv_bc2 + eps
            old = tl.load(pp + offs, mask=mask).to(tl.float32)
            new = old + (old * decay - tl.div_rn(m, denom) * step_size)
            _write(pp, cp, offs, mask, old, new, wkey, MODE)


_TABLES: OrderedDict = OrderedDict()  # (kernel, dtypes, device, first address, count) -> PointerTable
_MAX_TABLES = 64  # one per param group and dtype pair in use; bounded for processes that build many optimizers


def _table(name: str, lists, sizes, device):
    """The cached :class:`._triton.PointerTable` of these tensors (rebuilt only when an address or size changes)."""
    key = (name, tuple(ts[0].dtype for ts in lists), device, lists[0][0].data_ptr(), len(lists[0]))
    table = _TABLES.pop(key, None) or _triton.PointerTable()
    _TABLES[key] = table
    while len(_TABLES) > _MAX_TABLES:
        _TABLES.popitem(last=False)
    return table.get(lists, sizes, device)


def launch(kernel, name: str, tensors, keys, flag, scalars, small: int | None = None, **constexprs) -> None:
    """``kernel`` over each tensor of ``tensors`` = (params, grads, exp_avgs, exp_avg_sqs, comps, steps): one launch
    per tensor of ``small`` elements or more, one per (weight, gradient) dtype pair over the others. ``comps``
    entries may be None where the mode reads none (the weight stands in). ``keys``: each tensor's int key."""
    params, grads, ms, vs, comps, steps = tensors
    if not params:
        return
    device = params[0].device  # Triton launches on the current device: made this tensors' one, as torch's ops do
    with torch.cuda.device(device) if device.type == "cuda" else nullcontext():
        _launch(kernel, name, tensors, keys, flag, scalars, SMALL if small is None else small, constexprs)


def _launch(kernel, name, tensors, keys, flag, scalars, small, constexprs) -> None:
    params, grads, ms, vs, comps, steps = tensors
    comps = [p if c is None else c for p, c in zip(params, comps)]
    opts = dict(num_warps=NUM_WARPS, enable_fp_fusion=False, BLOCK=BLOCK, **constexprs)
    batched = {}
    for i, p in enumerate(params):
        n = p.numel()
        if n == 0:
            continue
        if n < small:
            batched.setdefault((p.dtype, grads[i].dtype), []).append(i)
            continue
        kernel[(triton.cdiv(n, BLOCK),)](flag, p, grads[i], ms[i], vs[i], comps[i], steps[i], flag, flag, n,
                                         keys[i], 1, *scalars, TABLE=False, **opts)
    for idx in batched.values():
        lists = [[ts[i] for i in idx] for ts in (params, grads, ms, vs, comps, steps)]
        numels = [params[i].numel() for i in idx]
        ptrs, sizes = _table(name, lists, numels + [keys[i] for i in idx], params[idx[0]].device)
        first = [ts[0] for ts in lists]
        kernel[(len(idx), triton.cdiv(max(numels), BLOCK))](flag, *first, ptrs, sizes, 0, 0, len(idx), *scalars,
                                                            TABLE=True, **opts)


def fp32_state_step(params, grads, exp_avgs, exp_avg_sqs, comps, steps, keys, flag, *, keyed: bool, lr, beta1,
                    beta2, eps, weight_decay, compensation: str, small: int | None = None) -> None:
    """:func:`.adamw.adamw_fp32_state` on the device (steps advanced here): ``keys`` are positions, or noise keys
    with ``keyed``."""
    _triton.advance_steps(steps, flag)
    w = _triton.fp32(1.0 - beta1)
    scalars = (*_triton.split64(lr), *_triton.split64(beta1), *_triton.split64(beta2), beta2, 1.0 - beta2, w,
               1.0 - lr * weight_decay, eps)
    launch(fp32_state_kernel, "fp32_state", (params, grads, exp_avgs, exp_avg_sqs, comps, steps), keys, flag,
           scalars, small, MODE=C_MODES[compensation], KEYED=keyed)


def bf16_state_step(params, grads, exp_avgs, exp_avg_sqs, comps, steps, positions, flag, *, lr, beta1, beta2, eps,
                    weight_decay, compensation: str, small: int | None = None) -> None:
    """:func:`.adamw_bf16.adamw_bf16`'s low-precision tensors on the device (steps advanced here); ``positions``:
    each tensor's noise id."""
    _triton.advance_steps(steps, flag)
    scalars = (*_triton.split64(lr), *_triton.split64(beta1), *_triton.split64(beta2), beta1, 1.0 - beta1, beta2,
               1.0 - beta2, eps, -lr * weight_decay)
    launch(bf16_state_kernel, "bf16_state", (params, grads, exp_avgs, exp_avg_sqs, comps, steps), positions, flag,
           scalars, small, MODE=C_MODES[compensation])
