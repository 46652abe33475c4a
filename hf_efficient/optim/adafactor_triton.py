"""Adafactor's step on CUDA in Triton: :func:`.adafactor._eager_step`'s operations, in its order, with no host sync.

Imported only where Triton is (see :mod:`._triton` for the conventions every kernel follows: the void flag, device
step counts, ``MODE``, bf16 stores, the compensated write).

Matrices (each a batch of ``B`` contiguous ``n x m`` matrices) of one kind (param group, weight and gradient dtypes,
first moment, compensation, tile width) take three launches in all, over one :class:`._triton.PointerTable` in
:mod:`._triton`'s layout (weights, gradients, step counts, then each matrix's statistics, exp_avg, Kahan buffer; its
info: sizes, program counts, offsets in the launch's one scratch, positions). Grid: matrices on dim 0, a matrix's
programs on dim 1 (a pass with more than :data:`._triton.MAX_PROGRAMS` programs for a matrix loops over them);
programs beyond a smaller matrix's count return at once.

1. :func:`_stats_kernel`, a program per block of whole rows: reads g for the row sums of g*g/k and writes the new
   row statistics, then reads the same rows again (from L2) for their part of the column sums and of
   ``D_j = sum_i (g_ij / k) * (g_ij / row_i)`` (the update's factored sum of squares, see :mod:`.adafactor`), and
   their part of the row mean (float64). The parts go to the scratch, at most :data:`_SCRATCH_BYTES` for the launch
   (the matrices share it in proportion to their size).
2. :func:`_cols_kernel`, a program per block of columns: adds the parts in block order (deterministic: no atomics),
   writes the new column statistics, ``1 / sqrt(col)`` for the update, and its part of the sum of squares (float64).
3. :func:`_update_kernel`, a program per :data:`_TILES_PER_PROGRAM` tiles: sums the parts into the RMS clip scale
   (float64, on the device) once, then for each tile reads g again and writes the weight (``exp_avg``, the
   compensation) in one pass.

Vectors (biases, norms) take one launch per kind over their own table: :func:`_vector_kernel`, a program per
vector, reads it twice (statistics and the sum of squares, then the update).

``ALIGNED`` (constexpr): every address in the table is 16-byte aligned and every row (vector) length a multiple of 16
elements; the kernels then promise it to the compiler (``tl.multiple_of``), which cannot see it in values read from
memory, and loads and stores stay 16-byte vectors. Per element, the update pass does its index arithmetic in int32
within a tile (the tile's start in int64, once) and takes each lerp's side once per program (the weights are
scalars), not per element.

fp32 arithmetic is the eager step's, operation for operation: lerp as torch's fused multiply-add, ``rsqrt`` as
``1 / sqrt`` correctly rounded (``div_rn``, ``sqrt_rn``: Triton's defaults are approximate on a GPU), clamps that keep
NaN. Sums differ from torch's in order only (row, column and D sums in fp32, the sums of squares in float64), as the
C kernel's do, and are held to the same tolerances (:func:`.adafactor._agree`).
"""

from __future__ import annotations

import functools
from contextlib import nullcontext

import torch
import triton
import triton.language as tl

from . import _triton

L = _triton.jit_helpers()

__all__ = ["step"]

_FP32_MAX = tl.constexpr(3.4028234663852886e38)
_SQRT_FP32_MAX = tl.constexpr(18446742974197923840.0)  # 2**64 (1 - 2**-24): the largest fp32 whose square is finite
_SCRATCH_BYTES = 32 << 20  # the column and D parts of one launch's matrices, whatever the model's size
_PROGRAMS = 4  # stats-pass programs per SM aimed at, for all of a launch's matrices (fewer where scratch or rows end)
_ROWS_TILE = 8192  # bytes of gradient in a tile of the stats pass (64 a thread: 2048 fp32 or 4096 bf16 elements)
_TILE = 4096  # elements of a tile of the update pass (16-byte vector loads for every dtype)
_COLS = 512  # columns of a program of the column pass
# columns of a tile of the stats pass: its 4 warps side by side along a row, each thread a 16-byte vector (512 fp32
# or 1024 bf16 / fp16 columns), so the column sums over the tile's rows stay within each thread; with a narrower
# tile the warps split rows, and each column sum crossed warps through shared memory, behind barriers, per tile.
# Both 4 rows deep: the column and D parts are read and written once per tile's rows (L2 traffic per gradient byte)
_STATS_COLS = {4: 512, 2: 1024}
_WIDE = 1024  # columns of a tile of the update pass; narrower matrices get tiles of their width (a kind each)
_PART = 256  # elements of the float64 parts summed at a time
_TILES_PER_PROGRAM = 4  # update-pass tiles a program steps: its setup (table, clip scale, noise key) paid once for them

