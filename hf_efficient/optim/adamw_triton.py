"""AdamW's Triton kernels (CUDA): fp32 moments (:func:`.adamw.adamw_fp32_state`) and bf16 moments
(:func:`.adamw_bf16.adamw_bf16`), each a single pass that reads the gradient and state, steps in fp32 and writes
the state and the compensated weight (:func:`._triton_lib.compensated`): no fp32 copy of the weights.

Launches: the tensors of a (weight dtype, gradient dtype) share one launch over a :class:`._triton.PointerTable`
(grid: tensors x programs, each program ``BLOCKS`` blocks of ``BLOCK`` elements; a tensor of more than
``MAX_PROGRAMS`` programs, which the grid's second dimension cannot hold, gets a launch of its own). Whole blocks
are read and written without a mask (16-byte vectors; the table's addresses promised aligned where they are), a
tensor's last partial block with one.
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

BLOCK = 2048  # elements per iteration: 16-byte vector loads (8 bf16 or 4 fp32 per thread and load)
# 8 elements a thread, not 16: half the registers, so twice the warps an SM holds to hide the latency of the
# per-element IEEE square root and divisions (serial, each behind a branch to its slow path); see issue 24's note
NUM_WARPS = 8
BLOCKS = 8  # blocks per program: its scalars (bias corrections: two float64 powers, a division) serve them all
MAX_PROGRAMS = 65535  # a table launch's programs per tensor (the grid's second dimension); a larger tensor: alone
_BF16_MAX = tl.constexpr(3.3895313892515355e38)  # bf16's largest finite value (adamw_bf16._BF16_MAX)
_STREAM = tl.constexpr(WEIGHT_STREAM)


@triton.jit
def _address(ptrs, like, ALIGNED: tl.constexpr):
    """The pointer at ``ptrs`` (an int64 address), typed as ``like``; 16-byte aligned where the table says so (the
    compiler cannot see it through a load, and without it every access is a scalar one)."""
    ptr = tl.load(ptrs).to(tl.pointer_type(like.dtype.element_ty))
    if ALIGNED:
        ptr = tl.multiple_of(ptr, 16)
    return ptr


@triton.jit
def _tensor(p_ptr, g_ptr, m_ptr, v_ptr, c_ptr, step_ptr, ptrs, sizes, n, key, count, TABLE: tl.constexpr,
            ALIGNED: tl.constexpr):
    """This program's tensor and program index within it: the arguments as given and ``program_id(0)``, or
    (``TABLE``) row ``program_id(0)`` of the pointer table (``ptrs``: p, g, m, v, c, step addresses, each ``count``
    long; ``sizes``: numels, then keys) and ``program_id(1)``: tensors on the grid's first dimension, which has room
    for 2**31 of them (the others 65535). The table's loads do not wait for one another, nor for the flag's."""
    prog = tl.program_id(0).to(tl.int64)
    if TABLE:
        t = tl.program_id(0)
        prog = tl.program_id(1).to(tl.int64)
        p_ptr = _address(ptrs + t, p_ptr, ALIGNED)
        g_ptr = _address(ptrs + count + t, g_ptr, ALIGNED)
        m_ptr = _address(ptrs + 2 * count + t, m_ptr, ALIGNED)
        v_ptr = _address(ptrs + 3 * count + t, v_ptr, ALIGNED)
        c_ptr = _address(ptrs + 4 * count + t, c_ptr, ALIGNED)
        step_ptr = _address(ptrs + 5 * count + t, step_ptr, False)
        n = tl.load(sizes + t)
        key = tl.load(sizes + count + t).to(tl.int32)
    return p_ptr, g_ptr, m_ptr, v_ptr, c_ptr, step_ptr, n.to(tl.int64), key, prog


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
    _write(pp, cp, offs, mask, old, new, wkey, MODE)


@triton.jit(do_not_specialize=["n", "key", "count"])  # a key or size of 1 must not become a constant
def fp32_state_kernel(flag_ptr, p_ptr, g_ptr, m_ptr, v_ptr, c_ptr, step_ptr, ptrs, sizes, n, key, count,
                      lr_hi, lr_lo, b1_hi, b1_lo, b2_hi, b2_lo, b2, omb2, lerp_w, decay, eps,
                      MODE: tl.constexpr, KEYED: tl.constexpr, TABLE: tl.constexpr, ALIGNED: tl.constexpr,
                      BLOCK: tl.constexpr, BLOCKS: tl.constexpr):
    """torch's AdamW (decoupled decay, lerp, addcmul, addcdiv, in its order) on fp32 moments, the weight written
    compensated, over ``BLOCKS`` blocks of a tensor. ``key``: the tensor's position (its noise key is
    ``weight_key(position, step)``), or with ``KEYED`` the key itself."""
    void = tl.load(flag_ptr)
    pp, gp, mp, vp, cp, sp, numel, tkey, prog = _tensor(p_ptr, g_ptr, m_ptr, v_ptr, c_ptr, step_ptr, ptrs, sizes,
                                                        n, key, count, TABLE, ALIGNED)
    start = prog * (BLOCK * BLOCKS)
    if (void == 0) & (start < numel):
        step = tl.load(sp).to(tl.int32)
        bc1 = 1.0 - L.pow_int(b1_hi, b1_lo, step)  # float64, as torch's Python scalars
        step_size = ((tl.cast(lr_hi, tl.float64) + tl.cast(lr_lo, tl.float64)) / bc1).to(tl.float32)
        bc2_sqrt = tl.sqrt(1.0 - L.pow_int(b2_hi, b2_lo, step)).to(tl.float32)
        wkey = tkey if KEYED else L.weight_key(tkey, step)
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
    _write(pp, cp, offs, mask, old, new, wkey, MODE)


@triton.jit(do_not_specialize=["n", "key", "count"])
def bf16_state_kernel(flag_ptr, p_ptr, g_ptr, m_ptr, v_ptr, c_ptr, step_ptr, ptrs, sizes, n, key, count,
                      lr_hi, lr_lo, b1_hi, b1_lo, b2_hi, b2_lo, b1, omb1, b2, omb2, eps, decay,
                      MODE: tl.constexpr, TABLE: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr,
                      BLOCKS: tl.constexpr):
    """``adamw_bf16``'s eager kernel (``_adamw_update`` then ``write``) over ``BLOCKS`` blocks of a tensor: moments
    stored in bf16, ``exp_avg_sq`` rounded stochastically except under none; ``key``: the tensor's position (its
    noise id)."""
    void = tl.load(flag_ptr)
    pp, gp, mp, vp, cp, sp, numel, tkey, prog = _tensor(p_ptr, g_ptr, m_ptr, v_ptr, c_ptr, step_ptr, ptrs, sizes,
                                                        n, key, count, TABLE, ALIGNED)
    start = prog * (BLOCK * BLOCKS)
    if (void == 0) & (start < numel):
        step = tl.load(sp).to(tl.int32)
        one = tl.full((), 1.0, tl.float64)
        inv_bc2 = (one / tl.sqrt(one - L.pow_int(b2_hi, b2_lo, step))).to(tl.float32)
        lr = tl.cast(lr_hi, tl.float64) + tl.cast(lr_lo, tl.float64)
        step_size = (lr / (one - L.pow_int(b1_hi, b1_lo, step))).to(tl.float32)
        wkey = L.weight_key(tkey, step)  # the weight's stream; the moment's is noise_key(position, step)
        for first in range(start, tl.minimum(start + BLOCK * BLOCKS, numel), BLOCK):
            offs = first + tl.arange(0, BLOCK)
            if first + BLOCK <= numel:
                _bf16_block(pp, gp, mp, vp, cp, offs, None, wkey, step_size, inv_bc2, b1, omb1, b2, omb2, eps, decay,
                            MODE)
            else:
                _bf16_block(pp, gp, mp, vp, cp, offs, offs < numel, wkey, step_size, inv_bc2, b1, omb1, b2, omb2,
                            eps, decay, MODE)


_TABLES: OrderedDict = OrderedDict()  # (kernel, dtypes, device, first address, count) -> PointerTable
_MAX_TABLES = 64  # one per param group and dtype pair in use; bounded for processes that build many optimizers


def _table(name: str, lists, sizes, device) -> _triton.PointerTable:
    """The cached :class:`._triton.PointerTable` of these tensors, current (rebuilt only when an address or size
    changes)."""
    key = (name, tuple(ts[0].dtype for ts in lists), device, lists[0][0].data_ptr(), len(lists[0]))
    table = _TABLES.pop(key, None) or _triton.PointerTable()
    _TABLES[key] = table
    while len(_TABLES) > _MAX_TABLES:
        _TABLES.popitem(last=False)
    table.get(lists, sizes, device)
    return table


def launch(kernel, name: str, tensors, keys, flag, scalars, small: int | None = None, **constexprs) -> None:
    """``kernel`` over each tensor of ``tensors`` = (params, grads, exp_avgs, exp_avg_sqs, comps, steps): one launch
    per (weight, gradient) dtype pair over a pointer table, except the tensors :func:`plan` sets apart (``small``:
    probes and tests, to take both kinds), which get a launch each. ``comps`` entries may be None where the mode
    reads none (the weight stands in). ``keys``: each tensor's int key."""
    params, grads, ms, vs, comps, steps = tensors
    if not params:
        return
    device = params[0].device  # Triton launches on the current device: made this tensors' one, as torch's ops do
    with torch.cuda.device(device) if device.type == "cuda" else nullcontext():
        _launch(kernel, name, tensors, keys, flag, scalars, small, constexprs)


