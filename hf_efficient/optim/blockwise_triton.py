"""The 8-bit families' Triton kernels (CUDA; CPU under the interpreter in tests): one launch per step for all of a
param group's 8-bit tensors of one (weight dtype, gradient dtype).

Launches (:func:`launch`, shared with :mod:`.lion_triton`): a :class:`._triton.PointerTable` holds the tensors'
addresses, sizes and positions; the grid has the tensors on axis 0 and each tensor's programs on axes 1 and 2
(programs of a tensor smaller than the largest return at once). A tensor of more than :data:`MAX_PROGRAMS` programs
gets a launch of its own: a grid sized for it would be mostly early exits for the others.

One program steps ``NB`` whole blocks of 256 elements in one pass, as a ``(4, NB, 64)`` tile (element ``64 * k + j``
of a block at row ``k``, column ``j``: the codes' in-memory order, see :mod:`.quant8_triton`): it reads the weight,
the gradient, the codes and absmaxes (and the Kahan buffer), computes the moments in fp32 in the order of the
family's eager ``_kernel``, and writes the codes, absmaxes and weight (bf16/fp16 through
:func:`._triton_lib.compensated`). The codec is :mod:`.quant8_triton`'s, so the codes are the eager kernel's exactly.
Conventions (the void flag, device step counts the kernels compute bias corrections and noise keys from) are
:mod:`._triton`'s; AdamW's bias corrections are computed once per tensor and step by :func:`adam_scalars_kernel`
(a launch of one program per tensor before the step's), not in every program. Bytes per parameter: the weight read
and written, the gradient read, each moment's code read and written, ~4 / 256 of absmax each way (and the Kahan
buffer's 2 + 2): fp32 weights 16 (AdamW) / 14 (Lion), bf16 weights 10 / 8 plus 4 under Kahan.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl

from . import _triton
from . import quant8_triton as Q

__all__ = ["adamw8bit", "lion8bit", "launch", "NB", "NUM_WARPS", "MAX_PROGRAMS"]

L = _triton.jit_helpers()
NB = 8  # blocks per program: 2048 elements, 16 a thread at 4 warps (its 4 rows of 4 columns)
NUM_WARPS = 4  # of an 8-bit program (NB and NUM_WARPS: read at each launch, so bench_cuda.py --sweep can vary them)
MAX_PROGRAMS = 65535  # CUDA's limit on a grid's axes 1 and 2: a tensor of more programs spans both, alone
_F32_MAX = tl.constexpr(3.4028234663852886e38)
_split = lru_cache(maxsize=64)(_triton.split64)  # per group and step otherwise: a few torch ops each on the host
_OUT = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def tensor_of_program(info, BLOCK: tl.constexpr):
    """This program's tensor ``t`` (grid axis 0), its size ``n`` (``info[t]``) and its first element (int64: tensors
    over 2**31 bytes); programs of ``BLOCK`` elements numbered over axes 1 and 2."""
    t = tl.program_id(0)
    program = tl.program_id(1) + tl.program_id(2) * tl.num_programs(1)
    return t, tl.load(info + t), program.to(tl.int64) * BLOCK


@triton.jit
def address(table, row, count, t, TYPE: tl.constexpr, ALIGN: tl.constexpr):
    """Tensor ``t``'s address in row ``row`` of a pointer table of ``count`` tensors, as a pointer to ``TYPE``,
    promised a multiple of ``ALIGN`` bytes (0: nothing promised) so that loads through it are vectors of that size:
    the compiler cannot see the alignment of an address read from memory, and a misaligned vector load faults."""
    ptr = tl.load(table + row * count + t).to(tl.pointer_type(TYPE))
    if ALIGN > 0:
        ptr = tl.multiple_of(ptr, ALIGN)
    return ptr


@triton.jit
def _blocks(first, n, NB: tl.constexpr, FULL: tl.constexpr):
    """This program's blocks ``(NB,)`` from element ``first``, which exist, their element offsets ``(4, NB, 64)``
    (``[k, b, j]``: element ``64 * k + j`` of block ``b``) and which are in the tensor (the last block
    is zero-padded, as eager's). ``FULL``: every element is (the mask a constant: the compiler keeps loads 16-byte
    vectors, which a mask against ``n``, read from memory and of unknown divisibility, would split)."""
    blk = first // 256 + tl.arange(0, NB)
    offs = (tl.arange(0, 4) * 64)[:, None, None] + blk[None, :, None] * 256 + tl.arange(0, 64)[None, None, :]
    if FULL:
        emask = tl.full(offs.shape, 1, tl.int1)
    else:
        emask = offs < n
    return blk, blk * 256 < n, offs, emask


@triton.jit
def _write(p_ptr, comp_ptr, old, new, offs, emask, position, step, MODE: tl.constexpr, OUT: tl.constexpr):
    """The new weight stored in ``OUT`` under compensation ``MODE`` (and the Kahan buffer, bf16), noise keyed by the
    parameter's position and step and numbered by element, as ``compensation.write``."""
    kahan: tl.constexpr = MODE == 0 and OUT != tl.float32
    if kahan:
        comp = tl.load(comp_ptr + offs, mask=emask, other=0.0).to(tl.float32)
    else:
        comp = old
    key = L.weight_key(tl.full((), 0, tl.int32) + position, step)  # a position of 1 could arrive as a constexpr
    w, c = L.compensated(old, new, comp, key, offs.to(tl.int32), MODE, OUT)
    tl.store(p_ptr + offs, w, mask=emask)
    if kahan:
        tl.store(comp_ptr + offs, L.to_bf16(c), mask=emask)