# the pointer table's lists, in order (_triton's rows first; a tensor a matrix does not have: its weight's address,
# never read) ...
_P, _G, _STEP, _ROW, _COL, _EA, _COMP = (tl.constexpr(i) for i in range(7))
# ... and the size table's fields: sizes, programs per pass, offsets in the scratch's parts, the noise position
_N, _M, _B, _NP, _R, _NC, _AT_PART, _AT_MEAN, _AT_CINV, _AT_OVER, _POS = (tl.constexpr(i) for i in range(11))


@triton.jit
def _lerp(start, end, w):
    """torch.lerp with a scalar weight: a fused multiply-add from the nearer end (as torch's and adafactor_cpu.c's),
    the end chosen once for all elements."""
    diff = end - start
    if w < 0.5:
        out = tl.fma(w, diff, start)
    else:
        out = tl.fma(w - 1.0, diff, end)
    return out


@triton.jit
def _rsqrt(x):
    """torch.rsqrt as the CPU computes it: ``1 / sqrt(x)``, both rounded to nearest."""
    return tl.div_rn(tl.full(x.shape, 1.0, tl.float32), tl.sqrt_rn(x))


@triton.jit
def _clamp_max(x):
    """``x.clamp(max=fp32 max)``: a NaN stays NaN (``tl.minimum`` would drop it on a GPU)."""
    return tl.where(x > _FP32_MAX, _FP32_MAX, x)


@triton.jit
def _beta2_weight(step_ptr, rate_hi, rate_lo):
    """``1 - beta2_t = t ** decay_rate`` (the lerp weight of the second moment), from the device step count: in
    float64 then rounded, as the host's ``step ** decay_rate`` is where torch takes it (``decay_rate`` as float64
    halves, :func:`._triton.split64`)."""
    t = tl.load(step_ptr).to(tl.float64)
    return tl.exp(tl.log(t) * (tl.cast(rate_hi, tl.float64) + tl.cast(rate_lo, tl.float64))).to(tl.float32)


@triton.jit
def _ratio(a, b):
    """``a / b`` (int32 scalars) as the host passed it: a Python float, rounded to fp32 at the launch."""
    return (a.to(tl.float64) / b.to(tl.float64)).to(tl.float32)


@triton.jit
def _clip_scale(sumsq, numel, clip_hi, clip_lo):
    """``1 / max(sqrt(sumsq / numel) / clip, 1)`` in float64 (:func:`.adafactor._clip_scale`)."""
    clip = tl.cast(clip_hi, tl.float64) + tl.cast(clip_lo, tl.float64)
    rms = tl.sqrt(sumsq / tl.maximum(tl.cast(numel, tl.float64), 1.0)) / clip
    return 1.0 / tl.where(rms > 1.0, rms, 1.0)  # a NaN rms stays NaN, as Python's max(nan, 1.0) does not


@triton.jit
def _sum_part(ptr, start, count, PART: tl.constexpr):
    """float64 sum of ``ptr[start:start + count]`` (a fixed order: the same bits in every program that sums it)."""
    acc = tl.zeros((PART,), tl.float64)
    for i in range(0, count, PART):
        offs = i + tl.arange(0, PART)
        acc += tl.load(ptr + start + offs, mask=offs < count, other=0.0)
    return tl.sum(acc, axis=0)


@triton.jit
def _row_mean(mean_ptr, b, P, n, PART: tl.constexpr):
    """Matrix ``b``'s row mean, fp32 (``row.div(n).sum(dtype=float64).float().clamp(max)``) from the stats pass's
    per-program parts."""
    return _clamp_max(_sum_part(mean_ptr, b.to(tl.int64) * P, P, PART).to(tl.float32))


# ----------------------------------------------------------------------------------------------------
# Reading the tables: matrix t = program_id(0)
# ----------------------------------------------------------------------------------------------------


@triton.jit
def _dims(sizes, count, t, ALIGNED: tl.constexpr):
    """Matrix ``t``'s rows, columns and batch (int32); with ``ALIGNED`` its rows start 16 elements apart (a row of
    ``m`` elements keeps every tile's loads 16-byte vectors)."""
    m = tl.load(sizes + _M * count + t).to(tl.int32)
    if ALIGNED:
        m = tl.multiple_of(m, 16)
    return tl.load(sizes + _N * count + t).to(tl.int32), m, tl.load(sizes + _B * count + t).to(tl.int32)


