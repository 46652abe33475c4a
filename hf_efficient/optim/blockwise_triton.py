"""The 8-bit families' Triton kernels (CUDA; CPU under the interpreter in tests): one launch per step for all of a
param group's 8-bit tensors of one (weight dtype, gradient dtype).

Launches: :func:`._triton.launch` (a pointer table of the tensors' addresses: weights, gradients, step counts, each
moment's codes, each moment's absmaxes, Kahan buffers; the grid has the tensors on axis 0 and each tensor's programs
on axes 1 and 2, programs of a tensor smaller than the largest returning at once; a tensor of more than
:data:`._triton.MAX_PROGRAMS` programs gets a launch of its own: a grid sized for it would be mostly early exits for
the others).

One program steps ``NB`` whole blocks of 256 elements in one pass, as a ``(4, NB, 64)`` tile (element ``64 * k + j``
of a block at row ``k``, column ``j``: the codes' in-memory order, see :mod:`.quant8_triton`): it reads the weight,
the gradient, the codes and absmaxes (and the Kahan buffer), computes the moments in fp32 in the order of the
family's eager ``_kernel``, and writes the codes, absmaxes and weight (bf16/fp16 through
:func:`._triton_lib.compensated`). The codec is :mod:`.quant8_triton`'s, so the codes are the eager kernel's exactly.
Conventions (the void flag, device step counts the kernels compute bias corrections and noise keys from) are
:mod:`._triton`'s; AdamW's bias corrections are computed once per tensor and step (:func:`._triton.adam_scalars`: a
launch of one program per tensor before the step's), not in every program. Bytes per parameter: the weight read
and written, the gradient read, each moment's code read and written, ~4 / 256 of absmax each way (and the Kahan
buffer's 2 + 2): fp32 weights 16 (AdamW) / 14 (Lion), bf16 weights 10 / 8 plus 4 under Kahan.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import _triton
from . import quant4_triton as Q4
from . import quant8_triton as Q
from .lion_triton import lion_update

__all__ = ["adamw8bit", "adamw4bit", "lion8bit", "NB", "NUM_WARPS"]

L = _triton.jit_helpers()
NB = 8  # blocks per program: 2048 elements, 16 a thread at 4 warps (its 4 rows of 4 columns)
NUM_WARPS = 4  # of an 8-bit program (NB and NUM_WARPS: read at each launch, so bench_cuda.py --sweep can vary them)
_F32_MAX = tl.constexpr(3.4028234663852886e38)


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
def _blocks4(first, n, NB: tl.constexpr, FULL: tl.constexpr):
    """:func:`_blocks` for the 4-bit codec (:mod:`.quant4_triton`): blocks of 128 elements as a ``(8, NB, 16)`` tile
    (element ``16 * k + j`` of block ``b`` at ``[k, b, j]``, nibble ``k`` of its word ``j``)."""
    blk = first // 128 + tl.arange(0, NB)
    offs = (tl.arange(0, 8) * 16)[:, None, None] + blk[None, :, None] * 128 + tl.arange(0, 16)[None, None, :]
    if FULL:
        emask = tl.full(offs.shape, 1, tl.int1)
    else:
        emask = offs < n
    return blk, blk * 128 < n, offs, emask


@triton.jit
def _adamw_update(old, g, m, v, beta1, omb1, beta2, omb2, inv_bc2, eps, decay, step_size):
    """``adamw8bit.adamw_update`` on fp32 tiles (decoded moments ``m``, ``v``): the new weight, m and v. Written once
    for the 8-bit and 4-bit kernels."""
    m = m * beta1 + g * omb1
    v = v * beta2 + (g * g) * omb2
    v = tl.where(v > _F32_MAX, _F32_MAX, v)  # clamp_max (a NaN stays): see adamw8bit.adamw_update
    return old * decay - tl.div_rn(m, tl.sqrt_rn(v) * inv_bc2 + eps) * step_size, m, v


@triton.jit
def _adamw8bit(table, info, count, t, n, first, coef, maps, omb1, omb2, eps, decay, beta1, beta2,
               MODE: tl.constexpr, OUT: tl.constexpr, GRAD: tl.constexpr, NB: tl.constexpr, ALIGNED: tl.constexpr,
               FULL: tl.constexpr, BITS: tl.constexpr):
    """:func:`adamw8bit_kernel`'s program (``BITS`` 4: :func:`adamw4bit_kernel`'s, the 4-bit codec's blocks and
    tiles), ``FULL`` as :func:`_blocks`. Tensors are promised aligned (``ALIGNED``)
    to 4 elements, a thread's vector in the tiles' layout (16 bytes of fp32, 8 of bf16): 8-element vectors of
    16-bit types would leave fewer threads on a row, and the compiler would spread a block's 4 rows over warps,
    its code words and absmax then exchanged through shared memory, with barriers."""
    step = tl.load(L.address(table, 2, count, t, tl.float32, 0)).to(tl.int32)
    step_size = tl.load(coef + 3 * t)  # _triton.adam_scalars', computed once per tensor and step
    inv_bc2 = tl.load(coef + 3 * t + 1)
    p_ptr = L.address(table, 0, count, t, OUT, OUT.primitive_bitwidth // 2 * ALIGNED)
    wm_ptr = L.address(table, 3, count, t, tl.int32, 16 * ALIGNED)
    wv_ptr = L.address(table, 4, count, t, tl.int32, 16 * ALIGNED)
    am_ptr = L.address(table, 5, count, t, tl.float32, 16 * ALIGNED)
    av_ptr = L.address(table, 6, count, t, tl.float32, 16 * ALIGNED)
    if BITS == 8:
        blk, bmask, offs, emask = _blocks(first, n, NB, FULL)
    else:
        blk, bmask, offs, emask = _blocks4(first, n, NB, FULL)
    g_ptr = L.address(table, 1, count, t, GRAD, GRAD.primitive_bitwidth // 2 * ALIGNED)
    g = tl.load(g_ptr + offs, mask=emask, other=0.0).to(tl.float32)
    old = tl.load(p_ptr + offs, mask=emask, other=0.0).to(tl.float32)
    if BITS == 8:
        new, m, v = _adamw_update(old, g, Q.load(wm_ptr, am_ptr, blk, bmask, maps, True),
                                  Q.load(wv_ptr, av_ptr, blk, bmask, maps, False), beta1, omb1, beta2, omb2, inv_bc2,
                                  eps, decay, step_size)
    else:
        new, m, v = _adamw_update(old, g, Q4.load(wm_ptr, am_ptr, blk, bmask, maps, True),
                                  Q4.load(wv_ptr, av_ptr, blk, bmask, maps, False), beta1, omb1, beta2, omb2, inv_bc2,
                                  eps, decay, step_size)
    L.write(p_ptr, L.address(table, 7, count, t, tl.bfloat16, 8 * ALIGNED), offs, emask, old, new,
            L.weight_key(tl.load(info + count + t).to(tl.int32), step), offs.to(tl.int32), MODE)
    if BITS == 8:
        Q.store(m, wm_ptr, am_ptr, blk, bmask, maps, True)
        Q.store(v, wv_ptr, av_ptr, blk, bmask, maps, False)
    else:
        Q4.store(m, wm_ptr, am_ptr, blk, bmask, True)
        Q4.store(v, wv_ptr, av_ptr, blk, bmask, False)


@triton.jit
def _adamw_of_program(table, info, flag_ptr, count, coef, maps, omb1, omb2, eps, decay, beta1, beta2,
                      MODE: tl.constexpr, OUT: tl.constexpr, GRAD: tl.constexpr, NB: tl.constexpr,
                      ALIGNED: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr):
    """What both AdamW entry kernels do: nothing when the void flag is set, else :func:`_adamw8bit` on this
    program's ``NB`` blocks of ``BLOCK`` elements, the whole-blocks body where they lie inside the tensor."""
    if tl.load(flag_ptr) != 0:
        return
    t, n, first = L.tensor_of_program(info, NB * BLOCK)
    if first >= n:
        return
    if first + NB * BLOCK <= n:
        _adamw8bit(table, info, count, t, n, first, coef, maps, omb1, omb2, eps, decay, beta1, beta2, MODE, OUT,
                   GRAD, NB, ALIGNED, True, BITS)
    else:
        _adamw8bit(table, info, count, t, n, first, coef, maps, omb1, omb2, eps, decay, beta1, beta2, MODE, OUT,
                   GRAD, NB, ALIGNED, False, BITS)


