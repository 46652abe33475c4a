"""The blockwise 4-bit codec of :mod:`.quant4` as ``@triton.jit`` functions, for 4-bit kernels.

A program holds ``NB`` whole blocks as an ``(8, NB, 16)`` fp32 tile: element ``16 * k + j`` of block ``b`` at
``[k, b, j]``, which is where :mod:`.quant4`'s in-memory layout keeps its code (nibble ``k`` of word ``j``). So each
32-bit code word is loaded and stored once and a thread holding a column holds its 8 rows: splitting a word into its
8 codes and summing them back are shifts within a thread, and a row is 16 contiguous elements of weights and
gradients. Codes, scales and decoded values are :mod:`.quant4`'s exactly, with few instructions:

- decoding, signed: the map is 16 floats (64 bytes, one cache line) looked up per element; unsigned: arithmetic
  (``c + 1`` from the code's bits as a float, times the block's root scale / 16, squared): no lookup.
- encoding, signed: 8 comparisons of ``|x|`` with the thresholds, constants in the instructions; unsigned: the
  nearest level by adding and subtracting 2**23 (IEEE rounding to nearest even: ``rint``), two comparisons to
  clamp, the code from the float's low bits. No table, no conversion instruction.

Multiplying a root by ``16 * fl(1 / r)`` instead of by ``fl(1 / r)`` and then 16 (as eager) gives the same code: the
two products differ only where ``fl(x / r)`` is subnormal, and there both round to level 1. Imported only where
Triton is installed.
"""

import torch
import triton
import triton.language as tl

from . import quant4

_TINY = tl.constexpr(1.1754943508222875e-38)  # 2**-126 (quant4.block_scale)
_T = [tl.constexpr(t) for t in quant4.THRESHOLDS]
_T0, _T1, _T2, _T3, _T4, _T5, _T6, _T7 = _T
_TABLES: dict = {}


def tables(device: torch.device) -> torch.Tensor:
    """The signed map (16 fp32) on ``device``, copied there once per process: what :func:`load` looks up."""
    key = torch.device(device)
    if key not in _TABLES:
        _TABLES[key] = quant4.signed_map().to(key)
    return _TABLES[key]


@triton.jit
def _words(words_ptr, blk):
    """Addresses ``(1, NB, 16)`` of the code words of blocks ``blk`` (rank 3, as the tiles)."""
    return words_ptr + blk[None, :, None] * 16 + tl.arange(0, 16)[None, None, :]


@triton.jit
def load(words_ptr, scale_ptr, blk, bmask, map_ptr, SIGNED: tl.constexpr):
    """Decoded values ``(8, NB, 16)`` fp32 of blocks ``blk`` (``(NB,)`` int64; ``bmask``: those that exist),
    element ``16 * k + j`` of block ``b`` at ``[k, b, j]``: :func:`.quant4.unpack`'s values."""
    word = tl.load(_words(words_ptr, blk), mask=bmask[None, :, None], other=0)  # (1, NB, 16) int32
    code = (word >> (tl.arange(0, 8) * 4)[:, None, None]) & 15
    a = tl.load(scale_ptr + blk[None, :, None], mask=bmask[None, :, None], other=0.0)  # (1, NB, 1)
    if SIGNED:
        return tl.load(map_ptr + code) * a
    else:
        level = (code | 0x4B000000).to(tl.float32, bitcast=True) - 8388607.0  # 2**23 + c, minus 2**23 - 1: c + 1
        root = level * (tl.sqrt_rn(a) * 0.0625)  # (c + 1) / 16 * r: both factors exact
        return root * root


@triton.jit
def encode(x, inv, SIGNED: tl.constexpr):
    """:func:`.quant4.encode` (int32 codes) of values ``x`` given their multiplier ``inv`` (broadcast): signed,
    ``x * inv`` is the normalized value; unsigned, ``x`` are the second moments, ``sqrt(x) * inv`` sixteen times the
    normalized root (``inv = 16 * fl(1 / r)``)."""
    if SIGNED:  # the count n of thresholds at or below |y| (0..7, then the top one) by a binary search
        y = x * inv
        a = tl.abs(y)
        p4 = a >= _T3
        p2 = a >= tl.where(p4, _T5, _T1)
        p1 = a >= tl.where(p4, tl.where(p2, _T6, _T4), tl.where(p2, _T2, _T0))
        n = tl.where(p4, 4, 0) + tl.where(p2, 2, 0) + tl.where(p1, 1, 0)
        return tl.where(y < 0, 7 - n, 7 + n + tl.where(a >= _T7, 1, 0))  # -1.0 is not in the map: -0.8875 at most
    else:
        q = (tl.sqrt_rn(x) * inv + 8388608.0) - 8388608.0  # rint: 0 <= q < 2**22, the sum rounded to an integer
        q = tl.where(q > 1.0, q, 1.0)  # comparisons: a NaN takes level 1, as eager
        q = tl.where(q < 16.0, q, 16.0)
        return (q + 8388607.0).to(tl.int32, bitcast=True) & 15  # 2**23 + (q - 1): the code in the low bits


@triton.jit
def store(x, words_ptr, scale_ptr, blk, bmask, SIGNED: tl.constexpr):
    """Blocks ``x`` (``(8, NB, 16)`` fp32, as :func:`load` gives them) stored as codes and scales, as
    :func:`.quant4.pack`: each block's scale (largest ``|x|`` by its bits, NaN winning; raised to 2**-126 where
    below it), the values encoded, the 8 codes of column ``j`` shifted into word ``j`` (disjoint bits: a sum)."""
    bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    top = tl.max(tl.max(bits, axis=0, keep_dims=True), axis=2, keep_dims=True)  # (1, NB, 1): rows first, in a thread
    a = top.to(tl.float32, bitcast=True)
    a = tl.where((a > 0) & (a < _TINY), _TINY, a)
    if SIGNED:
        inv = tl.div_rn(1.0, tl.where(a > 0, a, 1.0))
    else:
        r = tl.sqrt_rn(a)
        inv = tl.div_rn(1.0, tl.where(r > 0, r, 1.0)) * 16.0
    code = encode(x, inv, SIGNED)
    word = tl.sum(code << (tl.arange(0, 8) * 4)[:, None, None], axis=0, keep_dims=True)
    tl.store(_words(words_ptr, blk), word, mask=bmask[None, :, None])
    tl.store(scale_ptr + blk[None, :, None], a, mask=bmask[None, :, None])