@triton.jit
def _matrix(ptrs, sizes, count, t, PDT: tl.constexpr, GDT: tl.constexpr, ALIGNED: tl.constexpr):
    """Matrix ``t``'s tensors (weight, gradient, row and column statistics, step, exp_avg, Kahan buffer: stand-ins
    where it has none, never read), then its programs per pass (stats P, rows per stats program R, columns C), its
    offsets in the scratch's four parts (multiples of 16 elements) and its noise position. One call: Triton's
    interpreter (the tests) pays for every call of a device function."""
    p = tl.load(ptrs + _P * count + t).to(tl.pointer_type(PDT))
    g = tl.load(ptrs + _G * count + t).to(tl.pointer_type(GDT))
    col = tl.load(ptrs + _COL * count + t).to(tl.pointer_type(tl.float32))
    ea = tl.load(ptrs + _EA * count + t).to(tl.pointer_type(tl.float32))
    comp = tl.load(ptrs + _COMP * count + t).to(tl.pointer_type(tl.bfloat16))
    at_part = tl.load(sizes + _AT_PART * count + t)
    at_cinv = tl.load(sizes + _AT_CINV * count + t)
    if ALIGNED:
        p, g, col, ea, comp = (tl.multiple_of(p, 16), tl.multiple_of(g, 16), tl.multiple_of(col, 16),
                               tl.multiple_of(ea, 16), tl.multiple_of(comp, 16))
        at_part, at_cinv = tl.multiple_of(at_part, 16), tl.multiple_of(at_cinv, 16)
    return (p, g, tl.load(ptrs + _ROW * count + t).to(tl.pointer_type(tl.float32)), col,
            tl.load(ptrs + _STEP * count + t).to(tl.pointer_type(tl.float32)), ea, comp,
            tl.load(sizes + _NP * count + t).to(tl.int32), tl.load(sizes + _R * count + t).to(tl.int32),
            tl.load(sizes + _NC * count + t).to(tl.int32), at_part, tl.load(sizes + _AT_MEAN * count + t), at_cinv,
            tl.load(sizes + _AT_OVER * count + t), tl.load(sizes + _POS * count + t).to(tl.int32))


# ----------------------------------------------------------------------------------------------------
# The three passes of the matrices
# ----------------------------------------------------------------------------------------------------


@triton.jit
def _stats_rows(g_ptr, row_ptr, part, mean_at, start, end, n, m, inv_k, k_cols, eps, w, BR: tl.constexpr,
                BC: tl.constexpr):
    """Rows ``start:end`` of one matrix (``g_ptr``, ``row_ptr``: its own): the new row statistics, then, from the
    same rows again, this program's column and D parts (``part``: 2 m floats) and its part of the row mean."""
    mean = tl.zeros((BR,), tl.float64)
    rows = tl.arange(0, BR)
    for r0 in range(start, end, BR):
        rmask = rows < end - r0
        g_rows = g_ptr + tl.cast(r0, tl.int64) * m  # int64 once; int32 within the rows
        rsum = tl.zeros((BR,), tl.float32)
        for c0 in range(0, m, BC):
            cols = c0 + tl.arange(0, BC)
            mask = rmask[:, None] & (cols < m)[None, :]
            g = tl.load(g_rows + (rows[:, None] * m + cols[None, :]), mask=mask, other=0.0).to(tl.float32)
            rsum += tl.sum((g * inv_k) * g, axis=1)
        row_at = row_ptr + r0 + rows
        row = _lerp(tl.load(row_at, mask=rmask, other=0.0), _clamp_max(rsum * k_cols + eps), w)
        tl.store(row_at, row, mask=rmask)
        mean += tl.where(rmask, tl.div_rn(row, tl.full((BR,), n, tl.float32)).to(tl.float64), 0.0)
        rinv = tl.div_rn(tl.full((BR,), 1.0, tl.float32), row)
        for c0 in range(0, m, BC):  # the same rows again, from L2: their column and D parts
            cols = c0 + tl.arange(0, BC)
            cmask = cols < m
            mask = rmask[:, None] & cmask[None, :]
            g = tl.load(g_rows + (rows[:, None] * m + cols[None, :]), mask=mask, other=0.0).to(tl.float32)
            g_k = g * inv_k
            later = cmask & (tl.full((BC,), r0, tl.int32) != start)  # the program's first rows start the parts
            csum = tl.load(part + cols, mask=later, other=0.0) + tl.sum(g_k * g, axis=0)
            dsum = tl.load(part + m + cols, mask=later, other=0.0) + tl.sum((g * rinv[:, None]) * g_k, axis=0)
            tl.store(part + cols, csum, mask=cmask)
            tl.store(part + m + cols, dsum, mask=cmask)
    tl.store(mean_at, tl.sum(mean, axis=0))