@triton.jit(do_not_specialize=["count"])
def adamw8bit_kernel(table, info, flag_ptr, count, coef, maps, omb1, omb2, eps, decay, beta1, beta2,
                     MODE: tl.constexpr, OUT: tl.constexpr, GRAD: tl.constexpr, NB: tl.constexpr,
                     ALIGNED: tl.constexpr):
    """``adamw8bit.adamw_update`` on ``NB`` blocks of tensor ``program_id(0)``; its step size and bias correction from
    ``coef`` (:func:`._triton.adam_scalars`). ``table`` rows: weights, gradients, step counts, first and second moment
    codes, their absmaxes, Kahan buffers; ``info``: sizes, then positions. ``beta*`` is ``fp32(beta*)``, eager's
    ``coef[0]`` / ``coef[2]``. An entry of its own (not one kernel with a BITS argument): scripts/triton_sass.py
    counts and bounds each codec's kernel by name."""
    _adamw_of_program(table, info, flag_ptr, count, coef, maps, omb1, omb2, eps, decay, beta1, beta2, MODE, OUT, GRAD,
                      NB, ALIGNED, 8, 256)


@triton.jit(do_not_specialize=["count"])
def adamw4bit_kernel(table, info, flag_ptr, count, coef, maps, omb1, omb2, eps, decay, beta1, beta2,
                     MODE: tl.constexpr, OUT: tl.constexpr, GRAD: tl.constexpr, NB: tl.constexpr,
                     ALIGNED: tl.constexpr):
    """:func:`adamw8bit_kernel` for AdamW4bit: ``NB`` blocks of 128 elements of tensor ``program_id(0)``, moments in
    :mod:`.quant4_triton`'s codec (``maps``: its signed map), the same table rows, scalars and update."""
    _adamw_of_program(table, info, flag_ptr, count, coef, maps, omb1, omb2, eps, decay, beta1, beta2, MODE, OUT, GRAD,
                      NB, ALIGNED, 4, 128)