@triton.jit
def _adamw8bit(table, info, count, t, n, first, coef, maps, omb1, omb2, eps, decay, beta1, beta2,
               MODE: tl.constexpr, OUT: tl.constexpr, GRAD: tl.constexpr, NB: tl.constexpr, ALIGNED: tl.constexpr,
               FULL: tl.constexpr):
    """:func:`adamw8bit_kernel`'s program, ``FULL`` as :func:`_blocks`. Tensors are promised aligned (``ALIGNED``)
    to 4 elements, a thread's vector in the tiles' layout (16 bytes of fp32, 8 of bf16): 8-element vectors of
    16-bit types would leave fewer threads on a row, and the compiler would spread a block's 4 rows over warps,
    its code words and absmax then exchanged through shared memory, with barriers."""
    step = tl.load(address(table, 7, count, t, tl.float32, 0)).to(tl.int32)
    step_size = tl.load(coef + 2 * t)  # adam_scalars_kernel's, computed once per tensor and step
    inv_bc2 = tl.load(coef + 2 * t + 1)
    p_ptr = address(table, 0, count, t, OUT, OUT.primitive_bitwidth // 2 * ALIGNED)
    wm_ptr = address(table, 2, count, t, tl.int32, 16 * ALIGNED)
    wv_ptr = address(table, 3, count, t, tl.int32, 16 * ALIGNED)
    am_ptr = address(table, 4, count, t, tl.float32, 16 * ALIGNED)
    av_ptr = address(table, 5, count, t, tl.float32, 16 * ALIGNED)
    blk, bmask, offs, emask = _blocks(first, n, NB, FULL)
    g_ptr = address(table, 1, count, t, GRAD, GRAD.primitive_bitwidth // 2 * ALIGNED)
    g = tl.load(g_ptr + offs, mask=emask, other=0.0).to(tl.float32)
    m = Q.load(wm_ptr, am_ptr, blk, bmask, maps, True) * beta1 + g * omb1
    v = Q.load(wv_ptr, av_ptr, blk, bmask, maps, False) * beta2 + (g * g) * omb2
    v = tl.where(v > _F32_MAX, _F32_MAX, v)  # clamp_max (a NaN stays): see adamw8bit._kernel
    old = tl.load(p_ptr + offs, mask=emask, other=0.0).to(tl.float32)
    new = old * decay - tl.div_rn(m, tl.sqrt_rn(v) * inv_bc2 + eps) * step_size
    _write(p_ptr, address(table, 6, count, t, tl.bfloat16, 8 * ALIGNED), old, new, offs, emask,
           tl.load(info + count + t).to(tl.int32), step, MODE, OUT)
    Q.store(m, wm_ptr, am_ptr, blk, bmask, maps, True)
    Q.store(v, wv_ptr, av_ptr, blk, bmask, maps, False)


@triton.jit(do_not_specialize=["count"])
def adam_scalars_kernel(table, count, coef, lr_hi, lr_lo, beta1_hi, beta1_lo, beta2_hi, beta2_lo):
    """Tensor ``program_id(0)``'s step size and ``1 / sqrt(bias correction 2)`` into ``coef[2t]``, ``coef[2t+1]``
    (fp32), in float64 from its step count on the device, as eager's ``_coefficients``: once per tensor and step
    (a launch of one program per tensor before :func:`adamw8bit_kernel`), not in every program of every tensor, where
    the serial float64 powers, division and square root were a tenth of the kernel's instructions and held each
    program back before its first load. ``table`` row 7: the step counts."""
    t = tl.program_id(0)
    step = tl.load(address(table, 7, count, t, tl.float32, 0)).to(tl.int32)
    one = tl.full((), 1.0, tl.float64)
    lr = tl.cast(lr_hi, tl.float64) + tl.cast(lr_lo, tl.float64)
    # float64 division and square root are correctly rounded on the GPU (PTX has no approximate fp64 forms)
    tl.store(coef + 2 * t, (lr / (one - L.pow_int(beta1_hi, beta1_lo, step))).to(tl.float32))
    tl.store(coef + 2 * t + 1, (one / tl.sqrt(one - L.pow_int(beta2_hi, beta2_lo, step))).to(tl.float32))


@triton.jit(do_not_specialize=["count"])
def adamw8bit_kernel(table, info, flag_ptr, count, coef, maps, omb1, omb2, eps, decay, beta1, beta2,
                     MODE: tl.constexpr, OUT: tl.constexpr, GRAD: tl.constexpr, NB: tl.constexpr,
                     ALIGNED: tl.constexpr):
    """``adamw8bit._kernel`` on ``NB`` blocks of tensor ``program_id(0)``; its step size and bias correction from
    ``coef`` (:func:`adam_scalars_kernel`). ``table`` rows: weights, gradients, first and second moment codes, their
    absmaxes, Kahan buffers, step counts; ``info``: sizes, then positions. ``beta*`` is ``fp32(beta*)``, eager's
    ``coef[0]`` / ``coef[2]``."""
    if tl.load(flag_ptr) != 0:
        return
    t, n, first = tensor_of_program(info, NB * 256)
    if first >= n:
        return
    if first + NB * 256 <= n:
        _adamw8bit(table, info, count, t, n, first, coef, maps, omb1, omb2, eps, decay, beta1, beta2, MODE, OUT,
                   GRAD, NB, ALIGNED, True)
    else:
        _adamw8bit(table, info, count, t, n, first, coef, maps, omb1, omb2, eps, decay, beta1, beta2, MODE, OUT,
                   GRAD, NB, ALIGNED, False)


@triton.jit
def _lion8bit(table, info, count, t, n, first, maps, b1, omb1, b2, omb2, decay, lr, MODE: tl.constexpr,
              OUT: tl.constexpr, GRAD: tl.constexpr, NB: tl.constexpr, ALIGNED: tl.constexpr, FULL: tl.constexpr):
    """:func:`lion8bit_kernel`'s program, ``FULL`` as :func:`_blocks`."""
    step = tl.load(address(table, 5, count, t, tl.float32, 0)).to(tl.int32)
    p_ptr = address(table, 0, count, t, OUT, OUT.primitive_bitwidth // 2 * ALIGNED)
    wm_ptr = address(table, 2, count, t, tl.int32, 16 * ALIGNED)
    am_ptr = address(table, 3, count, t, tl.float32, 16 * ALIGNED)
    blk, bmask, offs, emask = _blocks(first, n, NB, FULL)
    g_ptr = address(table, 1, count, t, GRAD, GRAD.primitive_bitwidth // 2 * ALIGNED)
    g = tl.load(g_ptr + offs, mask=emask, other=0.0).to(tl.float32)
    m = Q.load(wm_ptr, am_ptr, blk, bmask, maps, True)
    u = m * b1 + g * omb1
    update = tl.where(u > 0, lr, tl.where(u < 0, -lr, 0.0))  # torch.sign(u) * lr exactly (0 for NaN, as on CPU)
    old = tl.load(p_ptr + offs, mask=emask, other=0.0).to(tl.float32)
    _write(p_ptr, address(table, 4, count, t, tl.bfloat16, 8 * ALIGNED), old, old * decay - update, offs,
           emask, tl.load(info + count + t).to(tl.int32), step, MODE, OUT)
    Q.store(m * b2 + g * omb2, wm_ptr, am_ptr, blk, bmask, maps, True)


@triton.jit(do_not_specialize=["count"])
def lion8bit_kernel(table, info, flag_ptr, count, maps, b1, omb1, b2, omb2, decay, lr, MODE: tl.constexpr,
                    OUT: tl.constexpr, GRAD: tl.constexpr, NB: tl.constexpr, ALIGNED: tl.constexpr):
    """``lion8bit._kernel`` on ``NB`` blocks of tensor ``program_id(0)`` (the step only keys the rounding noise).
    ``table`` rows: weights, gradients, momentum codes, absmaxes, Kahan buffers, step counts; ``info``: sizes, then
    positions."""
    if tl.load(flag_ptr) != 0:
        return
    t, n, first = tensor_of_program(info, NB * 256)
    if first >= n:
        return
    if first + NB * 256 <= n:
        _lion8bit(table, info, count, t, n, first, maps, b1, omb1, b2, omb2, decay, lr, MODE, OUT, GRAD, NB,
                  ALIGNED, True)
    else:
        _lion8bit(table, info, count, t, n, first, maps, b1, omb1, b2, omb2, decay, lr, MODE, OUT, GRAD, NB,
                  ALIGNED, False)


def launch(kernel, items, tables: dict, flag, scalars: tuple, mode: str, per_program: int, num_warps: int = 4,
           prepare=None, **constexprs) -> None:
    """``kernel`` over ``items`` (``(position, [weight, gradient, *more tensors])``, all on one device): one launch
    per (weight dtype, gradient dtype), the tensors on grid axis 0, their programs of ``per_program`` elements on
    axes 1 and 2; a tensor of more than :data:`MAX_PROGRAMS` programs in a launch of its own. Arguments: the pointer
    table (one row per tensor list), sizes and positions, ``flag``, the count of tensors, ``scalars``; constexprs
    ``MODE``, ``OUT``, ``GRAD``, ``ALIGNED`` and ``constexprs``. ``tables``: the caller's dict of
    :class:`._triton.PointerTable`, kept between steps (a table per set of tensors: gradient release steps a
    different bucket each call, the same ones each step). ``prepare(addresses, count, key)``: a launch's own leading
    arguments before ``scalars`` (``key``: its table's, for buffers kept in ``tables`` with it)."""
    batches = {}
    for position, tensors in items:
        p, g = tensors[0], tensors[1]
        alone = triton.cdiv(p.numel(), per_program) > MAX_PROGRAMS
        batches.setdefault((p.dtype, g.dtype, p.device, position if alone else None), []).append((position, tensors))
    for kind, batch in batches.items():
        positions = [position for position, _ in batch]
        sizes = [tensors[0].numel() for _, tensors in batch]
        key = (kernel, *kind[:3], *positions)
        table = tables.setdefault(key, _triton.PointerTable())
        addresses, info = table.get([list(row) for row in zip(*(tensors for _, tensors in batch))],
                                    sizes + positions, kind[2])
        programs = triton.cdiv(max(sizes), per_program)
        grid = (len(batch), min(programs, MAX_PROGRAMS), triton.cdiv(programs, MAX_PROGRAMS))
        lead = () if prepare is None else prepare(addresses, len(batch), key)
        kernel[grid](addresses, info, flag, len(batch), *lead, *scalars, MODE=_triton.C_MODES[mode], OUT=_OUT[kind[0]],
                     GRAD=_OUT[kind[1]], ALIGNED=table.aligned, num_warps=num_warps, enable_fp_fusion=False,
                     **constexprs)


def _launch_8bit(kernel, moments, items, flag, tables, scalars, mode, prepare=None) -> None:
    """The 8-bit ``kernel`` over ``items`` ((p, g, state, position): contiguous, steps already counted on the
    device): table rows weight, gradient, each moment's codes, each moment's absmaxes, Kahan buffer (the weight
    itself where none is read), step."""
    rows = [(position, [p, g, *(state[k] for k in moments), *(state[f"{k}_absmax"] for k in moments),
                        state.get("kahan_comp", p) if mode == "kahan" else p, state["step"]])
            for p, g, state, position in items]
    launch(kernel, rows, tables, flag, (Q.tables(items[0][0].device), *scalars), mode, NB * 256, NUM_WARPS,
           prepare, NB=NB)


def adamw8bit(items, flag, group: dict, mode: str, tables: dict) -> None:
    """One AdamW8bit step of ``items`` ((p, g, state, position) of one device; see :func:`_launch_8bit`)."""
    beta1, beta2 = group["betas"]
    lr = group["lr"]
    powers = (*_split(lr), *_split(beta1), *_split(beta2))

    def prepare(addresses, count: int, key) -> tuple:  # each tensor's step size and bias correction, once
        coef = tables.get((key, "coef"))
        if coef is None or coef.numel() != 2 * count:
            coef = tables[(key, "coef")] = torch.empty(2 * count, dtype=torch.float32, device=addresses.device)
        adam_scalars_kernel[(count,)](addresses, count, coef, *powers, num_warps=1)
        return (coef,)

    _launch_8bit(adamw8bit_kernel, ("exp_avg", "exp_avg_sq"), items, flag, tables,
                 (1.0 - beta1, 1.0 - beta2, group["eps"], 1.0 - lr * group["weight_decay"], _split(beta1)[0],
                  _split(beta2)[0]), mode, prepare)


def lion8bit(items, flag, group: dict, mode: str, tables: dict) -> None:
    """One Lion8bit step of ``items`` ((p, g, state, position) of one device; see :func:`_launch_8bit`). Its scalars
    are Lion8bit's (``lion8bit._c_coefficients``), each rounded to fp32 by the launch as there by ``array("f")``."""
    beta1, beta2 = group["betas"]
    lr = group["lr"]
    _launch_8bit(lion8bit_kernel, ("exp_avg",), items, flag, tables,
                 (beta1, 1.0 - beta1, beta2, 1.0 - beta2, 1.0 - lr * group["weight_decay"], lr), mode)
