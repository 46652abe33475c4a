"""The blockwise 8-bit codec of :mod:`.quant8` as ``@triton.jit`` functions, for the 8-bit families' Triton kernels.

A program holds ``NB`` whole blocks as a ``(4, NB, 64)`` fp32 tile: element ``64 * k + j`` of block ``b`` at
``[k, b, j]``. Rows outermost: the compiler then gives a thread all 4 rows of its columns (warps split the blocks), so
summing a column's codes into its word and a block's absmax need no exchange between warps. Codes stay in
:mod:`.quant8`'s in-memory layout (byte ``4 * j + k`` of a block holds element ``64 * k + j``), so each 32-bit code
word is loaded and stored once (its byte ``k`` is row ``k``'s code), and state, ``state_dict`` and checkpoints are
the C and torch kernels'. Decoding looks values up in ``quant8.c_tables()`` (on the device: its first 512 floats are
:func:`.quant8.decode` of every code, the rest the encoder's thresholds), so decoded values are the eager kernel's
exactly; encoding is :func:`.quant8.encode`'s arithmetic, operation for operation; a block's scale is
:func:`.quant8.block_scale`'s. Imported only where Triton is installed.
"""

import torch
import triton
import triton.language as tl

_TINY = tl.constexpr(1.1754943508222875e-38)  # 2**-126, fp32's smallest normal (quant8.block_scale)
_TABLES: dict = {}


def tables(device: torch.device) -> torch.Tensor:
    """``quant8.c_tables()`` on ``device``, copied there once per process (never inside a step after the first)."""
    key = torch.device(device)
    if key not in _TABLES:
        from . import quant8

        _TABLES[key] = quant8.c_tables().to(key)
    return _TABLES[key]


@triton.jit
def _words(words_ptr, blk):
    """Addresses ``(1, NB, 64)`` of the code words of blocks ``blk``: rank 3 as the tiles, so that broadcasting a
    word to its four rows and summing them back keep one layout (no exchange through shared memory)."""
    return words_ptr + blk[None, :, None] * 64 + tl.arange(0, 64)[None, None, :]


@triton.jit
def load(words_ptr, absmax_ptr, blk, bmask, table_ptr, SIGNED: tl.constexpr):
    """Decoded values ``(4, NB, 64)`` fp32 of blocks ``blk`` (``(NB,)`` int64; ``bmask``: those that exist), element
    ``64 * k + j`` of block ``b`` at ``[k, b, j]``: each 32-bit word loaded once, its byte ``k`` looked up in the map
    (codes are 0..255 whatever was masked: the lookup needs no mask), times its block's absmax."""
    word = tl.load(_words(words_ptr, blk), mask=bmask[None, :, None], other=0)  # (1, NB, 64)
    code = (word >> (tl.arange(0, 4) * 8)[:, None, None]) & 255
    value = tl.load(table_ptr + code + (0 if SIGNED else 256))
    return value * tl.load(absmax_ptr + blk, mask=bmask, other=0.0)[None, :, None]


@triton.jit
def encode(x, table_ptr, SIGNED: tl.constexpr):
    """:func:`.quant8.encode` of normalized values ``x`` (fp32): codes as int32, the same operations in order."""
    base = 512 if SIGNED else 520  # each map's 7 decade midpoints, then its top threshold
    first = 1.0 if SIGNED else 2.0
    a = tl.abs(x) if SIGNED else x
    n = tl.zeros_like(a) + (0.0 if SIGNED else 1.0)
    inv_scale = tl.zeros_like(a)
    for d in tl.static_range(7):
        above = a >= tl.load(table_ptr + base + d)
        n = tl.where(above, first * (2**d), n)
        inv_scale = tl.where(above, 1.0 * (10 ** (7 - d)), inv_scale)  # exact in fp32
    above = x > tl.load(table_ptr + base + 7)
    n = tl.where(above, first * 128, n)
    inv_scale = tl.where(above, 0.0, inv_scale)
    k = tl.floor((a * inv_scale - 1.0) * (n * 0.1111111111111111))
    j = n + tl.maximum(tl.minimum(k, n - 1.0), 0.0)
    if SIGNED:
        code = tl.where(x < 0, 127.0 - j, 127.0 + j)
    else:
        code = tl.maximum(j - 1.0, tl.where(x > 0, 1.0, 0.0))  # the floor: a positive value never gets 0.0's code
    return code.to(tl.int32)


@triton.jit
def store(x, words_ptr, absmax_ptr, blk, bmask, table_ptr, SIGNED: tl.constexpr):
    """Blocks ``x`` (``(4, NB, 64)`` fp32, as :func:`load` gives them) stored as codes and absmaxes, as
    :func:`.quant8.pack`: each block's scale (largest |x|, by the bits of |x| so that a NaN wins as in ``amax``;
    raised to 2**-126 where below it), the values times its fp32 reciprocal, encoded, the four codes of column ``j``
    summed into word ``j`` (their bytes do not overlap)."""
    top = tl.max(tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=2), axis=0)
    a = top.to(tl.float32, bitcast=True)
    a = tl.where((a > 0) & (a < _TINY), _TINY, a)
    one = tl.full(a.shape, 1.0, tl.float32)
    inv = tl.div_rn(one, tl.where(a > 0, a, one))  # a zero block's scale counts as 1
    code = encode(x * inv[None, :, None], table_ptr, SIGNED)
    word = tl.sum(code << (tl.arange(0, 4) * 8)[:, None, None], axis=0, keep_dims=True)
    tl.store(_words(words_ptr, blk), word, mask=bmask[None, :, None])
    tl.store(absmax_ptr + blk, a, mask=bmask)