@triton.jit
def _lion8bit(table, info, count, t, n, first, maps, b1, omb1, b2, omb2, decay, lr, MODE: tl.constexpr,
              OUT: tl.constexpr, GRAD: tl.constexpr, NB: tl.constexpr, ALIGNED: tl.constexpr, FULL: tl.constexpr):
    """:func:`lion8bit_kernel`'s program, ``FULL`` as :func:`_blocks`."""
    step = tl.load(L.address(table, 2, count, t, tl.float32, 0)).to(tl.int32)
    p_ptr = L.address(table, 0, count, t, OUT, OUT.primitive_bitwidth // 2 * ALIGNED)
    wm_ptr = L.address(table, 3, count, t, tl.int32, 16 * ALIGNED)
    am_ptr = L.address(table, 4, count, t, tl.float32, 16 * ALIGNED)
    blk, bmask, offs, emask = _blocks(first, n, NB, FULL)
    g_ptr = L.address(table, 1, count, t, GRAD, GRAD.primitive_bitwidth // 2 * ALIGNED)
    g = tl.load(g_ptr + offs, mask=emask, other=0.0).to(tl.float32)
    old = tl.load(p_ptr + offs, mask=emask, other=0.0).to(tl.float32)
    new, m = lion_update(old, g, Q.load(wm_ptr, am_ptr, blk, bmask, maps, True), b1, omb1, b2, omb2, decay, lr)
    L.write(p_ptr, L.address(table, 5, count, t, tl.bfloat16, 8 * ALIGNED), offs, emask, old, new,
            L.weight_key(tl.load(info + count + t).to(tl.int32), step), offs.to(tl.int32), MODE)
    Q.store(m, wm_ptr, am_ptr, blk, bmask, maps, True)


@triton.jit(do_not_specialize=["count"])
def lion8bit_kernel(table, info, flag_ptr, count, maps, b1, omb1, b2, omb2, decay, lr, MODE: tl.constexpr,
                    OUT: tl.constexpr, GRAD: tl.constexpr, NB: tl.constexpr, ALIGNED: tl.constexpr):
    """``lion8bit._kernel`` on ``NB`` blocks of tensor ``program_id(0)`` (the step only keys the rounding noise).
    ``table`` rows: weights, gradients, step counts, momentum codes, absmaxes, Kahan buffers; ``info``: sizes, then
    positions."""
    if tl.load(flag_ptr) != 0:
        return
    t, n, first = L.tensor_of_program(info, NB * 256)
    if first >= n:
        return
    if first + NB * 256 <= n:
        _lion8bit(table, info, count, t, n, first, maps, b1, omb1, b2, omb2, decay, lr, MODE, OUT, GRAD, NB,
                  ALIGNED, True)
    else:
        _lion8bit(table, info, count, t, n, first, maps, b1, omb1, b2, omb2, decay, lr, MODE, OUT, GRAD, NB,
                  ALIGNED, False)


def _launch_8bit(kernel, moments, items, flag, tables, scalars, mode, prepare=None, codec=Q, block=256) -> None:
    """The quantized ``kernel`` over ``items`` ((p, g, state, position): contiguous, steps already counted on the
    device) through :func:`._triton.launch`: table rows weight, gradient, step, each moment's codes, each moment's
    absmaxes, Kahan buffer (the weight itself where none is read). ``codec``: its Triton codec (its tables passed),
    ``block``: its elements per block."""
    rows = [(position, [p, g, state["step"], *(state[k] for k in moments), *(state[f"{k}_absmax"] for k in moments),
                        state.get("kahan_comp", p) if mode == "kahan" else p])
            for p, g, state, position in items]
    _triton.launch(kernel, rows, tables, flag, (codec.tables(items[0][0].device), *scalars), mode, NB * block,
                   num_warps=NUM_WARPS, prepare=prepare, NB=NB)


def adamw8bit(items, flag, group: dict, mode: str, tables: dict, kernel=None, codec=Q, block=256) -> None:
    """One AdamW8bit step of ``items`` ((p, g, state, position) of one device; see :func:`_launch_8bit`);
    ``kernel``, ``codec``, ``block``: :func:`adamw4bit`'s."""
    beta1, beta2 = group["betas"]
    lr = group["lr"]
    _launch_8bit(kernel or adamw8bit_kernel, ("exp_avg", "exp_avg_sq"), items, flag, tables,
                 (1.0 - beta1, 1.0 - beta2, group["eps"], 1.0 - lr * group["weight_decay"],
                  _triton.split64(beta1)[0], _triton.split64(beta2)[0]), mode, _triton.adam_scalars(lr, beta1, beta2),
                 codec, block)


def adamw4bit(items, flag, group: dict, mode: str, tables: dict) -> None:
    """One AdamW4bit step of ``items``: :func:`adamw8bit` with :func:`adamw4bit_kernel` and the 4-bit codec."""
    adamw8bit(items, flag, group, mode, tables, adamw4bit_kernel, Q4, 128)


def lion8bit(items, flag, group: dict, mode: str, tables: dict) -> None:
    """One Lion8bit step of ``items`` ((p, g, state, position) of one device; see :func:`_launch_8bit`). Its scalars
    are Lion8bit's (``lion8bit._c_coefficients``), each rounded to fp32 by the launch as there by ``array("f")``."""
    beta1, beta2 = group["betas"]
    lr = group["lr"]
    _launch_8bit(lion8bit_kernel, ("exp_avg",), items, flag, tables,
                 (beta1, 1.0 - beta1, beta2, 1.0 - beta2, 1.0 - lr * group["weight_decay"], lr), mode)
