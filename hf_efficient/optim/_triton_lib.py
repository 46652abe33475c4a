"""The ``@triton.jit`` functions every family's Triton kernel calls (see :mod:`._triton` for conventions): the
compensated write and its rounding, the noise, float64 powers, and the launch layer's side of :func:`._triton.launch`
(a program's tensor and pointers, the one weight store :func:`write`, the per-tensor Adam scalars).

Each rounding function mirrors a torch function of :mod:`.compensation` operation for operation, in int32 / fp32
arithmetic, so that a Triton kernel rounds bit for bit as the torch code and the C kernels do (tests compare them
under Triton's interpreter). Imported only where Triton is installed.

On the GPU a conversion rounds to nearest even in one instruction; Triton's interpreter truncates instead, so
:func:`to_bf16` rounds in integers there only (:data:`_INTERPRET`, read when this module is imported, as Triton reads
``TRITON_INTERPRET`` when a kernel is defined): the tests run the integer path, and compile the GPU one for sm_90.
"""

import os

import triton
import triton.language as tl

# murmur3 fmix32 constants and the golden-ratio increments, as int32 (compensation.py's _GOLDEN, _MIX1, _MIX2)
_GOLDEN = tl.constexpr(-1640531535)  # 0x9E3779B1
_KEY_GOLDEN = tl.constexpr(-1640531527)  # 0x9E3779B9
_MIX1 = tl.constexpr(-2048144789)  # 0x85EBCA6B
_MIX2 = tl.constexpr(-1028477387)  # 0xC2B2AE35
_WEIGHT_STREAM = tl.constexpr(0x2545F491)  # compensation.WEIGHT_STREAM
_INTERPRET = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")  # kernels run in numpy, not compiled


@triton.jit
def mix32(h):
    """murmur3's fmix32 on int32 (wrapping multiplies; arithmetic shifts masked to act as logical ones)."""
    h = h ^ ((h >> 16) & 0xFFFF)
    h = h * _MIX1
    h = h ^ ((h >> 13) & 0x7FFFF)
    h = h * _MIX2
    return h ^ ((h >> 16) & 0xFFFF)


@triton.jit
def hash_noise(key, idx):
    """int32 noise of element indices ``idx`` (int32) under ``key``: ``compensation.hash_noise``."""
    return mix32(idx * _GOLDEN + key)


@triton.jit
def weight_key(position, step):
    """The noise key of a weight's write: ``compensation.weight_key(position, step)`` (both int32 scalars)."""
    return mix32(mix32(position + _KEY_GOLDEN) ^ step) ^ _WEIGHT_STREAM


@triton.jit
def pow_int(base_hi, base_lo, n):
    """``base ** n`` in float64 for an int32 scalar ``n`` >= 0, by squaring; ``base`` comes as two fp32 halves (Triton
    passes Python floats as fp32): ``hi = fp32(base)``, ``lo = fp32(base - hi)`` (:func:`._triton.split64`). Within a
    few float64 ulp of Python's ``base ** n``, so its fp32 rounding is the host's value. A loop over ``n``'s bits up
    to its highest set one: every thread of a program runs it (float64, half rate), so ~log2(step) rounds instead of
    31 matter to a kernel of few elements per thread."""
    result = tl.full((), 1.0, tl.float64)
    b = tl.cast(base_hi, tl.float64) + tl.cast(base_lo, tl.float64)
    e = n
    while e > 0:
        result = tl.where((e & 1) != 0, result * b, result)
        b = b * b
        e = e >> 1
    return result


@triton.jit
def to_bf16(x):
    """fp32 ``x`` rounded to nearest-even bf16 (NaN stays NaN), as torch rounds: every bf16 store of these kernels
    goes through here. On the GPU the conversion itself (one instruction; a NaN's payload is the hardware's); under
    the interpreter, which truncates in its conversion, in integer arithmetic with the same result."""
    if _INTERPRET:
        bits = x.to(tl.int32, bitcast=True)
        rounded = (bits + (((bits >> 16) & 1) + 0x7FFF)) & -65536
        rounded = tl.where(x != x, 0x7FC00000, rounded)
        return rounded.to(tl.float32, bitcast=True).to(tl.bfloat16)
    else:
        return x.to(tl.bfloat16, fp_downcast_rounding="rtne")


@triton.jit
def to_dtype(x, OUT: tl.constexpr):
    """fp32 ``x`` rounded to nearest into ``OUT`` (bf16 through :func:`to_bf16`)."""
    if OUT == tl.bfloat16:
        return to_bf16(x)
    else:
        return x.to(OUT)