def plan(params, grads, small: int | None = None) -> tuple[list[int], list[list[int]]]:
    """``(alone, shared)``: the indices of the tensors that get a launch of their own (more than ``MAX_PROGRAMS``
    programs, or ``small`` elements or more), and one list per (weight, gradient) dtype pair of those that share
    one; empty tensors in neither. Reads only shapes and dtypes (meta tensors will do)."""
    alone_from = MAX_PROGRAMS * BLOCK * BLOCKS + 1
    alone_from = alone_from if small is None else min(alone_from, small)
    alone, shared = [], {}
    for i, p in enumerate(params):
        n = p.numel()
        if n >= alone_from:
            alone.append(i)
        elif n:
            shared.setdefault((p.dtype, grads[i].dtype), []).append(i)
    return alone, list(shared.values())


def _launch(kernel, name, tensors, keys, flag, scalars, small, constexprs) -> None:
    params, grads, ms, vs, comps, steps = tensors
    comps = [p if c is None else c for p, c in zip(params, comps)]
    span = BLOCK * BLOCKS  # elements per program
    opts = dict(num_warps=NUM_WARPS, enable_fp_fusion=False, BLOCK=BLOCK, BLOCKS=BLOCKS, **constexprs)
    alone, shared = plan(params, grads, small)
    for i in alone:  # its own arguments: Triton sees (and specialises on) their alignment itself
        kernel[(triton.cdiv(params[i].numel(), span),)](flag, params[i], grads[i], ms[i], vs[i], comps[i], steps[i],
                                                        flag, flag, params[i].numel(), keys[i], 1, *scalars,
                                                        TABLE=False, ALIGNED=False, **opts)
    for idx in shared:
        lists = [[ts[i] for i in idx] for ts in (params, grads, ms, vs, comps, steps)]
        numels = [params[i].numel() for i in idx]
        table = _table(name, lists, numels + [keys[i] for i in idx], params[idx[0]].device)
        first = [ts[0] for ts in lists]
        kernel[(len(idx), triton.cdiv(max(numels), span))](flag, *first, *table.tables, 0, 0, len(idx), *scalars,
                                                           TABLE=True, ALIGNED=table.aligned, **opts)


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
