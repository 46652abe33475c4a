"""Adafactor's step on CUDA in Triton: :func:`.adafactor._eager_step`'s operations, in its order, with no host sync.

Imported only where Triton is (see :mod:`._triton` for the conventions every kernel follows: the void flag, device
step counts, ``MODE``, bf16 stores, the compensated write).

A matrix (a batch of ``n x m`` matrices, contiguous) takes three launches:

1. :func:`_stats_kernel`, a program per block of whole rows: reads g for the row sums of g*g/k and writes the new
   row statistics, then reads the same rows again (from L2) for their part of the column sums and of
   ``D_j = sum_i (g_ij / k) * (g_ij / row_i)`` (the update's factored sum of squares, see :mod:`.adafactor`), and
   their part of the row mean (float64). The parts go to a scratch of at most :data:`_SCRATCH_BYTES`.
2. :func:`_cols_kernel`, a program per block of columns: adds the parts in block order (deterministic: no atomics),
   writes the new column statistics, ``1 / sqrt(col)`` for the update, and its part of the sum of squares (float64).
3. :func:`_update_kernel`, a program per tile: sums the parts into the RMS clip scale (float64, on the device),
   reads g again and writes the weight (``exp_avg``, the compensation) in one pass.

Vectors (biases, norms) take one launch per kind (dtypes, group, first moment, compensation) over a
:class:`._triton.PointerTable`: :func:`_vector_kernel`, a program per vector, reads it twice (statistics and the sum
of squares, then the update).

fp32 arithmetic is the eager step's, operation for operation: lerp as torch's fused multiply-add, ``rsqrt`` as
``1 / sqrt`` correctly rounded (``div_rn``, ``sqrt_rn``: Triton's defaults are approximate on a GPU), clamps that keep
NaN. Sums differ from torch's in order only (row, column and D sums in fp32, the sums of squares in float64), as the
C kernel's do, and are held to the same tolerances (:func:`.adafactor._agree`).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import _triton

L = _triton.jit_helpers()

__all__ = ["step"]

_FP32_MAX = tl.constexpr(3.4028234663852886e38)
_SQRT_FP32_MAX = tl.constexpr(18446742974197923840.0)  # 2**64 (1 - 2**-24): the largest fp32 whose square is finite
_SCRATCH_BYTES = 8 << 20  # the column and D parts of one matrix (the stats pass), whatever the model's size
_PROGRAMS = 4  # stats-pass programs per SM aimed at (fewer where the scratch or the rows run out)
_TILE = 4096  # elements of a tile of the update pass (16-byte vector loads for every dtype)
_COLS = 512  # columns of a tile of the stats pass and of a program of the column pass
_PART = 256  # elements of the float64 parts summed at a time


@triton.jit
def _lerp(start, end, w):
    """torch.lerp: a fused multiply-add from the nearer end (as torch's and adafactor_cpu.c's)."""
    return tl.where(w < 0.5, tl.fma(w, end - start, start), tl.fma(w - 1.0, end - start, end))


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


@triton.jit
def _stats_kernel(g_ptr, row_ptr, part_ptr, mean_ptr, step_ptr, flag_ptr, n, m, R, P, inv_k, k_cols, eps,
                  rate_hi, rate_lo, BR: tl.constexpr, BC: tl.constexpr):
    if tl.load(flag_ptr) != 0:
        return
    pid = tl.program_id(0)
    b, blk = pid // P, pid % P
    w = _beta2_weight(step_ptr, rate_hi, rate_lo)
    g_base = g_ptr + b.to(tl.int64) * n * m
    part = part_ptr + (b.to(tl.int64) * P + blk) * 2 * m  # this program's column parts, then its D parts
    start = blk * R
    end = tl.minimum(start + R, n)
    mean = tl.zeros((BR,), tl.float64)
    for r0 in range(start, end, BR):
        rows = r0 + tl.arange(0, BR)
        rmask = rows < end
        rsum = tl.zeros((BR,), tl.float32)
        for c0 in range(0, m, BC):
            cols = c0 + tl.arange(0, BC)
            mask = rmask[:, None] & (cols < m)[None, :]
            g = tl.load(g_base + rows[:, None].to(tl.int64) * m + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            rsum += tl.sum((g * inv_k) * g, axis=1)
        row_at = row_ptr + b.to(tl.int64) * n + rows
        row = _lerp(tl.load(row_at, mask=rmask, other=0.0), _clamp_max(rsum * k_cols + eps), w)
        tl.store(row_at, row, mask=rmask)
        mean += tl.where(rmask, tl.div_rn(row, tl.full((BR,), n, tl.float32)).to(tl.float64), 0.0)
        rinv = tl.div_rn(tl.full((BR,), 1.0, tl.float32), row)
        for c0 in range(0, m, BC):  # the same rows again, from L2: their column and D parts
            cols = c0 + tl.arange(0, BC)
            cmask = cols < m
            mask = rmask[:, None] & cmask[None, :]
            g = tl.load(g_base + rows[:, None].to(tl.int64) * m + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            g_k = g * inv_k
            later = cmask & (tl.full((BC,), r0, tl.int32) != start)  # the program's first rows start the parts
            csum = tl.load(part + cols, mask=later, other=0.0) + tl.sum(g_k * g, axis=0)
            dsum = tl.load(part + m + cols, mask=later, other=0.0) + tl.sum((g * rinv[:, None]) * g_k, axis=0)
            tl.store(part + cols, csum, mask=cmask)
            tl.store(part + m + cols, dsum, mask=cmask)
    tl.store(mean_ptr + b.to(tl.int64) * P + blk, tl.sum(mean, axis=0))


@triton.jit
def _cols_kernel(col_ptr, part_ptr, mean_ptr, cinv_ptr, over_ptr, step_ptr, flag_ptr, n, m, P, C, k_rows, eps,
                 rate_hi, rate_lo, BC: tl.constexpr, PART: tl.constexpr):
    if tl.load(flag_ptr) != 0:
        return
    pid = tl.program_id(0)
    b, cb = pid // C, pid % C
    w = _beta2_weight(step_ptr, rate_hi, rate_lo)
    cols = cb * BC + tl.arange(0, BC)
    cmask = cols < m
    csum = tl.zeros((BC,), tl.float32)
    dsum = tl.zeros((BC,), tl.float32)
    part = part_ptr + b.to(tl.int64) * P * 2 * m
    for blk in range(0, P):  # in block order: the same sums whatever the GPU runs first
        csum += tl.load(part + blk * 2 * m + cols, mask=cmask, other=0.0)
        dsum += tl.load(part + blk * 2 * m + m + cols, mask=cmask, other=0.0)
    col_at = col_ptr + b.to(tl.int64) * m + cols
    col = _lerp(tl.load(col_at, mask=cmask, other=1.0), _clamp_max(csum * k_rows + eps), w)
    tl.store(col_at, col, mask=cmask)
    tl.store(cinv_ptr + b.to(tl.int64) * m + cols, _rsqrt(col), mask=cmask)
    over = tl.sum(tl.where(cmask, dsum.to(tl.float64) / col.to(tl.float64), 0.0), axis=0)
    tl.store(over_ptr + pid, _row_mean(mean_ptr, b, P, n, PART).to(tl.float64) * over)


@triton.jit
def _write(p_ptr, offs, mask, u, ea_ptr, comp_ptr, step_ptr, scale, lr_hi, lr_lo, decay, omb1, position,
           HAS_EA: tl.constexpr, MODE: tl.constexpr):
    """The end of every tensor's step: the clip, ``exp_avg``, decay and the compensated write of the weight (``u``:
    the normalised update of the elements ``offs``; ``scale``: the float64 clip factor)."""
    OUT: tl.constexpr = p_ptr.dtype.element_ty
    if HAS_EA:
        ea = _lerp(tl.load(ea_ptr + offs, mask=mask, other=0.0), u * scale.to(tl.float32), omb1)
        tl.store(ea_ptr + offs, ea, mask=mask)
        upd = ea * (-lr_hi)  # fp32(-lr)
    else:
        upd = u * (-(tl.cast(lr_hi, tl.float64) + tl.cast(lr_lo, tl.float64)) * scale).to(tl.float32)
    old = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    new = old * decay + upd
    if OUT == tl.float32:
        tl.store(p_ptr + offs, new, mask=mask)
    else:
        if MODE == 2:
            new = old + (new - old)  # compensation.write stores p32 + delta, not the new value itself
        key = L.weight_key(position, tl.load(step_ptr).to(tl.int32))
        comp = tl.zeros(offs.shape, tl.float32)
        if MODE == 0:
            comp = tl.load(comp_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        fresh, comp = L.compensated(old, new, comp, key, offs.to(tl.int32), MODE, OUT)
        tl.store(p_ptr + offs, fresh, mask=mask)
        if MODE == 0:
            tl.store(comp_ptr + offs, L.to_bf16(comp), mask=mask)


@triton.jit
def _update_kernel(p_ptr, g_ptr, row_ptr, cinv_ptr, mean_ptr, over_ptr, ea_ptr, comp_ptr, step_ptr, flag_ptr, B, n,
                   m, P, C, k, lr_hi, lr_lo, clip_hi, clip_lo, decay, omb1, position, HAS_EA: tl.constexpr,
                   MODE: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, PART: tl.constexpr):
    if tl.load(flag_ptr) != 0:
        return
    pid = tl.program_id(0)
    row_tiles = tl.cdiv(n, BR)
    col_tiles = tl.cdiv(m, BC)
    b = pid // (row_tiles * col_tiles)
    rt = (pid // col_tiles) % row_tiles
    ct = pid % col_tiles
    numel = tl.cast(B, tl.int64) * n * m
    scale = _clip_scale(_sum_part(over_ptr, 0, tl.cast(B, tl.int64) * C, PART) * k, numel, clip_hi, clip_lo)
    rows = rt * BR + tl.arange(0, BR)
    cols = ct * BC + tl.arange(0, BC)
    rmask = rows < n
    cmask = cols < m
    mask = rmask[:, None] & cmask[None, :]
    offs = b.to(tl.int64) * n * m + rows[:, None].to(tl.int64) * m + cols[None, :]
    row = tl.load(row_ptr + b.to(tl.int64) * n + rows, mask=rmask, other=1.0)
    r = _rsqrt(tl.div_rn(row, tl.full((BR,), 1.0, tl.float32) * _row_mean(mean_ptr, b, P, n, PART)))
    c = tl.load(cinv_ptr + b.to(tl.int64) * m + cols, mask=cmask, other=1.0)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    _write(p_ptr, offs, mask, (g * r[:, None]) * c[None, :], ea_ptr, comp_ptr, step_ptr, scale, lr_hi,
           lr_lo, decay, omb1, position, HAS_EA, MODE)


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


@triton.jit
def _vector_kernel(ptrs, sizes, flag_ptr, count, lr_hi, lr_lo, clip_hi, clip_lo, decay, omb1, eps, rate_hi, rate_lo,
                   PDT: tl.constexpr, GDT: tl.constexpr, HAS_EA: tl.constexpr, MODE: tl.constexpr,
                   BLOCK: tl.constexpr):
    if tl.load(flag_ptr) != 0:
        return
    t = tl.program_id(0)
    numel = tl.load(sizes + t)
    position = tl.load(sizes + count + t).to(tl.int32)
    p_ptr = tl.load(ptrs + t).to(tl.pointer_type(PDT))
    g_ptr = tl.load(ptrs + count + t).to(tl.pointer_type(GDT))
    v_ptr = tl.load(ptrs + 2 * count + t).to(tl.pointer_type(tl.float32))
    step_ptr = tl.load(ptrs + 3 * count + t).to(tl.pointer_type(tl.float32))
    ea_ptr = p_ptr  # not read without a first moment
    comp_ptr = p_ptr
    if HAS_EA:
        ea_ptr = tl.load(ptrs + 4 * count + t).to(tl.pointer_type(tl.float32))
    if MODE == 0 and PDT != tl.float32:  # the last list of the table
        if HAS_EA:
            comp_ptr = tl.load(ptrs + 5 * count + t).to(tl.pointer_type(tl.bfloat16))
        else:
            comp_ptr = tl.load(ptrs + 4 * count + t).to(tl.pointer_type(tl.bfloat16))
    w = _beta2_weight(step_ptr, rate_hi, rate_lo)
    acc = tl.zeros((BLOCK,), tl.float64)
    for i in range(0, numel, BLOCK):
        offs = i + tl.arange(0, BLOCK).to(tl.int64)
        mask = offs < numel
        u = _vector_u(g_ptr, v_ptr, offs, mask, eps, w, True).to(tl.float64)
        acc += tl.where(mask, u * u, 0.0)
    norm = tl.sqrt(tl.sum(acc, axis=0))  # torch.linalg.vector_norm(u, dtype=float64) ** 2, as the eager step
    scale = _clip_scale(norm * norm, numel, clip_hi, clip_lo)
    tl.debug_barrier()  # the second moments this program stored, visible to all its threads
    for i in range(0, numel, BLOCK):
        offs = i + tl.arange(0, BLOCK).to(tl.int64)
        mask = offs < numel
        u = _vector_u(g_ptr, v_ptr, offs, mask, eps, w, False)
        _write(p_ptr, offs, mask, u, ea_ptr, comp_ptr, step_ptr, scale, lr_hi, lr_lo, decay, omb1,
               position, HAS_EA, MODE)


# ----------------------------------------------------------------------------------------------------
# Launches
# ----------------------------------------------------------------------------------------------------

_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
_LAUNCH = dict(enable_fp_fusion=False)  # memory-bound: and the GPU then rounds as the eager step and the interpreter


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
    ``found_inf``: the step's void flag. ``tables``: the caller's cache of pointer tables (one per vector kind)."""
    matrices, vectors = [], {}
    for item in items:
        p, grad, state, group, _ = item
        if not p.numel():
            continue
        if p.dim() >= 2:
            matrices.append((item, _plan(p)))
        else:
            kind = (id(group), p.dtype, grad.dtype, group["beta1"] is not None, _mode(p, group))
            vectors.setdefault(kind, []).append(item)
    if matrices:  # one scratch for all: the matrices' launches run one after another on the stream
        device = matrices[0][0][0].device
        scratch = [torch.empty(max(plan[i] for _, plan in matrices), dtype=dtype, device=device)
                   for i, dtype in zip(range(4), (torch.float32, torch.float64, torch.float32, torch.float64))]
        for item, plan in matrices:
            _step_matrix(*item, found_inf, plan, scratch)
    for kind, group_items in vectors.items():
        _step_vectors(group_items, kind, found_inf, tables.setdefault(kind, _triton.PointerTable()))