@triton.jit(do_not_specialize=["count"])
def _stats_kernel(ptrs, sizes, part_ptr, mean_ptr, flag_ptr, count, eps, rate_hi, rate_lo, GDT: tl.constexpr,
                  ALIGNED: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    """Program ``(t, j)``: row blocks ``j, j + grid[1], ...`` of matrix ``t`` (``P`` blocks of ``R`` rows each per
    matrix of its batch)."""
    if tl.load(flag_ptr) != 0:
        return
    t = tl.program_id(0)
    n, m, B = _dims(sizes, count, t, ALIGNED)  # read first: a program past the matrix's count returns
    P = tl.load(sizes + _NP * count + t).to(tl.int32)
    first = tl.program_id(1)
    if first < B * P:  # else: a smaller matrix than the grid's largest, nothing to do
        _, g_ptr, row_ptr, _, step_ptr, _, _, _, R, _, at_part, at_mean, _, _, _ = _matrix(
            ptrs, sizes, count, t, GDT, GDT, ALIGNED)
        w = _beta2_weight(step_ptr, rate_hi, rate_lo)
        part_ptr += at_part
        mean_ptr += at_mean
        k = tl.maximum(n, m)
        inv_k, k_cols = (1.0 / k.to(tl.float64)).to(tl.float32), _ratio(k, m)
        for pid in range(first, B * P, tl.num_programs(1)):
            b = pid // P
            blk = pid % P
            _stats_rows(g_ptr + b.to(tl.int64) * n * m, row_ptr + b.to(tl.int64) * n,
                        part_ptr + (b.to(tl.int64) * P + blk) * 2 * m, mean_ptr + pid, blk * R,
                        tl.minimum(blk * R + R, n), n, m, inv_k, k_cols, eps, w, BR, BC)


@triton.jit(do_not_specialize=["count"])
def _cols_kernel(ptrs, sizes, part_ptr, mean_ptr, cinv_ptr, over_ptr, flag_ptr, count, eps, rate_hi, rate_lo,
                 ALIGNED: tl.constexpr, BC: tl.constexpr, PART: tl.constexpr):
    """Program ``(t, j)``: column blocks ``j, j + grid[1], ...`` of matrix ``t`` (``C`` per matrix of its batch)."""
    if tl.load(flag_ptr) != 0:
        return
    t = tl.program_id(0)
    n, m, B = _dims(sizes, count, t, ALIGNED)
    C = tl.load(sizes + _NC * count + t).to(tl.int32)
    first = tl.program_id(1)
    if first < B * C:
        _, _, _, col_ptr, step_ptr, _, _, P, _, _, at_part, at_mean, at_cinv, at_over, _ = _matrix(
            ptrs, sizes, count, t, tl.float32, tl.float32, ALIGNED)
        w = _beta2_weight(step_ptr, rate_hi, rate_lo)
        part_ptr += at_part
        mean_ptr += at_mean
        cinv_ptr += at_cinv
        over_ptr += at_over
        k_rows = _ratio(tl.maximum(n, m), n)
        for pid in range(first, B * C, tl.num_programs(1)):
            b = pid // C
            cols = (pid % C) * BC + tl.arange(0, BC)
            cmask = cols < m
            csum = tl.zeros((BC,), tl.float32)
            dsum = tl.zeros((BC,), tl.float32)
            part = part_ptr + b.to(tl.int64) * P * 2 * m
            for blk in range(0, P):  # in block order: the same sums whatever the GPU runs first
                csum += tl.load(part + cols, mask=cmask, other=0.0)
                dsum += tl.load(part + m + cols, mask=cmask, other=0.0)
                part += 2 * m
            col_at = col_ptr + b.to(tl.int64) * m + cols
            col = _lerp(tl.load(col_at, mask=cmask, other=1.0), _clamp_max(csum * k_rows + eps), w)
            tl.store(col_at, col, mask=cmask)
            tl.store(cinv_ptr + b.to(tl.int64) * m + cols, _rsqrt(col), mask=cmask)
            over = tl.sum(tl.where(cmask, dsum.to(tl.float64) / col.to(tl.float64), 0.0), axis=0)
            tl.store(over_ptr + pid, _row_mean(mean_ptr, b, P, n, PART).to(tl.float64) * over)


@triton.jit
def _update(p_ptr, ea_ptr, comp_ptr, offs, idx, mask, u, factor, key, lr_hi, decay, omb1, HAS_EA: tl.constexpr,
            MODE: tl.constexpr):
    """The end of every tensor's step: ``exp_avg``, decay and the compensated write of the weight at ``offs``
    (``idx``: the elements' indices in the tensor, the noise's; :func:`._triton_lib.write`). ``u``: the normalised
    update; ``factor``: the clip scale (fp32) with a first moment, else ``-lr * scale`` (fp32), computed once per
    program."""
    if HAS_EA:
        ea = _lerp(tl.load(ea_ptr + offs, mask=mask, other=0.0), u * factor, omb1)
        tl.store(ea_ptr + offs, ea, mask=mask)
        upd = ea * (-lr_hi)  # fp32(-lr)
    else:
        upd = u * factor
    old = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    new = old * decay + upd
    if MODE == 2 and p_ptr.dtype.element_ty != tl.float32:
        new = old + (new - old)  # compensation.write stores p32 + delta, not the new value itself
    L.write(p_ptr, comp_ptr, offs, mask, old, new, key, idx, MODE)


@triton.jit
def _factor(scale, lr_hi, lr_lo, HAS_EA: tl.constexpr):
    """:func:`_update`'s ``factor`` from the float64 clip scale."""
    if HAS_EA:
        return scale.to(tl.float32)
    else:
        return (-(tl.cast(lr_hi, tl.float64) + tl.cast(lr_lo, tl.float64)) * scale).to(tl.float32)


@triton.jit
def _key(step_ptr, position, PDT: tl.constexpr, MODE: tl.constexpr):
    """The noise key of the weight's write (only a stochastic write of a bf16 / fp16 weight reads it)."""
    if MODE == 1 and PDT != tl.float32:
        return L.weight_key(position, tl.load(step_ptr).to(tl.int32))
    else:
        return position


@triton.jit(do_not_specialize=["count"])
def _update_kernel(ptrs, sizes, mean_ptr, cinv_ptr, over_ptr, flag_ptr, count, lr_hi, lr_lo, clip_hi, clip_lo,
                   decay, omb1, PDT: tl.constexpr, GDT: tl.constexpr, HAS_EA: tl.constexpr, MODE: tl.constexpr,
                   ALIGNED: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, PART: tl.constexpr):
    """Program ``(t, j)``: tiles ``j, j + grid[1], ...`` of matrix ``t``'s ``BR x BC`` tiles."""
    if tl.load(flag_ptr) != 0:
        return
    t = tl.program_id(0)
    n, m, B = _dims(sizes, count, t, ALIGNED)
    row_tiles = tl.cdiv(n, BR)
    col_tiles = tl.cdiv(m, BC)
    tiles = B * row_tiles * col_tiles
    first = tl.program_id(1)
    if first < tiles:
        p_ptr, g_ptr, row_ptr, _, step_ptr, ea_ptr, comp_ptr, P, _, C, _, at_mean, at_cinv, at_over, position = \
            _matrix(ptrs, sizes, count, t, PDT, GDT, ALIGNED)
        mean_ptr += at_mean
        cinv_ptr += at_cinv
        sumsq = _sum_part(over_ptr, at_over, B * C, PART) * tl.maximum(n, m)
        factor = _factor(_clip_scale(sumsq, B.to(tl.int64) * n * m, clip_hi, clip_lo), lr_hi, lr_lo, HAS_EA)
        key = _key(step_ptr, position, PDT, MODE)
        rows = tl.arange(0, BR)
        cols = tl.arange(0, BC)
        per_matrix = row_tiles * col_tiles
        mean_of = -1  # the matrix of the batch whose row mean ``mean`` is: none yet
        mean = tl.zeros((), tl.float32)
        for pid in range(first, tiles, tl.num_programs(1)):
            b = pid // per_matrix
            if b != mean_of:  # a sum over the whole block (a barrier), so once per matrix, not per tile
                mean = _row_mean(mean_ptr, b, P, n, PART)
                mean_of = b
            r0 = (pid % per_matrix) // col_tiles * BR
            c0 = pid % col_tiles * BC
            start = (b.to(tl.int64) * n + r0) * m + c0  # the tile's first element: int64 once, int32 within
            rmask = rows < n - r0
            cmask = cols < m - c0
            mask = rmask[:, None] & cmask[None, :]
            offs = rows[:, None] * m + cols[None, :]
            row = tl.load(row_ptr + b.to(tl.int64) * n + r0 + rows, mask=rmask, other=1.0)
            r = _rsqrt(tl.div_rn(row, tl.full((BR,), 1.0, tl.float32) * mean))
            c = tl.load(cinv_ptr + b.to(tl.int64) * m + c0 + cols, mask=cmask, other=1.0)
            g = tl.load(g_ptr + start + offs, mask=mask, other=0.0).to(tl.float32)
            _update(p_ptr + start, ea_ptr + start, comp_ptr + start, offs, start.to(tl.int32) + offs, mask,
                    (g * r[:, None]) * c[None, :], factor, key, lr_hi, decay, omb1, HAS_EA, MODE)


# ----------------------------------------------------------------------------------------------------
# Vectors
# ----------------------------------------------------------------------------------------------------


@triton.jit
def _vector_u(g_ptr, v_ptr, offs, mask, eps, w, STORE: tl.constexpr):
    """A vector's normalised update at ``offs``, its second moment first updated (``STORE``) or read back."""
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.where(g < -_SQRT_FP32_MAX, -_SQRT_FP32_MAX, tl.where(g > _SQRT_FP32_MAX, _SQRT_FP32_MAX, g))
    v = tl.load(v_ptr + offs, mask=mask, other=1.0)
    if STORE:
        v = _lerp(v, u * u + eps, w)
        tl.store(v_ptr + offs, v, mask=mask)
    return u * _rsqrt(v)


@triton.jit(do_not_specialize=["count"])
def _vector_kernel(ptrs, sizes, flag_ptr, count, lr_hi, lr_lo, clip_hi, clip_lo, decay, omb1, eps, rate_hi, rate_lo,
                   PDT: tl.constexpr, GDT: tl.constexpr, HAS_EA: tl.constexpr, MODE: tl.constexpr,
                   ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    """Program ``t``: vector ``t`` (table lists: p, g, step, exp_avg_sq, exp_avg, kahan_comp; sizes: numels, then
    positions), read twice. ``ALIGNED``: its addresses are 16-byte aligned and its length a multiple of 16."""
    if tl.load(flag_ptr) != 0:
        return
    t = tl.program_id(0)
    numel = tl.load(sizes + t)
    if ALIGNED:
        numel = tl.multiple_of(numel, 16)
    p_ptr = L.address(ptrs, 0, count, t, PDT, 16 * ALIGNED)
    g_ptr = L.address(ptrs, 1, count, t, GDT, 16 * ALIGNED)
    step_ptr = L.address(ptrs, 2, count, t, tl.float32, 0)
    v_ptr = L.address(ptrs, 3, count, t, tl.float32, 16 * ALIGNED)
    ea_ptr = v_ptr  # not read without a first moment
    comp_ptr = p_ptr
    if HAS_EA:
        ea_ptr = L.address(ptrs, 4, count, t, tl.float32, 16 * ALIGNED)
    if MODE == 0 and PDT != tl.float32:  # the last list of the table
        if HAS_EA:
            comp_ptr = L.address(ptrs, 5, count, t, tl.bfloat16, 16 * ALIGNED)
        else:
            comp_ptr = L.address(ptrs, 4, count, t, tl.bfloat16, 16 * ALIGNED)
    w = _beta2_weight(step_ptr, rate_hi, rate_lo)
    acc = tl.zeros((BLOCK,), tl.float64)
    for i in range(0, numel, BLOCK):
        offs = i + tl.arange(0, BLOCK).to(tl.int64)
        mask = offs < numel
        u = _vector_u(g_ptr, v_ptr, offs, mask, eps, w, True).to(tl.float64)
        acc += tl.where(mask, u * u, 0.0)
    norm = tl.sqrt(tl.sum(acc, axis=0))  # torch.linalg.vector_norm(u, dtype=float64) ** 2, as the eager step
    factor = _factor(_clip_scale(norm * norm, numel, clip_hi, clip_lo), lr_hi, lr_lo, HAS_EA)
    key = _key(step_ptr, tl.load(sizes + count + t).to(tl.int32), PDT, MODE)
    tl.debug_barrier()  # the second moments this program stored, visible to all its threads
    for i in range(0, numel, BLOCK):
        offs = i + tl.arange(0, BLOCK).to(tl.int64)
        mask = offs < numel
        u = _vector_u(g_ptr, v_ptr, offs, mask, eps, w, False)
        _update(p_ptr, ea_ptr, comp_ptr, offs, offs.to(tl.int32), mask, u, factor, key, lr_hi, decay, omb1, HAS_EA,
                MODE)


# ----------------------------------------------------------------------------------------------------
# Launches
# ----------------------------------------------------------------------------------------------------

_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
_LAUNCH = dict(enable_fp_fusion=False)  # memory-bound: and the GPU then rounds as the eager step and the interpreter
_SCRATCH_DTYPES = (torch.float32, torch.float64, torch.float32, torch.float64)  # column and D, mean, 1/sqrt(col), over


def _pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def _group_args(group: dict) -> tuple:
    """The group's scalars as the kernels take them: lr and clip as float64 halves (:func:`._triton.split64`)."""
    beta1 = group["beta1"]
    return (*_triton.split64(group["lr"]), *_triton.split64(group["clip_threshold"]),
            1.0 - group["lr"] * group["weight_decay"], 0.0 if beta1 is None else 1.0 - beta1)


def _mode(p: torch.Tensor, group: dict) -> int:
    return _triton.NONE if p.dtype == torch.float32 else _triton.C_MODES[group["compensation"]]


def step(items: list, found_inf: torch.Tensor, tables: dict) -> None:
    """Step ``items`` (``(p, grad, state, group, position)``: contiguous weights and gradients, the state Adafactor
    keeps for them, its ``step`` on the weight's device already counting this step), all on one device.
    ``found_inf``: the step's void flag. ``tables``: the caller's cache of pointer tables (one per kind and set of
    tensors).

    A kind (param group, weight and gradient dtypes, first moment, compensation, and for matrices the update tile's
    width: :data:`_WIDE` for every matrix that wide) takes three launches for its matrices, one for its vectors."""
    kinds: dict = {}
    for item in items:
        p, grad, _, group, _ = item
        if p.numel():
            width = min(_pow2(p.shape[-1]), _WIDE) if p.dim() >= 2 else 0
            kind = (id(group), p.dtype, grad.dtype, group["beta1"] is not None, _mode(p, group), width)
            kinds.setdefault(kind, []).append(item)
    if not kinds:
        return
    device = items[0][0].device  # Triton launches on the current device: made this step's, as torch's ops do
    with torch.cuda.device(device) if device.type == "cuda" else nullcontext():
        for kind, kind_items in kinds.items():
            launch = _step_matrices if kind[-1] else _step_vectors
            # keyed by the tensors too (as _triton.launch): gradient release steps the same buckets every
            # step, each with its own table, instead of rebuilding one table per kind at every bucket
            key = (*kind, *(position for *_, position in kind_items))
            launch(kind_items, kind, found_inf, tables.setdefault(key, _triton.PointerTable()))


def _plan(dims: list, rows_tile: int, sms: int) -> list:
    """Each matrix's stats-pass programs per matrix of its batch (P), rows per program (R) and column-pass programs
    (C), for ``dims`` (``(n, m, B)`` each). The launch's budget of :data:`_PROGRAMS` per SM and its scratch of
    :data:`_SCRATCH_BYTES` (``8 m`` bytes a program) are shared in proportion to the matrices' sizes; a matrix gets
    at least one program, and whole tiles of ``rows_tile`` rows."""
    total = sum(n * m * b for n, m, b in dims)
    plan = []
    for n, m, _ in dims:
        programs = max(1, min(_cdiv(n, rows_tile), _cdiv(_PROGRAMS * sms * n * m, total),
                              _SCRATCH_BYTES * n // (8 * total)))
        rows = rows_tile * _cdiv(_cdiv(n, rows_tile), programs)
        plan.append((_cdiv(n, rows), rows, _cdiv(m, _COLS)))
    return plan


def _layout(dims: list, plan: list) -> tuple[list, list]:
    """Each matrix's offsets (elements, multiples of 16: 16-byte aligned) in the four parts of the scratch
    (:data:`_SCRATCH_DTYPES`: column and D parts, row-mean parts, ``1 / sqrt(col)``, sum-of-squares parts), and
    the parts' lengths."""
    ends, offsets = [0, 0, 0, 0], []
    for (n, m, b), (P, _, C) in zip(dims, plan):
        offsets.append(tuple(ends))
        for i, size in enumerate((b * P * 2 * m, b * P, b * m, b * C)):
            ends[i] += _cdiv(size, 16) * 16
    return offsets, ends


def _scratch_parts(lengths: list, device: torch.device) -> list:
    """The launch's scratch: one allocation, viewed as its four parts."""
    sizes = [n * dtype.itemsize for n, dtype in zip(lengths, _SCRATCH_DTYPES)]
    buf = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
    parts, at = [], 0
    for size, dtype in zip(sizes, _SCRATCH_DTYPES):
        parts.append(buf[at:at + size].view(dtype))
        at += size
    return parts


def _grid(count: int, programs) -> tuple:
    """Matrices on dim 0; on dim 1 the most programs a matrix has (a matrix with more loops over them)."""
    return count, max(1, min(max(programs), _triton.MAX_PROGRAMS))


def _step_matrices(items: list, kind: tuple, found_inf: torch.Tensor, table: _triton.PointerTable) -> None:
    _, pdt, gdt, has_ea, mode, width = kind
    group, device = items[0][3], items[0][0].device
    dims = [(p.shape[-2], p.shape[-1], p.numel() // (p.shape[-2] * p.shape[-1])) for p, *_ in items]
    bc1 = min(width, _STATS_COLS[gdt.itemsize])
    br1, br3 = _ROWS_TILE // gdt.itemsize // bc1, _TILE // width
    plan = _plan(dims, br1, _sm_count(device))
    offsets, lengths = _layout(dims, plan)
    lists = [[it[0] for it in items], [it[1] for it in items]] + [
        [it[2][key] for it in items] for key in ("step", "exp_avg_sq_row", "exp_avg_sq_col")] + [
        [it[2]["exp_avg"] if has_ea else it[0] for it in items],
        [it[2]["kahan_comp"] if mode == _triton.KAHAN else it[0] for it in items]]
    fields = [*zip(*dims), *zip(*plan), *zip(*offsets), [it[4] for it in items]]  # in the order of _N ... _POS
    ptrs, sizes = table.get(lists, [v for field in fields for v in field], device)
    aligned = table.aligned and all(m % 16 == 0 for _, m, _ in dims)
    part, mean, cinv, over = _scratch_parts(lengths, device)
    count, eps, rate = len(items), group["eps"], _triton.split64(group["decay_rate"])
    _stats_kernel[_grid(count, [b * P for (_, _, b), (P, _, _) in zip(dims, plan)])](
        ptrs, sizes, part, mean, found_inf, count, eps, *rate, GDT=_TL[gdt], ALIGNED=aligned, BR=br1, BC=bc1,
        num_warps=4, **_LAUNCH)
    _cols_kernel[_grid(count, [b * C for (_, _, b), (_, _, C) in zip(dims, plan)])](
        ptrs, sizes, part, mean, cinv, over, found_inf, count, eps, *rate, ALIGNED=aligned, BC=_COLS, PART=_PART,
        num_warps=4, **_LAUNCH)
    tiles = [b * _cdiv(n, br3) * _cdiv(m, width) for n, m, b in dims]
    _update_kernel[_grid(count, [_cdiv(n, _TILES_PER_PROGRAM) for n in tiles])](
        ptrs, sizes, mean, cinv, over, found_inf, count, *_group_args(group), PDT=_TL[pdt], GDT=_TL[gdt],
        HAS_EA=has_ea, MODE=mode, ALIGNED=aligned, BR=br3, BC=width, PART=_PART, num_warps=8, **_LAUNCH)


def _step_vectors(items: list, kind: tuple, found_inf: torch.Tensor, table: _triton.PointerTable) -> None:
    _, pdt, gdt, has_ea, mode, _ = kind
    group = items[0][3]
    lists = [[it[0] for it in items], [it[1] for it in items], [it[2]["step"] for it in items],
             [it[2]["exp_avg_sq"] for it in items]]
    if has_ea:
        lists.append([it[2]["exp_avg"] for it in items])
    if mode == _triton.KAHAN:
        lists.append([it[2]["kahan_comp"] for it in items])
    # one int64 table: the sizes, then the positions (each weight's noise stream)
    numels = [it[0].numel() for it in items]
    ptrs, sizes = table.get(lists, numels + [it[4] for it in items], items[0][0].device)
    aligned = table.aligned and all(n % 16 == 0 for n in numels)
    _vector_kernel[(len(items),)](ptrs, sizes, found_inf, len(items), *_group_args(group), group["eps"],
                                  *_triton.split64(group["decay_rate"]), PDT=_TL[pdt], GDT=_TL[gdt], HAS_EA=has_ea,
                                  MODE=mode, ALIGNED=aligned, BLOCK=1024, num_warps=4, **_LAUNCH)