@triton.jit
def round_stochastic(x, noise, OUT: tl.constexpr):
    """fp32 ``x`` rounded to one of its two ``OUT`` (bf16 / fp16) neighbours, the far one with probability
    |x - near one| / spacing: ``compensation.round_stochastic``."""
    if OUT == tl.bfloat16:
        kept = (x.to(tl.int32, bitcast=True) + ((noise >> 16) & 0xFFFF)) & -65536
        out = tl.where(x != x, x, kept.to(tl.float32, bitcast=True))
    else:
        uniform = ((noise >> 8) & 0xFFFFFF).to(tl.float32) * 5.9604644775390625e-08  # 2**-24
        near = x.to(tl.float16).to(tl.float32)
        err = x - near
        far = (near * tl.where(err * near >= 0, 1.0 + 0.0006103515625, 1.0 - 0.0006103515625))  # 0.625 ulp
        far = far.to(tl.float16).to(tl.float32)
        out = tl.where(uniform * tl.abs(far - near) < tl.abs(err), far, near)
    return out.to(OUT)


@triton.jit
def compensated(old, new, comp, key, idx, MODE: tl.constexpr, OUT: tl.constexpr):
    """The stored weight (``OUT``) and the new Kahan buffer (fp32) of a weight stepped from ``old`` to ``new``
    (fp32), as ``compensation.write``: ``MODE`` 0 Kahan (``comp``: the buffer's values), 1 stochastic (noise of
    ``key`` and the element indices ``idx``), 2 round to nearest. An fp32 ``OUT`` takes ``new`` as is."""
    if OUT == tl.float32:
        return new, comp
    elif MODE == 0:
        y = (new - old) + comp  # this step's update plus what earlier steps could not apply
        fresh = to_dtype(old + y, OUT)
        return fresh, y - (fresh.to(tl.float32) - old)  # the part the rounded weight did not absorb
    elif MODE == 1:
        return round_stochastic(old + (new - old), hash_noise(key, idx), OUT), comp
    else:
        return to_dtype(new, OUT), comp


# ----------------------------------------------------------------------------------------------------
# The launch layer's side (see _triton.launch: the pointer table's rows, the info array, the grid)
# ----------------------------------------------------------------------------------------------------

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
def write(p_ptr, comp_ptr, offs, mask, old, new, key, idx, MODE: tl.constexpr):
    """The weights at ``offs`` stepped from ``old`` to ``new`` (fp32), stored in the weights' dtype under compensation
    ``MODE`` as :func:`compensated` writes them (the Kahan buffer, bf16 at ``comp_ptr``, read and written only under
    Kahan; noise of ``key`` and the elements' indices ``idx``, int32, under stochastic). ``mask`` None: every element
    (loads and stores stay whole vectors)."""
    OUT: tl.constexpr = p_ptr.dtype.element_ty
    KAHAN: tl.constexpr = MODE == 0 and OUT != tl.float32
    comp = old  # not read but under Kahan
    if KAHAN:
        comp = tl.load(comp_ptr + offs, mask=mask).to(tl.float32)
    w, comp = compensated(old, new, comp, key, idx, MODE, OUT)
    tl.store(p_ptr + offs, w, mask=mask)
    if KAHAN:  # after the weight, whose registers it frees (Lion8bit's bf16 kernel: 106 a thread, not 118)
        tl.store(comp_ptr + offs, to_bf16(comp), mask=mask)


@triton.jit(do_not_specialize=["count"])
def adam_scalars_kernel(table, count, coef, lr_hi, lr_lo, beta1_hi, beta1_lo, beta2_hi, beta2_lo):
    """Tensor ``program_id(0)``'s ``lr / (1 - beta1^t)``, ``1 / sqrt(1 - beta2^t)`` and ``sqrt(1 - beta2^t)`` into
    ``coef[3t .. 3t + 2]`` (fp32), in float64 from its step count on the device (the table's step row), as eager
    computes them in Python: once per tensor and step (:func:`._triton.adam_scalars`), not in every program of every
    tensor. Scalars as float64 halves (:func:`._triton.split64`)."""
    t = tl.program_id(0)
    step = tl.load(address(table, 2, count, t, tl.float32, 0)).to(tl.int32)  # the table's step row
    one = tl.full((), 1.0, tl.float64)
    lr = tl.cast(lr_hi, tl.float64) + tl.cast(lr_lo, tl.float64)
    # float64 division and square root are correctly rounded on the GPU (PTX has no approximate fp64 forms)
    bc2_sqrt = tl.sqrt(one - pow_int(beta2_hi, beta2_lo, step))
    tl.store(coef + 3 * t, (lr / (one - pow_int(beta1_hi, beta1_lo, step))).to(tl.float32))
    tl.store(coef + 3 * t + 1, (one / bc2_sqrt).to(tl.float32))
    tl.store(coef + 3 * t + 2, bc2_sqrt.to(tl.float32))