def _plan(p: torch.Tensor) -> tuple:
    """A matrix's launch shapes: scratch sizes (column and D parts, row-mean parts, 1 / sqrt(col), sum-of-squares
    parts), then rows per stats-pass program, programs per matrix (P), column programs (C), and the tiles. The stats
    pass gets programs of whole rows, as many as the scratch allows, up to :data:`_PROGRAMS` per SM."""
    n, m = p.shape[-2], p.shape[-1]
    B = p.numel() // (n * m)
    bc1 = min(_pow2(m), _COLS)
    br1 = max(1, min(_pow2(n), 2048 // bc1))
    programs = max(1, min(_cdiv(n, br1), _PROGRAMS * _sm_count(p.device) // B, _SCRATCH_BYTES // (8 * m * B)))
    rows = br1 * _cdiv(_cdiv(n, br1), programs)
    P, C = _cdiv(n, rows), _cdiv(m, _COLS)
    bc3 = min(_pow2(m), 1024)
    br3 = max(1, min(_pow2(n), _TILE // bc3))
    return B * P * 2 * m, B * P, B * m, B * C, rows, P, C, br1, bc1, br3, bc3


def _step_matrix(p, grad, state, group, position, found_inf, plan, scratch) -> None:
    n, m = p.shape[-2], p.shape[-1]
    B, k = p.numel() // (n * m), max(n, m)
    part, mean, cinv, over = scratch
    rows, P, C, br1, bc1, br3, bc3 = plan[4:]
    step_t, row, col = state["step"], state["exp_avg_sq_row"], state["exp_avg_sq_col"]
    eps, rate = group["eps"], _triton.split64(group["decay_rate"])
    _stats_kernel[(B * P,)](grad, row, part, mean, step_t, found_inf, n, m, rows, P, 1.0 / k, k / m, eps, *rate,
                            BR=br1, BC=bc1, num_warps=4, **_LAUNCH)
    _cols_kernel[(B * C,)](col, part, mean, cinv, over, step_t, found_inf, n, m, P, C, k / n, eps, *rate,
                           BC=_COLS, PART=_PART, num_warps=4, **_LAUNCH)
    mode, has_ea = _mode(p, group), group["beta1"] is not None
    grid = (B * _cdiv(n, br3) * _cdiv(m, bc3),)
    _update_kernel[grid](p, grad, row, cinv, mean, over, state["exp_avg"] if has_ea else p,
                         state["kahan_comp"] if mode == _triton.KAHAN else p, step_t, found_inf, B, n, m, P, C, k,
                         *_group_args(group), position, HAS_EA=has_ea, MODE=mode, BR=br3, BC=bc3, PART=_PART,
                         num_warps=8, **_LAUNCH)


def _step_vectors(items: list, kind: tuple, found_inf: torch.Tensor, table: _triton.PointerTable) -> None:
    _, pdt, gdt, has_ea, mode = kind
    group = items[0][3]
    lists = [[it[0] for it in items], [it[1] for it in items], [it[2]["exp_avg_sq"] for it in items],
             [it[2]["step"] for it in items]]
    if has_ea:
        lists.append([it[2]["exp_avg"] for it in items])
    if mode == _triton.KAHAN:
        lists.append([it[2]["kahan_comp"] for it in items])
    # one int64 table: the sizes, then the positions (each weight's noise stream)
    ptrs, sizes = table.get(lists, [it[0].numel() for it in items] + [it[4] for it in items], items[0][0].device)
    _vector_kernel[(len(items),)](ptrs, sizes, found_inf, len(items), *_group_args(group), group["eps"],
                                  *_triton.split64(group["decay_rate"]), PDT=_TL[pdt], GDT=_TL[gdt], HAS_EA=has_ea,
                                  MODE=mode, BLOCK=1024, num_warps=4, **_LAUNCH)
